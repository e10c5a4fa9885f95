"""The window join's function on the keyed-stage harness (no Spark): for any rows, batch
splits and parallelism, its pairs are the brute-force join per shared window, late rows
join nothing, and once the watermark passes every window its state is empty."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tests.operators.lockstep import run_in_lockstep

from keyscale.operators.coprocess import KeyedCoProcessFunction, WindowJoin, adapt
from keyscale.operators.windows import SlidingWindows, TumblingWindows
from keyscale.state.contexts import Context, RuntimeContext
from keyscale.testing import KeyedHarness

A = pa.struct([("ts", pa.int64()), ("v", pa.string())])
B = pa.struct([("ts", pa.int64()), ("v", pa.string())])
INPUT = pa.schema([("key", pa.string()), ("__side", pa.int8()), ("in1", A), ("in2", B)])
OUTPUT = "ts long, v string, ts_2 long, v_2 string, window_start timestamp, window_end timestamp"


def _harness(assigner: Any, parallelism: int, state_backend: str = "memory") -> KeyedHarness:
    fn = WindowJoin(assigner, "ts", "ts", A, B, ["ts", "v"], ["ts_2", "v_2"])
    return KeyedHarness.of(adapt(fn, 1), key_by=["key"], input_schema=INPUT, output_schema=OUTPUT, parallelism=parallelism,
                           state_backend=state_backend)


def _row(key: str, side: int, ts: int, v: str) -> dict[str, Any]:
    rec = {"ts": ts, "v": v}
    return {"key": key, "__side": side, "in1": rec if side == 0 else None, "in2": rec if side == 1 else None}


def _brute(assigner: Any, rows: list[dict[str, Any]]) -> list[tuple[int, str, int, str, int]]:
    def starts(ts: int) -> set[int]:
        import numpy as np

        return {int(s) for s in assigner.assign(np.array([ts], dtype=np.int64))[1]}

    left = [(r["key"], r["in1"]) for r in rows if r["__side"] == 0]
    right = [(r["key"], r["in2"]) for r in rows if r["__side"] == 1]
    return sorted((a["ts"], a["v"], b["ts"], b["v"], s) for ka, a in left for kb, b in right if ka == kb
                  for s in starts(a["ts"]) & starts(b["ts"]))


rows_strategy = st.lists(
    st.tuples(st.sampled_from(["k1", "k2", "k3"]), st.integers(0, 1), st.integers(0, 10_000)), min_size=1, max_size=30)


@settings(max_examples=30, deadline=None)
@given(rows=rows_strategy, sliding=st.booleans(), parallelism=st.integers(1, 3), cuts=st.lists(st.integers(0, 30), max_size=3))
def test_pairs_are_the_brute_force_join_and_state_ends_empty(rows: list[tuple[str, int, int]], sliding: bool, parallelism: int,
                                                             cuts: list[int]) -> None:
    assigner = SlidingWindows("3 seconds", "1 second") if sliding else TumblingWindows("2 seconds")
    records = [_row(k, side, ts, f"r{i}") for i, (k, side, ts) in enumerate(rows)]
    h = _harness(assigner, parallelism)
    got = []
    bounds = [0, *sorted({min(c, len(records)) for c in cuts}), len(records)]
    for lo, hi in itertools.pairwise(bounds):
        got += h.process(records[lo:hi])  # the watermark stays before every row: nothing is late
    h.advance_watermark(10**9)
    assert h.process() == []  # the windows' end emits nothing new: pairs came as they met
    pairs = sorted((r["ts"], r["v"], r["ts_2"], r["v_2"], int(r["window_start"].timestamp() * 1000)) for r in got)
    assert pairs == _brute(assigner, records)
    for key in ("k1", "k2", "k3"):
        assert h.state(key) is None  # every row left when its last window fired


@pytest.mark.parametrize("backend", ["memory", "rocksdb"])
def test_a_row_whose_windows_have_fired_joins_nothing_and_is_not_kept(backend: str) -> None:
    h = _harness(TumblingWindows("1 second"), 1, backend)
    assert h.process([_row("k", 0, 500, "a")]) == []
    h.advance_watermark(1500)  # window [0, 1000) has fired
    assert h.process([_row("k", 1, 700, "late"), _row("k", 1, 1200, "b"), _row("k", 0, 1900, "c")]) == [
        {"ts": 1900, "v": "c", "ts_2": 1200, "v_2": "b", "window_start": _dt(1000), "window_end": _dt(2000)}]
    state = h.state("k")
    assert state is not None and [r["v"] for r in state["left"]] == ["c"] and [r["v"] for r in state["right"]] == ["b"]


def _dt(ms: int) -> Any:
    import datetime as dt

    return dt.datetime(1970, 1, 1, tzinfo=dt.UTC) + dt.timedelta(milliseconds=ms)



# -- a batch at a time against the same join one record at a time ------------------------------

class PerRecordWindowJoin(KeyedCoProcessFunction):
    """The window join one record at a time (keyscale's before it became a batch at a
    time): the oracle the batch-at-a-time join must agree with, batch by batch."""

    def __init__(self, assigner: Any, time1: str, time2: str, type1: pa.DataType, type2: pa.DataType,
                 names1: list[str], names2: list[str]):
        self.assigner = assigner
        self.time1, self.time2 = time1, time2
        self.type1, self.type2 = type1, type2
        self.names1, self.names2 = names1, names2

    def open(self, ctx: RuntimeContext) -> None:
        self.left = ctx.list_state("left", self.type1)
        self.right = ctx.list_state("right", self.type2)

    def _starts(self, t: int) -> list[int]:
        return [int(s) for s in self.assigner.assign(np.array([t], dtype=np.int64))[1]]

    def _end(self, start: int) -> int:
        return int(self.assigner.end(np.array([start], dtype=np.int64))[0])

    def _join(self, row: dict[str, Any], t: int, others: list[dict[str, Any]], other_time: str, first: bool, ctx: Context) -> list[dict[str, Any]] | None:
        # A window [s, e) fires once the watermark reaches e - 1; after that it takes nothing.
        mine = {s for s in self._starts(t) if self._end(s) - 1 > ctx.current_watermark}
        if not mine:
            return None
        out = []
        for other in others:
            for s in sorted(mine.intersection(self._starts(_ms(other[other_time])))):
                left, right = (row, other) if first else (other, row)
                pair = {n: left[c] for c, n in zip(left, self.names1, strict=True)}
                pair.update({n: right[c] for c, n in zip(right, self.names2, strict=True)})
                pair["window_start"], pair["window_end"] = _utc(s), _utc(self._end(s))
                out.append(pair)
        ctx.timer_service.register_event_time_timer(max(self._end(s) for s in mine) - 1)
        return out

    def process_element1(self, row: dict[str, Any], ctx: Context) -> Iterable[Any] | None:
        out = self._join(row, _ms(row[self.time1]), self.right.get(), self.time2, True, ctx)
        if out is not None:
            self.left.add(row)
        return out

    def process_element2(self, row: dict[str, Any], ctx: Context) -> Iterable[Any] | None:
        out = self._join(row, _ms(row[self.time2]), self.left.get(), self.time1, False, ctx)
        if out is not None:
            self.right.add(row)
        return out

    def on_timer(self, key: Any, timestamp: int, ctx: Context) -> Iterable[Any] | None:
        def open_windows(r: dict[str, Any], time: str) -> bool:
            return max(self._end(s) for s in self._starts(_ms(r[time]))) - 1 > timestamp

        self.left.update(r for r in self.left.get() if open_windows(r, self.time1))
        self.right.update(r for r in self.right.get() if open_windows(r, self.time2))
        return None


def _ms(value: Any) -> int:
    return int(value)


def _utc(ms: int) -> Any:
    return _dt(ms)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.lists(st.tuples(st.sampled_from(["k1", "k2"]), st.integers(0, 1), st.integers(0, 6_000)), max_size=10),
                          st.integers(0, 2_500), st.sampled_from([None, 1, 3])), min_size=1, max_size=5),
       st.booleans(), st.sampled_from(["memory", "rocksdb"]))
# The watermark lands exactly where a row's only window fires (2000 - 1): the row must go.
@example([([("k1", 0, 100)], 0, None), ([], 1999, None), ([("k1", 1, 1500)], 0, None)], False, "memory")
def test_the_window_join_a_batch_at_a_time_equals_it_record_by_record(
        plan: list[tuple[list[tuple[str, int, int]], int, int | None]], sliding: bool, backend: str) -> None:
    """Random rows, watermark steps (late rows, windows firing) and restores at other
    parallelisms, then the end of time: the same pairs in the same batches, the same rows waiting."""
    assigner = SlidingWindows("3 seconds", "1 second") if sliding else TumblingWindows("2 seconds")
    names = (["ts", "v"], ["ts_2", "v_2"])
    fns = [PerRecordWindowJoin(assigner, "ts", "ts", A, B, *names), WindowJoin(assigner, "ts", "ts", A, B, *names)]
    runs = [KeyedHarness.of(adapt(f, 1), key_by=["key"], input_schema=INPUT, output_schema=OUTPUT, parallelism=2,  # type: ignore[arg-type]
                            state_backend=backend) for f in fns]
    batches, watermark, seq = [], 0, 0
    for rows, step, restore_at in plan:
        watermark += step
        batch = []
        for key, side, ts in rows:
            seq += 1
            batch.append(_row(key, side, ts, f"r{seq}"))
        batches.append((batch, watermark, restore_at))
    runs = run_in_lockstep(runs, batches, ("k1", "k2"))
    for h in runs:
        h.advance_watermark(10**9)
        assert h.process() == []
        assert h.state("k1") is None and h.state("k2") is None
