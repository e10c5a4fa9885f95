"""A batch's arrival order for a file source is a function of its files, not of Spark's split:
the same input run on another master, or with other ``spark.sql.files.*`` settings (a replay
after a restart elsewhere), feeds an order-sensitive keyed function the same sequence."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import cli, cli_here, read_output, run_job, write_events

pytestmark = [pytest.mark.slow]

# Each record's place among its key's records: any change of order changes the output.
JOB = '''
import keyscale as ks

class Positions(ks.KeyedProcessFunction):
    def open(self, ctx):
        self.seen = ctx.value_state("seen", "long")

    def process_element(self, row, ctx):
        n = (self.seen.value() or 0) + 1
        self.seen.update(n)
        yield (ctx.key, row.value, n)

def build(ctx):
    # FAILFAST: a JSON source in Spark's default mode needs a corrupt-record column (runtime/batch/malformed.py)
    events = ctx.spark.readStream.schema("key string, value long").format(ctx.arg("format")).option("mode", "FAILFAST").load(ctx.arg("input"))
    return (
        ks.stream(events)
        .filter("value >= 0")
        .key_by("key")
        .process(Positions(), "key string, value long, n long", uid="positions")
        .sink(ks.sinks.ParquetSink(ctx.arg("output")))
    )
'''

# Files of different sizes: Spark packs splits largest first, so the order of partitions
# (and of monotonically_increasing_id) changes with the split size and the number of cores.
ROWS = (3000, 9000, 5000, 7000, 2000, 6000)


def _write_input(folder: Path, fmt: str) -> None:
    folder.mkdir(parents=True)
    first = 0
    for i, n in enumerate(ROWS):
        # value: unique, and increasing along each file (the file's order)
        table = pa.table({"key": [f"k{(first + j) * 7 % 13}" for j in range(n)], "value": list(range(first, first + n))})
        if fmt == "parquet":
            pq.write_table(table, folder / f"part-{i}.parquet", row_group_size=500)  # splittable at row groups
        else:
            (folder / f"part-{i}.json").write_text("".join(json.dumps(r) + "\n" for r in table.to_pylist()))
        first += n


def _run(tmp_path: Path, name: str, fmt: str, *spark_args: str, here: bool = False) -> pd.DataFrame:
    """One run of the job: in a process of its own, or (``here``) on the tests' session."""
    job = tmp_path / "positions_job.py"
    job.write_text(JOB)
    out = tmp_path / f"out-{name}"
    (cli_here if here else cli)("run", str(job), "--job-dir", str(tmp_path / f"job-{name}"), "-p", "2", "--until-idle", *spark_args,
                                "--set", f"input={tmp_path / 'in'}", "--set", f"output={out}", "--set", f"format={fmt}", check=True)
    return read_output(out)


@pytest.mark.parametrize("fmt", ["parquet", "json"])
def test_same_order_on_another_master_and_split(spark: Any, tmp_path: Path, fmt: str) -> None:
    _write_input(tmp_path / "in", fmt)
    small = _run(tmp_path, "small-splits", fmt, "--master", "local[1]",
                 "--conf", "spark.sql.files.maxPartitionBytes=16384", "--conf", "spark.sql.files.openCostInBytes=1024")
    # Spark's defaults on two cores: the tests' own session is that (local[2], keyscale's settings).
    default = _run(tmp_path, "defaults", fmt, here=True)
    assert len(small) == sum(ROWS)
    # Within a file, a key's records arrive in the file's order (value increases along a file).
    bounds = pd.Series(range(len(ROWS))).map(lambda i: sum(ROWS[: i + 1]))
    small["file"] = small["value"].map(lambda v: int((bounds <= v).sum()))
    for _, g in small.sort_values("n").groupby(["key", "file"]):
        assert g["value"].is_monotonic_increasing
    pd.testing.assert_frame_equal(small.drop(columns="file"), default)


BRANCHES = '''
import keyscale as ks
from pyspark.sql import functions as F

def build(ctx):
    events = ctx.spark.readStream.schema("key string, value long, ts timestamp").parquet(ctx.arg("input"))
    s = ks.stream(events)
    return ks.pipeline(
        s.select("*").sink(ks.sinks.ParquetSink(ctx.arg("star"))),
        s.filter("value > 0").sink(ks.sinks.ParquetSink(ctx.arg("filtered"))),
        s.transform(lambda df: df.withColumn("seen", F.lit(",".join(df.columns)))).sink(ks.sinks.ParquetSink(ctx.arg("seen"))),
        s.filter("value > 0").key_by("key").aggregate(uid="n", n=ks.aggregates.count()).sink(ks.sinks.ParquetSink(ctx.arg("counts"))),
    )
'''


def test_order_columns_never_reach_user_code_or_sinks(spark: Any, tmp_path: Path) -> None:
    write_events(tmp_path / "in", files=2, rows=50, keys=3)
    job = tmp_path / "branches_job.py"
    job.write_text(BRANCHES)
    outs = {name: tmp_path / name for name in ("star", "filtered", "seen", "counts")}
    run_job(job, tmp_path / "job", 2, {"input": str(tmp_path / "in"), **{k: str(v) for k, v in outs.items()}})
    star, filtered, seen, counts = (read_output(outs[n]) for n in ("star", "filtered", "seen", "counts"))
    assert list(star.columns) == list(filtered.columns) == ["key", "value", "ts", "batch"] and len(star) == len(filtered) == 100
    assert set(seen["seen"]) == {"key,value,ts"}
    assert counts.groupby("key")["n"].max().sum() == 100


def test_a_source_without_file_metadata_logs_no_spark_error(spark: Any, tmp_path: Path) -> None:
    # A union of two file sources has no _metadata: the query runs in Spark's order, and the
    # failed probe for the files' metadata is keyscale's to handle, not an error for the user's log.
    import logging

    from pyspark.logger import PySparkLogger

    from keyscale.runtime.task.arrival import with_file_order

    class Kept(logging.Handler):
        def __init__(self) -> None:
            super().__init__()
            self.messages: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.messages.append(record.getMessage())

    for name in ("a", "b"):
        _write_input(tmp_path / name, "parquet")
    a, b = (spark.readStream.schema("key string, value long").parquet(str(tmp_path / n)) for n in ("a", "b"))
    union = a.unionByName(b)
    # PySpark's own logger (it does not propagate, and its handler's stream is whichever
    # stderr it first saw): what reaches it is what any of its handlers would print.
    logger, kept = PySparkLogger.getLogger("DataFrameQueryContextLogger"), Kept()
    logger.addHandler(kept)
    try:
        df, ordered = with_file_order(union)
        assert not ordered and df is union
        assert kept.messages == []
        # ...and an error of the user's own DataFrame code is still logged as PySpark logs it.
        with pytest.raises(Exception, match="no_such_column"):
            union.select("no_such_column")
        assert len(kept.messages) == 1 and "no_such_column" in kept.messages[0]
    finally:
        logger.removeHandler(kept)
