"""The garbage collector's pauses in a task's busy time (runtime/task/gcpauses.py): summed
from start/stop pairs on the busy time's clock, the callback gone however the block ends,
and reported by keyed and non-keyed subtasks. A fake clock that steps by a power of two per
reading makes every sum exact: no timed assertion."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pytest
from test_task import TRACKER_OUT, Driver, Tracker, _clear_held, make_batches  # noqa: F401 (_clear_held: the warm state, cleared)

import keyscale.runtime.task.gcpauses as gcpauses
from keyscale.operators.nonkeyed import ProcessFunction
from keyscale.runtime.task.gcpauses import GcPauses, gc_pauses
from keyscale.runtime.task.nonkeyed import NonKeyedTask, run_nonkeyed_subtask

STEP = 2.0**-20  # seconds per reading of the fake clock


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    ticks = iter(range(1, 10**9))
    monkeypatch.setattr(gcpauses, "perf_counter", lambda: next(ticks) * STEP)
    yield


def test_each_collection_adds_its_pause(clock: None) -> None:
    before = list(gc.callbacks)
    with gc_pauses() as pauses:
        assert pauses in gc.callbacks
        for _ in range(3):
            gc.collect()
    assert gc.callbacks == before
    # One reading at each start and each stop: every collection (ours and any the
    # interpreter ran meanwhile) adds exactly one step.
    assert pauses.seconds >= 3 * STEP and (pauses.seconds / STEP).is_integer()


def test_a_stop_without_its_start_counts_nothing() -> None:
    p = GcPauses()
    p("stop", {})  # added while a collection ran
    assert p.seconds == 0.0
    p("start", {})
    p("stop", {})
    p("stop", {})
    assert p.seconds >= 0.0 and p._began < 0


def test_the_callback_is_removed_when_the_block_fails() -> None:
    before = list(gc.callbacks)
    with pytest.raises(ValueError), gc_pauses():
        raise ValueError("the task failed")
    assert gc.callbacks == before


def test_a_keyed_subtask_reports_its_pauses_within_its_busy_time(clock: None, tmp_path: Any) -> None:
    class Collecting(Tracker):
        def process_element(self, row: Any, ctx: Any) -> Any:
            gc.collect()
            return super().process_element(row, ctx)

    before = list(gc.callbacks)
    _, reports = Driver(tmp_path / "job", Collecting(), TRACKER_OUT).run(0, make_batches(1, 12, 4)[0], 2)
    assert gc.callbacks == before
    assert [r.subtask for r in reports] == [0, 1]
    assert all(0 < r.gc_seconds <= r.busy_seconds for r in reports if r.records), reports


def test_a_nonkeyed_subtask_reports_its_pauses(clock: None) -> None:
    class Collect(ProcessFunction):
        def process(self, records: Any, ctx: Any) -> Any:
            gc.collect()
            return []

    schema = pa.schema([("x", pa.int64())])
    spec = NonKeyedTask(uid="n", function=Collect(), output_schema=schema, parallelism=1, batch_id=0, batch_time_ms=0, lists=({},))
    _, report = run_nonkeyed_subtask(spec, iter([pa.record_batch([pa.array([1, 2])], schema=schema)]), 0)
    assert 0 < report.gc_seconds <= report.busy_seconds and report.records == 2
