"""A keyed stage runs every subtask in every batch, also when Spark proves the batch empty:
a transform with an aggregate before the stage plans an empty batch (a drain, an idle
batch that only moves the clock) to no partitions at all, and the subtasks would never
report (the batch failed with "subtask 0 ... did not report"). Each subtask now gets one
marker row through the shuffle (runtime/batch/stages.py), dropped by the task."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from conftest import read_output, run_job, write_events

pytestmark = [pytest.mark.slow]

JOB = '''
import keyscale as ks
from pyspark.sql import functions as F

NAME = "pre_aggregated"

def build(ctx):
    df = ctx.spark.readStream.schema("key string, value long, ts timestamp").option("maxFilesPerTrigger", 1).parquet(ctx.arg("input"))
    # Each batch summed per key in Spark first (a per-batch transform), then kept running.
    per_batch = ks.stream(df).transform(lambda d: d.groupBy("key").agg(F.sum("value").alias("value")))
    return per_batch.key_by("key").aggregate(uid="totals", total=ks.aggregates.sum("value")).sink(ks.sinks.ParquetSink(ctx.arg("output")))
'''


def test_a_stage_after_a_per_batch_aggregate_runs_the_empty_drain_batch(spark: Any, tmp_path: Path) -> None:
    write_events(tmp_path / "in", files=2, rows=300, keys=20, seed=5)
    job = tmp_path / "job.py"
    job.write_text(JOB)
    summary = run_job(job, tmp_path / "job", 2, {"input": str(tmp_path / "in"), "output": str(tmp_path / "out")}, drain_at_end=True)
    assert len(summary.batches) == 3  # two files, then the drain's empty batch
    out = read_output(tmp_path / "out")
    events = pd.read_parquet(tmp_path / "in")
    last = out.sort_values("batch").groupby("key").last()["total"].to_dict()
    assert last == events.groupby("key")["value"].sum().to_dict()


def test_marker_rows_are_planned_once_per_session_and_parallelism(spark: Any) -> None:
    # Each batch's plan is new, but its marker rows are the same: building and analysing them
    # cost ~30 ms a batch on a two-input stage, so they are kept between batches.
    from keyscale.runtime.batch.stages import routed
    from keyscale.runtime.task.spec import KG, SEQ

    cache: dict[Any, Any] = {}

    def markers(df: Any, p: int) -> list[int]:
        rows, _ = routed(df, df.schema, ["key", "value"], ["key"], 128, p, cache)
        return sorted(r[KG] for r in rows.where(f"{SEQ} = -1").collect())

    # Two batches of one query: two session objects (PySpark wraps each batch anew), one session.
    from pyspark.sql import SparkSession

    batch = [SparkSession(spark.sparkContext, spark._jsparkSession).createDataFrame([("a", i), ("b", i)], "key string, value long")
             for i in range(2)]
    assert markers(batch[0], 2) == [0, 64]
    planned = dict(cache)
    assert markers(batch[1], 2) == [0, 64]
    assert cache == planned  # the second batch reused the first one's
    assert markers(batch[1], 4) == [0, 32, 64, 96]  # a rescale plans its own
    assert len(cache) == len(planned) + 1
    other = spark.newSession()  # another query's session: nothing of the first is reused
    assert markers(other.createDataFrame([("c", 3)], "key string, value long"), 2) == [0, 64]
    assert cache["session"].equals(other._jsparkSession) and len(cache) == 2


def test_marker_rows_are_one_spark_task_whatever_the_default_parallelism(spark: Any) -> None:
    # Each batch's shuffle map side runs the readers' tasks and the markers' tasks: the markers
    # add one task, not one per default-parallelism slot (most of them empty).
    from keyscale.runtime.batch.stages import _markers

    df = spark.createDataFrame([("a", 1)], "key string, value long")
    for p in (1, 2, 5):
        markers = _markers(spark, df.schema, ["key", "value"], 128, p, {})
        assert markers.rdd.getNumPartitions() == 1
        assert markers.count() == p
