"""What a scale-up onto new executors waits for on a local standalone cluster, and what
shortens it: a warm-up job, or executors that start with a class archive (issue 36:
"executors kept warm or started ahead").

    .venv/bin/python bench/executor_start.py --repeats 3                      # cold, warm
    .venv/bin/python bench/executor_start.py --repeats 3 --modes cold,archive

The cluster is ``bench/autoscale.py --real``'s: 4 workers of 1 core, 1-core executors.
Per repeat and mode, the application is brought down to one executor (warm: it just ran a
job), then asks for 4 (``request_executors``) and measures:

* **registered**: from the request until the driver has 4 executor cores
  (``wait_for_executor_cores``; what a keyscale scale-up waits for);
* **warm-up** (mode ``warm`` only): a ``mapInArrow`` job of 4 tasks that imports what a
  stage task imports, run on the new executors before anything else;
* **first** and **second**: a 4-task ``mapInArrow`` job of 400 rows importing the same,
  run twice: a batch's stage at P=4 on the new executors, then the next batch's.

**until two batches ran** (``registered + warm-up + first + second``) says whether the new
parallelism's batches come to speed sooner. Modes ``cold`` and ``warm`` run on a cluster
started plainly; ``archive`` on one started with ``class_archive=True`` (its executors map
``executor-classes.jsa``, made at its folder's first start, timed apart). Each mode's
cluster is started for its turn and stopped after it, modes alternating; the table has
each run and the medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

import pyarrow as pa  # noqa: E402

WORKERS = 4


def stage_like(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """What a keyed stage's task imports before its first record."""
    import keyscale.runtime.task.keyed
    import keyscale.runtime.task.spark  # noqa: F401

    yield from batches


def timed(run: object) -> float:
    t = time.monotonic()
    run()  # type: ignore[operator]
    return time.monotonic() - t


def measure(spark: Any, mode: str) -> dict[str, float | str]:
    """One turn: down to one executor, then up to :data:`WORKERS`, timed (see the module doc)."""
    from keyscale.cluster.executors import request_executors, wait_for_executor_cores

    def job(rows_: int) -> None:
        spark.range(rows_, numPartitions=WORKERS).mapInArrow(stage_like, "id long").collect()

    request_executors(spark, 1)
    wait_for_executor_cores(spark, 1, 60)
    spark.range(4, numPartitions=1).mapInArrow(stage_like, "id long").collect()  # the one left is warm
    time.sleep(2)
    request_executors(spark, WORKERS)
    registered = timed(lambda: wait_for_executor_cores(spark, WORKERS, 120))
    warm = timed(lambda: job(WORKERS)) if mode == "warm" else 0.0
    first, second = timed(lambda: job(400)), timed(lambda: job(400))
    return {"mode": mode, "registered": registered, "warm-up": warm, "first": first, "second": second,
            "until two batches ran": registered + warm + first + second}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", default="cold,warm", help="of cold, warm, archive (default cold,warm)")
    args = ap.parse_args()
    modes = args.modes.split(",")
    if not modes or set(modes) - {"cold", "warm", "archive"}:
        ap.error(f"--modes {args.modes!r}: give some of cold, warm, archive")

    from keyscale.cluster import start_cluster, stop_cluster
    from keyscale.cluster.executors import spark_conf_for_cluster, wait_for_executor_cores
    from keyscale.runtime.driver.session import spark_session

    work = Path(tempfile.mkdtemp(prefix="keyscale-executor-start-"))
    if "archive" in modes:  # the archive's folder makes it at its first start
        made = timed(lambda: start_cluster(work / "archive", workers=0, class_archive=True))
        stop_cluster(work / "archive")
        print(f"executors' class archive made in {made:.1f} s (with the master's start)", flush=True)
    rows: list[dict[str, float | str]] = []
    for _ in range(args.repeats):
        for mode in modes:
            folder = work / ("archive" if mode == "archive" else "plain")
            cluster = start_cluster(folder, workers=WORKERS, cores=1, memory="1g", class_archive=mode == "archive")
            spark = None
            try:
                spark = spark_session(cluster.master_url, conf=spark_conf_for_cluster(master=cluster.master_url))
                wait_for_executor_cores(spark, WORKERS, 120, at_least=True)

                row = measure(spark, mode)
                rows.append(row)
                print(" ".join(f"{k} {v:.2f} s" if isinstance(v, float) else str(v) for k, v in row.items()), flush=True)
            finally:
                if spark is not None:
                    spark.stop()
                stop_cluster(folder)
    cols = ["registered", "warm-up", "first", "second", "until two batches ran"]
    print("\n| mode | " + " | ".join(cols) + " |\n|---|" + "---:|" * len(cols))
    for mode in modes:
        mine = [r for r in rows if r["mode"] == mode]
        for r in mine:
            print(f"| {mode} | " + " | ".join(f"{float(r[c]):.1f} s" for c in cols) + " |")
        print(f"| **{mode}, median** | " + " | ".join(f"**{statistics.median(float(r[c]) for r in mine):.1f} s**" for c in cols) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
