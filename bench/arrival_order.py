"""What a file source's arrival order (keyscale.runtime.task.arrival) costs per batch: workload W
(400,000-row Parquet files, one per batch) through the vectorized running count, noop sink,
local[2], parallelism 2, run by two keyscale source trees in turn (before/after a change).

    git archive BASE src | tar -x -C /tmp/base     # the tree before the change
    .venv/bin/python bench/arrival_order.py --before /tmp/base/src --after src --repeats 3

Each run is a fresh process (its own Spark driver) with that tree first on ``sys.path``;
a run's figure is the median of Spark's ``triggerExecution`` over batches 1-4 (batch 0
warms the JVM and the Python workers); the result is the median over repeats per tree.

On a busy machine those figures spread more than the change moves them. ``--plan-only``
measures the Spark side of the change alone, in one driver, the two plans taking turns:
each batch of the same streaming query, with and without the order columns read in the
scan, through a keyed stage's plan (sequence, key group, the exact shuffle, ``mapInArrow``
counting rows); the median over every batch after the first of each query.

    .venv/bin/python bench/arrival_order.py --plan-only --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def child(data: Path, mode: str) -> dict[str, Any]:
    import keyscale
    from keyscale.runtime.driver.runner import JobRunner, RunOptions

    tmp = Path(tempfile.mkdtemp(prefix="ks-arrival-"))
    try:
        opts = RunOptions(
            job_file=str(HERE / "jobs" / "w_count.py"), job_dir=str(tmp / "job"), parallelism=2, master="local[2]",
            until_idle=True, args={"input": str(data), "mode": mode, "sink": "noop"},
        )
        t = time.perf_counter()
        s = JobRunner(opts).run()
        return {"keyscale": keyscale.__file__, "batch_seconds": s.trigger_seconds, "wall_seconds": time.perf_counter() - t, "rows": s.records}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def plan_only(data: Path, repeats: int) -> dict[str, float]:
    from pyspark.sql import functions as F

    from keyscale.runtime.driver.session import spark_session
    from keyscale.runtime.task.arrival import with_file_order

    spark = spark_session("local[2]", "arrival-plan")

    def count(batches: Any) -> Any:
        import pyarrow as pa

        yield pa.record_batch([pa.array([sum(b.num_rows for b in batches)])], names=["n"])

    def run(ordered: bool) -> list[float]:
        src = spark.readStream.schema("key long, v long").option("maxFilesPerTrigger", 1).parquet(str(data))
        order = ["__ks_file", "__ks_block"] if ordered else []
        if ordered:
            src, ok = with_file_order(src)
            assert ok
        times: list[float] = []

        def batch(df: Any, _: int) -> None:
            t = time.perf_counter()
            rows = df.select("key", "v", F.monotonically_increasing_id().alias("s"), F.expr("cast(pmod(hash(key), 128) as int)").alias("kg"), *order)
            rows.repartition(2, "kg").mapInArrow(count, "n long").collect()
            times.append(time.perf_counter() - t)

        q = src.writeStream.foreachBatch(batch).option("checkpointLocation", tempfile.mkdtemp(prefix="ks-arrival-")).trigger(availableNow=True).start()
        q.awaitTermination()
        return times[1:]

    res: dict[str, list[float]] = {"without": [], "with": []}
    for r in range(repeats):
        for label in res:
            ts = run(label == "with")
            res[label] += ts
            print(f"repeat {r} {label} order columns: {[round(x, 3) for x in ts]}", flush=True)
    spark.stop()
    return {k: statistics.median(v) for k, v in res.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", help="keyscale source tree (the folder holding keyscale/) before the change")
    ap.add_argument("--after", help="the same after it")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--mode", default="vectorized", help="w_count's mode: vectorized | per-record | combined")
    ap.add_argument("--data", type=Path, default=None, help="where workload W is (made if absent; default bench/data)")
    ap.add_argument("--plan-only", action="store_true", help="the Spark side alone, in this process (this tree)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    sys.path.insert(0, str(HERE))
    from _workload import DEFAULT_DATA_ROOT, ensure_workload

    data = ensure_workload(a.data or DEFAULT_DATA_ROOT, "W")
    if a.child:
        print(json.dumps(child(data, a.mode)))
        return
    if a.plan_only:
        med = plan_only(data, a.repeats)
        print(json.dumps({"plan_batch_seconds": med, "change": med["with"] / med["without"] - 1}))
        return
    if not (a.before and a.after):
        ap.error("--before and --after are needed (or --plan-only)")
    runs: dict[str, list[float]] = {"before": [], "after": []}
    for r in range(a.repeats):
        for label in ("before", "after"):  # interleaved: machine noise hits both alike
            tree = str(Path(getattr(a, label)).resolve())
            env = {**os.environ, "PYTHONPATH": tree, "KEYSCALE_SPARK_LOG_LEVEL": "ERROR", "PYSPARK_PYTHON": sys.executable}
            argv = [sys.executable, __file__, "--child", "--before", a.before, "--after", a.after, "--mode", a.mode]
            if a.data:
                argv += ["--data", str(a.data)]
            proc = subprocess.run(argv, capture_output=True, text=True, env=env, check=True)
            res = json.loads(proc.stdout.strip().splitlines()[-1])
            assert res["keyscale"].startswith(tree), (res["keyscale"], tree)
            steady = statistics.median(res["batch_seconds"][1:5])
            runs[label].append(steady)
            print(f"repeat {r} {label}: batches {[round(x, 3) for x in res['batch_seconds']]} -> steady {steady:.3f} s", flush=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    print(json.dumps({"mode": a.mode, "steady_batch_seconds": med, "change": med["after"] / med["before"] - 1}))


if __name__ == "__main__":
    main()
