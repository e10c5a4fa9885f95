"""Rescale cost at ~1M keys of state (W-1M of ../shared/ANCHORS.md), keyscale vs Spark.

    .venv/bin/python bench/rescale.py --repeats 2

1. Live rescale. W-1M with 8 files (one per batch, ~865k+ keys by batch 4). Three runs
   side by side: P=2 throughout, P=1 throughout, and P=2 rescaled live to 1 after batch 4
   and back to 2 after batch 5. The cost of a rescale is the rescaled run's batch against
   the same batch of the run already at that parallelism: batch 5 (2->1) against P=1's
   batch 5, batch 6 (1->2) against P=2's batch 6.
2. Restart at a new parallelism. State built at P=2 over the 5 W-1M files; then one more
   file, and a new `keyscale run -p 4` process: seconds from its launch to its first
   committed batch. Against Spark: new session + offline
   ``_streamingCheckpointManager.repartition(ckpt, 4)`` + restart until the first batch
   (bench/spark_baselines.offline_repartition), same state, same machine, same run.
"""

from __future__ import annotations

import argparse
import json
import logging
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
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from _workload import DEFAULT_DATA_ROOT, ensure_workload  # noqa: E402
from spark_baselines import make_spark, offline_repartition  # noqa: E402

from keyscale.checkpoint.jobdir import JobDir  # noqa: E402
from keyscale.runtime.driver.runner import BatchRecord, JobRunner, RunOptions  # noqa: E402


def live_run(data: Path, p: int, plan: dict[int, int]) -> list[float]:
    tmp = Path(tempfile.mkdtemp(prefix="ks-rescale-"))
    try:
        jd = JobDir(tmp / "job")

        def on_batch(rec: BatchRecord) -> None:
            if rec.batch in plan:
                jd.request_rescale(plan[rec.batch])

        opts = RunOptions(job_file=str(HERE / "jobs" / "w_count.py"), job_dir=str(jd.path), parallelism=p, until_idle=True,
                          args={"input": str(data), "mode": "vectorized", "sink": "noop"})
        s = JobRunner(opts, on_batch).run()
        return s.trigger_seconds
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def keyscale_restart(data: Path, from_p: int, to_p: int) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="ks-restart-"))
    try:
        inp = tmp / "in"
        inp.mkdir()
        files = sorted(data.glob("part-*.parquet"))
        for f in files:
            os.link(f, inp / f.name)
        base = [sys.executable, "-m", "keyscale.cli.main", "run", str(HERE / "jobs" / "w_count.py"), "--job-dir", str(tmp / "job"),
                "--until-idle", "--set", f"input={inp}", "--set", "mode=vectorized", "--set", "sink=noop"]
        subprocess.run([*base, "-p", str(from_p)], check=True, capture_output=True, cwd=ROOT)
        shutil.copyfile(files[0], inp / f"part-{len(files):05d}.parquet")  # newest file: one more batch
        t0 = time.perf_counter()
        proc = subprocess.Popen([*base, "-p", str(to_p)], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, cwd=ROOT)
        first = None
        assert proc.stderr is not None
        for line in proc.stderr:
            if f"batch {len(files)} committed" in line and first is None:
                first = time.perf_counter() - t0
        proc.wait()
        if proc.returncode != 0 or first is None:
            raise RuntimeError(f"restart failed (exit {proc.returncode})")
        m = JobDir(tmp / "job").latest_manifest()
        assert m is not None and m.operators["count"].parallelism == to_p
        return {"first_batch_after_launch_s": first, "state_files": len(m.operators["count"].files)}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=str(HERE / "out" / "rescale.json"))
    a = ap.parse_args(argv)
    logging.getLogger("keyscale").setLevel(logging.WARNING)
    w1m8 = ensure_workload(DEFAULT_DATA_ROOT, "W-1M-8", files=8, keys=1_000_000)
    w1m = ensure_workload(DEFAULT_DATA_ROOT, "W-1M", keys=1_000_000)

    live: dict[str, list[list[float]]] = {"p2": [], "p1": [], "rescaled": []}
    restart: dict[str, list[Any]] = {"keyscale": [], "spark": []}
    live_run(w1m8, 2, {})  # warm-up: JVM, Python workers, page cache; not counted
    for rep in range(a.repeats):
        print(f"repeat {rep + 1}/{a.repeats}", flush=True)
        for name, p, plan in (("p2", 2, {}), ("p1", 1, {}), ("rescaled", 2, {4: 1, 5: 2})):
            live[name].append(live_run(w1m8, p, plan))
            print(f"  live {name}: {[round(x, 2) for x in live[name][-1]]}", flush=True)
        restart["keyscale"].append(keyscale_restart(w1m, 2, 4))
        print(f"  keyscale restart 2->4: {restart['keyscale'][-1]}", flush=True)
        spark = make_spark(2)
        from spark_baselines import stop_spark

        stop_spark(spark, stop_jvm=True)  # the baseline starts its own, cold, as a restarted driver would
        r = offline_repartition(make_spark, w1m, 2, 4)
        restart["spark"].append({k: v for k, v in r.items() if k.endswith("seconds") and not isinstance(v, list)})
        print(f"  spark offline repartition 2->4 + restart: {restart['spark'][-1]}", flush=True)

    med = statistics.median
    down = med(r[5] / p1[5] for r, p1 in zip(live["rescaled"], live["p1"], strict=True))
    up = med(r[6] / p2[6] for r, p2 in zip(live["rescaled"], live["p2"], strict=True))
    steady2 = med(med(x[2:5]) for x in live["p2"])
    ks_restart = med(x["first_batch_after_launch_s"] for x in restart["keyscale"])
    sp_total = med(x["total_seconds"] for x in restart["spark"])
    sp_parts = {k: med(x[k] for x in restart["spark"]) for k in ("session_start_seconds", "repartition_seconds", "restart_seconds")}
    print()
    print(f"steady batch at P=2 (batches 2-4): {steady2:.2f} s")
    print(f"first batch after live 2->1: {med(r[5] for r in live['rescaled']):.2f} s vs P=1 run's same batch {med(p[5] for p in live['p1']):.2f} s: ratio {down:.2f}")
    print(f"first batch after live 1->2: {med(r[6] for r in live['rescaled']):.2f} s vs P=2 run's same batch {med(p[6] for p in live['p2']):.2f} s: ratio {up:.2f}")
    print(f"restart at P=4, launch to first batch: keyscale {ks_restart:.2f} s; Spark session+repartition+restart {sp_total:.2f} s {sp_parts}; ratio {ks_restart / sp_total:.2f}")
    out = {"command": "bench/rescale.py " + " ".join(argv or sys.argv[1:]), "live": live, "restart": restart,
           "summary": {"live_2_to_1_ratio": down, "live_1_to_2_ratio": up, "steady_p2_s": steady2,
                       "keyscale_restart_s": ks_restart, "spark_restart_total_s": sp_total, "spark_parts": sp_parts,
                       "restart_ratio": ks_restart / sp_total}}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
