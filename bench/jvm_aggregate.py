"""What Spark's hash aggregate costs where ``aggregate(combine=True)`` puts it (issue 12, item 2).

    PYTHONPATH=src .venv/bin/python bench/jvm_aggregate.py [--file N] [--runs 3]

One Nexmark bid file (bench/nexmark's 2M-event data, made if missing), q17's columns, the
stage's exact shuffle (routing column, two partitions) written to noop, with and without
the ``groupBy(route, marker, key group, auction, day)`` that combining adds, alternated:
the JVM's time for the aggregation alone, to set against the Python work it saves.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from nexmark import queries as Q  # noqa: E402
from nexmark import run as R  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    from pyspark.sql import functions as F

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--file", type=int, default=3)
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args(argv)
    data = R.ensure_data(HERE / "data", 2_000_000, 10)
    spark = R.spark_session()
    bids = sorted((data / "bid").glob("*.parquet"))[a.file]
    df = Q._q17_columns(spark.read.schema(Q.SCHEMAS["bid"]).parquet(str(bids))).select("auction", "day", "price", "r1", "r2", "r3", "date_time")
    rows = df.select("*", F.monotonically_increasing_id().alias("seq")).withColumn("kg", F.pmod(F.hash("auction", "day"), F.lit(128)))
    staged = rows.withColumn("route", F.element_at(F.array(F.lit(3), F.lit(5)), F.expr("int((kg * 2) div 128) + 1"))).repartition(2, "route")
    us = F.unix_micros(F.col("date_time"))
    grouped = staged.groupBy("route", (F.col("seq") < 0).alias("marker"), "kg", "auction", "day").agg(
        F.count(F.lit(1)), F.sum("r1"), F.sum("r2"), F.sum("r3"), F.min("price"), F.max("price"), F.sum("price"), F.count("price"),
        F.max(((us - F.pmod(us, F.lit(1000))) / 1000).cast("long")), F.min("seq"))
    print(f"{df.count():,} bids in {grouped.count():,} (auction, day) groups")
    for _ in range(a.runs):
        for name, q in (("shuffle only", staged), ("shuffle + groupBy", grouped)):
            t = time.perf_counter()
            q.write.format("noop").mode("overwrite").save()
            print(f"{name:18} {time.perf_counter() - t:.3f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
