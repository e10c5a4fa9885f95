"""Delta and Iceberg sinks against the Parquet sink: time per batch of a running count's output.

    .venv/bin/python bench/lakehouse_sink.py [--rows 100000] [--batches 8] [--repeats 3]

Each batch is what a keyed running count emits for the keys it updated: ``key string``
(``--rows`` distinct keys of 1M, ``k<n>``), ``count long``, ``sum long``, 2 Spark
partitions, cached in memory first so every sink gets the same input and only the write is
timed (each sink's ``write``, the batch's one Spark action). The sinks, each into its own
table on local disk, written batch by batch interleaved so that load hits them alike:
ParquetSink; DeltaSink append and upsert (merge by key); IcebergSink append and upsert
(SQLite catalog). Reported: median time per batch over batches 1.. (batch 0 creates the
table) and repeats, and the ratio to the Parquet sink.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)

    from pyspark.sql import functions as F

    from keyscale.checkpoint.lineage import Lineage
    from keyscale.runtime.driver.session import spark_session
    from keyscale.sinks.base import SinkContext
    from keyscale.sinks.delta import DeltaSink
    from keyscale.sinks.iceberg import IcebergSink
    from keyscale.sinks.parquet import ParquetSink

    spark = spark_session("local[2]")
    spark.sparkContext.setLogLevel("ERROR")
    times: dict[str, list[float]] = {}
    for r in range(a.repeats):
        root = Path(tempfile.mkdtemp(prefix="ks-lakehouse-bench-"))
        catalog = {"type": "sql", "uri": f"sqlite:///{root}/catalog.db", "warehouse": f"file://{root}/warehouse"}
        sinks: dict[str, Any] = {
            "parquet": ParquetSink(str(root / "parquet")),
            "delta append": DeltaSink(str(root / "delta-append")),
            "delta upsert": DeltaSink(str(root / "delta-upsert"), mode="upsert", keys=["key"]),
            "iceberg append": IcebergSink(catalog, "bench.append"),
            "iceberg upsert": IcebergSink(catalog, "bench.upsert", mode="upsert", keys=["key"]),
        }
        ctx = SinkContext(Lineage(f"bench-{r}"), "lakehouse-bench", str(root), "run", -1)
        for sink in sinks.values():
            sink.open(ctx)
        for b in range(a.batches):
            # The keys a batch updated: a random --rows of 1M, with growing counts.
            df = (spark.range(a.rows, numPartitions=2)
                  .select(F.concat(F.lit("k"), ((F.col("id") * 7919 + b * 104729) % 1_000_000).cast("string")).alias("key"),
                          (F.col("id") % 50 + b).alias("count"), (F.col("id") * 3 + b).alias("sum"))
                  .cache())
            df.count()
            for name, sink in sinks.items():
                started = time.perf_counter()
                sink.write(df, b)
                if b > 0:
                    times.setdefault(name, []).append(time.perf_counter() - started)
            df.unpersist()
        print(f"repeat {r}: " + ", ".join(f"{n} {statistics.median(v):.2f} s" for n, v in times.items()), flush=True)
    base = statistics.median(times["parquet"])
    print(f"\nper batch of {a.rows:,} rows, medians over batches 1-{a.batches - 1} x {a.repeats} repeats:")
    for name, v in times.items():
        print(f"  {name:15s} {statistics.median(v):6.2f} s  ({statistics.median(v) / base:.2f}x parquet)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
