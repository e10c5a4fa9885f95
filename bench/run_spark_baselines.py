"""Run the Spark baselines on workload W / W-1M and write medians as JSON.

Usage::

    python bench/run_spark_baselines.py --repeats 2 --out bench/out/spark_baselines.json
    python bench/run_spark_baselines.py --skip-tws            # skip the ~6 min TWS run
    python bench/run_spark_baselines.py --only native_agg:W --merge   # add/replace one entry

Each run gets a fresh SparkSession in a fresh JVM (local[2], 2 shuffle partitions, RocksDB).
Steady state = batches 1..4 (batch 0 includes planning/warm-up); the reported
``steady_median_s`` is the median over the steady batches of all repeats. The JSON is
rewritten after every run, so an interrupted invocation keeps what it measured.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import spark_baselines as sb
from _workload import (
    DEFAULT_DATA_ROOT,
    W1M_KEYS,
    ensure_workload,
    load_results,
    median,
    write_result,
)

STEADY = slice(1, 5)  # batches 1-4

REPART_PARTS = [
    "stop_seconds",
    "session_start_seconds",
    "repartition_seconds",
    "restart_seconds",
    "total_seconds",
    "total_with_stop_seconds",
]


def _spec(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The baseline runs: id, workload, callable(spark_or_factory, data_dir), repeats."""
    runs: list[dict[str, Any]] = [
        {"id": "native_agg:W", "fn": "native_agg", "workload": "W", "repeats": args.repeats},
        {"id": "native_agg:W-1M", "fn": "native_agg", "workload": "W-1M", "repeats": args.repeats},
        {
            "id": "apply_in_pandas_with_state:W",
            "fn": "apply_in_pandas_with_state",
            "workload": "W",
            "repeats": args.aipws_repeats or args.repeats,
        },
        {
            "id": "transform_with_state_in_pandas:W",
            "fn": "transform_with_state_in_pandas",
            "workload": "W",
            "repeats": args.tws_repeats,
            "max_batches": args.tws_files,
        },
        {
            "id": "offline_repartition:W",
            "fn": "offline_repartition",
            "workload": "W",
            "repeats": args.repeats,
        },
        {
            "id": "offline_repartition:W-1M",
            "fn": "offline_repartition",
            "workload": "W-1M",
            "repeats": args.repeats,
        },
    ]
    if args.skip_tws:
        runs = [r for r in runs if r["fn"] != "transform_with_state_in_pandas"]
    if args.only:
        wanted = set(args.only)
        unknown = wanted - {r["id"] for r in runs} - {r["fn"] for r in runs}
        if unknown:
            raise SystemExit(f"unknown --only {sorted(unknown)}; ids: {[r['id'] for r in runs]}")
        runs = [r for r in runs if r["id"] in wanted or r["fn"] in wanted]
    return runs


def _run_once(run: dict[str, Any], data_dir: Path) -> dict[str, Any]:
    fn: Callable[..., dict[str, Any]] = getattr(sb, run["fn"])
    if run["fn"] == "offline_repartition":
        return fn(sb.make_spark, data_dir, from_p=2, to_p=4)
    spark = sb.make_spark(2)
    try:
        kwargs = {"max_batches": run["max_batches"]} if run.get("max_batches") else {}
        return fn(spark, data_dir, **kwargs)
    finally:
        sb.stop_spark(spark, stop_jvm=True)


def _aggregate(run: dict[str, Any], reps: list[dict[str, Any]]) -> dict[str, Any]:
    steady = [b for r in reps for b in r["batch_seconds"][STEADY]]
    batch0 = [r["batch_seconds"][0] for r in reps if r["batch_seconds"]]
    rows_per_batch = reps[0]["rows"] / max(1, len(reps[0]["batch_seconds"]))
    out: dict[str, Any] = {
        "baseline": run["fn"],
        "workload": run["workload"],
        "repeats": len(reps),
        "files": len(reps[0]["batch_seconds"]),
        "rows": reps[0]["rows"],
        "batch0_median_s": median(batch0) if batch0 else None,
        "steady_median_s": median(steady) if steady else None,
        "steady_min_s": min(steady) if steady else None,
        "steady_max_s": max(steady) if steady else None,
        "steady_per_repeat_median_s": [median(r["batch_seconds"][STEADY]) for r in reps if r["batch_seconds"][STEADY]],
        "wall_median_s": median(r["wall_seconds"] for r in reps),
        "state_rows": reps[0].get("state_rows", reps[0].get("build_state_rows")),
    }
    if out["steady_median_s"]:
        out["steady_rows_per_s"] = rows_per_batch / out["steady_median_s"]
    if run["fn"] == "offline_repartition":
        for part in REPART_PARTS:
            out[part.replace("_seconds", "_median_s")] = median(r[part] for r in reps)
        out["restart_batch_median_s"] = median(r["restart_batch_seconds"][0] for r in reps)
        out["restart_state_partitions"] = reps[0]["restart_state_partitions"]
        out["restart_state_rows"] = reps[0]["restart_state_rows"]
        out["from_p"], out["to_p"] = reps[0]["from_p"], reps[0]["to_p"]
    out["runs"] = reps
    return out


