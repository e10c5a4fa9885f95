"""A live scale-up starts its Python workers before its first batch (batch/parallelism.py):
the rules without Spark, and the workers it starts with Spark."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from keyscale.checkpoint.jobdir import JobDir
from keyscale.runtime.batch import parallelism
from keyscale.runtime.batch.jobstate import (
    ExecutorsAsked,
    History,
    RunSummary,
    Scaling,
    WorkerStart,
)


class _Conf:
    def __init__(self, conf: dict[str, str]):
        self.conf = conf

    def get(self, key: str, default: str) -> str:
        return self.conf.get(key, default)


def _job(parallelism: int, conf: dict[str, str] | None = None) -> Any:
    spark = SimpleNamespace(sparkContext=SimpleNamespace(getConf=lambda: _Conf(conf or {})))
    return SimpleNamespace(scaling=Scaling(parallelism={"totals": parallelism}), spark=spark)


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[WorkerStart]:
    """The worker starts asked for, in order (none runs: each is done when the test says so)."""
    out: list[WorkerStart] = []

    def start(spark: Any, parallelism: int) -> WorkerStart:
        out.append(WorkerStart(parallelism))
        return out[-1]

    monkeypatch.setattr(parallelism, "start_workers", start)
    monkeypatch.setattr("keyscale.cluster.executor_cores", lambda spark: 2)
    return out


def test_a_scale_up_waits_for_its_workers_then_applies_once(started: list[WorkerStart], caplog: pytest.LogCaptureFixture) -> None:
    job = _job(1)
    caplog.set_level(logging.INFO, "keyscale")
    assert parallelism.awaiting_workers(job, 7, 2) is True  # starts them, the batch runs at 1
    assert parallelism.awaiting_workers(job, 8, 2) is True  # still starting
    assert [w.parallelism for w in started] == [2]
    started[0].done.set()
    assert parallelism.awaiting_workers(job, 9, 2) is False  # started: the rescale applies at this batch
    assert job.scaling.worker_start is None
    assert len(started) == 1
    assert "Python workers for 2 subtasks started" in caplog.text


@pytest.mark.parametrize(("current", "wanted", "conf"), [
    (2, 1, {}),  # a scale-down needs no new worker
    (2, 2, {}),
    (2, 3, {}),  # 3 subtasks on 2 cores run 2 tasks at once, in the workers there are
    (1, 2, {"spark.python.worker.reuse": "false"}),  # no worker outlives its task: nothing to start ahead
])
def test_no_wait_where_no_worker_would_be_kept_or_needed(started: list[WorkerStart], current: int, wanted: int, conf: dict[str, str]) -> None:
    job = _job(current, conf)
    assert parallelism.awaiting_workers(job, 3, wanted) is False
    assert started == []


def test_a_start_that_fails_or_outlasts_its_bound_does_not_hold_the_rescale_up(started: list[WorkerStart], caplog: pytest.LogCaptureFixture) -> None:
    job = _job(1)
    assert parallelism.awaiting_workers(job, 1, 2) is True
    started[0].error = "Py4JJavaError: lost"
    started[0].done.set()
    assert parallelism.awaiting_workers(job, 2, 2) is False
    assert "failed (Py4JJavaError: lost); rescaling without them" in caplog.text

    assert parallelism.awaiting_workers(job, 3, 2) is True  # another request later: started anew
    started[1].started -= parallelism.WARMUP_BOUND_SECONDS
    assert parallelism.awaiting_workers(job, 4, 2) is False
    assert "not started within 30 s; rescaling without them" in caplog.text


def test_a_new_target_starts_workers_for_it(started: list[WorkerStart], monkeypatch: pytest.MonkeyPatch) -> None:
    job = _job(1)
    assert parallelism.awaiting_workers(job, 1, 2) is True
    monkeypatch.setattr("keyscale.cluster.executor_cores", lambda spark: 4)  # executors came meanwhile
    assert parallelism.awaiting_workers(job, 2, 4) is True
    assert [w.parallelism for w in started] == [2, 4]


def _running(tmp_path: Path, parallelism: int) -> Any:
    """A job at ``parallelism`` with what applying a rescale request touches."""
    job = _job(parallelism)
    job.jobdir = JobDir(tmp_path / "job")
    job.jobdir.claim("job", 128, 128)
    job.opts, job.max_parallelism = SimpleNamespace(scaling="fixed"), 128
    job.history = History(RunSummary("job", str(tmp_path / "job")))
    return job


def test_a_requested_scale_up_applies_at_the_first_batch_after_its_workers_started(started: list[WorkerStart], tmp_path: Path) -> None:
    job = _running(tmp_path, 1)
    job.jobdir.request_rescale(2)
    parallelism.apply_rescale_requests(job, 5)
    parallelism.apply_rescale_requests(job, 6)
    assert job.scaling.parallelism == {"totals": 1}  # batches 5 and 6 at the old parallelism
    assert job.jobdir.read_rescale_requests() == {"*": 2}  # still pending
    started[0].done.set()
    parallelism.apply_rescale_requests(job, 7)
    assert job.scaling.parallelism == {"totals": 2}
    assert job.history.summary.rescales == [(7, "totals", 1, 2)]


def test_a_scale_up_that_waited_for_new_executors_applies_when_they_came(
    started: list[WorkerStart], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Executors start cold: a warm-up there moves the time to speed, not shortens it."""
    job = _running(tmp_path, 1)
    job.jobdir.request_rescale(2)
    job.scaling.executors_asked = ExecutorsAsked(2, 0.0)
    monkeypatch.setattr(parallelism, "awaiting_executors", lambda job, batch_id: False)  # they came
    parallelism.apply_rescale_requests(job, 5)
    assert job.scaling.parallelism == {"totals": 2}
    assert started == []


def test_the_workers_it_starts_have_the_task_side_imported(spark: Any) -> None:
    """The job runs without error, and after it two tasks at once run in workers that
    imported keyscale's task side before them (a task's own function, pickled by value,
    imports none of it). On the tests' shared session those workers may have been started
    by earlier tests too: what the start saves a rescale is measured by bench/latency.py
    (docs/benchmarks.md, "Python workers started before a scale-up"), not here."""
    w = parallelism.start_workers(spark, 2)
    assert w.done.wait(120) and w.error is None

    def probe(batches: Any) -> Any:
        import os
        import sys
        import time

        import pyarrow as pa

        loaded = "keyscale.runtime.task.spark" in sys.modules
        for _ in batches:
            pass
        time.sleep(0.3)  # both tasks at once: two workers
        yield pa.RecordBatch.from_pydict({"pid": [os.getpid()], "loaded": [loaded]})

    rows = spark.range(0, 2, 1, 2).mapInArrow(probe, "pid long, loaded boolean").collect()
    assert len({r.pid for r in rows}) == 2
    assert all(r.loaded for r in rows)


def test_the_job_runs_beside_the_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    """start_workers returns at once: the batch at the old parallelism runs meanwhile."""
    gate = threading.Event()

    class _Df:
        def collect(self) -> list[Any]:
            gate.wait(10)
            return []

    spark = SimpleNamespace(sparkContext=SimpleNamespace(setLocalProperty=lambda k, v: None), range=lambda *a: _Df())
    monkeypatch.setattr("keyscale._spark_map.map_in_arrow", lambda df, fn, schema: df)
    w = parallelism.start_workers(spark, 2)  # type: ignore[arg-type]
    assert not w.done.is_set()
    gate.set()
    assert w.done.wait(10) and w.error is None
