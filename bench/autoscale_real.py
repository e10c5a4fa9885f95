"""``bench/autoscale.py --real``: one short load trace through the real job on a local
Spark standalone cluster (``keyscale.cluster``), once per policy (issue 36, item 5).

    .venv/bin/python bench/autoscale.py --real                       # 5 policies, ~30 min
    .venv/bin/python bench/autoscale.py --real --policies keyscale-slo,fixed-peak
    .venv/bin/python bench/autoscale.py --real --trace step --slo 8

The cluster and the job are ``bench/elastic.py``'s: 4 workers of 1 core (1g), 1-core
executors; ``bench/jobs/slow_count.py``, a keyed running count (50 keys, 128 key groups)
that sleeps ``--cost-ms`` per record (I/O-like work, so 4 executors help on a 2-core
machine), reading a 4-partition keyscale log (the local log keeps append times, so every
batch measures its end-to-end latency, ``keyscale.latency``), trigger 1 s. The load is
written by ``keyscale.sources.start_generator`` once the job is up and holds the executors
its start needs. Traces (:data:`TRACES`, short enough for this machine):

* ``spike_twice`` (default): 100 rec/s with a 10x spike (1,000 rec/s for 30 s) at 40 s and
  the same spike again one "season" (90 s) later, 220 s in all. The autoscaler runs with
  ``season_seconds=90``: the first spike is unseen (reactive), the second one the forecast
  has seen before (predictive).
* ``step``: 100 -> 600 rec/s at 40 s, for 120 s (160 s).

Policies (one job each, one after the other, same cluster, fresh log and job directory):

* ``fixed-peak``: ``-p P --scaling fixed --conf spark.cores.max=P``, P the smallest
  parallelism dividing 128 whose subtasks' sleep covers the peak at 70 % busy;
* ``keyscale-slo``: ``-p 1 --scaling auto --autoscaler active --scaling-max 4
  --slo latency=<SLO>s`` with :data:`AUTOSCALER_OPTIONS` (bench/elastic.py's short windows
  plus a 90 s season, 10 s forecast buckets, a 20 s scale-down horizon);
* ``keyscale-reactive``: the same without ``--slo``;
* ``fixed-average``: as ``fixed-peak``, sized for the trace's mean rate;
* ``flink``: Flink's operator algorithm (:mod:`keyscale.scaling.flink`, its windows
  compressed as keyscale's are: ``bench/flink_policy.py``) recommending inside the job, and
  each rescale it recommends made as Flink's operator makes it, by a restart: ``keyscale
  stop --savepoint``, then ``keyscale run -p N --conf spark.cores.max=N`` from the
  checkpoint the savepoint was taken of, the input arriving meanwhile (the restart's
  seconds are in the JSON's ``restarts``).

Figures per policy, over the trace (from the generator's start to its end):

* **10 s windows within the SLO**: a window is within it when at least one batch committed
  in it and every batch committed in it has a p99 latency at most the SLO (each batch's
  ``latency`` in the job's ``GET /history``; the max of the batches' p99 bounds the
  window's p99 from above: the status keeps no histograms, so this is stricter than the
  simulator's merged p99 per minute); minutes are too few in a 220 s trace;
* **executor core-seconds**: the integral of the cores the application holds (the master's
  ``/json/``, sampled every 0.5 s), against fixed at peak; also parallelism x seconds;
* **rescales** (``rescale`` events of the run), **worst batch p99**, **worst latency**
  (the largest batch maximum), **batches over the SLO** (per load phase in the JSON);
* **exactly-once**: after ``keyscale stop`` each key's final count in the output equals its
  records in the log (bench/elastic.py's check).

Also the load average of the machine during each run. Results: a table on stdout,
``bench/out/autoscale_real.json`` (every batch, decision, executor request and sample) and
``docs/img/autoscale_real.png`` (input rate, executor cores and each batch's p99 per policy).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(HERE))

import elastic  # noqa: E402  (bench/elastic.py: its sampler, core integral and exactly-once check)

JOB_FILE = HERE / "jobs" / "slow_count.py"
MAX_P = 4
SLO_SECONDS = 8.0
WINDOW_SECONDS = 10.0


@dataclass(frozen=True)
class RealTrace:
    schedule: str
    description: str
    season_seconds: float | None = None


TRACES = {
    "spike_twice": RealTrace(
        "100/s for 40s, 1000/s for 30s, 100/s for 60s, 1000/s for 30s, 100/s for 60s",
        "100 rec/s, a 10x spike (1,000 rec/s for 30 s) at 40 s and again at 130 s (one 90 s season later)",
        90.0),
    "step": RealTrace("100/s for 40s, 600/s for 120s", "100 -> 600 rec/s at 40 s"),
}

#: bench/elastic.py's short windows (the defaults assume minutes), plus the forecast's
#: season, buckets and scale-down horizon scaled to the trace.
AUTOSCALER_OPTIONS = [*elastic.AUTOSCALER_OPTIONS, "forecast_bucket_seconds=10", "forecast_horizon_seconds=20"]
POLICIES = ("keyscale-slo", "fixed-peak", "keyscale-reactive", "fixed-average", "flink")


def log_line(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def peak_parallelism(schedule: str, cost_ms: float, max_p: int = MAX_P, average: bool = False) -> int:
    """The smallest parallelism dividing 128 whose subtasks sleep at most 70 % of the time at
    the peak (``average``: at the trace's mean rate).

    >>> peak_parallelism("100/s for 4s, 1000/s for 3s", 2.0), peak_parallelism("100/s for 4s, 1000/s for 3s", 2.0, average=True)
    (4, 2)
    >>> peak_parallelism("100/s for 4s, 300/s for 3s", 2.0)
    1
    """
    from keyscale.sources import RateSchedule
    from keyscale.state.keygroups import aligned_parallelism

    segments = RateSchedule.parse(schedule).segments
    if average:
        rate = sum((float(s.rate) + float(s.end_rate)) / 2 * float(s.duration) for s in segments) / sum(float(s.duration) for s in segments)
    else:
        rate = max(max(float(s.rate), float(s.end_rate)) for s in segments)
    raw = max(1, math.ceil(rate * cost_ms / 1000 / 0.7))
    return aligned_parallelism(min(raw, max_p), 128, 1, max_p)


def phases(schedule: str) -> list[tuple[float, float, float]]:
    """(start, end, rate) of each segment, in seconds from the generator's start."""
    from keyscale.sources import RateSchedule

    out, t = [], 0.0
    for s in RateSchedule.parse(schedule).segments:
        out.append((t, t + float(s.duration), float(s.rate)))
        t += float(s.duration)
    return out


@dataclass(frozen=True)
class RealFigures:
    trace: str
    policy: str
    label: str
    windows: int
    windows_within_slo: int
    pct_windows_within_slo: float
    core_seconds: float
    core_seconds_vs_peak: float | None
    parallelism_seconds: float
    rescales: int
    worst_batch_p99_seconds: float | None
    worst_latency_seconds: float | None
    worst_window_p99_bound_seconds: float | None
    batches: int
    batches_over_slo: int
    exactly_once: bool
    records: int
    load_avg_mean: float | None
    load_avg_max: float | None


def batch_rows(history: dict[str, Any], t0: float) -> list[dict[str, Any]]:
    """The run's batches that measured a latency: committed (s from ``t0``), records, p99, max, parallelism."""
    rows = []
    for b in history.get("batches", []):
        lat = b.get("latency")
        if not lat or not lat.get("records"):
            continue
        rows.append({"batch": b["batch"], "t": lat["committed_ms"] / 1000 - t0, "records": lat["records"],
                     "p50": lat["p50_seconds"], "p99": lat["p99_seconds"], "max": lat["max_seconds"],
                     "seconds": b.get("seconds"), "p": (b.get("parallelism") or {}).get("totals"), "backlog": b.get("backlog")})
    return rows


def window_p99_bounds(rows: list[dict[str, Any]], duration: float, window: float = WINDOW_SECONDS) -> list[float | None]:
    """Per window of the trace, the largest p99 of the batches committed in it (None: no
    batch with a latency committed in it): an upper bound of the window's p99.

    >>> rows = [{"t": 1.0, "p99": 2.0}, {"t": 4.0, "p99": 3.0}, {"t": 12.0, "p99": 11.0}]
    >>> window_p99_bounds(rows, 30.0)
    [3.0, 11.0, None]
    """
    n = math.ceil(duration / window - 1e-9)
    out: list[float | None] = [None] * n
    for r in rows:
        i = int(r["t"] // window)
        if 0 <= i < n:
            out[i] = r["p99"] if out[i] is None else max(out[i], r["p99"])  # type: ignore[type-var]
    return out


def over_slo_per_phase(rows: list[dict[str, Any]], ph: list[tuple[float, float, float]], slo: float) -> list[dict[str, Any]]:
    """Per load phase (and the drain after the trace): batches committed in it, and those over the SLO.

    >>> over_slo_per_phase([{"t": 1.0, "p99": 2.0}, {"t": 6.0, "p99": 12.0}, {"t": 11.0, "p99": 11.0}], [(0, 5, 1.0), (5, 10, 9.0)], 10.0)
    [{'from': 0, 'to': 5, 'rate': 1.0, 'batches': 1, 'over_slo': 0}, {'from': 5, 'to': 10, 'rate': 9.0, 'batches': 1, 'over_slo': 1}, {'from': 10, 'to': None, 'rate': None, 'batches': 1, 'over_slo': 1}]
    """
    spans = [*ph, (ph[-1][1], None, None)]
    out = []
    for lo, hi, rate in spans:
        inside = [r for r in rows if r["t"] >= lo and (hi is None or r["t"] < hi)]
        out.append({"from": lo, "to": hi, "rate": rate, "batches": len(inside), "over_slo": sum(1 for r in inside if r["p99"] > slo)})
    return out


def figures(trace: str, policy: str, label: str, run: dict[str, Any], slo: float, peak_core_seconds: float | None) -> RealFigures:
    rows = [r for r in run["batches"] if 0 <= r["t"] < run["duration"]]
    per_window = window_p99_bounds(rows, run["duration"])
    ok = sum(1 for v in per_window if v is not None and v <= slo)
    loads = [s["load1"] for s in run["load"]]
    return RealFigures(
        trace=trace, policy=policy, label=label, windows=len(per_window), windows_within_slo=ok,
        pct_windows_within_slo=100.0 * ok / len(per_window),
        core_seconds=run["core_seconds"],
        core_seconds_vs_peak=run["core_seconds"] / peak_core_seconds if peak_core_seconds else None,
        parallelism_seconds=run["parallelism_seconds"],
        rescales=len({r["batch"] for r in run["rescales"]}),  # a rescale moves every operator between the same two batches
        worst_batch_p99_seconds=max((r["p99"] for r in rows), default=None),
        worst_latency_seconds=max((r["max"] for r in rows), default=None),
        worst_window_p99_bound_seconds=max((v for v in per_window if v is not None), default=None),
        batches=len(rows), batches_over_slo=sum(1 for r in rows if r["p99"] > slo),
        exactly_once=bool(run["exactly_once"].get("ok")), records=int(run["exactly_once"].get("records") or 0),
        load_avg_mean=sum(loads) / len(loads) if loads else None, load_avg_max=max(loads) if loads else None,
    )


def table(rows: list[RealFigures], slo: float) -> str:
    def s(v: float | None) -> str:
        return "-" if v is None else f"{v:,.1f} s"

    lines = [f"| trace | policy | 10 s windows within the {slo:g} s SLO | core-seconds (vs fixed at peak) | rescales "
             "| worst batch p99 | worst latency | batches over the SLO | exactly-once | load average (mean / max) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        vs = f" ({r.core_seconds_vs_peak:.0%})" if r.core_seconds_vs_peak is not None else ""
        load = f"{r.load_avg_mean:.1f} / {r.load_avg_max:.1f}" if r.load_avg_mean is not None else "-"
        lines.append(
            f"| {r.trace} | {r.label} | {r.pct_windows_within_slo:.1f}% ({r.windows_within_slo}/{r.windows}) "
            f"| {r.core_seconds:,.0f}{vs} | {r.rescales} | {s(r.worst_batch_p99_seconds)} | {s(r.worst_latency_seconds)} "
            f"| {r.batches_over_slo} of {r.batches} | {'yes' if r.exactly_once else 'NO'} ({r.records:,} records) | {load} |")
    return "\n".join(lines)


STYLES = {"fixed-peak": ("tab:gray", ":"), "fixed-average": ("tab:brown", ":"), "keyscale-reactive": ("tab:blue", "-"),
          "keyscale-slo": ("tab:green", "--"), "flink": ("tab:red", "-.")}


def plot(trace_name: str, runs: dict[str, dict[str, Any]], slo: float, path: Path) -> Path:
    """Input rate; executor cores the application holds; each batch's p99 latency, per policy."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 8), layout="constrained")
    FigureCanvasAgg(fig)
    ax_rate, ax_cores, ax_lat = fig.subplots(3, 1, sharex=True, height_ratios=[2, 2, 3])
    ph = phases(TRACES[trace_name].schedule)
    ax_rate.step([a for a, _, _ in ph] + [ph[-1][1]], [r for _, _, r in ph] + [ph[-1][2]], where="post", color="black", lw=0.8)
    ax_rate.set_ylabel("input (records/s)")
    ax_rate.set_title(f"{trace_name} on a local cluster: {TRACES[trace_name].description}", fontsize=9)
    for name, run in runs.items():
        color, ls = STYLES.get(name, (None, "-"))
        smp = [x for x in run["samples"] if x["cores"] is not None]
        ax_cores.step([x["t"] for x in smp], [x["cores"] for x in smp], where="post", color=color, ls=ls, lw=1.2, label=run["label"])
        ax_lat.plot([b["t"] for b in run["batches"]], [b["p99"] for b in run["batches"]], color=color, ls=ls, lw=1.0, marker=".",
                    ms=3, label=run["label"])
    ax_cores.set_ylabel("executor cores")
    ax_cores.set_ylim(bottom=0)
    ax_cores.legend(loc="upper right", fontsize=8)
    ax_lat.axhline(slo, color="black", ls="--", lw=0.8, label=f"SLO {slo:g} s")
    ax_lat.set_yscale("log")
    ax_lat.set_ylabel("p99 latency per batch (s)")
    ax_lat.set_xlabel("time from the generator's start (s)")
    ax_lat.set_xlim(0, ph[-1][1] + 30)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=80)
    return path


def job_argv(policy: str, d: Path, args: argparse.Namespace, master: str, trace: RealTrace) -> tuple[list[str], int, str]:
    """The ``keyscale run`` command of a policy, the executor cores it holds at start, its label."""
    argv = [sys.executable, "-m", "keyscale.cli.main", "run", str(JOB_FILE), "--job-dir", str(d / "job"), "--master", master,
            "--trigger-interval", "1 second", "--set", f"log={d / 'log'}", "--set", f"output={d / 'out'}",
            "--set", f"cost_ms={args.cost_ms:g}", "--set", f"limit={args.limit}"]
    if policy in ("fixed-peak", "fixed-average"):
        p = peak_parallelism(trace.schedule, args.cost_ms, average=policy == "fixed-average")
        return [*argv, "-p", str(p), "--scaling", "fixed", "--conf", f"spark.cores.max={p}"], p, f"{policy.replace('-', ' at ')} (P={p})"
    if policy == "flink":
        # Flink's policy recommends (bench/flink_policy.py); run_policy restarts the job at
        # what it recommends, with as many executor cores: a rescale is a restart.
        argv[1:3] = [str(HERE / "flink_policy.py")]
        flink = [*argv, "-p", "1", "--scaling", "auto", "--autoscaler", "recommend", "--scaling-max", str(MAX_P), "--conf", "spark.cores.max=1"]
        return flink, 1, "Flink's algorithm (a restart per rescale)"
    argv += ["-p", "1", "--scaling", "auto", "--autoscaler", "active", "--scaling-max", str(MAX_P)]
    options = list(args.autoscaler_option)
    if trace.season_seconds is not None:
        options.append(f"season_seconds={trace.season_seconds:g}")
    for opt in options:
        argv += ["--autoscaler-option", opt]
    if policy == "keyscale-slo":
        return [*argv, "--slo", f"latency={args.slo:g}s"], 1, f"keyscale SLO+predictive (latency={args.slo:g}s)"
    return argv, 1, "keyscale reactive"


def run_policy(policy: str, trace_name: str, args: argparse.Namespace, cluster: Any, work: Path) -> dict[str, Any]:
    from keyscale.checkpoint.jobdir import JobDir
    from keyscale.runtime.control.server import call
    from keyscale.sources import GENERATOR_DDL, RateSchedule, create_log, start_generator

    trace = TRACES[trace_name]
    sched = RateSchedule.parse(trace.schedule)
    duration = float(sched.duration)
    d = work / policy
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    log = create_log(d / "log", GENERATOR_DDL, 4)
    argv, want_cores, label = job_argv(policy, d, args, cluster.master_url, trace)
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable}
    job_log = d / "job.log"
    jd = JobDir(d / "job")

    def start(cmd: list[str], cores: int, p: int | None = None) -> subprocess.Popen[bytes]:
        """Start the job; return once its status and the executors its start needs are there."""
        log_line(f"{policy}: starting {' '.join(cmd[2:])}")
        with open(job_log, "a") as out:
            started = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=out, env=env)
        deadline = time.time() + 240
        while True:  # ready: a status (its plan, at parallelism p), and the executors its start needs registered
            if started.poll() is not None:
                raise RuntimeError(f"{policy}: job exited at start:\n{job_log.read_text()[-3000:]}")
            st = jd.read_status()
            have = elastic.master_app_cores(cluster.webui_url) or 0
            if st and st.get("running") and elastic.parallelism(st) in ((p,) if p else range(1, 1 << 30)) and have == cores:
                return started
            if time.time() > deadline:
                raise RuntimeError(f"{policy}: not ready after 240 s (cores {have})")
            time.sleep(0.5)

    job_log.write_text("")
    proc = start(argv, want_cores)
    gen = None
    sampler = elastic.Sampler(cluster.webui_url, d / "job", log)
    result: dict[str, Any] = {"policy": policy, "label": label, "trace": trace_name, "schedule": trace.schedule,
                              "argv": argv[3:], "duration": duration, "load": []}
    earlier: list[dict[str, Any]] = []  # the histories of the runs a restart ended (flink)
    restarts: list[dict[str, Any]] = []
    seen = len(jd.read_events())

    def follow_flink() -> None:
        """Flink's operator: a rescale it recommends is a restart (stop with a savepoint, start
        again at the new parallelism with as many executor cores), the input arriving meanwhile."""
        nonlocal proc, seen
        events = jd.read_events()
        asks = [e for e in events[seen:] if e.get("type") == "autoscaler" and e.get("uid") == "totals" and e.get("action") != "none"]
        seen = len(events)
        if not asks or asks[-1]["target_parallelism"] == asks[-1]["current_parallelism"]:
            return
        ask, asked = asks[-1], time.time()
        to, was = int(ask["target_parallelism"]), int(ask["current_parallelism"])
        earlier.append(call(jd, "GET", "/history", timeout=30))
        log_line(f"{policy}: restarting at P={to} (was {was}): {ask['reason']}")
        subprocess.run([sys.executable, "-m", "keyscale.cli.main", "stop", str(d / "job"), "--savepoint"], cwd=ROOT, env=env, check=True,
                       capture_output=True, timeout=300)
        proc.wait(120)
        i = argv.index("-p")
        cmd = [*argv[:i], "-p", str(to), *argv[i + 2:]]
        cmd[cmd.index("spark.cores.max=1")] = f"spark.cores.max={to}"
        proc = start(cmd, to, to)
        restarts.append({"t": round(asked - t0, 1), "from": was, "to": to, "seconds": round(time.time() - asked, 1), "reason": ask["reason"]})
        log_line(f"{policy}: restarted in {time.time() - asked:.1f} s")
        seen = len(jd.read_events())

    try:
        log_line(f"{policy}: ready ({want_cores} cores); generator: {trace.schedule}")
        sampler.start()
        t0 = time.time()
        gen = start_generator(log, sched, keys=args.keys, seed=0)
        last_print = 0.0
        while time.time() < t0 + duration:
            if proc.poll() is not None:
                raise RuntimeError(f"{policy}: job exited during the run:\n{job_log.read_text()[-3000:]}")
            if policy == "flink":
                follow_flink()
            now = time.time()
            if now - last_print >= 5:
                last_print = now
                result["load"].append({"t": round(now - t0, 1), "load1": os.getloadavg()[0]})
                s = sampler.samples[-1] if sampler.samples else {}
                lat = (jd.read_status() or {}).get("latency") or {}
                log_line(f"{policy}: t={now - t0:5.1f}s P={s.get('p')} cores={s.get('cores')} backlog={s.get('backlog')} "
                         f"last p99={lat.get('p99_seconds')} (batch {lat.get('batch')}) load={os.getloadavg()[0]:.1f}")
            time.sleep(0.5)
        gen.join(60)
        drained_at = None
        while time.time() < t0 + duration + args.drain_timeout and proc.poll() is None:
            if policy == "flink":
                follow_flink()
            s = sampler.samples[-1]
            if s["backlog"] == 0:
                drained_at = s["t"]
                break
            time.sleep(0.5)
        log_line(f"{policy}: trace done; " + (f"drained {drained_at - t0 - duration:.1f} s after it" if drained_at else "NOT drained"))
        history = call(jd, "GET", "/history", timeout=30)
        sampler.stop()
        log_line(f"{policy}: stopping the job")
        subprocess.run([sys.executable, "-m", "keyscale.cli.main", "stop", str(d / "job")], cwd=ROOT, env=env, check=True,
                       capture_output=True, timeout=300)
        proc.wait(120)
        samples = sampler.samples
        t_end = t0 + duration
        events = jd.read_events()
        result.update({
            "t0": t0,
            "drained_after_trace_seconds": (drained_at - t_end) if drained_at else None,
            "core_seconds": elastic.integrate(samples, t0, t_end),
            "core_seconds_with_drain": elastic.integrate(samples, t0, drained_at or time.time()),
            "parallelism_seconds": sum((a["p"] or 0) * (min(b["t"], t_end) - max(a["t"], t0))
                                       for a, b in itertools.pairwise(samples) if min(b["t"], t_end) > max(a["t"], t0)),
            "batches": [r for h in (*earlier, history) for r in batch_rows(h, t0)],
            "rescales": [{"t": round(e["time_ms"] / 1000 - t0, 1), "batch": e.get("batch"), "operator": e.get("operator"),
                          "from": e.get("from"), "to": e.get("to")} for h in (*earlier, history) for e in h.get("events", [])
                         if e.get("type") == "rescale"]
                        + [{"t": r["t"], "batch": f"restart at {r['t']} s", "operator": "totals", "from": r["from"], "to": r["to"]}
                           for r in restarts],
            "restarts": restarts,
            "decisions": [{"t": round(float(e["time"]) - t0, 1) if isinstance(e.get("time"), int | float) and e["time"] > 1e9 else None}
                          | {k: e.get(k) for k in ("batch", "uid", "action", "current_parallelism", "target_parallelism", "reason", "forecast")}
                          for e in events if e.get("type") == "autoscaler" and e.get("action") != "none"],
            "executor_events": [e for e in events if str(e.get("type", "")).startswith("executors")],
            "exactly_once": elastic.exactly_once(log, d / "out"),
            "generator": {"records": gen.result.records if gen.result else None, "error": repr(gen.error) if gen.error else None},
            "samples": [{**s, "t": round(s["t"] - t0, 2)} for s in samples],
        })
        log_line(f"{policy}: core-s {result['core_seconds']:.0f}, rescales {[(r['t'], r['operator'], r['from'], r['to']) for r in result['rescales']]}, "
                 f"exactly-once {result['exactly_once'].get('ok')}")
        return result
    finally:
        elastic.stop_run(proc, gen, sampler, d / "job", env)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="autoscale.py --real", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default="spike_twice", choices=sorted(TRACES))
    ap.add_argument("--policies", default=",".join(POLICIES), help=f"comma-separated, of: {', '.join(POLICIES)}")
    ap.add_argument("--slo", type=float, default=SLO_SECONDS, help="latency SLO in seconds (p99)")
    ap.add_argument("--cost-ms", type=float, default=2.0, help="the job's sleep per record")
    ap.add_argument("--limit", type=int, default=1500, help="records a batch reads per log partition")
    ap.add_argument("--keys", type=int, default=50)
    ap.add_argument("--drain-timeout", type=float, default=90, help="seconds after the trace to wait for the backlog")
    ap.add_argument("--autoscaler-option", action="append", help=f"replaces the defaults {AUTOSCALER_OPTIONS}")
    ap.add_argument("--class-archive", action="store_true",
                    help="the cluster's executors start with a class archive of their own (keyscale cluster start --class-archive)")
    ap.add_argument("--work", help="working folder (default: a temporary one, deleted)")
    ap.add_argument("--out", type=Path, default=HERE / "out" / "autoscale_real.json")
    ap.add_argument("--png", default=str(ROOT / "docs" / "img" / "autoscale_real.png"), help="the plot ('' for none)")
    args = ap.parse_args(argv)
    args.autoscaler_option = args.autoscaler_option or AUTOSCALER_OPTIONS
    names = [p for p in args.policies.split(",") if p]
    for bad in [p for p in names if p not in POLICIES]:
        ap.error(f"unknown policy {bad!r}")

    from keyscale.cluster import start_cluster, stop_cluster

    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="keyscale-autoscale-real-"))
    cluster_dir = work / "cluster"
    runs: dict[str, dict[str, Any]] = {}
    failed: dict[str, str] = {}
    rows: list[RealFigures] = []
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        args.out.write_text(json.dumps({"config": config, "trace": asdict(TRACES[args.trace]), "rows": [asdict(r) for r in rows],
                                        "failed": failed, "runs": runs}, indent=1, default=str))

    try:
        log_line(f"starting a cluster of {MAX_P} one-core workers in {cluster_dir}")
        cluster = start_cluster(cluster_dir, workers=MAX_P, cores=1, memory="1g", class_archive=args.class_archive)
        log_line(f"cluster up: {cluster.master_url}")
        for name in names:
            try:
                runs[name] = run_policy(name, args.trace, args, cluster, work)
            except Exception as e:  # the next policy still runs; the JSON says what failed
                log_line(f"{name}: FAILED: {e!r}")
                failed[name] = repr(e)[-3000:]
            save()
    finally:
        stop_cluster(cluster_dir)
        log_line("cluster stopped")
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    peak = runs["fixed-peak"]["core_seconds"] if "fixed-peak" in runs else None
    rows = [figures(args.trace, n, r["label"], r, args.slo, peak) for n, r in runs.items()]
    for r in runs.values():
        r["over_slo_per_phase"] = over_slo_per_phase(r["batches"], phases(r["schedule"]), args.slo)
    save()
    if args.png and runs:
        log_line(f"plot: {plot(args.trace, runs, args.slo, Path(args.png))}")
    print(f"trace {args.trace}: {TRACES[args.trace].description}")
    print(table(rows, args.slo))
    log_line(f"wrote {args.out}" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
