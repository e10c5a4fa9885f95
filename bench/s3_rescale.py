"""Live rescale on an isolated cluster with the job's state on S3 (issue 11).

    .venv/bin/python bench/s3_rescale.py                      # S3, then local disk
    .venv/bin/python bench/s3_rescale.py --stores s3 --files 10 --rows 200000

A standalone cluster of ``--workers`` one-core workers on 127.0.0.1 (``keyscale.cluster``),
and the running count with string keys (``examples/running_count.py``: count and sum per
key, ``--keys`` keys, one input file of ``--rows`` rows per batch) at parallelism 2,
rescaled live to 4 after batch ``--rescale-after`` (half the files by default). The
application holds every worker's core from the start (no ``spark.cores.max``), so the
rescale measures keyscale's state redistribution, not executor start-up.

* ``s3``: the workers are isolated (another Unix user, a private mount namespace: they
  cannot read the driver's local dirs) and the job dir and output are on a SeaweedFS
  server started here (``keyscale.storage.seaweed.serving_bucket``); tasks read and write
  state through the storage layer, with the endpoint and keys the driver gives them.
* ``local``: the same job on a plain cluster (workers run as this user and share its
  disk) with job dir and output on local disk: the baseline.

The input is in a world-readable folder under /tmp (mode 0755), outside /root and
pytest's private tmp dirs, so isolated workers can read it as Spark's file source needs.

Before the job, a warm-up Spark job starts a Python worker (keyscale and pyarrow imported)
on every executor. Per run, from keyscale's batch times (read, process, state, sink,
commit): the steady batch (median of the batches at P=2 from batch 2 on; batches 0 and 1
warm up), the first batch at P=4 and its ratio to the steady batch (target: within
1.5x), and the median of the later batches at P=4 with the first one's ratio to it.
Results: ``bench/out/s3_rescale.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
JOB = ROOT / "examples" / "running_count.py"

from keyscale.checkpoint.jobdir import JobDir  # noqa: E402
from keyscale.cluster import start_cluster, stop_cluster  # noqa: E402
from keyscale.runtime.driver.runner import BatchRecord, JobRunner, RunOptions  # noqa: E402


def write_input(folder: Path, files: int, rows: int, keys: int, seed: int = 0) -> None:
    """``files`` Parquet files of ``rows`` rows (key string of ``keys`` keys, value long, ts)."""
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o755)
    base = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    for i in range(files):
        rng = np.random.default_rng(seed + i)
        table = pa.table({
            "key": pa.array([f"key-{k}" for k in rng.integers(0, keys, rows)], pa.string()),
            "value": pa.array(rng.integers(1, 100, rows), pa.int64()),
            "ts": pa.array(np.full(rows, int((base + dt.timedelta(seconds=i)).timestamp() * 1e6)), pa.timestamp("us", tz="UTC")),
        })  # fmt: skip
        path = folder / f"part-{i:05d}.parquet"
        pq.write_table(table, path)
        os.chmod(path, 0o644)
        stamp = 1_700_000_000 + i  # Spark's file source takes files in modification-time order
        os.utime(path, (stamp, stamp))


def warm_up(master: str, workers: int) -> Any:
    """Start the session the job will use and a Python worker on every executor, with
    keyscale and pyarrow imported (``spark.python.worker.reuse`` keeps them): the first
    batches then measure keyscale, not process start-up."""
    from keyscale.cluster import wait_for_executor_cores
    from keyscale.runtime.driver.session import spark_session

    spark = spark_session(master)
    wait_for_executor_cores(spark, workers, timeout=180)
    sc = spark.sparkContext
    for _ in range(2):
        sc.parallelize(range(4 * workers), 4 * workers).map(lambda x: (__import__("keyscale.runtime.task.keyed"), __import__("pyarrow"), x)[2]).sum()
    return spark


def run(master: str, job_dir: str, out: str, inp: Path, rescale_after: int, workers: int) -> dict[str, Any]:
    jd = JobDir(job_dir)
    pars: list[int] = []

    def on_batch(rec: BatchRecord) -> None:
        pars.append(rec.parallelism["totals"])
        if rec.batch == rescale_after:
            jd.request_rescale(4)

    spark = warm_up(master, workers)
    opts = RunOptions(job_file=str(JOB), job_dir=job_dir, parallelism=2, master=master, until_idle=True,
                      args={"input": str(inp), "output": out})  # fmt: skip
    t0 = time.perf_counter()
    try:
        s = JobRunner(opts, on_batch).run()
    finally:
        spark.stop()  # the next run is on another cluster: a new SparkContext
    wall = time.perf_counter() - t0
    secs = [b.seconds for b in s.batches]
    first4 = pars.index(4)
    steady = statistics.median(secs[2:first4])  # batches 0 and 1 warm up (state grows, caches fill)
    after = secs[first4 + 1 :]
    return {
        "batch_seconds": secs, "parallelism": pars, "spark_trigger_seconds": s.trigger_seconds, "wall_seconds": wall,
        "steady_s": steady, "first_at_4_s": secs[first4], "ratio": secs[first4] / steady,
        "after_at_4_median_s": statistics.median(after) if after else None,
        "ratio_to_later_at_4": secs[first4] / statistics.median(after) if after else None,
        "requests_first_at_4": s.batches[first4].requests, "records": s.records,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--files", type=int, default=14)
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--keys", type=int, default=100_000)
    ap.add_argument("--rescale-after", type=int, help="the last batch at P=2 (default: files // 2 - 1)")
    ap.add_argument("--stores", default="s3,local", help="comma-separated: s3, local")
    ap.add_argument("--out", default=str(HERE / "out" / "s3_rescale.json"))
    a = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("bench/s3_rescale.py needs root (isolated workers run as another user)", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("KEYSCALE_SPARK_LOG_LEVEL", "ERROR")
    rescale_after = a.rescale_after if a.rescale_after is not None else a.files // 2 - 1
    work = Path(tempfile.mkdtemp(prefix="ks-s3-rescale-", dir="/tmp"))
    os.chmod(work, 0o755)  # the input below must be readable to the worker user
    results: dict[str, Any] = {}
    try:
        inp = work / "in"
        write_input(inp, a.files, a.rows, a.keys)
        print(f"input: {a.files} files x {a.rows:,} rows, {a.keys:,} string keys in {inp}", flush=True)
        for store in a.stores.split(","):
            cluster = work / f"cluster-{store}"
            with contextlib.ExitStack() as s3:
                if store == "s3":
                    from keyscale.storage.seaweed import serving_bucket

                    # The driver's S3 settings (in its environment); they travel with the job to the tasks.
                    s3.enter_context(serving_bucket(work / "seaweedfs", "bench"))
                    job_dir, out = "s3://bench/jobs/rc", "s3://bench/out"
                else:
                    job_dir, out = str(work / "local" / "job"), str(work / "local" / "out")
                info = start_cluster(cluster, workers=a.workers, cores=1, isolated=store == "s3")
                try:
                    print(f"{store}: cluster {info.master_url} ({a.workers} workers x 1 core, isolated={store == 's3'})", flush=True)
                    r = run(info.master_url, job_dir, out, inp, rescale_after, a.workers)
                finally:
                    stop_cluster(cluster)
            results[store] = r
            print(f"{store}: batches {[round(x, 2) for x in r['batch_seconds']]} parallelism {r['parallelism']}", flush=True)
            print(f"{store}: steady batch at P=2 {r['steady_s']:.2f} s, first batch at P=4 {r['first_at_4_s']:.2f} s "
                  f"(ratio {r['ratio']:.2f}), later batches at P=4 {r['after_at_4_median_s']:.2f} s (ratio {r['ratio_to_later_at_4']:.2f})", flush=True)  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)
    doc = {"command": "bench/s3_rescale.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "workers": a.workers, "files": a.files, "rows": a.rows, "keys": a.keys, "rescale_after": rescale_after,
           "load_average_at_end": os.getloadavg(), "results": results}  # fmt: skip
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
