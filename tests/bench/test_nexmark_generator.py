"""The Nexmark event generator (bench/nexmark/generator.py) against the spec's rules.

Proportions and interleaving, id references (with and without the spec's id leads),
determinism and range independence, event times against the out-of-order bound and the
watermark, the hot auction/seller/bidder skew, field formats, and the Parquet files.
"""

from __future__ import annotations

import json
import re
import sys
from functools import cache
from itertools import pairwise
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import ROOT

# bench/ holds scripts with generic names (storage, kafka, windows): on sys.path only for this import.
sys.path.insert(0, str(ROOT / "bench"))
try:
    from nexmark import generator as nx
finally:
    sys.path.remove(str(ROOT / "bench"))

DEFAULT = nx.NexmarkConfig()
STRICT = nx.NexmarkConfig(person_id_lead=0, auction_id_lead=0)


@cache
def sample(cfg: nx.NexmarkConfig, n: int) -> nx.Chunk:
    return nx.generate(cfg, 0, n, with_event_id=True)


def col(table: pa.Table, name: str) -> np.ndarray:
    return table.column(name).to_numpy()


def test_proportions_and_interleaving_per_50_events() -> None:
    for cfg in (DEFAULT, nx.NexmarkConfig(out_of_order_group=1000)):
        c = nx.generate(cfg, 0, 10_000, with_event_id=True)
        ids = {k: col(t, "event_id") for k, t in zip(nx.STREAMS, c, strict=True)}
        # The spec's interleaving: id % 50 == 0 a person, 1..3 auctions, 4..49 bids.
        assert set(ids["person"] % 50) == {0}
        assert set(ids["auction"] % 50) == {1, 2, 3}
        assert set(ids["bid"] % 50) == set(range(4, 50))
        for k, per_50 in zip(nx.STREAMS, (1, 3, 46), strict=True):
            assert (np.bincount(ids[k] // 50, minlength=200) == per_50).all(), k
        every = np.sort(np.concatenate(list(ids.values())))
        assert (every == np.arange(10_000)).all()
        # Person and auction ids are dense, in the order of their events.
        assert (col(c.person, "id") == 1000 + ids["person"] // 50).all()
        if cfg.out_of_order_group == 1:
            assert (col(c.auction, "id") == 1000 + np.arange(c.auction.num_rows)).all()
        assert (np.sort(col(c.auction, "id")) == 1000 + np.arange(c.auction.num_rows)).all()


@given(start=st.integers(0, 10**9))
@settings(max_examples=25, deadline=None)
def test_any_50_consecutive_events_are_1_person_3_auctions_46_bids(start: int) -> None:
    c = nx.generate(DEFAULT, start, start + 50)
    assert (c.person.num_rows, c.auction.num_rows, c.bid.num_rows) == (1, 3, 46)


def test_references_with_leads_zero_are_to_earlier_events() -> None:
    c = sample(STRICT, 200_000)
    person_event = dict(zip(col(c.person, "id"), col(c.person, "event_id"), strict=True))
    auction_event = dict(zip(col(c.auction, "id"), col(c.auction, "event_id"), strict=True))
    for seller, e in zip(col(c.auction, "seller"), col(c.auction, "event_id"), strict=True):
        assert person_event[seller] <= e
    bid_e = col(c.bid, "event_id")
    # Vectorised: the event id of auction a (base 0) is 50 * (a // 3) + 1 + a % 3, of person p 50 * p.
    a = col(c.bid, "auction") - 1000
    p = col(c.bid, "bidder") - 1000
    assert (a >= 0).all() and (p >= 0).all()
    assert (50 * (a // 3) + 1 + a % 3 <= bid_e).all()
    assert (50 * p <= bid_e).all()
    assert set(col(c.bid, "auction")) <= set(auction_event)
    assert set(col(c.bid, "bidder")) <= set(person_event)


def test_references_with_the_spec_leads_stay_within_the_leads() -> None:
    cfg = DEFAULT
    c = sample(cfg, 200_000)
    e = col(c.bid, "event_id")
    last_a = nx.last_auction(cfg, e)
    last_p = nx.last_person(cfg, e)
    a = col(c.bid, "auction") - 1000
    p = col(c.bid, "bidder") - 1000
    assert (a <= last_a + cfg.auction_id_lead).all()
    assert (a >= np.maximum(last_a - cfg.num_in_flight_auctions, 0)).all()
    assert (p <= last_p + cfg.person_id_lead).all()
    assert (p >= np.maximum(last_p + 1 - cfg.num_active_people, 0)).all()
    assert (a > last_a).any() and (p > last_p).any()  # the leads are used
    s = col(c.auction, "seller") - 1000
    last_s = nx.last_person(cfg, col(c.auction, "event_id"))
    assert (s <= last_s + cfg.person_id_lead).all() and (s >= 0).all()


@given(
    seed=st.integers(0, 2**32),
    n=st.integers(0, 1500),
    split=st.floats(0, 1),
    start=st.integers(0, 10**7),
    group=st.sampled_from([1, 1, 7, 100, 1000]),
)
@settings(max_examples=20, deadline=None)
def test_ranges_generate_independently(seed: int, n: int, split: float, start: int, group: int) -> None:
    cfg = nx.NexmarkConfig(seed=seed, out_of_order_group=group, rate=12_345)
    mid = start + int(n * split)
    whole = nx.generate(cfg, start, start + 2 * n)
    left, right = nx.generate(cfg, start, mid), nx.generate(cfg, mid, start + 2 * n)
    for w, a, b in zip(whole, left, right, strict=True):
        assert w.equals(pa.concat_tables([a, b]))
    # Blocks inside generate() do not change the result either.
    for w, blocked in zip(whole, nx.generate(cfg, start, start + 2 * n, block=333), strict=True):
        assert w.equals(blocked)


def test_same_seed_same_tables_other_seed_other_tables() -> None:
    a = nx.generate(nx.NexmarkConfig(seed=5), 1000, 6000)
    b = nx.generate(nx.NexmarkConfig(seed=5), 1000, 6000)
    c = nx.generate(nx.NexmarkConfig(seed=6), 1000, 6000)
    assert all(x.equals(y) for x, y in zip(a, b, strict=True))
    assert not a.bid.equals(c.bid) and not a.person.equals(c.person)
    # The ids and times depend on the event numbers only, not on the seed.
    assert a.person.column("id").equals(c.person.column("id"))
    assert a.bid.column("date_time").equals(c.bid.column("date_time"))


@pytest.mark.parametrize(("group", "rate"), [(1, 10_000), (10, 3), (1000, 10_000), (1000, 10_000_000)])
def test_event_times_within_the_out_of_order_bound_and_above_the_watermark(group: int, rate: int) -> None:
    cfg = nx.NexmarkConfig(out_of_order_group=group, rate=rate)
    start, stop = 123_457, 123_457 + 20_000
    events = nx.generate_events(cfg, start, stop)
    assert events.schema.field("date_time").type == pa.timestamp("us", tz="UTC")
    t = col(events, "date_time").astype(np.int64)
    numbers = np.arange(start, stop)
    nominal = nx.time_us(cfg, numbers)
    bound = (group - 1) * 1_000_000 // rate + 1
    assert (np.abs(t - nominal) <= bound).all()
    if group == 1:
        assert (t == nominal).all() and (np.diff(t) >= 0).all()
    else:  # (not for sizes dividing 952 = 953 - 1, where the spec's permutation is the identity)
        assert (t != nominal).any()
    # Watermark: no event at position n or later is earlier than watermark(n).
    suffix_min = np.minimum.accumulate(t[::-1])[::-1]
    assert (suffix_min >= nx.watermark_us(cfg, numbers)).all()
    # Each stream's own date_time is the event's.
    kinds = col(events, "event_type")
    c = nx.generate(cfg, start, stop)
    for kind, table in enumerate(c):
        assert (col(table, "date_time").astype(np.int64) == t[kinds == kind]).all()


def test_event_spacing_follows_the_rate() -> None:
    cfg = nx.NexmarkConfig(rate=10_000_000)
    t = nx.time_us(cfg, np.arange(0, 100_000_001, 10_000_000))
    assert (np.diff(t) == 1_000_000).all() and t[0] == nx.BASE_TIME_US


@pytest.mark.parametrize("ratio", [2, 10])
def test_hot_auctions_get_their_share_of_bids(ratio: int) -> None:
    cfg = nx.NexmarkConfig(hot_auction_ratio=ratio)
    c = sample(cfg, 200_000)
    auction = col(c.bid, "auction")
    hot_share = 1 - 1 / ratio  # the spec: P(hot) = 1 - 1/hotAuctionRatio
    # The hot auction is the first of the current group of 100 auctions.
    at_hot = ((auction - 1000) % 100 == 0).mean()
    assert hot_share - 0.01 <= at_hot <= hot_share + 0.02
    # Within a group (~1530 bids), the top auction gets at least that share.
    window = nx.last_auction(cfg, col(c.bid, "event_id")) // 100
    for w in np.unique(window)[1:-1]:
        counts = np.unique(auction[window == w], return_counts=True)[1]
        assert counts.max() / counts.sum() >= hot_share - 0.05
    # Over the whole sample, the top auction gets far more than a uniform one would.
    counts = np.unique(auction, return_counts=True)[1]
    assert counts.max() / counts.sum() > 50 / c.auction.num_rows


def test_hot_sellers_and_hot_bidders() -> None:
    c = sample(DEFAULT, 200_000)
    seller = col(c.auction, "seller") - 1000
    bidder = col(c.bid, "bidder") - 1000
    # P(hot) = 1 - 1/4: the first (sellers) / second (bidders) person of the group of 100.
    assert 0.74 <= (seller % 100 == 0).mean() <= 0.78
    assert 0.74 <= (bidder % 100 == 1).mean() <= 0.78


def test_field_formats_and_sizes() -> None:
    c = sample(DEFAULT, 200_000)
    p, a, b = (t.to_pandas() for t in c)
    assert p.name.str.fullmatch(r"[A-Z][a-z]+ [A-Z][a-z]+").all()
    assert set(p.city) <= set(nx.US_CITIES) and set(p.state) == set(nx.US_STATES)
    assert p.email_address.str.fullmatch(r"[a-z ]{0,6}@[a-z ]{0,4}\.com").all()
    assert p.credit_card.str.fullmatch(r"\d{4} \d{4} \d{4} \d{4}").all()
    for s, longest in ((a.item_name, 19), (a.description, 99)):
        assert s.str.len().max() <= longest and not s.str.match(r"^ | $").any()
        assert s.str.fullmatch(r"[a-z ]*").all()
    assert set(a.category) == set(range(10, 15))
    assert (a.reserve >= a.initial_bid).all() and (a.expires > a.date_time).all()
    for price in (a.initial_bid, b.price):
        assert price.min() >= 100 and price.max() <= 100_000_000
    hot = b.channel.isin(nx.HOT_CHANNELS)
    assert 0.48 <= hot.mean() <= 0.52
    assert b.channel[~hot].str.fullmatch(r"channel-\d{1,4}").all()
    url = r"https://www\.nexmark\.com/[a-z_]{3,4}/[a-z_]{3,4}/[a-z_]{3,4}/item\.htm\?query=1(&channel_id=-?\d+)?"
    assert b.url.str.fullmatch(url).all()
    assert b.groupby("channel").url.nunique().max() == 1  # one url per channel
    # Sizes: the extra pads each event to the configured average (within 2%).
    person_size = 8 + sum(p[k].str.len() for k in ("name", "email_address", "credit_card", "city", "state", "extra"))
    auction_size = 8 + a.item_name.str.len() + a.description.str.len() + 40 + a.extra.str.len()
    for size, avg in ((person_size, 200), (auction_size, 500), (32 + b.extra.str.len(), 100)):
        assert abs(size.mean() - avg) / avg < 0.02
    assert b.extra.str.len().between(54, 81).all()
    for extra in (p.extra, a.extra, b.extra):
        assert not re.search(r"[^a-z]", "".join(extra))


def test_combined_stream() -> None:
    cfg = nx.NexmarkConfig(out_of_order_group=100)
    events = nx.generate_events(cfg, 500, 3000)
    assert events.schema == nx.EVENT_SCHEMA
    kinds = col(events, "event_type")
    assert (kinds == nx.event_kinds(cfg, nx.event_ids(cfg, np.arange(500, 3000)))).all()
    c = nx.generate(cfg, 500, 3000)
    for kind, name, table in zip(range(3), nx.STREAMS, c, strict=True):
        column = events.column(name)
        assert (column.is_valid().to_numpy(zero_copy_only=False) == (kinds == kind)).all()
        assert pa.Table.from_struct_array(column.drop_null().combine_chunks()).equals(table)


def test_parquet_files_in_order_with_increasing_mtimes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "nexmark"
    argv = [str(out), "--events", "12345", "--files", "4", "--rate", "1000", "--seed", "3",
            "--start", "50", "--out-of-order-group", "10", "--combined",
            "--base-time", "2024-01-01T00:00:00Z"]
    assert nx.main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["rows"] == {"person": 247, "auction": 741, "bid": 11357, "events": 12345}
    cfg = nx.NexmarkConfig(seed=3, rate=1000, out_of_order_group=10, base_time_us=1_704_067_200_000_000)
    expected = {**dict(zip(nx.STREAMS, nx.generate(cfg, 50, 50 + 12345), strict=True)),
                "events": nx.generate_events(cfg, 50, 50 + 12345)}
    for stream, table in expected.items():
        files = sorted((out / stream).iterdir())
        assert [f.name for f in files] == [f"part-{k:05d}.parquet" for k in range(4)]
        mtimes = [f.stat().st_mtime for f in files]
        assert all(x < y for x, y in pairwise(mtimes))
        read = pa.concat_tables([pq.read_table(f) for f in files])
        assert read.schema == table.schema and read.equals(table), stream
    meta = json.loads((out / "_nexmark.json").read_text())
    assert meta["ranges"][0] == [50, 50 + 12345 // 4] and meta["config"]["seed"] == 3
    with pytest.raises(FileExistsError):
        nx.main(argv)
    assert nx.main([*argv[:2], "100", *argv[3:], "--force"]) == 0
    assert pq.read_table(out / "bid").num_rows == 92


def test_the_spec_permutation_is_the_identity_for_group_sizes_dividing_952() -> None:
    n = np.arange(10_000)
    for group in (2, 4, 7, 8, 17, 952):
        assert (nx.event_ids(nx.NexmarkConfig(out_of_order_group=group), n) == n).all()
    for group in (3, 10, 100, 1000):
        ids = nx.event_ids(nx.NexmarkConfig(out_of_order_group=group), n)
        assert (ids != n).any() and (np.sort(ids[: 10_000 // group * group]) == n[: 10_000 // group * group]).all()


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="953"):
        nx.NexmarkConfig(out_of_order_group=953 * 2)
    with pytest.raises(ValueError, match="rate"):
        nx.NexmarkConfig(rate=0)
    with pytest.raises(ValueError):
        nx.generate(DEFAULT, 10, 5)
