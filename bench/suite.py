"""Benchmark suite of issue 12: realistic jobs, keyscale against Spark native, same run.

    PYTHONPATH=src .venv/bin/python bench/suite.py [--quick] [--jobs running_count multi_agg ...]
        [--keys 10000 1000000] [--with-10m] [--repeats 3] [--out bench/out/suite.json]

Jobs (input ``key string, value long, ts timestamp``, one file per micro-batch, local[2],
parallelism 2 / 2 shuffle partitions, a Parquet sink on every side):

* ``running_count``: count and sum per string key (README's running_count). Spark: groupBy(key).agg
  in update mode, RocksDB, foreachBatch writing Parquet.
* ``multi_agg``: count, sum, min, max, mean on (key, bucket). Spark: the same agg, update mode.
* ``tumbling`` / ``session``: 1-minute windows / 30 s sessions, watermark 10 s. Spark: window() /
  session_window() groupBy, append mode.
* ``process``: per-record KeyedProcessFunction (running count and sum). Spark:
  applyInPandasWithState (update mode) -- its best Python option on W (ANCHORS.md).
* ``two_stage``: running sum per key, tier per total, count per tier. Spark cannot chain two
  update-mode aggregations; its side is stage 1 native + the tier column, so it does LESS work.

Per job and cardinality, per repeat, interleaved: keyscale, Spark native, and the **floor**
(Spark batch, no state: each file's own groupBy/agg written to Parquet). Steady batch =
median of batches 1.. (batch 0 warms up); e2e = wall time of the whole run. Medians over
repeats. ``--combine``: also keyscale with ``aggregate(combine=True)`` (Spark aggregates
each subtask's records per key before they cross to Python) for the jobs of running aggregates (COMBINABLE), interleaved
with the rest. ``--quick``: 3 files x 100,000 rows, 10k keys, 1 repeat. 10M keys (``--with-10m``)
needs ~3x the 1M time per batch and several GB of state: left out by default.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from spark_baselines import ROCKSDB_PROVIDER, batch_seconds, run_available_now  # noqa: E402

SCHEMA = "key string, value long, ts timestamp"
JOBS = ["running_count", "multi_agg", "tumbling", "session", "process", "two_stage"]
COMBINABLE = ["running_count", "multi_agg", "two_stage"]
T0_MS = 1_700_000_000_000
SPAN_MS = 300_000


def make_input(root: Path, files: int, rows: int, keys: int, seed: int = 0) -> Path:
    """``files`` Parquet files of string keys ``k<n>`` (n uniform in [0, keys)), value, ts (numpy)."""
    d = root / f"in-{files}x{rows}-{keys}"
    if (d / "_COMPLETE").exists():
        return d
    tmp = Path(tempfile.mkdtemp(dir=root))
    for i in range(files):
        rng = np.random.default_rng(seed + i)
        k = pc.binary_join_element_wise("k", pa.array(rng.integers(0, keys, rows)).cast(pa.string()), "")
        v = pa.array(rng.integers(0, 100, rows))
        ts = T0_MS + i * SPAN_MS + np.arange(rows, dtype=np.int64) * SPAN_MS // rows - rng.integers(0, 5_000, rows)
        t = pa.table({"key": k, "value": v, "ts": pa.array(ts * 1000).cast(pa.timestamp("us", tz="UTC"))})
        pq.write_table(t, tmp / f"part-{i:05d}.parquet")
    (tmp / "_COMPLETE").write_text("{}")
    if d.exists():
        shutil.rmtree(d)
    tmp.rename(d)
    return d


def _stage(src: Path, dst: Path) -> Path:
    """Copy the files with increasing mtimes: Spark's file source reads oldest first."""
    dst.mkdir(parents=True)
    now = time.time()
    for i, f in enumerate(sorted(src.glob("*.parquet"))):
        shutil.copy(f, dst / f.name)
        os.utime(dst / f.name, (now - 100 + i, now - 100 + i))
    return dst


