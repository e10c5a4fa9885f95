"""The batch-at-a-time co-process function's view of a batch (no Spark): the combined rows
``(key, __side, in1, in2)`` a two-input stage's task gets, split back into each input's
records, with their keys' codes and their places in the batch."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tests.operators.lockstep import run_in_lockstep

from keyscale.errors import JobDefinitionError
from keyscale.operators.coprocess import (
    INPUTS,
    SIDE,
    IntervalJoin,
    KeyedCoProcessFunction,
    VectorizedKeyedCoProcessFunction,
    adapt,
)
from keyscale.state.batches import KeyedBatch, KeyedCoBatch
from keyscale.state.contexts import Context, RuntimeContext

IN1 = pa.struct([("id", pa.string()), ("name", pa.string()), ("age", pa.int64())])
IN2 = pa.struct([("user", pa.string()), ("page", pa.string())])


def combined(rows: list[tuple[int, str, int]]) -> pa.Table:
    """Combined rows of (side, key, n) as the stage's task gets them."""
    side = [s for s, _, _ in rows]
    in1 = [{"id": k, "name": f"name{n}", "age": n} if s == 0 else None for s, k, n in rows]
    in2 = [{"user": k, "page": f"page{n}"} if s == 1 else None for s, k, n in rows]
    return pa.table({"id": [k for _, k, _ in rows], SIDE: pa.array(side, pa.int8()),
                     INPUTS[0]: pa.array(in1, IN1), INPUTS[1]: pa.array(in2, IN2)})


class Seen(VectorizedKeyedCoProcessFunction):
    input_columns1 = ("name", "age")

    def process_batch(self, batch: KeyedCoBatch) -> tuple[dict[str, Any], pd.DataFrame]:
        self.batch = batch
        return {}, pd.DataFrame()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1), st.sampled_from(["a", "b", "c", "d"]), st.integers(0, 99)), max_size=40))
def test_each_input_gets_its_own_records_in_arrival_order(rows: list[tuple[int, str, int]]) -> None:
    table = combined(rows)
    keys, codes = np.unique(np.array([k for _, k, _ in rows], dtype=object), return_inverse=True) if rows else (np.array([], dtype=object), np.array([], dtype=np.int64))
    fn = Seen()
    adapter = adapt(fn, 1)
    batch = KeyedBatch(records=pd.DataFrame(index=range(len(rows))), codes=np.asarray(codes, dtype=np.int64), keys=pd.DataFrame({"id": keys}),
                       state=pd.DataFrame(index=range(len(keys))), order=np.argsort(codes, kind="stable"), starts=np.zeros(1, dtype=np.int64),
                       batch_id=7, processing_time=0, arrow=table.select(adapter.input_columns))  # type: ignore[attr-defined]
    adapter.process_batch(batch)  # type: ignore[union-attr]
    b = fn.batch
    for n, records, codes_n, positions in ((0, b.records1, b.codes1, b.positions1), (1, b.records2, b.codes2, b.positions2)):
        mine = [(i, k, v) for i, (s, k, v) in enumerate(rows) if s == n]
        assert positions.tolist() == [i for i, _, _ in mine]
        assert [b.keys["id"][c] for c in codes_n] == [k for _, k, _ in mine]
        if n == 0:  # only the declared columns become pandas; integers stay integers
            assert list(records.columns) == ["name", "age"] and str(records["age"].dtype) == "Int64"
            assert records["age"].tolist() == [v for _, _, v in mine]
            assert b.arrow1 is not None and b.arrow1.column_names == ["name", "age"]
        else:  # None: every column
            assert list(records.columns) == ["user", "page"] and records["page"].tolist() == [f"page{v}" for _, _, v in mine]
    assert b.batch_id == 7


def test_arrow_only_functions_get_no_pandas() -> None:
    class ArrowOnly(Seen):
        pandas_records = False

    fn = ArrowOnly()
    adapter = adapt(fn, 1)
    rows = [(0, "a", 1), (1, "a", 2), (1, "b", 3)]
    batch = KeyedBatch(records=pd.DataFrame(index=range(3)), codes=np.array([0, 0, 1]), keys=pd.DataFrame({"id": ["a", "b"]}),
                       state=pd.DataFrame(index=range(2)), order=np.arange(3), starts=np.array([0, 2, 3]), batch_id=0, processing_time=0,
                       arrow=combined(rows).select(adapter.input_columns))  # type: ignore[attr-defined]
    adapter.process_batch(batch)  # type: ignore[union-attr]
    assert fn.batch.records2.shape == (2, 0) and fn.batch.arrow2 is not None and fn.batch.arrow2.column("page").to_pylist() == ["page2", "page3"]


def test_a_function_of_another_kind_is_refused_by_name() -> None:
    try:
        adapt(object(), 1)  # type: ignore[arg-type]
    except JobDefinitionError as e:
        assert "object is not a KeyedCoProcessFunction or VectorizedKeyedCoProcessFunction" in str(e)
    else:
        raise AssertionError("accepted")


# -- the interval join, a batch at a time, against the same join one record at a time ------------

