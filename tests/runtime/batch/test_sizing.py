"""A latency target sizes a log source's batches (RunOptions.latency_target, issue 35 item 3):
the limit comes from the run's own batches, a source's own smaller limit is kept and the
status says whose limit holds; light input makes small batches and a backlog larger ones;
an option that cannot be served is refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from conftest import EXAMPLES, read_output, run_on_thread
from keyscale.checkpoint.jobdir import JobDir
from keyscale.cli.main import main
from keyscale.errors import JobDefinitionError
from keyscale.runtime.batch import sizing
from keyscale.runtime.batch.jobstate import (
    BatchRecord,
    ExecutorsAsked,
    History,
    JobState,
    RunOptions,
    RunSummary,
)
from keyscale.runtime.control.metrics import families
from keyscale.scaling.batch_size import PROBE_RECORDS, WAITING
from keyscale.sources import LocalLog
from keyscale.sources.reader import LogSource

JOB = EXAMPLES / "log_count.py"


def _job(tmp_path: Path, target: str | None, batches: list[tuple[int, float, int]]) -> JobState:
    """A job whose history holds ``batches`` (records, seconds, backlog after), one a second."""
    jd = JobDir(tmp_path / "job")
    job = JobState(RunOptions("", str(tmp_path / "job"), latency_target=target), jd, "run", History(RunSummary("j", jd.uri)))
    for i, (n, s, backlog) in enumerate(batches):
        job.history.batches.append({"batch": i, "time_ms": 1000 * i, "seconds": s, "records": n, "backlog": backlog})
    return job


def _source(own: int | None) -> LogSource:
    return LogSource(log=None, uid="reader", max_records_per_partition=own)  # type: ignore[arg-type]  # read_limit reads no log


# 0.2 s a batch plus 10 µs a record (the first batch, slower, is no measure); each batch
# reads all that waits, one a second: 5,000 to 14,000 records/s.
STEADY = [(5000, 3.0, 0), *((5000 + 1000 * i, 0.2 + 1e-5 * (5000 + 1000 * i), 0) for i in range(10))]


def test_without_a_target_a_batch_reads_up_to_its_sources_own_limit_only(tmp_path: Path) -> None:
    job = _job(tmp_path, None, STEADY)
    assert sizing.read_limit(job, _source(None), 4) is None
    assert sizing.read_limit(job, _source(700), 4) == 700
    assert job.batch.read_limit is None  # and the status has no batch_size


def test_the_targets_limit_holds_when_the_source_has_none(tmp_path: Path) -> None:
    job = _job(tmp_path, "1s", STEADY)
    per = sizing.read_limit(job, _source(None), 4)
    got = job.batch.read_limit
    assert got is not None and per == got.per_partition
    out = got.to_json()
    # Half the target (0.5 s) less the fixed 0.2 s, at 10 µs a record: 30,000 records, 7,500 a partition.
    assert out["records"] == pytest.approx(30_000, rel=0.01) and out["records_per_partition"] == per
    assert out["limited_by"] == "latency target" and out["meets_target"] is True
    assert out["expected_batch_seconds"] == pytest.approx(0.5, rel=0.01) and "half the 1.00 s target" in out["reason"]


def test_a_sources_own_smaller_limit_is_kept_and_the_status_says_so(tmp_path: Path) -> None:
    job = _job(tmp_path, "1s", STEADY)
    assert sizing.read_limit(job, _source(100), 4) == 100  # 400 a batch: below the target's 30,000 and below keeping up
    got = job.batch.read_limit
    assert got is not None
    out = got.to_json()
    assert out["limited_by"] == "source 'reader' max_records_per_batch" and out["records"] == 400
    assert out["meets_target"] is False  # 400 records a batch do not keep up with 5,000 records/s
    assert "source 'reader' max_records_per_batch (100 a partition) is below the target's" in out["reason"]
    assert sizing.read_limit(job, _source(10**6), 4) == job.batch.read_limit.per_partition < 10**6  # a larger one: the target's


def test_while_a_scale_up_waits_for_executors_a_batch_reads_about_two_seconds_at_the_last_pace(tmp_path: Path) -> None:
    # The spike's first batch at P=1 read 1,500 records in 4.5 s (333/s): the next reads about
    # 2 s of that, 667 records over 4 partitions, so the job looks for its executors again soon.
    for target in (None, "60s"):
        job = _job(tmp_path, target, [(100, 0.4, 0), (1500, 4.5, 12_000)])
        job.scaling.executors_asked = ExecutorsAsked(cores=4, asked_at=0.0)
        assert sizing.read_limit(job, _source(None), 4) == 167, target
        if target is not None:  # the status says whose limit holds
            assert job.batch.read_limit is not None
            shown = job.batch.read_limit.to_json()
            assert shown["records"] == 668 and shown["limited_by"] == WAITING and shown["expected_batch_seconds"] == 2.0
        assert sizing.read_limit(job, _source(50), 4) == 50  # a smaller limit of the source's stays
        job.scaling.executors_asked = None  # they came: the batch reads what it would anyway
        assert sizing.read_limit(job, _source(None), 4) == (None if target is None else job.batch.read_limit.per_partition)


def test_before_any_batch_is_measured_the_first_reads_a_probe(tmp_path: Path) -> None:
    job = _job(tmp_path, "1s", [(0, 3.0, 50_000)])  # the run's first batch (Python workers starting) is no measure
    assert sizing.read_limit(job, _source(None), 2) == PROBE_RECORDS // 2
    assert job.batch.read_limit is not None and "no batch measured yet" in job.batch.read_limit.to_json()["reason"]


def test_the_status_limit_is_a_metric(tmp_path: Path) -> None:
    job = _job(tmp_path, "1s", STEADY)
    sizing.read_limit(job, _source(None), 4)
    assert job.batch.read_limit is not None
    status = {"job": "j", "state": "running", "operators": {}, "batch_size": job.batch.read_limit.to_json()}
    got = {s.name: s.value for f in families(status, None, RunSummary("j", "d"), 0) for s in f.samples}
    assert got["keyscale_batch_read_limit_records"] == job.batch.read_limit.records
    assert got["keyscale_batch_meets_latency_target"] == 1.0


@pytest.mark.parametrize("value", ["soon", "0 ms", "-1s", "5 parsecs"])
def test_a_target_that_is_not_a_positive_duration_is_refused(value: str) -> None:
    with pytest.raises(JobDefinitionError, match="latency_target"):
        sizing.target_seconds(value)


def test_keyscale_run_refuses_a_bad_latency_target_before_anything_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["run", str(JOB), "--job-dir", str(tmp_path / "job"), "--latency-target", "soon", "--set", "log=x", "--set", "output=y"])
    assert code == 2
    assert "latency_target 'soon' is not a duration" in capsys.readouterr().err


# -- the running job (Spark)


def _append(log: LocalLog, start: int, n: int) -> None:
    log.append(0, pa.table({"key": [f"k{(start + i) % 7}" for i in range(n)], "value": [start + i for i in range(n)]}))


def _run(tmp_path: Path, log: LocalLog, batches: int, after: Any, args: dict[str, str] | None = None,
         **opts: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run log_count until ``batches`` batches ran (``after(i)`` after batch ``i``); the
    batches' history and the status as of the last commit."""
    from keyscale.runtime.driver.runner import JobRunner

    runner: Any = None
    seen = 0

    def on_batch(rec: BatchRecord) -> None:
        nonlocal seen
        seen += 1
        after(seen - 1)
        if seen >= batches:
            runner.stop()

    runner = JobRunner(RunOptions(job_file=str(JOB), job_dir=str(tmp_path / "job"), parallelism=1, trigger_interval="100 milliseconds",
                                  args={"log": log.uri, "output": str(tmp_path / "out"), **(args or {})}, **opts), on_batch=on_batch)
    run_on_thread(runner.run, 300)
    assert runner.job.committed.status is not None
    return list(runner.history()["batches"]), runner.job.committed.status