def _fmt(x: Any, nd: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def print_table(results: dict[str, Any]) -> None:
    rows = results["baselines"]
    print()
    print(f"{'baseline':36} {'rep':>3} {'files':>5} {'batch0 s':>8} {'steady s':>8} "
          f"{'(min-max)':>13} {'rows/s':>9} {'wall s':>7}")
    for key, r in rows.items():
        rng = f"{_fmt(r['steady_min_s'])}-{_fmt(r['steady_max_s'])}"
        print(f"{key:36} {r['repeats']:>3} {r['files']:>5} {_fmt(r['batch0_median_s']):>8} "
              f"{_fmt(r['steady_median_s']):>8} {rng:>13} {_fmt(r.get('steady_rows_per_s'), 0):>9} "
              f"{_fmt(r['wall_median_s'], 1):>7}")
    rep = {k: r for k, r in rows.items() if r["baseline"] == "offline_repartition"}
    if rep:
        print()
        print(f"{'offline repartition 2->4':36} {'stop':>6} {'session':>8} {'repart':>7} "
              f"{'restart':>8} {'(batch)':>8} {'total':>6} {'+stop':>6} {'state':>8}")
        for key, r in rep.items():
            print(f"{key:36} {_fmt(r['stop_median_s']):>6} {_fmt(r['session_start_median_s']):>8} "
                  f"{_fmt(r['repartition_median_s']):>7} {_fmt(r['restart_median_s']):>8} "
                  f"{_fmt(r['restart_batch_median_s']):>8} {_fmt(r['total_median_s']):>6} "
                  f"{_fmt(r['total_with_stop_median_s']):>6} {_fmt(r['restart_state_rows']):>8}")
    print()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("bench/out/spark_baselines.json"))
    ap.add_argument("--data-root", type=Path, default=DEFAULT_DATA_ROOT)
    ap.add_argument("--skip-tws", action="store_true", help="skip transformWithStateInPandas")
    ap.add_argument("--tws-files", type=int, default=3, help="files (batches) for the TWS run")
    ap.add_argument("--tws-repeats", type=int, default=1)
    ap.add_argument("--aipws-repeats", type=int, default=None, help="default: --repeats")
    ap.add_argument("--only", nargs="+", help="run ids (e.g. native_agg:W-1M) or function names")
    ap.add_argument("--merge", action="store_true", help="keep other entries of an existing --out")
    args = ap.parse_args(argv)

    runs = _spec(args)
    data = {
        "W": ensure_workload(args.data_root, "W"),
        "W-1M": ensure_workload(args.data_root, "W-1M", keys=W1M_KEYS),
    }
    results: dict[str, Any] = {"baselines": {}}
    if args.merge and args.out.exists():
        results = load_results(args.out)
    import pyspark

    results["env"] = {
        "pyspark": pyspark.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "master": "local[2]",
        "shuffle_partitions": 2,
        "state_store": sb.ROCKSDB_PROVIDER,
        "updated": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
    }
    for run in runs:
        reps = []
        for i in range(run["repeats"]):
            t = time.perf_counter()
            la = os.getloadavg()[0]
            print(f"[{datetime.now():%H:%M:%S}] {run['id']} repeat {i + 1}/{run['repeats']} "
                  f"(load {la:.2f}) ...", flush=True)
            r = _run_once(run, data[run["workload"]])
            r["load_avg_1m_before"] = la
            reps.append(r)
            print(f"    batches {[round(b, 2) for b in r['batch_seconds']]} wall {r['wall_seconds']:.1f}s "
                  f"({time.perf_counter() - t:.1f}s incl. session)", flush=True)
            if run["fn"] == "offline_repartition":
                print("    " + ", ".join(f"{p}={r[p]:.2f}" for p in REPART_PARTS)
                      + f", restart batch {r['restart_batch_seconds']}, "
                      f"partitions {r['restart_state_partitions']}", flush=True)
            results["baselines"][run["id"]] = _aggregate(run, reps)
            write_result(args.out, results)
    print_table(results)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
