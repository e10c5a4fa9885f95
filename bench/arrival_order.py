"""What a file source's arrival order (keyscale.runtime.arrival) costs per batch: workload W
(400,000-row Parquet files, one per batch) through the vectorized running count, noop sink,
local[2], parallelism 2, run by two keyscale source trees in turn (before/after a change).

    git archive BASE src | tar -x -C /tmp/base     # the tree before the change
    .venv/bin/python bench/arrival_order.py --before /tmp/base/src --after src --repeats 3

Each run is a fresh process (its own Spark driver) with that tree first on ``sys.path``;
a run's figure is the median of Spark's ``triggerExecution`` over batches 1-4 (batch 0
warms the JVM and the Python workers); the result is the median over repeats per tree.
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
    from keyscale.runtime.driver import JobRunner, RunOptions

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="keyscale source tree (the folder holding keyscale/) before the change")
    ap.add_argument("--after", required=True, help="the same after it")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--mode", default="vectorized", help="w_count's mode: vectorized | per-record | combined")
    ap.add_argument("--data", type=Path, default=None, help="where workload W is (made if absent; default bench/data)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    sys.path.insert(0, str(HERE))
    from _workload import DEFAULT_DATA_ROOT, ensure_workload

    data = ensure_workload(a.data or DEFAULT_DATA_ROOT, "W")
    if a.child:
        print(json.dumps(child(data, a.mode)))
        return
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