def _counted(tmp_path: Path) -> int:
    """Records the output counts: each key's last running count, added up."""
    out = read_output(tmp_path / "out")
    return int(out.groupby("key")["count"].max().sum())


@pytest.mark.slow
def test_light_input_makes_small_batches_and_a_backlog_larger_ones_every_record_counted_once(spark: Any, tmp_path: Path) -> None:
    log = LocalLog.create(str(tmp_path / "log"), "key string, value long", partitions=1)
    _append(log, 0, 20)
    total = 20

    def after(i: int) -> None:
        nonlocal total
        n = 20 if i < 4 else 40_000 if i == 4 else 0  # light input, then a backlog far beyond one batch's limit
        _append(log, total, n)
        total += n

    # A target of 10 s: half of it is well above a batch's fixed cost even on a loaded machine,
    # so the light batches' limit is the probe's or its growth, not keeping up's.
    history, status = _run(tmp_path, log, 10, after, latency_target="10s")
    records = [b["records"] for b in history]
    assert records[:5] == [20] * 5  # light input: each batch reads the little that waits...
    assert all(b["read_limit"] > 20 for b in history[:5])  # ...well below its limit
    for b in history[5:]:
        assert b["records"] <= b["read_limit"]  # the backlog: within each batch's limit,
        if b["backlog"]:
            assert b["records"] == b["read_limit"]  # as much as the limit while records wait
    assert max(records[5:]) > 20  # and so larger batches
    size = status["batch_size"]
    assert size["target_seconds"] == 10.0 and size["limited_by"] == "latency target" and size["records"] == history[-1]["read_limit"]
    assert size["records_per_partition"] == size["records"] and isinstance(size["meets_target"], bool) and size["reason"]
    assert size["expected_batch_seconds"] is not None and size["expected_batch_seconds"] > 0
    assert _counted(tmp_path) == sum(records)  # every record read counted once, whatever the sizes


