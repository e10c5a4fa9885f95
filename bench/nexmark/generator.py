"""Nexmark event generator: persons, auctions and bids as Arrow tables and Parquet files.

    .venv/bin/python bench/nexmark/generator.py OUT --events 10000000 --files 20 --rate 10000000 --seed 0

writes ``OUT/person/part-00000.parquet`` .. ``OUT/bid/part-00019.parquet`` (and, with
``--combined``, ``OUT/events/``): file ``k`` of every stream holds the events of event numbers
``[start + events*k/files, start + events*(k+1)/files)``, and the files' modification times
increase with ``k`` (Spark's file source takes files oldest first), so ``maxFilesPerTrigger=1``
replays the stream in order, one slice of it per micro-batch.

The rules are those of the Nexmark generator of Apache Beam (``sdks/java/testing/nexmark``,
``sources/generator``) and of its port in the Flink Nexmark benchmark (``nexmark/nexmark``,
``nexmark-flink/.../generator``), with their default configuration (``NexmarkConfiguration``):

* Event number ``n`` (position in the stream) has event id ``adjusted(n)``: with the
  out-of-order group size ``g`` (``outOfOrderGroupSize``, default 1 in both), ``adjusted(n) =
  (n // g) * g + (n * 953) % g``, a permutation of each group of ``g`` consecutive numbers.
  The id decides the kind: ``id % 50`` is 0 for a person, 1-3 for an auction, 4-49 for a bid
  (proportions 1:3:46, configurable). Person ids and auction ids are dense, from 1000:
  the person of event id ``e`` is ``1000 + e // 50``, the auctions ``1000 + 3 * (e // 50) +
  (e % 50 - 1)``.
* Event time: ``base_time + adjusted(n) / rate`` (``timestampForEvent``), so an event's time
  is off its position's nominal time ``base_time + n / rate`` by less than ``g`` events'
  spacing, and ``base_time + ((n // g) * g) / rate`` is a watermark: no event at position
  ``n`` or later has an earlier time. Base time 2015-07-15T00:00:00Z, Beam's ``BASE_TIME``.
* Person: name from 11 first x 9 last names, email ``<3-6 chars>@<3-4 chars>.com``, credit
  card four ``%04d`` groups, city (10 US cities) and state (6 states) drawn independently,
  ``extra`` padding so that ``8 + len(strings)`` averages ``avg_person_bytes`` (200).
* Auction: seller is with probability ``1 - 1/hot_sellers_ratio`` (default 4: 3/4) the hot
  seller, the first person of the current group of 100 persons, else a random person among
  the last ``num_active_people`` (1000) plus ``person_id_lead`` (10) not yet created;
  category ``10 + uniform(5)``; ``initial_bid = round(10**(6u) * 100)``, ``reserve =
  initial_bid + another such price``; ``expires = date_time + 1 + uniform(2h)``, ``h`` the
  time until ``num_in_flight_auctions * 50 / 3`` events later (so about 100 auctions are open);
  ``item_name`` 3-19 chars, ``description`` 3-99 chars (letters, about 1 in 13 a space,
  trimmed); ``extra`` pads ``8 + len(item_name) + len(description) + 40`` to 500 on average.
* Bid: auction is with probability ``1 - 1/hot_auction_ratio`` (default 2: 1/2) the hot
  auction, the first of the current group of 100 auctions, else a random one among the last
  ``num_in_flight_auctions`` (100) plus ``auction_id_lead`` (10) not yet created; bidder is
  with probability ``1 - 1/hot_bidders_ratio`` (3/4) the hot bidder, the second person of the
  current group of 100 persons, else a random active person as for sellers; price as above;
  channel/url: with probability 1/2 one of 4 hot channels (Google, Facebook, Baidu, Apple,
  each with a fixed url), else ``channel-<i>``, ``i`` uniform in [0, 10000), with that
  channel's url (``https://www.nexmark.com/<s>/<s>/<s>/item.htm?query=1``, 9 in 10 of them
  with ``&channel_id=<abs(Integer.reverse(i))>``); ``extra`` pads 32 bytes to 100 on average
  (54-81 chars). Bid columns as in the Flink benchmark (Beam's Bid has no channel/url).
* ``extra`` strings are substrings of a 1 MiB pool of random letters at random offsets, as
  in the Flink generator (``StringsGenerator.nextExactString``); length ``d - r + uniform(2r)``
  with ``d`` the missing bytes and ``r = round(0.2 d)``.

So a bid's auction may be an auction up to ``auction_id_lead`` ids ahead of the last one
created, and a bid's bidder or an auction's seller a person up to ``person_id_lead`` ahead
(the spec's "leads", which make some events look swapped in time); with both leads 0 every
reference is to an auction/person of an earlier (or the same) event id.

Differences from the Java generators (deliberate):

* Randomness: every value is a function of ``(seed, event id, field)`` (a splitmix64 hash
  of a counter, vectorised with numpy), so any range of events can be generated alone and
  ``[0, 2N) == [0, N) + [N, 2N)``. Beam is deterministic per event too (a ``java.util.Random``
  seeded with the event id, no seed of its own); Flink draws from one unseeded
  ``SplittableRandom`` per generator. Same distributions, different values: no event is
  bit-identical to Beam's or Flink's. "1 in 13 a space" is 5042/65536; letters come from
  16-bit draws (bias < 1e-3).
* Timestamps are microseconds (``timestamp[us, UTC]``), the event spacing exact integer
  arithmetic: ``base + n * 10**6 // rate`` us; the Java generators truncate to
  milliseconds. Auction lengths follow the same rule in microseconds (at 10 M events/s an
  auction lasts ~170 us on average; in Flink it would round to 1 ms).
* One timeline (``numEventGenerators = 1``, Flink's default; Beam's default of 100 parallel
  timelines is not modelled); constant rate (no sine/square rate shapes).
* The Flink generator adds ``FIRST_PERSON_ID`` to a bid's bidder twice (bidders are then
  ``2000 + ...``, matching no person); Beam and this generator add it once.
* The hot channels' urls and the 10000 channel urls come from the seed (Flink draws them
  from an unseeded random at class load).
* With a lead of 0, the hot bidder (second person of the group) is capped at the last person
  created (it would otherwise be one ahead right after a group starts).
* Out-of-order group sizes divisible by 953 are refused (the spec's permutation would then
  repeat ids). As in the spec, sizes that divide 952 (2, 4, 7, 8, 14, 17, ...) give the
  identity permutation (``953 = 1 mod g``): no disorder; 10, 100 or 1000 do.
* Base time: Beam's fixed 2015-07-15 (``--base-time`` to change it); Flink's default is the
  wall clock when the job starts.
* Not implemented: Beam's ``probDelayedEvent``/``occasionalDelaySec`` (it holds events back in
  wall-clock emission only when rate-limited, which is off by default; Flink declares the
  options but does not use them), Flink's ``extendedBidMode`` and side inputs.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

# Constants of the spec (GeneratorConfig, PersonGenerator, AuctionGenerator, BidGenerator).
FIRST_PERSON_ID = 1000
FIRST_AUCTION_ID = 1000
FIRST_CATEGORY_ID = 10
NUM_CATEGORIES = 5
HOT_GROUP = 100  # HOT_AUCTION_RATIO = HOT_SELLER_RATIO = HOT_BIDDER_RATIO: hot ids change every 100
HOT_CHANNELS_RATIO = 2
CHANNELS_NUMBER = 10_000
MIN_STRING_LENGTH = 3
OUT_OF_ORDER_MULTIPLIER = 953
BASE_TIME_US = 1_436_918_400_000_000  # 2015-07-15T00:00:00Z
POOL_LENGTH = 1 << 20  # StringsGenerator.REUSABLE_EXTRA_STRING
MAX_AVG_BYTES = POOL_LENGTH // 4

US_STATES = ("AZ", "CA", "ID", "OR", "WA", "WY")
US_CITIES = ("Phoenix", "Los Angeles", "San Francisco", "Boise", "Portland", "Bend", "Redmond",
             "Seattle", "Kent", "Cheyenne")
FIRST_NAMES = ("Peter", "Paul", "Luke", "John", "Saul", "Vicky", "Kate", "Julie", "Sarah",
               "Deiter", "Walter")
LAST_NAMES = ("Shultz", "Abrams", "Spencer", "White", "Bartels", "Walton", "Smith", "Jones",
              "Noris")
HOT_CHANNELS = ("Google", "Facebook", "Baidu", "Apple")

PERSON, AUCTION, BID = 0, 1, 2
STREAMS = ("person", "auction", "bid")

TS = pa.timestamp("us", tz="UTC")
PERSON_SCHEMA = pa.schema([
    ("id", pa.int64()), ("name", pa.string()), ("email_address", pa.string()),
    ("credit_card", pa.string()), ("city", pa.string()), ("state", pa.string()),
    ("date_time", TS), ("extra", pa.string()),
])
AUCTION_SCHEMA = pa.schema([
    ("id", pa.int64()), ("item_name", pa.string()), ("description", pa.string()),
    ("initial_bid", pa.int64()), ("reserve", pa.int64()), ("date_time", TS), ("expires", TS),
    ("seller", pa.int64()), ("category", pa.int64()), ("extra", pa.string()),
])
BID_SCHEMA = pa.schema([
    ("auction", pa.int64()), ("bidder", pa.int64()), ("price", pa.int64()),
    ("channel", pa.string()), ("url", pa.string()), ("date_time", TS), ("extra", pa.string()),
])
SCHEMAS = {"person": PERSON_SCHEMA, "auction": AUCTION_SCHEMA, "bid": BID_SCHEMA}
# The combined stream, as Beam's Event / the Flink benchmark's datagen table: one row per event.
EVENT_SCHEMA = pa.schema([
    ("event_type", pa.int32()),
    ("person", pa.struct(list(PERSON_SCHEMA))),
    ("auction", pa.struct(list(AUCTION_SCHEMA))),
    ("bid", pa.struct(list(BID_SCHEMA))),
    ("date_time", TS),
])

# Events generated at a time inside generate() (bounds memory, about 150 MB of Arrow data,
# and keeps string offsets in int32), and per row group in the files.
BLOCK = 1 << 20
FILE_BLOCK = 1 << 18
# Columns worth a Parquet dictionary (few distinct values); random strings are not.
DICTIONARY_COLUMNS = {
    "person": ["name", "city", "state"], "auction": ["category"], "bid": ["channel", "url"],
    "events": ["event_type", "person.name", "person.city", "person.state", "auction.category",
               "bid.channel", "bid.url"],
}


@dataclass(frozen=True)
class NexmarkConfig:
    """The generator's parameters; defaults are the spec's (Beam's and Flink's NexmarkConfiguration)."""

    seed: int = 0
    rate: int = 10_000  # events per second of event time (firstEventRate)
    base_time_us: int = BASE_TIME_US
    out_of_order_group: int = 1  # outOfOrderGroupSize
    person_proportion: int = 1
    auction_proportion: int = 3
    bid_proportion: int = 46
    hot_auction_ratio: int = 2
    hot_sellers_ratio: int = 4
    hot_bidders_ratio: int = 4
    num_in_flight_auctions: int = 100
    num_active_people: int = 1000
    avg_person_bytes: int = 200
    avg_auction_bytes: int = 500
    avg_bid_bytes: int = 100
    person_id_lead: int = 10  # PERSON_ID_LEAD
    auction_id_lead: int = 10  # AUCTION_ID_LEAD

    def __post_init__(self) -> None:
        if self.rate < 1:
            raise ValueError(f"rate must be >= 1 event/s, got {self.rate}")
        g = self.out_of_order_group
        if g < 1 or g % OUT_OF_ORDER_MULTIPLIER == 0:
            raise ValueError(f"out_of_order_group must be >= 1 and not a multiple of 953, got {g}")
        if self.person_proportion < 1 or self.auction_proportion < 1 or self.bid_proportion < 0:
            raise ValueError("proportions: person >= 1, auction >= 1, bid >= 0")
        for name in ("hot_auction_ratio", "hot_sellers_ratio", "hot_bidders_ratio",
                     "num_in_flight_auctions", "num_active_people"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.person_id_lead < 0 or self.auction_id_lead < 0:
            raise ValueError("id leads must be >= 0")
        for name in ("avg_person_bytes", "avg_auction_bytes", "avg_bid_bytes"):
            if not 0 <= getattr(self, name) <= MAX_AVG_BYTES:
                raise ValueError(f"{name} must be in [0, {MAX_AVG_BYTES}]")

    @property
    def total_proportion(self) -> int:
        return self.person_proportion + self.auction_proportion + self.bid_proportion


class Chunk(NamedTuple):
    """The events of a range of event numbers, one table per stream, rows in stream order."""

    person: pa.Table
    auction: pa.Table
    bid: pa.Table


# ---------------------------------------------------------------------------------------------
# Event numbers, ids, times (GeneratorConfig, lastBase0PersonId, lastBase0AuctionId)


def event_ids(cfg: NexmarkConfig, numbers: np.ndarray) -> np.ndarray:
    """Event id of each event number (position in the stream): the out-of-order permutation."""
    n = np.asarray(numbers, dtype=np.int64)
    g = cfg.out_of_order_group
    if g == 1:
        return n.copy()
    return (n // g) * g + (n * OUT_OF_ORDER_MULTIPLIER) % g


def event_kinds(cfg: NexmarkConfig, ids: np.ndarray) -> np.ndarray:
    """0 (person), 1 (auction) or 2 (bid) for each event id."""
    off = np.asarray(ids, dtype=np.int64) % cfg.total_proportion
    p, a = cfg.person_proportion, cfg.auction_proportion
    return np.where(off < p, PERSON, np.where(off < p + a, AUCTION, BID)).astype(np.int8)


def time_us(cfg: NexmarkConfig, numbers: np.ndarray) -> np.ndarray:
    """Event time (us since the epoch) of the event id or number ``numbers`` (timestampForEvent)."""
    n = np.asarray(numbers, dtype=np.int64)
    return cfg.base_time_us + (n * 1_000_000) // cfg.rate


def watermark_us(cfg: NexmarkConfig, numbers: np.ndarray) -> np.ndarray:
    """A lower bound of the event time of every event at position ``numbers`` or later."""
    n = np.asarray(numbers, dtype=np.int64)
    g = cfg.out_of_order_group
    return time_us(cfg, (n // g) * g)


def last_person(cfg: NexmarkConfig, ids: np.ndarray) -> np.ndarray:
    """Base-0 id of the last person created at or before event id ``ids``."""
    epoch, off = np.divmod(np.asarray(ids, dtype=np.int64), cfg.total_proportion)
    return epoch * cfg.person_proportion + np.minimum(off, cfg.person_proportion - 1)


def last_auction(cfg: NexmarkConfig, ids: np.ndarray) -> np.ndarray:
    """Base-0 id of the last auction created at or before event id ``ids`` (-1 if none yet)."""
    epoch, off = np.divmod(np.asarray(ids, dtype=np.int64), cfg.total_proportion)
    p, a = cfg.person_proportion, cfg.auction_proportion
    within = np.where(off < p, -1, np.where(off >= p + a, a - 1, off - p))
    return epoch * a + within


# ---------------------------------------------------------------------------------------------
# Counter-based randomness: value = hash(seed, stream, field, word, event id)

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _mix_int(z: int) -> int:
    z &= _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, in place on a uint64 array."""
    z ^= z >> np.uint64(30)
    z *= np.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> np.uint64(27)
    z *= np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return z


