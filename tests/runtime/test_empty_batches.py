"""A keyed stage runs every subtask in every batch, also when Spark proves the batch empty:
a transform with an aggregate before the stage plans an empty batch (a drain, an idle
batch that only moves the clock) to no partitions at all, and the subtasks would never
report (the batch failed with "subtask 0 ... did not report"). Each subtask now gets one
marker row through the shuffle (runtime/stages.py), dropped by the task."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from conftest import read_output, run_job, write_events

pytestmark = [pytest.mark.spark, pytest.mark.slow]

JOB = '''
import keyscale as ks
from pyspark.sql import functions as F

NAME = "pre_aggregated"

def build(ctx):
    df = ctx.spark.readStream.schema("key string, value long, ts timestamp").option("maxFilesPerTrigger", 1).parquet(ctx.arg("input"))
    # Each batch summed per key in Spark first (a per-batch transform), then kept running.
    per_batch = ks.stream(df).transform(lambda d: d.groupBy("key").agg(F.sum("value").alias("value")))
    return per_batch.key_by("key").aggregate(uid="totals", total=ks.sum("value")).sink(ks.ParquetSink(ctx.arg("output")))
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
