"""Workload W (../shared/ANCHORS.md): keyscale against Spark's stateful options, same run.

    .venv/bin/python bench/keyed_count.py --repeats 3 [--tws-files 3] [--skip-tws]

Per repeat, interleaved so that machine noise hits all alike: Spark native
``groupBy(key).agg(sum)`` (RocksDB), keyscale vectorized, keyscale per-record, and
``applyInPandasWithState``; ``transformWithStateInPandas`` once on the first
``--tws-files`` files (it takes ~110 s per batch). All use ``maxFilesPerTrigger=1``, a
noop sink, local[2], 2 shuffle partitions / parallelism 2. Steady state = batches 1-4,
each system measured by Spark's own ``triggerExecution`` per batch; medians over repeats.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _workload import DEFAULT_DATA_ROOT, ensure_workload  # noqa: E402
from spark_baselines import (  # noqa: E402
    ROCKSDB_PROVIDER,
    apply_in_pandas_with_state,
    native_agg,
    transform_with_state_in_pandas,
)

from keyscale.runtime.driver.runner import JobRunner, RunOptions  # noqa: E402
from keyscale.runtime.driver.session import spark_session  # noqa: E402


def keyscale_run(data: Path, mode: str, parallelism: int = 2) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="ks-bench-"))
    try:
        opts = RunOptions(
            job_file=str(HERE / "jobs" / "w_count.py"), job_dir=str(tmp / "job"), parallelism=parallelism,
            until_idle=True, args={"input": str(data), "mode": mode, "sink": "noop"},
        )
        t = time.perf_counter()
        s = JobRunner(opts).run()
        wall = time.perf_counter() - t
        return {"batch_seconds": s.trigger_seconds, "wall_seconds": wall, "rows": s.records}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def steady(r: dict[str, Any]) -> float:
    xs = r["batch_seconds"][1:5]
    return statistics.median(xs) if xs else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tws-files", type=int, default=3)
    ap.add_argument("--skip-tws", action="store_true")
    ap.add_argument("--skip-apply", action="store_true")
    ap.add_argument("--out", default=str(HERE / "out" / "keyed_count.json"))
    a = ap.parse_args(argv)
    logging.getLogger("keyscale").setLevel(logging.WARNING)
    data = ensure_workload(DEFAULT_DATA_ROOT, "W")
    spark = spark_session("local[2]", "keyscale-bench", {"spark.sql.streaming.stateStore.providerClass": ROCKSDB_PROVIDER})
    systems: dict[str, Any] = {
        "spark native agg (RocksDB)": lambda: native_agg(spark, data),
        "keyscale vectorized": lambda: keyscale_run(data, "vectorized"),
        "keyscale vectorized, combine=True": lambda: keyscale_run(data, "combined"),
        "keyscale per-record": lambda: keyscale_run(data, "per-record"),
    }
    if not a.skip_apply:
        systems["spark applyInPandasWithState"] = lambda: apply_in_pandas_with_state(spark, data)
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in systems}
    for rep in range(a.repeats):
        for name, fn in systems.items():
            print(f"repeat {rep + 1}/{a.repeats}: {name} ...", flush=True)
            r = fn()
            runs[name].append(r)
            print(f"   steady batch {steady(r):.2f} s; batches {[round(x, 2) for x in r['batch_seconds']]}", flush=True)
    if not a.skip_tws:
        print(f"transformWithStateInPandas on {a.tws_files} files (slow) ...", flush=True)
        r = transform_with_state_in_pandas(spark, data, max_batches=a.tws_files)
        runs["spark transformWithStateInPandas"] = [r]
        print(f"   batches {[round(x, 2) for x in r['batch_seconds']]}", flush=True)

    rows_per_batch = 400_000
    table = {}
    for name, rs in runs.items():
        med = statistics.median(steady(r) for r in rs)
        table[name] = {"steady_batch_s": med, "rows_per_s": rows_per_batch / med, "repeats": len(rs),
                       "per_repeat_steady_s": [steady(r) for r in rs], "runs": rs}
    native = table["spark native agg (RocksDB)"]["rows_per_s"]
    tws = table.get("spark transformWithStateInPandas", {}).get("rows_per_s")
    print(f"\n{'system':34} {'steady batch':>12} {'rows/s':>10} {'vs native':>9} {'vs tWSiP':>9}")
    for name, t in table.items():
        vs_tws = f"{t['rows_per_s'] / tws:8.1f}x" if tws else "       -"
        print(f"{name:34} {t['steady_batch_s']:11.2f}s {t['rows_per_s']:10,.0f} {t['rows_per_s'] / native:8.2f}x {vs_tws}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"command": " ".join(["bench/keyed_count.py", *(argv or sys.argv[1:])]), "systems": table}, indent=1))
    print(f"\nwrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