def _agg(job: str, df: Any, streaming: bool) -> tuple[Any, str]:
    """Spark's aggregation of ``job`` on ``df`` and its output mode."""
    from pyspark.sql import functions as F

    if job in ("running_count", "process"):
        return df.groupBy("key").agg(F.count("*").alias("count"), F.sum("value").alias("sum")), "update"
    if job == "multi_agg":
        df = df.withColumn("bucket", (F.col("value") % 4).cast("int"))
        return df.groupBy("key", "bucket").agg(F.count("*").alias("n"), F.sum("value").alias("total"), F.min("value").alias("lo"),
                                               F.max("value").alias("hi"), F.avg("value").alias("avg")), "update"
    if job in ("tumbling", "session"):
        if streaming:
            df = df.withWatermark("ts", "10 seconds")
        w = F.window("ts", "1 minute") if job == "tumbling" else F.session_window("ts", "30 seconds")
        return df.groupBy(w, "key").agg(F.count("*").alias("count"), F.sum("value").alias("total")), "append"
    if job == "two_stage":
        out = df.groupBy("key").agg(F.sum("value").alias("total"))
        return out.withColumn("tier", F.least(F.floor(F.col("total") / 500), F.lit(9)).cast("int")), "update"
    raise ValueError(job)


def _process_spark(df: Any) -> Any:
    """applyInPandasWithState: per key running count and sum."""
    import pandas as pd
    from pyspark.sql.streaming.state import GroupStateTimeout

    def fn(key: Any, pdfs: Any, state: Any) -> Any:
        n, s = state.get if state.exists else (0, 0)
        for p in pdfs:
            n += len(p)
            s += int(p["value"].sum())
        state.update((n, s))
        yield pd.DataFrame({"key": [key[0]], "count": [n], "sum": [s]})

    return df.groupBy("key").applyInPandasWithState(fn, "key string, count long, sum long", "n long, s long", "update",
                                                      GroupStateTimeout.NoTimeout)


def spark_native(spark: Any, job: str, data: Path, tmp: Path) -> dict[str, Any]:
    src = spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1).parquet(str(_stage(data, tmp / "in")))
    if job == "process":
        df, mode = _process_spark(src), "update"
    else:
        df, mode = _agg(job, src, True)
    out = str(tmp / "out")

    def sink(b: Any, bid: int) -> None:
        b.write.mode("append").parquet(out)

    progress, wall = run_available_now(df, tmp / "ckpt", mode, sink)
    return {"batch_seconds": batch_seconds(progress), "wall_seconds": wall}


def spark_floor(spark: Any, job: str, data: Path, tmp: Path) -> dict[str, Any]:
    """The same batches without state: each file's own aggregation written to Parquet."""
    secs = []
    t0 = time.perf_counter()
    for f in sorted(data.glob("*.parquet")):
        t = time.perf_counter()
        df, _ = _agg("running_count" if job == "process" else job, spark.read.schema(SCHEMA).parquet(str(f)), False)
        df.write.mode("append").parquet(str(tmp / "out"))
        secs.append(time.perf_counter() - t)
    return {"batch_seconds": secs, "wall_seconds": time.perf_counter() - t0}


def keyscale(job: str, data: Path, tmp: Path, combine: bool = False) -> dict[str, Any]:
    from keyscale.runtime.driver.runner import JobRunner, RunOptions

    opts = RunOptions(job_file=str(HERE / "jobs" / "suite_job.py"), job_dir=str(tmp / "job"), parallelism=2, until_idle=True,
                      drain_at_end=False, args={"input": str(_stage(data, tmp / "in")), "output": str(tmp / "out"), "job": job,
                                                "combine": "yes" if combine else "no"})
    t0 = time.perf_counter()
    s = JobRunner(opts).run()
    return {"batch_seconds": list(s.trigger_seconds), "wall_seconds": time.perf_counter() - t0}


