"""The driver's calls to the JVM on a batch's fixed path (issue 35, item 2): each is a Py4J
round trip (~0.3-1 ms, more on a busy machine) and a Java object for the garbage collector
thread to release. A log source's almost empty batch made ~172 of them on the batch's own
thread; now ~70 (docs/benchmarks.md, "The fixed cost of a batch"). Counted, never timed."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pyarrow as pa
import pytest

from conftest import EXAMPLES, jvm_calls, read_output, run_on_thread
from keyscale.runtime.batch.jobstate import BatchRecord, RunOptions, session_cache
from keyscale.runtime.batch.status import _spark_of
from keyscale.runtime.driver.runner import JobRunner
from keyscale.sources import LocalLog


def test_the_status_reads_the_spark_application_once(spark: Any) -> None:
    job = SimpleNamespace(spark=spark)
    first = _spark_of(job)  # type: ignore[arg-type]
    with jvm_calls() as sent:
        again = _spark_of(job)  # type: ignore[arg-type]
    assert sent == []
    assert again == first and again is not None and again["application_id"] == spark.sparkContext.applicationId
    again["ui"] = "changed"  # a caller's copy: the next status is not changed by it
    assert _spark_of(job) == first  # type: ignore[arg-type]


def test_the_plan_cache_knows_its_own_session_without_asking_the_jvm(spark: Any) -> None:
    cache: dict[Any, Any] = {}
    session_cache(cache, spark)["kept"] = 1
    with jvm_calls() as sent:
        assert session_cache(cache, spark)["kept"] == 1
    assert sent == []
    assert "kept" not in session_cache(cache, spark.newSession())  # another session's cache is its own


def test_a_plan_reads_up_to_the_end_read_just_before_it_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The status reads the log's end right after a commit (the lag), and a batch that
    follows at once plans on that read instead of reading it again (a Kafka log's read is
    a consumer and its fetches, ~20 ms). Used once, and only while fresh: a later plan reads
    the end anew, and so do all plans after a wait."""
    from keyscale.runtime.batch import source_plan

    ends = [[5, 7]]
    reads: list[int] = []

    class Log:
        def end_offsets(self) -> list[int]:
            reads.append(1)
            return list(ends[0])

    job, src = SimpleNamespace(log_ends={}), SimpleNamespace(uid="events", log=Log())
    now = [100.0]
    monkeypatch.setattr(source_plan.time, "monotonic", lambda: now[0])
    assert source_plan.read_ends(job, src) == [5, 7] and len(reads) == 1  # type: ignore[arg-type]
    ends[0] = [9, 9]
    now[0] += 0.01
    assert source_plan.ends_for_plan(job, src) == [5, 7] and len(reads) == 1  # type: ignore[arg-type]
    assert source_plan.ends_for_plan(job, src) == [9, 9] and len(reads) == 2  # type: ignore[arg-type]  # used once
    source_plan.read_ends(job, src)  # type: ignore[arg-type]
    now[0] += source_plan.FRESH_ENDS_SECONDS + 0.01
    ends[0] = [12, 9]
    assert source_plan.ends_for_plan(job, src) == [12, 9]  # type: ignore[arg-type]  # too old: read again


@pytest.mark.slow
def test_a_log_sources_batch_plans_in_under_110_jvm_calls(spark: Any, tmp_path: Path) -> None:
    # Almost empty batches of log_count at p=2 (readers, a keyed stage, a Parquet sink): the
    # calls the batch's own thread makes from the third batch's end to the sixth's.
    log = LocalLog.create(str(tmp_path / "log"), "key string, value long", partitions=2)
    counts: list[int] = []
    batches = 6
    runner: JobRunner
    sent: list[list[str]] = []  # the batch thread's calls, as they are made

    def on_batch(rec: BatchRecord) -> None:
        log.append(rec.batch % 2, pa.table({"key": [f"k{rec.batch}"], "value": [rec.batch]}))
        counts.append(len(sent[0]))
        if len(counts) >= batches:
            runner.stop()

    runner = JobRunner(RunOptions(job_file=str(EXAMPLES / "log_count.py"), job_dir=str(tmp_path / "job"), parallelism=2,
                                  trigger_interval="1 millisecond", args={"log": log.uri, "output": str(tmp_path / "out")}),
                       on_batch=on_batch)

    def run() -> None:
        with jvm_calls() as calls:
            sent.append(calls)
            runner.run()

    run_on_thread(run, 240)
    assert len(counts) == batches
    per_batch = (counts[5] - counts[2]) / 3
    assert per_batch < 110, per_batch
    # ...and the batches did their work: every record appended after a batch counted by the next.
    out = read_output(tmp_path / "out")
    assert sorted(out.groupby("key")["count"].max().items()) == [(f"k{b}", 1) for b in range(batches - 1)]
