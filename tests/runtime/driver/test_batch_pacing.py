"""When a log source's next batch starts (issue 35, item 2): at once while records wait in
the log, not a trigger interval after the last one began; when idle, as soon as records
arrive; ``wait_for_trigger=True`` keeps one batch per interval. What the batches read and
commit is unchanged: every record counted once."""

from __future__ import annotations

import itertools
import threading
import time
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pytest

from conftest import EXAMPLES, read_output, run_on_thread
from keyscale.runtime.batch.jobstate import BatchRecord, RunOptions
from keyscale.runtime.driver.runner import JobRunner
from keyscale.sources import LocalLog

pytestmark = [pytest.mark.slow]

JOB = EXAMPLES / "log_count.py"


def _append(log: LocalLog, start: int, n: int) -> None:
    log.append(0, pa.table({"key": [f"k{(start + i) % 7}" for i in range(n)], "value": [start + i for i in range(n)]}))


def _run(tmp_path: Path, log: LocalLog, interval: str, batches: int, after: Any, **opts: Any) -> tuple[JobRunner, list[float], list[float]]:
    """Run log_count until ``batches`` batches ran; ``after(i)`` after batch ``i``; when each batch began and ended."""
    ended: list[float] = []
    begun: list[float] = []
    runner: JobRunner

    def on_batch(rec: BatchRecord) -> None:
        ended.append(time.monotonic())
        begun.append(time.monotonic() - rec.seconds)
        after(len(ended) - 1)
        if len(ended) >= batches:
            runner.stop()

    runner = JobRunner(RunOptions(job_file=str(JOB), job_dir=str(tmp_path / "job"), parallelism=1, trigger_interval=interval,
                                  args={"log": log.uri, "output": str(tmp_path / "out")}, **opts), on_batch=on_batch)
    run_on_thread(runner.run, 240)
    return runner, begun, ended


def _counted(tmp_path: Path) -> dict[str, int]:
    out = read_output(tmp_path / "out")
    return {str(k): int(v) for k, v in out.sort_values("count").groupby("key").tail(1).set_index("key")["count"].items()}


def _expected(n: int) -> dict[str, int]:
    return {str(k): int(v) for k, v in pd.Series([f"k{i % 7}" for i in range(n)]).value_counts().items()}


def test_records_waiting_start_the_next_batch_without_the_trigger_wait(spark: Any, tmp_path: Path) -> None:
    log = LocalLog.create(str(tmp_path / "log"), "key string, value long", partitions=1)
    _append(log, 0, 50)
    # Each batch's callback appends records: the next batch has input waiting when it may start.
    runner, _, ended = _run(tmp_path, log, "60 seconds", 4, lambda i: _append(log, 50 + 50 * i, 50) if i < 3 else None)
    records = [b.records for b in runner.summary.batches]
    assert records == [50, 50, 50, 50]
    assert ended[-1] - ended[0] < 30, "a batch waited for the 60 s trigger while records waited"
    assert _counted(tmp_path) == _expected(200)  # each record counted once


def test_an_idle_job_starts_a_batch_as_soon_as_records_arrive(spark: Any, tmp_path: Path) -> None:
    log = LocalLog.create(str(tmp_path / "log"), "key string, value long", partitions=1)
    arrived: list[float] = []

    def later(i: int) -> None:
        if i == 0:  # batch 0 read nothing; records come a second later, while the job idles
            def produce() -> None:
                time.sleep(1.0)
                _append(log, 0, 30)
                arrived.append(time.monotonic())
            threading.Thread(target=produce, daemon=True).start()

    runner, _, ended = _run(tmp_path, log, "60 seconds", 2, later)
    assert [b.records for b in runner.summary.batches] == [0, 30]
    assert ended[1] - arrived[0] < 30, "the idle job waited for the 60 s trigger with records in the log"
    assert _counted(tmp_path) == _expected(30)


def test_wait_for_trigger_keeps_one_batch_per_interval(spark: Any, tmp_path: Path) -> None:
    log = LocalLog.create(str(tmp_path / "log"), "key string, value long", partitions=1)
    _append(log, 0, 20)
    runner, begun, _ = _run(tmp_path, log, "3 seconds", 3, lambda i: _append(log, 20 + 20 * i, 20), wait_for_trigger=True)
    assert [b.records for b in runner.summary.batches] == [20, 20, 20]
    # A batch begins 3 s after the one before began, records waiting or not (without the
    # option they would run back to back, under a second apart). ``begun`` is estimated from
    # when on_batch ran less the batch's own seconds, so the status write between commit and
    # callback (slower for a job's first batch, on a busy machine) shifts it by a few tenths.
    assert all(b - a >= 2.5 for a, b in itertools.pairwise(begun)), begun
