"""Elasticity on a local Spark standalone cluster (issue 5): a load step, three ways.

    .venv/bin/python bench/elastic.py                 # the benchmark (one repeat, ~10 min)
    .venv/bin/python bench/elastic.py --quick         # shorter schedule (~6 min)
    .venv/bin/python bench/elastic.py --repeats 2 --runs auto,fixed-max

A cluster of 4 one-core workers (1g each) on 127.0.0.1 (``keyscale.cluster``), and the
same job (``bench/jobs/slow_count.py``: a keyed running count costing ``cost_ms`` per
record, a ``time.sleep``, i.e. I/O-like work) on the same rate schedule, three ways, one
after the other (order rotated per repeat so drifting machine noise hits all alike):

* ``fixed-min``: ``-p 1 --scaling fixed``, the application capped at 1 core;
* ``fixed-max``: ``-p 4 --scaling fixed``, the application capped at 4 cores (all of them);
* ``auto``: ``-p 1 --scaling auto --autoscaler active --scaling-max 4`` with the
  ``--autoscaler-option`` settings below; the driver asks Spark for as many executors as
  the parallelism it chooses (``request_executors`` after each decision).

The cap for the fixed runs is ``spark.cores.max=P`` through ``PYSPARK_SUBMIT_ARGS`` (the
``keyscale run`` CLI has no Spark-conf flag; without a cap the application takes every core
the cluster offers, so a fixed P=1 job would hold 4 executors and idle 3): a fixed
deployment is provisioned for its parallelism. The autoscaled job is not capped.

Each run: a fresh log (4 partitions, generator schema), the job started and its executors
registered, then the generator (``keyscale.sources.start_generator``) writes the schedule
(default ``200/s for 20s, 1200/s for 40s, 200/s for 80s``, 50 keys). Every 0.5 s a sampler
records

* the cores the application holds: ``activeapps[].cores`` of the master's ``/json/``;
* the backlog: records in the log minus the reader offsets of the job's last committed
  batch (``status.json``), i.e. what is not yet processed and committed;
* the keyed operator's parallelism (``status.json``).

Measured per run:

* **drain time**: from the step's start to the first sample after the step's end with the
  backlog at or under ``--drained`` records (default: 3 s of the base rate); a run whose
  backlog never gets there within ``--drain-timeout`` s after the schedule is reported as
  not drained (a lower bound);
* **max backlog**;
* **core-seconds**: the integral of the application's cores over the run, from the
  generator's start to the later of the schedule's end and the drain (also: over the
  schedule only);
* **reversals**: changes of direction of the parallelism, attributed to the load phase
  (between two load changes) they happen in; the goal allows at most one per phase;
* **exactly-once**: after ``keyscale stop``, each key's final count in the output equals
  its number of records in the log.

Results: ``bench/out/elastic.json`` (``elastic_quick.json`` with ``--quick``), progress on stdout.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
JOB_FILE = HERE / "jobs" / "slow_count.py"
OUT = HERE / "out"

SCHEDULE = "200/s for 20s, 1200/s for 40s, 200/s for 80s"
QUICK_SCHEDULE = "200/s for 10s, 1200/s for 25s, 200/s for 55s"
#: Autoscaler settings for a run measured in tens of seconds (the defaults assume minutes).
AUTOSCALER_OPTIONS = [
    "stabilization_seconds=5",
    "scale_down_delay_seconds=10",
    "metrics_window_seconds=8",
    "warmup_batches=1",
    "catch_up_seconds=20",
    "min_busy_seconds=0",
]
MAX_P = 4


def log_line(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def master_app_cores(webui_url: str) -> int | None:
    """Cores the (single) active application holds, from the master's JSON."""
    try:
        with urllib.request.urlopen(webui_url + "/json/", timeout=2) as r:
            data = json.loads(r.read().decode())
    except (OSError, ValueError):
        return None
    return sum(int(a.get("cores", 0)) for a in data.get("activeapps", []))


def committed_offsets(st: dict[str, Any]) -> int | None:
    reader = st.get("operators", {}).get("reader", {})
    readers = reader.get("readers")
    if readers is None:
        return None
    return sum(int(p.get("offset") or 0) for r in readers for p in r.get("partitions", {}).values())


def parallelism(st: dict[str, Any], uid: str = "totals") -> int | None:
    op = st.get("operators", {}).get(uid)
    return int(op["parallelism"]) if op and "parallelism" in op else None


