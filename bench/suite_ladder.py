"""Where running_count's batch goes on Spark, rung by rung (issue 12: within 1.3x of the floor).

    PYTHONPATH=src .venv/bin/python bench/suite_ladder.py [--keys 1000000] [--repeats 3]

The suite's input (bench/suite.py: 5 files x 400,000 rows of ``key string, value long,
ts timestamp``, uniform string keys), one file per batch as batch jobs in one session, each
rung adding one thing an engine that keeps its state in Python cannot skip, beside the
suite's **floor** (Spark's own count and sum of the file, no state, written to Parquet):

  read             key and value read, nothing done
  + shuffle        the exact shuffle of every record by key (2 partitions)
  + to Python      ... and every record through Arrow to a Python function that counts
  + aggregate      ... which instead counts and sums per key (pyarrow group_by) and returns
                   a row per key, written to Parquet: a stateless running count in
                   Python, the least such an engine does before it touches any state
  + keyscale       keyscale's own shuffle (``runtime.batch.stages.routed``: arrival sequence, key
                   group, routing, marker rows) and the same aggregate, to Parquet
  floor            ``groupBy(key).agg(count, sum)`` to Parquet (Spark aggregates each
                   partition before its shuffle)

Medians over the repeats after the first (which warms up) and files 1..4.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from rungs import time_rungs, warm_median  # noqa: E402
from suite import SCHEMA, make_input  # noqa: E402

OUT_SCHEMA = "key string, count long, sum long"


def _count(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    n = sum(b.num_rows for b in batches)
    yield pa.RecordBatch.from_pydict({"n": [n]})


def _aggregate(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    table = pa.Table.from_batches(list(batches))
    if table.num_rows == 0:
        return
    agg = table.select(["key", "value"]).group_by("key").aggregate([("value", "count"), ("value", "sum")])
    yield from pa.table({"key": agg["key"], "count": agg["value_count"], "sum": agg["value_sum"]}).to_batches()


def rungs(spark: Any, file: str, out: Path) -> dict[str, Callable[[], Any]]:
    """The rungs on one input file, each a function that runs it once."""
    from pyspark.sql import functions as F

    from keyscale.runtime.batch.stages import routed

    def read() -> Any:
        return spark.read.schema(SCHEMA).parquet(file).select("key", "value")

    def noop(df: Any) -> None:
        df.write.format("noop").mode("overwrite").save()

    def parquet(df: Any) -> None:
        df.write.mode("overwrite").parquet(str(out))

    def keyscale_shuffle(p: int = 2, m: int = 128) -> Any:
        df = read()
        rows, to = routed(df, df.schema, df.columns, ["key"], m, p)  # what runtime.batch.stages.keyed plans
        return rows.repartition(p, to).select("key", "value")

    return {
        "read": lambda: noop(read()),
        "+ shuffle": lambda: noop(read().repartition(2, "key")),
        "+ to Python": lambda: noop(read().repartition(2, "key").mapInArrow(_count, "n long")),
        "+ aggregate, to Parquet": lambda: parquet(read().repartition(2, "key").mapInArrow(_aggregate, OUT_SCHEMA)),
        "+ keyscale's shuffle": lambda: parquet(keyscale_shuffle().mapInArrow(_aggregate, OUT_SCHEMA)),
        "floor": lambda: parquet(read().groupBy("key").agg(F.count("*").alias("count"), F.sum("value").alias("sum"))),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, default=1_000_000)
    ap.add_argument("--files", type=int, default=5)
    ap.add_argument("--rows", type=int, default=400_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--data-root", type=Path, default=HERE / "data" / "suite")
    a = ap.parse_args(argv)
    from keyscale.runtime.driver.session import spark_session

    a.data_root.mkdir(parents=True, exist_ok=True)
    data = make_input(a.data_root, a.files, a.rows, a.keys)
    files = sorted(str(f) for f in data.glob("*.parquet"))[1:]
    spark = spark_session("local[2]", "keyscale-suite-ladder", {"spark.sql.shuffle.partitions": "2"})
    out = Path(tempfile.mkdtemp(prefix="ks-ladder-"))
    try:
        times = time_rungs([rungs(spark, f, out / "out") for f in files], a.repeats)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    floor = warm_median(times["floor"], len(files))
    print(f"\nrunning_count, {a.keys:,} keys: one batch's file ({a.rows:,} rows; {len(files)} files x {a.repeats} repeats, "
          "medians without the first repeat; local[2])\n| rung | seconds | / floor |\n|---|---|---|")
    for name, ts in times.items():
        s = warm_median(ts, len(files))
        print(f"| {name} | {s:.3f} | {s / floor:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