def steady(r: dict[str, Any]) -> float:
    xs = r["batch_seconds"][1:] or r["batch_seconds"]
    return statistics.median(xs) if xs else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 files x 100,000 rows, 10k keys, 1 repeat")
    ap.add_argument("--jobs", nargs="+", choices=JOBS, default=JOBS)
    ap.add_argument("--keys", nargs="+", type=int, default=[10_000, 1_000_000])
    ap.add_argument("--with-10m", action="store_true", help="also 10,000,000 keys (slow, several GB)")
    ap.add_argument("--files", type=int, default=5)
    ap.add_argument("--rows", type=int, default=400_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-floor", action="store_true")
    ap.add_argument("--combine", action="store_true", help="also keyscale with aggregate(combine=True) (COMBINABLE jobs)")
    ap.add_argument("--data-root", type=Path, default=HERE / "data" / "suite")
    ap.add_argument("--out", type=Path, default=HERE / "out" / "suite.json")
    a = ap.parse_args(argv)
    if a.quick:
        a.files, a.rows, a.keys, a.repeats = 3, 100_000, [10_000], 1
    if a.with_10m:
        a.keys = [*a.keys, 10_000_000]
    logging.getLogger("keyscale").setLevel(logging.WARNING)
    from keyscale.runtime.driver.session import spark_session

    spark = spark_session("local[2]", "keyscale-suite", {"spark.sql.streaming.stateStore.providerClass": ROCKSDB_PROVIDER,
                                                          "spark.sql.shuffle.partitions": "2"})
    a.data_root.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    for keys in a.keys:
        data = make_input(a.data_root, a.files, a.rows, keys)
        for job in a.jobs:
            systems: dict[str, Callable[[Path], dict[str, Any]]] = {
                "keyscale": lambda t, job=job, data=data: keyscale(job, data, t),
                "spark": lambda t, job=job, data=data: spark_native(spark, job, data, t),
            }
            if a.combine and job in COMBINABLE:
                systems["combined"] = lambda t, job=job, data=data: keyscale(job, data, t, combine=True)
            if not a.no_floor:
                systems["floor"] = lambda t, job=job, data=data: spark_floor(spark, job, data, t)
            runs: dict[str, list[dict[str, Any]]] = {k: [] for k in systems}
            for rep in range(a.repeats):
                for name, fn in systems.items():
                    tmp = Path(tempfile.mkdtemp(prefix="ks-suite-"))
                    try:
                        r = fn(tmp)
                    finally:
                        shutil.rmtree(tmp, ignore_errors=True)
                    runs[name].append(r)
                    print(f"{job} {keys} rep {rep + 1}: {name:8} steady {steady(r):6.2f} s  e2e {r['wall_seconds']:6.1f} s  "
                          f"batches {[round(x, 2) for x in r['batch_seconds']]}", flush=True)
            med = {k: {"steady": statistics.median(steady(r) for r in v), "e2e": statistics.median(r["wall_seconds"] for r in v)}
                   for k, v in runs.items()}
            row = {"job": job, "keys": keys, "median": med, "runs": runs,
                   "ratio": med["spark"]["steady"] / med["keyscale"]["steady"],
                   "e2e_ratio": med["spark"]["e2e"] / med["keyscale"]["e2e"],
                   "floor_ratio": med["keyscale"]["steady"] / med["floor"]["steady"] if "floor" in med else None,
                   "combined_ratio": med["spark"]["steady"] / med["combined"]["steady"] if "combined" in med else None}
            rows.append(row)
    print("\n| job | keys | keyscale steady (s) | Spark steady (s) | ratio | e2e ratio | vs floor | combine=True steady (s) | its ratio |"
          "\n|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        fr = f"{r['floor_ratio']:.2f}x" if r["floor_ratio"] else "-"
        comb = (f"{r['median']['combined']['steady']:.2f} | {r['combined_ratio']:.2f}x" if r["combined_ratio"] else "- | -")
        print(f"| {r['job']} | {r['keys']:,} | {r['median']['keyscale']['steady']:.2f} | {r['median']['spark']['steady']:.2f} | "
              f"{r['ratio']:.2f}x | {r['e2e_ratio']:.2f}x | {fr} | {comb} |")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"command": " ".join(["bench/suite.py", *(argv if argv is not None else sys.argv[1:])]),
                                 "files": a.files, "rows": a.rows, "results": rows}, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