class Sampler(threading.Thread):
    def __init__(self, webui_url: str, job_dir: Path, log: Any, every: float = 0.5):
        super().__init__(daemon=True)
        from keyscale.checkpoint.jobdir import JobDir

        self.webui_url, self.jobdir, self.log, self.every = webui_url, JobDir(job_dir), log, every
        self.samples: list[dict[str, Any]] = []
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            t = time.time()
            cores = master_app_cores(self.webui_url)
            st = self.jobdir.read_status()
            try:
                produced = sum(self.log.end_offsets())
            except Exception:
                produced = None
            done = committed_offsets(st)
            self.samples.append({
                "t": t, "cores": cores, "produced": produced, "committed": done,
                "backlog": None if produced is None or done is None else produced - done,
                "p": parallelism(st), "p_reader": parallelism(st, "reader"),
                "batch": st.get("last_checkpoint"),
            })
            self._halt.wait(max(0.0, self.every - (time.time() - t)))

    def stop(self) -> None:
        self._halt.set()
        self.join(10)


def integrate(samples: list[dict[str, Any]], t0: float, t1: float) -> float:
    """Integral of cores over [t0, t1], step-wise (each sample holds until the next)."""
    total = 0.0
    for a, b in itertools.pairwise(samples):
        lo, hi = max(a["t"], t0), min(b["t"], t1)
        if hi > lo and a["cores"] is not None:
            total += a["cores"] * (hi - lo)
    return total


def reversals(samples: list[dict[str, Any]], phases: list[float]) -> tuple[list[dict[str, Any]], list[int]]:
    """Parallelism changes (time, from, to) and reversals per load phase."""
    changes, prev = [], None
    for s in samples:
        if s["p"] is None:
            continue
        if prev is not None and s["p"] != prev:
            changes.append({"t": s["t"], "from": prev, "to": s["p"]})
        prev = s["p"]
    per_phase = [0] * (len(phases) + 1)
    last_dir = 0
    for c in changes:
        d = 1 if c["to"] > c["from"] else -1
        if last_dir and d != last_dir:
            per_phase[sum(1 for p in phases if c["t"] >= p)] += 1
        last_dir = d
    return changes, per_phase


def exactly_once(log: Any, out_dir: Path) -> dict[str, Any]:
    import pandas as pd
    import pyarrow.dataset as pads

    records = pd.concat([log.read(p, 0, e).to_pandas() for p, e in enumerate(log.end_offsets())])
    want = records.groupby("key").size().sort_index()
    if not out_dir.exists() or not any(out_dir.glob("batch=*")):
        return {"ok": False, "why": "no output", "records": int(want.sum())}
    out = pads.dataset(str(out_dir), partitioning="hive").to_table().to_pandas()
    got = out.groupby("key")["count"].max().sort_index()
    ok = got.index.equals(want.index) and bool((got.to_numpy() == want.to_numpy()).all())
    diff = {} if ok else {k: [int(got.get(k, -1)), int(want.get(k, -1))] for k in want.index.union(got.index) if got.get(k, -1) != want.get(k, -1)}
    return {"ok": ok, "records": int(want.sum()), "keys": len(want), "output_rows": len(out), "mismatched": dict(list(diff.items())[:10])}


