"""Event-time timers of vectorized functions (``event_timers = True``), run by the harness
(the subtasks' own code, no Spark): the same firings as a per-record function with the same
logic, on both state backends, across restores at other parallelisms and a drain."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.operators.lockstep import run_in_lockstep

import keyscale as ks
from keyscale.errors import JobDefinitionError
from keyscale.operators.eventtime import END_OF_TIME
from keyscale.testing import KeyedHarness

GAP = 10
IN = "k string, t long"
OUT = "k string, n long, fired long"


class SessionEndPerRecord(ks.KeyedProcessFunction):
    """Per record: count a key's records; one timer at the latest time seen + GAP; its firing
    emits the count and forgets the key."""

    def open(self, ctx: ks.state.RuntimeContext) -> None:
        self.n = ctx.value_state("n", "long")
        self.last = ctx.value_state("last", "long")

    def process_element(self, row: Any, ctx: ks.state.Context) -> Any:
        last = self.last.value()
        if last is None or row.t > last:
            if last is not None:
                ctx.timer_service.delete_event_time_timer(last + GAP)
            self.last.update(row.t)
            ctx.timer_service.register_event_time_timer(row.t + GAP)
        self.n.update((self.n.value() or 0) + 1)
        return []

    def on_timer(self, key: Any, timestamp: int, ctx: ks.state.Context) -> Any:
        yield (key, self.n.value(), timestamp)
        self.n.clear()
        self.last.clear()


class SessionEnd(ks.VectorizedKeyedFunction):
    """The same a batch at a time: due timers fire first (with the state before the batch's
    records, as the per-record runtime does), then the records count and move the timer."""

    event_timers = True

    def open(self, ctx: ks.state.RuntimeContext) -> None:
        self.n = ctx.value_state("n", "long")
        self.last = ctx.value_state("last", "long")

    def process_batch(self, b: ks.state.KeyedBatch) -> tuple[dict[str, Any], pd.DataFrame]:
        assert b.due is not None and b.timer is not None
        due = b.due
        fired = pd.DataFrame({"k": b.keys["k"][due], "n": b.state["n"][due], "fired": b.timer[due]})
        n = np.where(due, 0, b.state["n"].to_numpy(dtype=np.int64, na_value=0)) + b.count()
        none = np.iinfo(np.int64).min
        last = np.maximum(np.where(due, none, b.state["last"].to_numpy(dtype=np.int64, na_value=none)), b.reduce("t", "max"))
        live = n > 0

        def where_live(values: np.ndarray) -> pd.Series:
            return pd.Series(np.where(live, values, 0), dtype="Int64").where(live)

        return {"n": where_live(n), "last": where_live(last), ks.state.TIMER: where_live(last + GAP)}, fired


batches = st.lists(
    st.tuples(st.lists(st.tuples(st.sampled_from("abcdefgh"), st.integers(0, 60)), max_size=12),
              st.integers(0, 15), st.sampled_from([None, 1, 2, 3])),
    min_size=1, max_size=6)


@settings(max_examples=25, deadline=None)
@given(batches, st.lists(st.tuples(st.sampled_from("abcdefgh"), st.integers(0, 60)), max_size=5), st.sampled_from(["memory", "rocksdb"]))
def test_vectorized_timers_fire_as_per_record_ones(plan: list[tuple[list[tuple[str, int]], int, int | None]], last: list[tuple[str, int]],
                                                   backend: str) -> None:
    """Each batch: records, a watermark step, and maybe a restore at another parallelism
    first; then a drain with the ``last`` records (their timers fire in it: no batch
    follows). Both functions emit the same rows in the same batches."""
    runs = [KeyedHarness.of(f, key_by=["k"], input_schema=IN, output_schema=OUT, parallelism=2, event_time="t", state_backend=backend)
            for f in (SessionEndPerRecord(), SessionEnd())]
    steps = itertools.accumulate(step for _, step, _ in plan)
    runs = run_in_lockstep(runs, [([{"k": k, "t": t} for k, t in records], w, restore_at)
                                  for (records, _, restore_at), w in zip(plan, steps, strict=True)], "abcdefgh")
    run_in_lockstep(runs, [([{"k": k, "t": t} for k, t in last], END_OF_TIME, None)])
    assert all(h.state(k) is None for h in runs for k in "abcdefgh")  # every session ended, nothing left


def test_a_due_key_without_records_is_in_the_batch() -> None:
    h = KeyedHarness.of(SessionEnd(), key_by=["k"], input_schema=IN, output_schema=OUT, parallelism=1, event_time="t")
    h.advance_watermark(0)
    assert h.process([{"k": "a", "t": 5}, {"k": "a", "t": 7}, {"k": "b", "t": 30}]) == []
    h.advance_watermark(17)  # a's timer (7 + 10) is due, b's (40) is not
    assert h.process([]) == [{"k": "a", "n": 2, "fired": 17}]
    assert h.state("a") is None and h.state("b") == {"n": 1, "last": 30}


def test_event_timers_need_a_watermark(spark: Any, tmp_path: Any) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"k": ["a"], "t": [1]}), tmp_path / "p.parquet")
    s = ks.stream(spark.readStream.schema("k string, t long").parquet(str(tmp_path)))
    with pytest.raises(JobDefinitionError, match="operator 'ends': SessionEnd has event_timers, which fire as the watermark passes them"):
        s.key_by("k").process(SessionEnd(), OUT, uid="ends")


class Remind(ks.VectorizedKeyedFunction):
    """A timer at each key's earliest record's time + GAP, set only in batches with records:
    in the others the returned state has no TIMER, so the due ones are spent, the rest kept."""

    event_timers = True

    def process_batch(self, b: ks.state.KeyedBatch) -> tuple[dict[str, Any], pd.DataFrame]:
        assert b.due is not None and b.timer is not None
        fired = pd.DataFrame({"k": b.keys["k"][b.due], "n": 0, "fired": b.timer[b.due]})
        if not len(b.records):
            return {}, fired  # no TIMER: the due timers are spent, the others kept
        return {ks.state.TIMER: pd.Series(b.reduce("t", "min") + GAP, dtype="Int64")}, fired


def test_due_timers_are_spent_when_the_function_sets_none() -> None:
    h = KeyedHarness.of(Remind(), key_by=["k"], input_schema=IN, output_schema=OUT, parallelism=1, event_time="t")
    assert h.process([{"k": "a", "t": 1}, {"k": "b", "t": 20}]) == []
    h.advance_watermark(11)
    assert h.process() == [{"k": "a", "n": 0, "fired": 11}]  # b's (30) stays
    h.advance_watermark(40)
    assert h.process() == [{"k": "b", "n": 0, "fired": 30}]  # a's was spent: it does not fire again
    h.advance_watermark(END_OF_TIME)
    assert h.process() == []


def test_reduce_gives_keys_without_records_the_identity() -> None:
    b = ks.state.KeyedBatch(records=pd.DataFrame({"v": [5, 7, 1]}), codes=np.array([0, 2, 0]), keys=pd.DataFrame({"k": ["a", "b", "c", "d"]}),
                            state=pd.DataFrame(index=range(4)), order=np.array([0, 2, 1]), starts=np.array([0, 2, 2, 3, 3]), batch_id=0,
                            processing_time=0)
    assert b.reduce("v", "sum").tolist() == [6, 0, 7, 0]
    assert b.reduce("v", "max").tolist() == [5, np.iinfo(np.int64).min, 7, np.iinfo(np.int64).min]
    assert b.count("v").tolist() == [2, 0, 1, 0] and b.count().tolist() == [2, 0, 1, 0]
