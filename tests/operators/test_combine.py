"""``aggregate(combine=True)``: Spark aggregates each subtask's records per key in the JVM; the
job's output, state, counts and watermark are what they are without it, across a live
rescale, and a job can turn it on or off between runs of the same job directory."""

from __future__ import annotations

import datetime as dt
import os
import shutil
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import read_output, run_job, write_events
from keyscale.checkpoint.jobdir import JobDir

pytestmark = [pytest.mark.spark, pytest.mark.slow]

JOB = '''
from pyspark.sql import functions as F

import keyscale as ks

NAME = "combined"


def build(ctx):
    events = ctx.spark.readStream.schema("key string, value long, ts timestamp").option("maxFilesPerTrigger", 1).parquet(ctx.arg("input"))
    # x: a double, NaN (a missing value to keyscale's aggregates) for every 7th value.
    x = F.when(F.col("value") % 7 == 0, F.lit(float("nan"))).otherwise(F.col("value") * 0.5)
    return (
        ks.stream(events.withColumn("x", x)).with_watermark("ts", "10 seconds", max_ahead="1 hour")
        .key_by("key", null_keys="drop")
        .aggregate(uid="totals", combine=ctx.arg("combine") == "yes", n=ks.aggregates.count(), total=ks.aggregates.sum("value"), lo=ks.aggregates.min("value"),
                   hi=ks.aggregates.max("value"), avg=ks.aggregates.mean("value"), nx=ks.aggregates.count("x"), lx=ks.aggregates.min("x"), hx=ks.aggregates.max("x"))
        .sink(ks.sinks.ParquetSink(ctx.arg("output")))
    )
'''


@pytest.fixture(scope="module")
def events(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("events")
    write_events(folder, files=3, rows=3000, keys=200, seed=5, null_keys=40)
    # A last file with event times a century ahead among ordinary ones: counted, never the watermark.
    ts = [dt.datetime(2126, 1, 1, tzinfo=dt.UTC) if i % 3 == 0 else dt.datetime(2026, 1, 2, tzinfo=dt.UTC) + dt.timedelta(seconds=i)
          for i in range(300)]
    pq.write_table(pa.table({"key": [f"k{i % 50}" for i in range(300)], "value": list(range(300)),
                             "ts": pa.array(ts, pa.timestamp("us", tz="UTC"))}), folder / "part-00003.parquet")
    os.utime(folder / "part-00003.parquet", (1_700_000_003, 1_700_000_003))
    return folder


def _run(tmp: Path, events: Path, combine: str, rescale: dict[int, int] | None = None, job: str = "job", **kw: Any) -> Any:
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "job.py").write_text(JOB)
    jd = JobDir(tmp / job)

    def on_batch(rec: Any) -> None:
        if rescale and rec.batch in rescale:
            jd.request_rescale(rescale[rec.batch])

    return run_job(tmp / "job.py", tmp / job, 2, {"input": str(events), "output": str(tmp / "out"), "combine": combine},
                   on_batch=on_batch, **kw)


def _committed(tmp: Path, job: str = "job") -> tuple[int, dict[str, Any]]:
    m = JobDir(tmp / job).latest_manifest()
    assert m is not None
    return m.watermark_ms, m.extra["counters"]


@pytest.mark.parametrize("backend", ["memory", "rocksdb"])
def test_combined_batches_give_the_same_output_counts_and_watermark_across_a_rescale(
    spark: Any, events: Path, tmp_path: Path, backend: str,
) -> None:
    plain = _run(tmp_path / "plain", events, "no")
    combined = _run(tmp_path / "combined", events, "yes", rescale={1: 3, 2: 1}, state_backend=backend)
    assert [b.parallelism["totals"] for b in combined.batches] == [2, 2, 3, 1]
    a, b = read_output(tmp_path / "plain" / "out"), read_output(tmp_path / "combined" / "out")
    assert len(a) > 0 and a["batch"].nunique() == 4
    pd.testing.assert_frame_equal(a, b)  # every batch's rows: the keys it updated, with the same values
    assert [r.records for r in combined.batches] == [r.records for r in plain.batches] == [3000, 3000, 3000, 300]
    assert _committed(tmp_path / "combined") == _committed(tmp_path / "plain")
    watermark, counts = _committed(tmp_path / "plain")
    assert counts["totals"] == {"dropped_null_keys": 120, "too_far_ahead": 100}, counts
    assert watermark == (dt.datetime(2026, 1, 2, tzinfo=dt.UTC) + dt.timedelta(seconds=299 - 10)).timestamp() * 1000 - 1  # Flink's: max - delay - 1 ms


def test_a_job_turns_combining_on_between_runs_of_its_job_directory(spark: Any, events: Path, tmp_path: Path) -> None:
    arriving = tmp_path / "arriving"
    arriving.mkdir()
    files = sorted(events.glob("part-*.parquet"))
    for f in files[:2]:
        shutil.copy2(f, arriving / f.name)
    _run(tmp_path, arriving, "no")
    for f in files[2:]:
        shutil.copy2(f, arriving / f.name)
    _run(tmp_path, arriving, "yes")
    reference = tmp_path / "reference"
    reference.mkdir()
    _run(reference, events, "no")
    pd.testing.assert_frame_equal(read_output(tmp_path / "out"), read_output(reference / "out"))