def run_one(kind: str, args: argparse.Namespace, cluster: Any, work: Path) -> dict[str, Any]:
    from keyscale.checkpoint.jobdir import JobDir
    from keyscale.sources import GENERATOR_DDL, RateSchedule, create_log, start_generator

    sched = RateSchedule.parse(args.schedule)
    segs = sched.segments
    base = float(segs[0].rate)
    step_start = float(segs[0].duration)
    step_end = step_start + float(segs[1].duration)
    total = float(sum(s.duration for s in segs))
    threshold = args.drained if args.drained is not None else 3 * base

    d = work / kind
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    log = create_log(d / "log", GENERATOR_DDL, args.partitions)
    argv = [sys.executable, "-m", "keyscale.cli.main", "run", str(JOB_FILE), "--job-dir", str(d / "job"), "--master", cluster.master_url,
            "--trigger-interval", args.trigger_interval,
            "--set", f"log={d / 'log'}", "--set", f"output={d / 'out'}", "--set", f"cost_ms={args.cost_ms}", "--set", f"limit={args.limit}"]
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable}
    if kind == "auto":
        argv += ["-p", "1", "--scaling", "auto", "--autoscaler", "active", "--scaling-max", str(MAX_P)]
        for opt in args.autoscaler_option:
            argv += ["--autoscaler-option", opt]
        want_cores = 1  # the driver sizes executors to the initial parallelism at start
    else:
        p = 1 if kind == "fixed-min" else MAX_P
        argv += ["-p", str(p), "--scaling", "fixed"]
        env["PYSPARK_SUBMIT_ARGS"] = f"--conf spark.cores.max={p} pyspark-shell"
        want_cores = p
    job_log = d / "job.log"
    log_line(f"{kind}: starting {' '.join(argv[3:])}" + (f"  [{env['PYSPARK_SUBMIT_ARGS']}]" if "PYSPARK_SUBMIT_ARGS" in env else ""))
    with open(job_log, "w") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=out, env=env)
    gen = None
    sampler = Sampler(cluster.webui_url, d / "job", log)
    result: dict[str, Any] = {"kind": kind, "schedule": args.schedule, "argv": argv[3:], "spark_submit_args": env.get("PYSPARK_SUBMIT_ARGS")}
    try:
        # Ready: the job wrote a status (its plan) and its executors are registered.
        deadline = time.time() + 240
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{kind}: job exited at start:\n{job_log.read_text()[-3000:]}")
            st = JobDir(d / "job").read_status()
            cores = master_app_cores(cluster.webui_url) or 0
            # Exactly: an autoscaled app first takes every core offered, then gives back what P=1 does not need.
            if st and parallelism(st) is not None and (cores == want_cores if kind == "auto" else cores >= (want_cores or MAX_P)):
                break
            if time.time() > deadline:
                raise RuntimeError(f"{kind}: not ready after 240 s (status {json.dumps(st)[:500]}, cores {cores})")
            time.sleep(0.5)
        log_line(f"{kind}: ready (app holds {cores} cores); generator starts: {args.schedule}")
        sampler.start()
        t0 = time.time()
        gen = start_generator(log, sched, keys=args.keys, seed=0)
        phases = [t0 + step_start, t0 + step_end]
        drained_at = None
        last_print = 0.0
        end_wait = t0 + total + args.drain_timeout
        while time.time() < end_wait:
            if proc.poll() is not None:
                raise RuntimeError(f"{kind}: job exited during the run:\n{job_log.read_text()[-3000:]}")
            now = time.time()
            s = sampler.samples[-1] if sampler.samples else None
            if s and drained_at is None and s["t"] >= t0 + step_end and s["backlog"] is not None and s["backlog"] <= threshold:
                drained_at = s["t"]
                log_line(f"{kind}: backlog drained {drained_at - phases[0]:.1f} s after the step started")
            if s and now - last_print >= 5:
                last_print = now
                log_line(f"{kind}: t={now - t0:5.1f}s  P={s['p']}  cores={s['cores']}  backlog={s['backlog']}  batch={s['batch']}")
            if now >= t0 + total and drained_at is not None:
                break
            time.sleep(0.5)
        gen.join(30)
        t_end = max(t0 + total, drained_at or time.time())
        # Let the last records through before stopping (for the exactly-once check).
        while time.time() < t_end + 60 and proc.poll() is None:
            s = sampler.samples[-1]
            if s["backlog"] == 0:
                break
            time.sleep(0.5)
        sampler.stop()
        log_line(f"{kind}: stopping the job")
        subprocess.run([sys.executable, "-m", "keyscale.cli.main", "stop", str(d / "job")], cwd=ROOT, check=True, capture_output=True, timeout=300)
        proc.wait(120)
        samples = sampler.samples
        changes, per_phase = reversals([s for s in samples if s["t"] <= t_end], phases)
        events = JobDir(d / "job").read_events()
        decisions = [e for e in events if e.get("type") == "autoscaler" and e.get("action") != "none"]
        win = [s for s in samples if t0 <= s["t"] <= t_end and s["backlog"] is not None]
        result.update({
            "drained": drained_at is not None,
            "drain_seconds": (drained_at - phases[0]) if drained_at else None,
            "drain_lower_bound_seconds": None if drained_at else t_end - phases[0],
            "drained_threshold_records": threshold,
            "max_backlog": max((s["backlog"] for s in win), default=None),
            "core_seconds": integrate(samples, t0, t_end),
            "core_seconds_schedule": integrate(samples, t0, t0 + total),
            "window_seconds": t_end - t0,
            "parallelism_seconds": sum(
                (a["p"] or 0) * (min(b["t"], t_end) - max(a["t"], t0))
                for a, b in itertools.pairwise(samples) if min(b["t"], t_end) > max(a["t"], t0)),
            "changes": [{**c, "t": round(c["t"] - t0, 1)} for c in changes],
            "reversals_per_phase": per_phase,
            "decisions": [{k: e.get(k) for k in ("batch", "time", "action", "current_parallelism", "target_parallelism", "reason")} | {"t": round(float(e["time"]) - t0, 1) if isinstance(e.get("time"), int | float) and e["time"] > 1e9 else None} for e in decisions],
            "executor_requests": [e for e in events if e.get("type") == "executors"],
            "exactly_once": exactly_once(log, d / "out"),
            "generator": {"records": gen.result.records if gen.result else None, "error": repr(gen.error) if gen.error else None},
            "samples": [{**s, "t": round(s["t"] - t0, 2)} for s in samples],
        })
        log_line(f"{kind}: drain {result['drain_seconds'] if drained_at else 'not drained'} s, max backlog {result['max_backlog']}, "
                 f"core-s {result['core_seconds']:.0f}, changes {[(c['t'], c['from'], c['to']) for c in result['changes']]}, "
                 f"reversals/phase {per_phase}, exactly-once {result['exactly_once']['ok']}")
        return result
    finally:
        stop_run(proc, gen, sampler, d / "job")


