"""Nexmark's batch-at-a-time functions (bench/nexmark/queries.py) against their per-record
forms on the keyed-stage harness (no Spark): for any persons, auctions, watermark steps and
restores at another parallelism, both emit the same rows in every batch."""

from __future__ import annotations

import datetime as dt
import sys
from typing import Any

import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import ROOT
from keyscale.operators.coprocess import adapt
from keyscale.testing import KeyedHarness

sys.path.insert(0, str(ROOT / "bench"))
try:
    from nexmark import queries as Q
finally:
    sys.path.remove(str(ROOT / "bench"))

TS = pa.timestamp("us", tz="UTC")
PERSON = pa.struct([("id", pa.int64()), ("name", pa.string()), ("date_time", TS)])
AUCTION = pa.struct([("seller", pa.int64()), ("date_time", TS)])
INPUT = pa.schema([("id", pa.int64()), ("__side", pa.int8()), ("in1", PERSON), ("in2", AUCTION)])
OUTPUT = "id long, name string, starttime timestamp"
T0 = 1_700_000_000_000  # a 10 s window boundary (epoch ms)


def _at(ms: int) -> dt.datetime:
    return dt.datetime.fromtimestamp((T0 + ms) / 1000, dt.UTC)


def _person(pid: int, ms: int) -> dict[str, Any]:
    return {"id": pid, "__side": 0, "in1": {"id": pid, "name": f"p{pid}", "date_time": _at(ms)}, "in2": None}


def _auction(seller: int, ms: int) -> dict[str, Any]:
    return {"id": seller, "__side": 1, "in1": None, "in2": {"seller": seller, "date_time": _at(ms)}}


# A batch: events (a person of a new id, or an auction of a seller), the watermark's step
# after it, and a parallelism to restore both at first (or None). A person comes once, as in
# Nexmark (the batch form relies on it); auctions may come before their seller.
batches = st.lists(st.tuples(
    st.lists(st.tuples(st.booleans(), st.integers(1, 4), st.integers(0, 45_000)), max_size=12),
    st.integers(0, 15_000), st.sampled_from([None, 1, 3])), min_size=1, max_size=5)


@settings(max_examples=40, deadline=None)
@given(batches)
def test_q8_a_batch_at_a_time_emits_what_the_per_record_function_does(plan: list[tuple[list[tuple[bool, int, int]], int, int | None]]) -> None:
    runs = [KeyedHarness.of(adapt(f, 1), key_by=["id"], input_schema=INPUT, output_schema=OUTPUT, parallelism=2)  # type: ignore[arg-type]
            for f in (Q.NewUsers(), Q.NewUsersBatch())]
    seen: set[int] = set()
    watermark = Q.WINDOW_MS // 2
    for events, step, restore_at in plan:
        records = []
        for is_person, pid, ms in events:
            if is_person and pid not in seen:
                seen.add(pid)
                records.append(_person(pid, ms))
            elif not is_person:
                records.append(_auction(pid, ms))
        if restore_at is not None:
            runs = [h.snapshot().restore(restore_at) for h in runs]
        outs = []
        for h in runs:
            h.advance_watermark(T0 + watermark)
            outs.append(h.process(records))
        assert outs[0] == outs[1]
        watermark += step
    for h in runs:  # the end of time: every window closes, nothing more is emitted, no state is left
        h.advance_watermark(T0 + 10**9)
        assert h.process() == []
        assert all(h.state(pid) is None for pid in range(1, 5))