class PerRecordIntervalJoin(KeyedCoProcessFunction):
    """The interval join one record at a time (keyscale's before it became a batch at a
    time): the oracle the batch-at-a-time join must agree with, batch by batch."""

    def __init__(self, time1: str, time2: str, lower_ms: int, upper_ms: int, type1: pa.DataType, type2: pa.DataType,
                 names1: list[str], names2: list[str]):
        self.time1, self.time2 = time1, time2
        self.lower, self.upper = lower_ms, upper_ms
        self.type1, self.type2 = type1, type2
        self.names1, self.names2 = names1, names2  # output column names per input column

    def open(self, ctx: RuntimeContext) -> None:
        self.left = ctx.list_state("left", self.type1)
        self.right = ctx.list_state("right", self.type2)

    def _emit(self, left: dict[str, Any], right: dict[str, Any]) -> dict[str, Any]:
        out = {n: left[c] for c, n in zip(left, self.names1, strict=True)}
        out.update({n: right[c] for c, n in zip(right, self.names2, strict=True)})
        return out

    def process_element1(self, row: dict[str, Any], ctx: Context) -> Iterable[Any] | None:
        t = _ms(row[self.time1])
        if t + self.upper < ctx.current_watermark:
            return None  # no right row that could join it can arrive any more (they would be late)
        out = [self._emit(row, r) for r in self.right.get() if t + self.lower <= _ms(r[self.time2]) <= t + self.upper]
        self.left.add(row)
        ctx.timer_service.register_event_time_timer(t + self.upper)
        return out

    def process_element2(self, row: dict[str, Any], ctx: Context) -> Iterable[Any] | None:
        t = _ms(row[self.time2])
        if t - self.lower < ctx.current_watermark:
            return None
        out = [self._emit(r, row) for r in self.left.get() if _ms(r[self.time1]) + self.lower <= t <= _ms(r[self.time1]) + self.upper]
        self.right.add(row)
        ctx.timer_service.register_event_time_timer(t - self.lower)
        return out

    def on_timer(self, key: Any, timestamp: int, ctx: Context) -> Iterable[Any] | None:
        # A left row at t joins right rows up to t + upper, a right row at t left rows from
        # t - upper: once the watermark passes those times, no partner can come any more.
        self.left.update(r for r in self.left.get() if _ms(r[self.time1]) + self.upper > timestamp)
        self.right.update(r for r in self.right.get() if _ms(r[self.time2]) - self.lower > timestamp)
        return None


def _ms(value: Any) -> int:
    return int(value)


LEFT = pa.struct([("id", pa.string()), ("t", pa.int64()), ("v", pa.int64())])
RIGHT = pa.struct([("user", pa.string()), ("t", pa.int64()), ("w", pa.string())])
PAIRS = pa.schema([("id", pa.string()), ("t", pa.int64()), ("v", pa.int64()), ("user", pa.string()), ("t_2", pa.int64()), ("w", pa.string())])
COMBINED = pa.schema([("id", pa.string()), (SIDE, pa.int8()), (INPUTS[0], LEFT), (INPUTS[1], RIGHT)])

rows_of_a_batch = st.lists(st.tuples(st.integers(0, 1), st.sampled_from("abc"), st.integers(0, 80)), max_size=10)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(rows_of_a_batch, st.integers(0, 25), st.sampled_from([None, 1, 3])), min_size=1, max_size=6),
       st.integers(-20, 5), st.integers(0, 20), st.sampled_from(["memory", "rocksdb"]))
# Rows exactly at both bounds and one past them: t = 10 on the left, lower -5, upper 5.
@example([([(0, "a", 10), (1, "a", 4), (1, "a", 5), (1, "a", 15), (1, "a", 16)], 0, None)], -5, 10, "memory")
@example([([(1, "a", 4), (1, "a", 5), (1, "a", 15), (1, "a", 16)], 0, None), ([(0, "a", 10)], 0, None)], -5, 10, "memory")
def test_the_interval_join_a_batch_at_a_time_equals_it_record_by_record(
        plan: list[tuple[list[tuple[int, str, int]], int, int | None]], lower: int, width: int, backend: str) -> None:
    """Random rows of both sides, watermark steps and restores at other parallelisms, then
    a drain: the same pairs in the same batches, and the same rows left waiting."""
    from keyscale.operators.eventtime import END_OF_TIME
    from keyscale.testing import KeyedHarness

    upper = lower + width
    names = (["id", "t", "v"], ["user", "t_2", "w"])
    fns = [PerRecordIntervalJoin("t", "t", lower, upper, LEFT, RIGHT, *names), IntervalJoin("t", "t", lower, upper, LEFT, RIGHT, *names)]
    runs = [KeyedHarness.of(adapt(f, 1), key_by=["id"], input_schema=COMBINED, output_schema=PAIRS, parallelism=2, state_backend=backend)  # type: ignore[arg-type]
            for f in fns]
    batches, watermark, seq = [], 0, 0
    for rows, step, restore_at in plan:
        watermark += step
        batch = []
        for side, key, t in rows:
            seq += 1
            one = {"id": key, "t": t, "v": seq} if side == 0 else {"user": key, "t": t, "w": f"w{seq}"}
            batch.append({"id": key, SIDE: side, INPUTS[0]: one if side == 0 else None, INPUTS[1]: one if side == 1 else None})
        batches.append((batch, watermark, restore_at))
    runs = run_in_lockstep(runs, batches, "abc")
    for h in runs:
        h.advance_watermark(END_OF_TIME)
        assert h.process() == []
    assert all(h.state(k) is None for h in runs for k in "abc")