def stop_run(proc: subprocess.Popen[Any], gen: Any, sampler: Any, job_dir: Path, env: dict[str, str] | None = None) -> None:
    """End one measured run, whatever state it stopped in: the sampler, the generator, then
    the job (``keyscale stop``, a kill if that does not end it)."""
    if sampler.is_alive():
        sampler.stop()
    if gen is not None:
        gen.stop()
        gen.join(30)
    if proc.poll() is None:
        try:
            subprocess.run([sys.executable, "-m", "keyscale.cli.main", "stop", str(job_dir)], cwd=ROOT, env=env,
                           capture_output=True, timeout=120)
            proc.wait(60)
        except Exception:
            pass
    if proc.poll() is None:
        proc.kill()
        proc.wait(30)


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    import statistics

    by: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        by.setdefault(r["kind"], []).append(r)

    def med(kind: str, key: str) -> float | None:
        vals = [r[key] for r in by.get(kind, []) if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    s: dict[str, Any] = {k: {"drain_seconds": med(k, "drain_seconds"), "drain_lower_bound_seconds": med(k, "drain_lower_bound_seconds"),
                             "max_backlog": med(k, "max_backlog"), "core_seconds": med(k, "core_seconds"),
                             "core_seconds_schedule": med(k, "core_seconds_schedule"),
                             "max_reversals_per_phase": max(max(r["reversals_per_phase"]) for r in rs),
                             "exactly_once": all(r["exactly_once"]["ok"] for r in rs), "runs": len(rs)} for k, rs in by.items()}
    a, f = s.get("auto"), s.get("fixed-max")
    if a and f and a["drain_seconds"] and f["drain_seconds"]:
        s["drain_ratio"] = a["drain_seconds"] / f["drain_seconds"]
        s["core_seconds_ratio"] = a["core_seconds"] / f["core_seconds"]
        s["goal_met"] = {"drain <= 2x": s["drain_ratio"] <= 2, "core-seconds <= 60%": s["core_seconds_ratio"] <= 0.6,
                         "<= 1 reversal per load change": a["max_reversals_per_phase"] <= 1}
    return s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help=f"shorter schedule: {QUICK_SCHEDULE}")
    ap.add_argument("--schedule")
    ap.add_argument("--runs", default="fixed-min,fixed-max,auto")
    ap.add_argument("--cost-ms", type=float, default=1.0)
    ap.add_argument("--limit", type=int, default=1500, help="records a batch reads per log partition")
    ap.add_argument("--keys", type=int, default=50)
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--trigger-interval", default="1 second")
    ap.add_argument("--drained", type=float, help="backlog (records) counted as drained (default: 3 s of the base rate)")
    ap.add_argument("--drain-timeout", type=float, default=180, help="seconds after the schedule to wait for the drain")
    ap.add_argument("--autoscaler-option", action="append", help=f"replaces the defaults {AUTOSCALER_OPTIONS}")
    ap.add_argument("--work", help="working folder (default: a temporary one, deleted)")
    ap.add_argument("--out")
    args = ap.parse_args()
    args.schedule = args.schedule or (QUICK_SCHEDULE if args.quick else SCHEDULE)
    args.autoscaler_option = args.autoscaler_option or AUTOSCALER_OPTIONS
    out_path = Path(args.out) if args.out else OUT / ("elastic_quick.json" if args.quick else "elastic.json")
    kinds = args.runs.split(",")

    from keyscale.cluster import start_cluster, stop_cluster

    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="keyscale-elastic-"))
    cluster_dir = work / "cluster"
    results: list[dict[str, Any]] = []
    try:
        log_line(f"starting a cluster of {MAX_P} one-core workers in {cluster_dir}")
        cluster = start_cluster(cluster_dir, workers=MAX_P, cores=1, memory="1g")
        log_line(f"cluster up: {cluster.master_url} (web UI {cluster.webui_url})")
        for rep in range(args.repeats):
            order = kinds[rep % len(kinds):] + kinds[:rep % len(kinds)]
            for kind in order:
                r = run_one(kind, args, cluster, work / f"rep{rep}")
                r["repeat"] = rep
                results.append(r)
                OUT.mkdir(exist_ok=True)
                out_path.write_text(json.dumps({"config": vars(args), "results": results, "summary": summarize(results)}, indent=1, default=str))
    finally:
        stop_cluster(cluster_dir)
        log_line("cluster stopped")
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    summary = summarize(results)
    out_path.write_text(json.dumps({"config": vars(args), "results": results, "summary": summary}, indent=1, default=str))
    log_line(f"summary: {json.dumps(summary, indent=1)}")
    log_line(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