# Stream salts: persons, auctions, bids, the channel table, the extra pool.
_S_PERSON, _S_AUCTION, _S_BID, _S_CHANNELS, _S_POOL = 1, 2, 3, 4, 5


class _Draws:
    """Independent uniform draws per (event id, field): the same for an event whatever range it is in."""

    def __init__(self, seed: int, stream: int, ids: np.ndarray) -> None:
        self.n = len(ids)
        self.seed = seed
        self._key = _mix_int(seed * 0xD1342543DE82EF95 + stream * 0x2545F4914F6CDD1D + 1)
        self._base = np.asarray(ids, dtype=np.int64).astype(np.uint64) * np.uint64(_GOLDEN)

    def bits(self, field: int, word: int = 0) -> np.ndarray:
        salt = _mix_int(self._key ^ _mix_int(field * 0x9FB21C651E98DF25 + word * 0xC13FA9A902A6328F + 7))
        return _mix(self._base + np.uint64(salt))

    def uniform(self, field: int) -> np.ndarray:
        """Floats in [0, 1) with 53 random bits."""
        return (self.bits(field) >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))

    def below(self, field: int, n: int | np.ndarray) -> np.ndarray:
        """Integers in [0, n) (``n`` >= 1, a scalar or one per row)."""
        n = np.asarray(n, dtype=np.int64)
        return np.minimum((self.uniform(field) * n).astype(np.int64), n - 1)

    def u16(self, field: int, width: int) -> np.ndarray:
        """A (rows, width) uint16 matrix of draws, 4 per 64-bit word."""
        words = -(-width // 4)
        out = np.empty((self.n, words), dtype="<u8")
        for j in range(words):
            out[:, j] = self.bits(field, j)
        return out.view("<u2")[:, :width]


def _letters(v: np.ndarray) -> np.ndarray:
    return (97 + ((v.astype(np.uint32) * 26) >> 16)).astype(np.uint8)


# ---------------------------------------------------------------------------------------------
# Strings as (rows, width) byte matrices with a keep mask; concatenated into Arrow strings.

_Part = tuple[np.ndarray, np.ndarray]  # (uint8 chars, bool keep), both (rows, width)

_SPECIAL_CUT = 65536 // 13 + 1  # P(special) = 5042/65536 ~ 1/13


def _next_string(d: _Draws, field: int, max_length: int, special: str = " ") -> _Part:
    """StringsGenerator.nextString: MIN..max_length-1 chars, letters or (1 in 13) ``special``, trimmed."""
    lengths = MIN_STRING_LENGTH + d.below(field, max_length - MIN_STRING_LENGTH)
    width = max_length - 1
    v = d.u16(field + 1, width).astype(np.int32)
    is_special = v < _SPECIAL_CUT
    letters = 97 + ((v - _SPECIAL_CUT) * 26) // (65536 - _SPECIAL_CUT)
    chars = np.where(is_special, ord(special), letters).astype(np.uint8)
    cols = np.arange(width)
    keep = cols[None, :] < lengths[:, None]
    if special.isspace():  # String.trim()
        solid = keep & ~is_special
        anyc = solid.any(axis=1)
        first = solid.argmax(axis=1)
        last = width - 1 - solid[:, ::-1].argmax(axis=1)
        keep = (cols[None, :] >= first[:, None]) & (cols[None, :] <= last[:, None]) & anyc[:, None]
    return chars, keep


def _const(rows: int, text: str) -> _Part:
    b = np.frombuffer(text.encode(), dtype=np.uint8)
    return np.broadcast_to(b, (rows, len(b))), np.ones((rows, len(b)), dtype=bool)


def _strings(parts: Sequence[_Part]) -> tuple[pa.Array, np.ndarray]:
    """Concatenate the parts row-wise into an Arrow string array; also return the lengths."""
    chars = np.hstack([p[0] for p in parts]) if len(parts) > 1 else parts[0][0]
    keep = np.hstack([p[1] for p in parts]) if len(parts) > 1 else parts[0][1]
    rows = chars.shape[0]
    lengths = keep.sum(axis=1, dtype=np.int64)
    offsets = np.zeros(rows + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if offsets[-1] >= 1 << 31:
        raise OverflowError("string column over 2 GiB: generate fewer events at a time")
    data = np.ascontiguousarray(chars)[keep]
    arr = pa.StringArray.from_buffers(rows, pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(data))
    return arr, lengths


def _pick(values: Sequence[str], idx: np.ndarray) -> tuple[pa.Array, np.ndarray]:
    lens = np.array([len(v.encode()) for v in values], dtype=np.int64)
    return pa.array(values, pa.string()).take(pa.array(idx)), lens[idx]


@functools.lru_cache(maxsize=4)
def _pool(seed: int) -> np.ndarray:
    """The extra-string pool: POOL_LENGTH random letters, plus a wrap-around tail for windows."""
    d = _Draws(seed, _S_POOL, np.arange(POOL_LENGTH // 4096))
    letters = _letters(d.u16(0, 4096).reshape(-1))
    return np.concatenate([letters, letters[: POOL_LENGTH // 2]])


def _extra(d: _Draws, field: int, current: np.ndarray, avg: int) -> pa.Array:
    """StringsGenerator.nextExtra: pad ``current`` bytes to ``avg`` on average (+-20%).

    Each value is a slice of the pool at a random offset (as Flink's nextExactString). The
    slices are described as an Arrow ``string_view`` array over the pool (no copy in numpy),
    which Arrow's cast then copies into a plain string array.
    """
    missing = np.maximum(avg - current, 0)
    delta = np.floor(missing * 0.2 + 0.5).astype(np.int64)  # Math.round
    size = missing - delta + np.where(delta == 0, 0, d.below(field, np.maximum(2 * delta, 1)))
    offset = d.below(field + 1, POOL_LENGTH - size)
    pool = _pool(d.seed)
    rows = d.n
    views = np.zeros((rows, 4), dtype="<i4")  # 16 bytes per value: length, then data or reference
    views[:, 0] = size
    raw = views.view(np.uint8)
    windows = np.lib.stride_tricks.sliding_window_view(pool, 12)
    inline = size <= 12
    if inline.any():
        short = windows[offset[inline]] * (np.arange(12)[None, :] < size[inline, None])
        raw[inline, 4:16] = short
    long = ~inline
    raw[long, 4:8] = windows[offset[long], :4]  # prefix
    views[long, 2] = 0  # buffer index
    views[long, 3] = offset[long]
    arr = pa.Array.from_buffers(pa.string_view(), rows, [None, pa.py_buffer(views), pa.py_buffer(pool)])
    return arr.cast(pa.string())


def _price(d: _Draws, field: int) -> np.ndarray:
    """PriceGenerator.nextPrice: round(10^(6u) * 100), 100 .. 10^8 cents, log-uniform."""
    return np.floor(10.0 ** (d.uniform(field) * 6.0) * 100.0 + 0.5).astype(np.int64)


def _next_person(cfg: NexmarkConfig, d: _Draws, ids: np.ndarray, field: int) -> np.ndarray:
    """PersonGenerator.nextBase0PersonId: one of the last num_active_people, or a lead."""
    num = last_person(cfg, ids) + 1
    active = np.minimum(num, cfg.num_active_people)
    return num - active + d.below(field, active + cfg.person_id_lead)


def _next_auction(cfg: NexmarkConfig, d: _Draws, ids: np.ndarray, field: int) -> np.ndarray:
    """AuctionGenerator.nextBase0AuctionId: one of the last num_in_flight_auctions, or a lead."""
    last = last_auction(cfg, ids)
    low = np.maximum(last - cfg.num_in_flight_auctions, 0)
    return low + d.below(field, last - low + 1 + cfg.auction_id_lead)


@functools.lru_cache(maxsize=4)
def _channel_table(seed: int) -> tuple[pa.Array, pa.Array]:
    """Channels and urls: the 4 hot ones, then ``channel-<i>`` for i < 10000 (BidGenerator's cache)."""
    rows = len(HOT_CHANNELS) + CHANNELS_NUMBER
    d = _Draws(seed, _S_CHANNELS, np.arange(rows))
    parts: list[_Part] = [_const(rows, "https://www.nexmark.com/")]
    for field in (0, 2, 4):
        parts += [_next_string(d, field, 5, "_"), _const(rows, "/")]
    parts.append(_const(rows, "item.htm?query=1"))
    base = _strings(parts)[0].to_pylist()
    with_id = d.below(6, 10) > 0
    urls = list(base[: len(HOT_CHANNELS)])
    channels = list(HOT_CHANNELS)
    for i in range(CHANNELS_NUMBER):
        url = base[len(HOT_CHANNELS) + i]
        if with_id[len(HOT_CHANNELS) + i]:
            rev = int(f"{i:032b}"[::-1], 2)  # Integer.reverse(i) as an unsigned int
            signed = rev - (1 << 32) if rev >= 1 << 31 else rev
            # Math.abs of an int32 (which leaves Integer.MIN_VALUE, channel 1's, negative).
            url += f"&channel_id={signed if signed == -(1 << 31) else abs(signed)}"
        urls.append(url)
        channels.append(f"channel-{i}")
    return pa.array(channels, pa.string()), pa.array(urls, pa.string())


# ---------------------------------------------------------------------------------------------
# The three kinds of event, for arrays of event ids of that kind


def persons(cfg: NexmarkConfig, ids: np.ndarray) -> pa.Table:
    """PersonGenerator.nextPerson for each event id in ``ids`` (all of them person events)."""
    d = _Draws(cfg.seed, _S_PERSON, ids)
    rows = len(ids)
    first = d.below(0, len(FIRST_NAMES))
    last = d.below(1, len(LAST_NAMES))
    full_names = [f"{f} {s}" for f in FIRST_NAMES for s in LAST_NAMES]
    name, name_len = _pick(full_names, first * len(LAST_NAMES) + last)
    email, email_len = _strings(
        [_next_string(d, 2, 7), _const(rows, "@"), _next_string(d, 4, 5), _const(rows, ".com")])
    card = np.full((rows, 19), ord(" "), dtype=np.uint8)
    for k in range(4):
        group = d.below(6 + k, 10_000)
        for j in range(4):
            card[:, 5 * k + j] = 48 + (group // 10 ** (3 - j)) % 10
    credit_card, card_len = _strings([(card, np.ones(card.shape, dtype=bool))])
    city, city_len = _pick(US_CITIES, d.below(10, len(US_CITIES)))
    state, state_len = _pick(US_STATES, d.below(11, len(US_STATES)))
    current = 8 + name_len + email_len + card_len + city_len + state_len
    return pa.Table.from_arrays([
        pa.array(FIRST_PERSON_ID + last_person(cfg, ids)), name, email, credit_card, city, state,
        pa.array(time_us(cfg, ids), TS), _extra(d, 12, current, cfg.avg_person_bytes),
    ], schema=PERSON_SCHEMA)


def auctions(cfg: NexmarkConfig, ids: np.ndarray) -> pa.Table:
    """AuctionGenerator.nextAuction for each event id in ``ids`` (all of them auction events)."""
    d = _Draws(cfg.seed, _S_AUCTION, ids)
    hot = d.below(0, cfg.hot_sellers_ratio) > 0
    hot_seller = (last_person(cfg, ids) // HOT_GROUP) * HOT_GROUP
    seller = FIRST_PERSON_ID + np.where(hot, hot_seller, _next_person(cfg, d, ids, 1))
    category = FIRST_CATEGORY_ID + d.below(2, NUM_CATEGORIES)
    initial_bid = _price(d, 3)
    ts = time_us(cfg, ids)
    # Auction length: uniform with mean the time until num_in_flight_auctions more auctions.
    ahead = cfg.num_in_flight_auctions * cfg.total_proportion // cfg.auction_proportion
    horizon = time_us(cfg, ids + ahead) - ts
    expires = ts + 1 + d.below(4, np.maximum(2 * horizon, 1))
    item_name, name_len = _strings([_next_string(d, 5, 20)])
    description, desc_len = _strings([_next_string(d, 7, 100)])
    reserve = initial_bid + _price(d, 9)
    current = 8 + name_len + desc_len + 8 + 8 + 8 + 8 + 8
    return pa.Table.from_arrays([
        pa.array(FIRST_AUCTION_ID + last_auction(cfg, ids)), item_name, description,
        pa.array(initial_bid), pa.array(reserve), pa.array(ts, TS), pa.array(expires, TS),
        pa.array(seller), pa.array(category), _extra(d, 10, current, cfg.avg_auction_bytes),
    ], schema=AUCTION_SCHEMA)


def bids(cfg: NexmarkConfig, ids: np.ndarray) -> pa.Table:
    """BidGenerator.nextBid for each event id in ``ids`` (all of them bid events)."""
    d = _Draws(cfg.seed, _S_BID, ids)
    hot = d.below(0, cfg.hot_auction_ratio) > 0
    hot_auction = (last_auction(cfg, ids) // HOT_GROUP) * HOT_GROUP
    auction = FIRST_AUCTION_ID + np.where(hot, hot_auction, _next_auction(cfg, d, ids, 1))
    hot = d.below(2, cfg.hot_bidders_ratio) > 0
    newest = last_person(cfg, ids)
    hot_bidder = np.minimum((newest // HOT_GROUP) * HOT_GROUP + 1, newest + cfg.person_id_lead)
    bidder = FIRST_PERSON_ID + np.where(hot, hot_bidder, _next_person(cfg, d, ids, 3))
    price = _price(d, 4)
    hot = d.below(5, HOT_CHANNELS_RATIO) > 0
    which = np.where(hot, d.below(6, len(HOT_CHANNELS)),
                     len(HOT_CHANNELS) + d.below(7, CHANNELS_NUMBER))
    channels, urls = _channel_table(cfg.seed)
    take = pa.array(which)
    current = np.full(len(ids), 8 + 8 + 8 + 8, dtype=np.int64)
    return pa.Table.from_arrays([
        pa.array(auction), pa.array(bidder), pa.array(price), channels.take(take), urls.take(take),
        pa.array(time_us(cfg, ids), TS), _extra(d, 8, current, cfg.avg_bid_bytes),
    ], schema=BID_SCHEMA)


# ---------------------------------------------------------------------------------------------
# Ranges of events


def _blocks(start: int, stop: int, block: int) -> Iterator[tuple[int, int]]:
    for lo in range(start, stop, block):
        yield lo, min(lo + block, stop)


def _with_event_id(table: pa.Table, ids: np.ndarray, on: bool) -> pa.Table:
    return table.append_column("event_id", pa.array(ids)) if on else table


def _generate_block(cfg: NexmarkConfig, start: int, stop: int, with_event_id: bool) -> Chunk:
    ids = event_ids(cfg, np.arange(start, stop, dtype=np.int64))
    kinds = event_kinds(cfg, ids)
    tables = []
    for kind, make in ((PERSON, persons), (AUCTION, auctions), (BID, bids)):
        sel = ids[kinds == kind]
        tables.append(_with_event_id(make(cfg, sel), sel, with_event_id))
    return Chunk(*tables)


def generate(cfg: NexmarkConfig, start: int, stop: int, *, with_event_id: bool = False,
             block: int = BLOCK) -> Chunk:
    """The events of event numbers [start, stop): one table per stream, rows in stream order.

    A function of ``(cfg, start, stop)`` only, and per event of ``(cfg, event id)``, so
    ranges can be generated apart (in parallel) and concatenated. ``with_event_id`` appends
    an ``event_id`` column (not part of the spec's schema).
    """
    if not 0 <= start <= stop:
        raise ValueError(f"need 0 <= start <= stop, got [{start}, {stop})")
    parts = [_generate_block(cfg, lo, hi, with_event_id) for lo, hi in _blocks(start, stop, block)]
    if len(parts) == 1:
        return parts[0]
    if not parts:
        parts = [_generate_block(cfg, start, start, with_event_id)]
    return Chunk(*(pa.concat_tables([p[i] for p in parts]) for i in range(3)))


def combine(cfg: NexmarkConfig, start: int, stop: int, chunk: Chunk) -> pa.Table:
    """One row per event of [start, stop), in stream order: ``event_type`` (0 person, 1 auction,
    2 bid), the event in the matching struct column (the others null), and ``date_time``."""
    ids = event_ids(cfg, np.arange(start, stop, dtype=np.int64))
    kinds = event_kinds(cfg, ids)
    columns: list[pa.Array] = [pa.array(kinds.astype(np.int32))]
    for kind, table, schema in zip((PERSON, AUCTION, BID), chunk, SCHEMAS.values(), strict=True):
        mine = kinds == kind
        index = np.cumsum(mine) - 1
        struct = pa.StructArray.from_arrays(
            [table.column(f.name).combine_chunks() for f in schema], fields=list(schema))
        columns.append(struct.take(pa.array(index, mask=~mine)))
    columns.append(pa.array(time_us(cfg, ids), TS))
    return pa.Table.from_arrays(columns, schema=EVENT_SCHEMA)


def generate_events(cfg: NexmarkConfig, start: int, stop: int) -> pa.Table:
    """The combined single stream of event numbers [start, stop) (see ``combine``)."""
    return combine(cfg, start, stop, generate(cfg, start, stop))


# ---------------------------------------------------------------------------------------------
# Parquet files


def file_ranges(start: int, events: int, files: int) -> list[tuple[int, int]]:
    """Event-number ranges of the ``files`` files: as equal as possible, in order."""
    return [(start + events * k // files, start + events * (k + 1) // files) for k in range(files)]


def _part_name(k: int) -> str:
    return f"part-{k:05d}.parquet"


def _tmp_name(k: int) -> str:
    # Hidden (leading dot) until complete: Spark's file source skips such names.
    return f".{_part_name(k)}.tmp"


def _write_file(out: str, cfg: NexmarkConfig, k: int, lo: int, hi: int, combined: bool,
                compression: str, block: int) -> dict[str, int]:
    """Write file ``k`` of every stream under its hidden temporary name; return the row counts."""
    streams = {**SCHEMAS, **({"events": EVENT_SCHEMA} if combined else {})}
    writers = {name: pq.ParquetWriter(Path(out, name, _tmp_name(k)), schema, compression=compression,
                                      use_dictionary=DICTIONARY_COLUMNS[name])
               for name, schema in streams.items()}
    counts = dict.fromkeys(streams, 0)
    try:
        for blo, bhi in _blocks(lo, hi, block):
            chunk = generate(cfg, blo, bhi, block=block)
            tables = dict(zip(STREAMS, chunk, strict=True))
            if combined:
                tables["events"] = combine(cfg, blo, bhi, chunk)
            for name, table in tables.items():
                writers[name].write_table(table)
                counts[name] += table.num_rows
    finally:
        for w in writers.values():
            w.close()
    return counts


def write_dataset(out: Path, cfg: NexmarkConfig, *, events: int, files: int, start: int = 0,
                  combined: bool = False, compression: str = "snappy", block: int = FILE_BLOCK,
                  jobs: int = 1, force: bool = False, mtime_step: float = 1.0) -> dict[str, Any]:
    """Write ``files`` Parquet files per stream under ``out/<stream>/``; return a summary.

    Files appear (renamed from hidden temporary names) in order, each with a modification time
    ``mtime_step`` seconds after the previous one, the last ``mtime_step`` before the start of
    the run, so that Spark's file source (oldest first) reads them in event order.
    """
    if events < 0 or files < 1:
        raise ValueError("need events >= 0 and files >= 1")
    out = Path(out)
    streams = [*STREAMS, *(["events"] if combined else [])]
    existing = [p for s in streams for p in (out / s).glob("part-*.parquet")]
    if existing and not force:
        raise FileExistsError(f"{out} already holds {len(existing)} part files (use --force)")
    for s in streams:
        (out / s).mkdir(parents=True, exist_ok=True)
        for p in [*(out / s).glob("part-*.parquet"), *(out / s).glob(".part-*.parquet.tmp")]:
            p.unlink()
    ranges = file_ranges(start, events, files)
    t0 = time.time()
    totals = dict.fromkeys(streams, 0)
    args = [(str(out), cfg, k, lo, hi, combined, compression, block) for k, (lo, hi) in enumerate(ranges)]
    pool = ProcessPoolExecutor(jobs) if jobs > 1 else None
    try:
        results = pool.map(_write_file, *zip(*args, strict=True)) if pool else (
            _write_file(*a) for a in args)
        for k, counts in enumerate(results):
            mtime = t0 - (files - k) * mtime_step
            for s in streams:
                tmp = out / s / _tmp_name(k)
                os.utime(tmp, (mtime, mtime))
                os.replace(tmp, out / s / _part_name(k))
                totals[s] += counts[s]
    finally:
        if pool:
            pool.shutdown(cancel_futures=True)
    seconds = time.time() - t0
    summary: dict[str, Any] = {
        "out": str(out), "events": events, "start": start, "files": files, "rows": totals,
        "seconds": round(seconds, 3), "events_per_s": round(events / seconds) if seconds > 0 else None,
        "ranges": ranges, "config": asdict(cfg), "combined": combined, "compression": compression,
    }
    # '_' prefix: ignored by Spark's file source.
    (out / "_nexmark.json").write_text(json.dumps({k: v for k, v in summary.items()
                                                    if k not in ("seconds", "events_per_s")}, indent=1))
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("out", type=Path, help="output folder: OUT/person, OUT/auction, OUT/bid")
    ap.add_argument("--events", type=int, default=10_000_000, help="events in all (default 10 M)")
    ap.add_argument("--files", type=int, default=20, help="files per stream (default 20)")
    ap.add_argument("--rate", type=int, default=NexmarkConfig.rate,
                    help="events per second of event time (default 10000, the spec's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start", type=int, default=0, help="first event number (default 0)")
    ap.add_argument("--base-time", default="2015-07-15T00:00:00Z",
                    help="event time of event 0, ISO 8601 (default Beam's 2015-07-15T00:00:00Z)")
    ap.add_argument("--out-of-order-group", type=int, default=1,
                    help="outOfOrderGroupSize: events permuted within groups of this size "
                         "(default 1: in order, the spec's default)")
    ap.add_argument("--hot-auction-ratio", type=int, default=NexmarkConfig.hot_auction_ratio)
    ap.add_argument("--hot-sellers-ratio", type=int, default=NexmarkConfig.hot_sellers_ratio)
    ap.add_argument("--hot-bidders-ratio", type=int, default=NexmarkConfig.hot_bidders_ratio)
    ap.add_argument("--no-leads", action="store_true",
                    help="person/auction id leads 0: every reference is to an earlier event")
    ap.add_argument("--combined", action="store_true", help="also OUT/events, the single stream")
    ap.add_argument("--compression", default="snappy")
    ap.add_argument("--jobs", type=int, default=1, help="processes writing files in parallel")
    ap.add_argument("--force", action="store_true", help="replace existing part files")
    args = ap.parse_args(argv)
    leads = 0 if args.no_leads else 10
    base = datetime.datetime.fromisoformat(args.base_time.replace("Z", "+00:00"))
    if base.tzinfo is None:
        base = base.replace(tzinfo=datetime.UTC)
    cfg = NexmarkConfig(
        seed=args.seed, rate=args.rate, base_time_us=round(base.timestamp() * 1_000_000), out_of_order_group=args.out_of_order_group,
        hot_auction_ratio=args.hot_auction_ratio, hot_sellers_ratio=args.hot_sellers_ratio,
        hot_bidders_ratio=args.hot_bidders_ratio, person_id_lead=leads, auction_id_lead=leads)
    summary = write_dataset(args.out, cfg, events=args.events, files=args.files, start=args.start,
                            combined=args.combined, compression=args.compression, jobs=args.jobs,
                            force=args.force)
    summary.pop("ranges")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
