"""Parquet sink: the storage-seam writer (Python tasks, one object per partition, marker)
against the rename protocol it replaced (Spark's Parquet writer into a temporary folder,
fsync of every file, one rename), on a local path; optionally the seam writer on S3 too.

    .venv/bin/python bench/parquet_sink.py [--rows 2000000] [--partitions 2] [--repeats 3] [--s3 s3://bucket/prefix]

Data: ``key string`` (100,000 distinct), ``a long``, ``b long``, cached in memory first, so
both writers get the same input and only the write is timed (one Spark action each).
Per repeat the writers run interleaved, so load hits them alike; medians over repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any


def rename_protocol(df: Any, root: Path, batch: int) -> None:
    """The sink as it was before issue 11 (keyscale.sinks.parquet at 3118e3a), minus the lineage checks."""
    from keyscale.storage.local import fsync_path

    tmp = root / f"_tmp-{batch}-{uuid.uuid4().hex[:8]}"
    df.write.mode("overwrite").parquet(str(tmp))
    for p in list(tmp.iterdir()):
        if p.name.startswith(("_", ".")):
            p.unlink()
    (tmp / "_keyscale.json").write_text("{}")
    for p in tmp.iterdir():
        fsync_path(p)
    fsync_path(tmp)
    os.rename(tmp, root / f"batch={batch:012d}")
    fsync_path(root)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--partitions", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--s3", help="also time the seam writer on this s3:// location (AWS_* settings from the environment)")
    a = ap.parse_args(argv)

    from pyspark.sql import functions as F

    from keyscale.runtime.driver.session import spark_session
    from keyscale.sinks.parquet import ParquetSink, read_output

    spark = spark_session("local[2]")
    df = (spark.range(0, a.rows, 1, a.partitions)
          .select(F.concat(F.lit("key-"), (F.col("id") % 100_000).cast("string")).alias("key"),
                  F.col("id").alias("a"), (F.col("id") * 7 % 1000).alias("b"))
          .cache())
    assert df.count() == a.rows
    work = Path(tempfile.mkdtemp(prefix="ks-sink-bench-"))
    (work / "old").mkdir()
    times: dict[str, list[float]] = {"spark writer, rename protocol": [], "python tasks, storage seam": []}
    if a.s3:
        times["python tasks, storage seam, S3"] = []
    seam = ParquetSink(work / "new")
    remote = ParquetSink(f"{a.s3.rstrip('/')}/bench-{uuid.uuid4().hex[:8]}") if a.s3 else None
    for r in range(-1, a.repeats):  # repeat -1 warms up both (JIT, Python workers)
        t = time.perf_counter()
        rename_protocol(df, work / "old", r + 1)
        old_s = time.perf_counter() - t
        t = time.perf_counter()
        assert seam.write(df, r + 1) == a.rows
        new_s = time.perf_counter() - t
        if r >= 0:
            times["spark writer, rename protocol"].append(old_s)
            times["python tasks, storage seam"].append(new_s)
        if remote is not None:
            t = time.perf_counter()
            assert remote.write(df, r + 1) == a.rows
            if r >= 0:
                times["python tasks, storage seam, S3"].append(time.perf_counter() - t)
    assert read_output(work / "new").num_rows == a.rows * (a.repeats + 1)
    sizes = {
        "spark writer, rename protocol": sum(p.stat().st_size for p in (work / "old" / "batch=000000000001").iterdir()),
        "python tasks, storage seam": sum(p.stat().st_size for p in (work / "new" / "batch=000000000001").iterdir()),
    }
    out = {"rows": a.rows, "partitions": a.partitions, "repeats": a.repeats, "results": {}}
    for name, xs in times.items():
        med = statistics.median(xs)
        out["results"][name] = {"seconds": xs, "median_s": round(med, 3), "rows_per_s": round(a.rows / med), "bytes": sizes.get(name)}
        print(f"{name:34s} median {med:6.2f} s  {a.rows / med:>12,.0f} rows/s  runs {' '.join(f'{x:.2f}' for x in xs)}  bytes {sizes.get(name)}")
    Path("bench/out").mkdir(parents=True, exist_ok=True)
    Path("bench/out/parquet_sink.json").write_text(json.dumps(out, indent=1))
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
