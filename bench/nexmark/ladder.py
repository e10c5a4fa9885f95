"""Where a keyed query's batch goes on Spark, rung by rung (issue 16: the 1.5x target).

    PYTHONPATH=src .venv/bin/python bench/nexmark/ladder.py --queries q11 q17 [--repeats 3]

One micro-batch's input (the bid file of a batch of the benchmark's 2M events), as batch
jobs in one session, each rung adding one thing a keyed engine on Spark cannot skip, then
keyscale's own additions, beside Spark's own query on the same file as a batch job (its
plan without streaming or a state store): medians over the repeats of batches 1-5.

  read           the columns the query reads (``queries.READS``), nothing done
  + columns      the query's own per-record columns (q17's day and price ranges)
  + shuffle      the exact shuffle of every record by the keyed stage's key
  + to Python    ... and every record through Arrow to a Python function that only counts
  + keyscale     keyscale's own shuffle (``runtime.batch.stages.routed``: arrival sequence, key
                 group, routing, one marker row per subtask), through Arrow to the same
                 counting function
  Spark query    Spark's native query, the same file read as a batch DataFrame

A keyed engine that runs the user's state in Python needs at least "+ to Python" per batch,
before its state, its commit and streaming's own bookkeeping.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from rungs import time_rungs, warm_median  # noqa: E402

from nexmark import queries as Q  # noqa: E402
from nexmark import run as R  # noqa: E402

# Per query: the keyed stage's key and the per-record transform before it (None: none).
KEYED: dict[str, tuple[list[str], Callable[[Any], Any] | None]] = {
    "q11": (["bidder"], None),
    "q17": (["auction", "day"], Q._q17_columns),
}


def _count(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    n = sum(b.num_rows for b in batches)
    yield pa.RecordBatch.from_pydict({"n": [n]})


def rungs(spark: Any, query: str, file: str) -> dict[str, Callable[[], Any]]:
    """The rungs of ``query`` on one input file, each a function that runs it once."""
    from keyscale.runtime.batch.stages import routed

    key, transform = KEYED[query]
    cols = Q.READS[query]["bid"]

    def read() -> Any:
        return spark.read.schema(Q.SCHEMAS["bid"]).parquet(file).select(*cols)

    def columns() -> Any:
        return transform(read()) if transform else read()

    def keyscale_shuffle(p: int = 2, m: int = 128) -> Any:
        df = columns()
        rows, to = routed(df, df.schema, df.columns, key, m, p)  # what runtime.batch.stages.keyed plans
        return rows.repartition(p, to)

    def noop(df: Any) -> None:
        df.write.format("noop").mode("overwrite").save()

    def spark_query() -> Any:
        saved = Q._read
        Q._read = lambda s, d, stream: s.read.schema(Q.SCHEMAS[stream]).parquet(file)  # type: ignore[assignment]
        try:
            df, _, post = Q.spark_query(spark, query, Path(file).parent.parent)
        finally:
            Q._read = saved  # type: ignore[assignment]
        return post(df) if post else df

    out: dict[str, Callable[[], Any]] = {
        "read": lambda: noop(read()),
        "+ columns": lambda: noop(columns()),
        "+ shuffle": lambda: noop(columns().repartition(2, *key)),
        "+ to Python": lambda: noop(columns().repartition(2, *key).mapInArrow(_count, "n long")),
        "+ keyscale": lambda: noop(keyscale_shuffle().mapInArrow(_count, "n long")),
        "Spark query": lambda: noop(spark_query()),
    }
    if transform is None:
        del out["+ columns"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--queries", nargs="+", default=list(KEYED), choices=list(KEYED))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--data-root", type=Path, default=HERE.parent / "data")
    a = ap.parse_args(argv)
    data = R.ensure_data(a.data_root, 2_000_000, 10)
    files = sorted(str(f) for f in (data / "bid").glob("*.parquet"))[1:6]
    spark = R.spark_session()
    for query in a.queries:
        times = time_rungs([rungs(spark, query, f) for f in files], a.repeats)
        print(f"\n{query}: one batch's bid file ({len(files)} files x {a.repeats} repeats, medians; local[2])\n"
              "| rung | seconds |\n|---|---|")
        for name, ts in times.items():
            print(f"| {name} | {warm_median(ts, len(files)):.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