@pytest.mark.slow
def test_a_sources_own_smaller_limit_stays_under_a_target(spark: Any, tmp_path: Path) -> None:
    log = LocalLog.create(str(tmp_path / "log"), "key string, value long", partitions=1)
    _append(log, 0, 5000)
    history, status = _run(tmp_path, log, 3, lambda i: None, args={"max_records_per_batch": "300"}, latency_target="30s")
    assert [b["records"] for b in history] == [300, 300, 300]  # the target alone would read 1,000 (its probe), then more
    assert [b["read_limit"] for b in history] == [300, 300, 300]
    assert status["batch_size"]["limited_by"] == "source 'reader' max_records_per_batch"
    assert _counted(tmp_path) == 900


@pytest.mark.slow
def test_a_job_on_a_spark_source_with_a_latency_target_does_not_start(spark: Any, tmp_path: Path) -> None:
    from keyscale.runtime.driver.runner import JobRunner

    (tmp_path / "in").mkdir()
    runner = JobRunner(RunOptions(job_file=str(EXAMPLES / "running_count.py"), job_dir=str(tmp_path / "job"), until_idle=True,
                                  args={"input": str(tmp_path / "in"), "output": str(tmp_path / "out")}, latency_target="1s"))
    with pytest.raises(JobDefinitionError, match=r"latency_target '1s': the job reads a Spark source, whose batches Spark sizes"):
        runner.run()
    assert not (tmp_path / "out").exists()


def test_a_latency_target_on_a_spark_source_is_refused() -> None:
    class Graph:
        log_source = None

    with pytest.raises(JobDefinitionError, match="Spark source, whose batches Spark sizes"):
        sizing.check_target("1s", Graph())  # type: ignore[arg-type]
    sizing.check_target(None, Graph())  # type: ignore[arg-type]  # no target: nothing to refuse
