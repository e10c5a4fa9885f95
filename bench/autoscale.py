"""Autoscaling policies side by side on the same load traces (issue 36, item 5), in the
simulator (``keyscale.scaling.simulate``: the job model of ``scaling/jobmodel.py``, each
batch's end-to-end latency from ``scaling/arrivals.py``).

    .venv/bin/python bench/autoscale.py                        # every trace x policy, PNGs in docs/img/
    .venv/bin/python bench/autoscale.py --traces spike_10x --no-plots
    .venv/bin/python bench/autoscale.py --slo 10 --flink-restart-seconds 5.31

Traces (``keyscale.scaling.shapes``): a day compressed into 2 h and the same day at 24 h,
both ±10 % noise; a 10x spike; a step; a flat noisy load; a slow ramp. Policies
(:data:`POLICIES`, a name -> factory table, so another policy plugs in with one line):

* ``fixed-peak``: the smallest parallelism dividing the key groups whose capacity covers
  the trace's peak at 70 % utilisation; ``fixed-average``: the same for the mean rate;
* ``keyscale-reactive``: today's :class:`keyscale.scaling.policy.Autoscaler` with its
  defaults, live rescales (no downtime: docs/benchmarks.md, "Live rescale 2 -> 4 -> 2
  mid-run", no batch after it slower than 1.09x);
* ``keyscale-slo``: the Autoscaler with ``slo=latency=<SLO>`` (and its forecast);
* ``flink``: :class:`keyscale.scaling.flink.FlinkAutoscaler` (Flink's operator algorithm
  with its documented defaults), every rescale a restart of ``--flink-restart-seconds``
  (default 20.57 s: docs/benchmarks.md, "With the running job warm", the median time from
  a restart request to the first batch committed at the new parallelism when the job is
  stopped with a savepoint and restored in a new process);
* ``flink-example`` (not run by default): the same with the settings of the operator
  docs' "basic configuration example" (:data:`FLINK_EXAMPLE`).

``--real`` (``bench/autoscale_real.py``, its own options after it) replays one short trace
through the real job on a local standalone cluster instead: fixed at peak, keyscale
SLO+predictive and keyscale reactive, one after the other (the Flink policy exists only in
the simulator):

    .venv/bin/python bench/autoscale.py --real                 # ~20 min; --help after --real for its options

Figures per trace and policy: % of minutes within the SLO (a minute is within it when the
p99 latency of the records committed in it, ``keyscale.latency.window_quantile`` over its
batches, is at most the SLO; a minute without a commit is not), core-seconds against
fixed-peak, rescales per hour, the worst record's latency, the worst minute's p99, batches
whose p99 is over the SLO, and records lost (arrived, minus processed, minus still unread
at the end: the simulator's conservation check, 0).
Results: a table on stdout, ``bench/out/autoscale.json``, and per trace
``docs/img/autoscale_<trace>.png`` (input rate, parallelism and per-minute p99 latency of
every policy).
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "src"))

from keyscale.latency import representative, window_quantile  # noqa: E402
from keyscale.scaling.flink import FlinkAutoscaler, FlinkConfig  # noqa: E402
from keyscale.scaling.policy import Autoscaler, AutoscalerConfig  # noqa: E402
from keyscale.scaling.shapes import SHAPES  # noqa: E402
from keyscale.scaling.simulate import Policy, SimulationResult, simulate  # noqa: E402
from keyscale.scaling.slo import parse_slo  # noqa: E402
from keyscale.scaling.traces import Trace  # noqa: E402
from keyscale.state.keygroups import aligned_parallelism  # noqa: E402

SLO_SECONDS = 10.0
#: docs/benchmarks.md, "With the running job warm": cold restart (new process), median.
FLINK_RESTART_SECONDS = 20.57
SIZING_UTILIZATION = 0.7


@dataclass(frozen=True)
class Plan:
    """How one policy runs a trace: its start, its policy (``None``: fixed), the downtime
    each rescale costs, and the label the table and plots show."""

    label: str
    initial_parallelism: int
    policy: Policy | None
    rescale_seconds: float = 0.0


@dataclass(frozen=True)
class Settings:
    slo_seconds: float = SLO_SECONDS
    flink_restart_seconds: float = FLINK_RESTART_SECONDS


def sized_for(trace: Trace, rate: float) -> int:
    """The smallest parallelism dividing the key groups that processes ``rate`` at 70 %."""
    job = trace.job
    raw = next(
        (p for p in range(1, job.max_parallelism + 1) if job.capacity_rps(p) * SIZING_UTILIZATION >= rate),
        job.max_parallelism,
    )
    return aligned_parallelism(raw, job.max_parallelism, 1, job.max_parallelism)


def peak_rate(trace: Trace) -> float:
    return max(p.input_rate for p in trace.points)


def mean_rate(trace: Trace) -> float:
    return trace.arrivals(0.0, trace.duration_seconds) / trace.duration_seconds


def fixed_peak(trace: Trace, s: Settings) -> Plan:
    p = sized_for(trace, peak_rate(trace))
    return Plan(f"fixed at peak (P={p})", p, None)


def fixed_average(trace: Trace, s: Settings) -> Plan:
    p = sized_for(trace, mean_rate(trace))
    return Plan(f"fixed at average (P={p})", p, None)


def keyscale_reactive(trace: Trace, s: Settings) -> Plan:
    return Plan("keyscale reactive", trace.job.initial_parallelism, Autoscaler(AutoscalerConfig()))


def keyscale_slo(trace: Trace, s: Settings) -> Plan:
    """The SLO + predictive policy: the Autoscaler with ``slo=latency=<SLO>``."""
    slo = parse_slo(f"latency={s.slo_seconds:g}s")
    return Plan(f"keyscale SLO+predictive ({slo})", trace.job.initial_parallelism, Autoscaler(AutoscalerConfig(), slo=slo))


def flink(trace: Trace, s: Settings) -> Plan:
    return Plan(
        f"Flink operator algorithm (restart {s.flink_restart_seconds:g} s)",
        trace.job.initial_parallelism,
        FlinkAutoscaler(),
        s.flink_restart_seconds,
    )


#: The flink-kubernetes-operator docs' "Basic configuration example" (custom-resource/autoscaler.md):
#: stabilization 1m, metrics.window 5m, target 0.6 (max 0.8, min 0.4), restart.time 2m, catch-up 5m.
FLINK_EXAMPLE = FlinkConfig(
    stabilization_seconds=60.0,
    metrics_window_seconds=300.0,
    target_utilization=0.6,
    utilization_boundary=0.2,
    restart_seconds=120.0,
    catch_up_seconds=300.0,
)


def flink_example(trace: Trace, s: Settings) -> Plan:
    return Plan(
        f"Flink, docs' example settings (restart {s.flink_restart_seconds:g} s)",
        trace.job.initial_parallelism,
        FlinkAutoscaler(FLINK_EXAMPLE),
        s.flink_restart_seconds,
    )


POLICIES: dict[str, Callable[[Trace, Settings], Plan]] = {
    "fixed-peak": fixed_peak,
    "fixed-average": fixed_average,
    "keyscale-reactive": keyscale_reactive,
    "keyscale-slo": keyscale_slo,
    "flink": flink,
    "flink-example": flink_example,
}
"""Policies by name: (trace, settings) -> how it runs."""

DEFAULT_POLICIES = ("fixed-peak", "fixed-average", "keyscale-reactive", "keyscale-slo", "flink")


def run(trace: Trace, plan: Plan) -> SimulationResult:
    started = replace(trace, job=replace(trace.job, initial_parallelism=plan.initial_parallelism))
    if plan.policy is None:
        return simulate(started, mode="off")
    return simulate(started, policy=plan.policy, rescale_seconds=plan.rescale_seconds)


def bound(trace: Trace, ceiling: float, margin: float = 1.0, against: Trace | None = None) -> float:
    """Core-seconds against fixed at peak of a policy that knows the trace in advance and
    rescales for free at every point of it (every 5 s): the smallest parallelism dividing
    the key groups that carries ``margin`` x the rate at ``ceiling`` busy. No policy that
    keeps its batches at most ``ceiling`` busy spends less; ``margin`` is the noise a policy
    that cannot foresee each draw must hold room for; ``against``: the trace whose fixed at
    peak it is measured against (``trace`` itself by default).

    >>> from keyscale.scaling.shapes import ramp
    >>> round(bound(ramp(), 1.0), 3)
    0.513
    """
    pts = trace.points
    ends = [p.time for p in pts[1:]] + [trace.duration_seconds]
    used = sum(sized_for(trace, p.input_rate * margin * SIZING_UTILIZATION / ceiling) * (end - p.time)
               for p, end in zip(pts, ends, strict=True))  # fmt: skip
    ref = trace if against is None else against
    return used / (sized_for(ref, peak_rate(ref)) * ref.duration_seconds)


def bounds_table(traces: list[str]) -> str:
    """Per trace, :func:`bound` at 90 % busy (the ceiling a 10 s latency SLO leaves a 5 s
    trigger at 95 % of the target, keyscale.scaling.room) and at 100 %; and, for a trace with
    noise, at 90 % for its noise-free shape times ``1 + noise``: what a policy that knows the
    shape but not each draw must hold."""
    lines = ["| trace | lowest core-seconds at 90 % busy, every draw foreseen | at 100 % busy | "
             "at 90 % busy, the shape foreseen, room for its noise |", "|---|---:|---:|---:|"]  # fmt: skip
    for name in traces:
        fn = SHAPES[name]
        noise = inspect.signature(fn).parameters.get("noise")
        shaped = "-" if noise is None else f"{bound(fn(noise=0.0), 0.9, 1 + noise.default, fn()):.1%}"
        lines.append(f"| {name} | {bound(fn(), 0.9):.1%} | {bound(fn(), 1.0):.1%} | {shaped} |")
    return "\n".join(lines)


def jump_minute(trace: Trace, before: int, slo: float) -> str:
    """One table row: the SLO policy held at ``before`` subtasks until ``trace``'s first load
    change (``min_parallelism``), then free to scale: that change's first batch, and how many
    of the records committed in its minute were over ``slo``."""
    at = trace.load_changes()[0][0]
    policy = Autoscaler(AutoscalerConfig(min_parallelism=before), slo=parse_slo(f"latency={slo:g}s"))
    result = run(trace, Plan("", before, policy))
    minute = int(at // 60)
    total = over = 0
    for b in result.batches:
        lat = b.metrics.latency
        if lat is not None and int((b.metrics.time + b.metrics.batch_seconds) // 60) == minute:
            total += lat.records
            over += sum(n for k, n in lat.buckets.items() if representative(k) > slo)
    first = next(b.metrics for b in result.batches if b.metrics.time > at)
    p99 = f", p99 {first.latency.p99_seconds:.1f} s" if first.latency else ""
    return (f"| {trace.name} | {before} | {first.input_records:,} in {first.batch_seconds:.2f} s{p99} "
            f"| {over:,} of {total:,} ({over / total:.1%}) | {minute_p99(result)[minute]:.1f} s |")


def minute_p99(result: SimulationResult) -> list[float | None]:
    """Per minute of the trace, the p99 latency of the records committed in it (``None``:
    no commit in that minute)."""
    minutes = math.ceil(result.trace.duration_seconds / 60)
    by_minute: list[list[Any]] = [[] for _ in range(minutes)]
    for b in result.batches:
        m = b.metrics
        committed = m.time + m.batch_seconds
        i = int(committed // 60)
        if m.latency is not None and i < minutes:
            by_minute[i].append(m.latency)
    return [window_quantile(lat, 0.99) if lat else None for lat in by_minute]


def records_lost(result: SimulationResult) -> float:
    """Arrived, minus processed, minus unread at the end (the first batch reads one
    trigger interval before t=0)."""
    last = result.batches[-1]
    job = result.trace.job
    arrived = result.trace.arrivals(-job.trigger_interval_seconds, last.metrics.time)
    processed = sum(b.metrics.input_records for b in result.batches)
    return arrived - processed - last.unread_records


@dataclass(frozen=True)
class Figures:
    trace: str
    policy: str
    label: str
    minutes: int
    minutes_within_slo: int
    pct_minutes_within_slo: float
    core_seconds: float
    core_seconds_vs_peak: float
    rescales: int
    rescales_per_hour: float
    worst_latency_seconds: float
    worst_minute_p99_seconds: float
    batches_over_slo: int
    records_lost: float
    downtime_seconds: float


def figures(name: str, plan: Plan, result: SimulationResult, peak_core_seconds: float, slo: float) -> Figures:
    per_minute = minute_p99(result)
    ok = sum(1 for v in per_minute if v is not None and v <= slo)
    hours = result.trace.duration_seconds / 3600
    worst = max((b.metrics.latency.max_seconds for b in result.batches if b.metrics.latency), default=0.0)
    return Figures(
        trace=result.trace.name,
        policy=name,
        label=plan.label,
        minutes=len(per_minute),
        minutes_within_slo=ok,
        pct_minutes_within_slo=100.0 * ok / len(per_minute),
        core_seconds=result.core_seconds,
        core_seconds_vs_peak=result.core_seconds / peak_core_seconds,
        rescales=len(result.changes),
        rescales_per_hour=len(result.changes) / hours,
        worst_latency_seconds=worst,
        worst_minute_p99_seconds=max((v for v in per_minute if v is not None), default=math.inf),
        batches_over_slo=sum(1 for b in result.batches if b.metrics.latency and b.metrics.latency.p99_seconds > slo),
        records_lost=round(records_lost(result), 3) + 0.0,  # + 0.0: no "-0" in the table
        downtime_seconds=result.downtime_seconds,
    )


def bench_trace(trace: Trace, names: list[str], s: Settings) -> tuple[list[Figures], dict[str, SimulationResult]]:
    plans = {n: POLICIES[n](trace, s) for n in names}
    results = {n: run(trace, plans[n]) for n in names}
    peak = results["fixed-peak"] if "fixed-peak" in results else run(trace, fixed_peak(trace, s))
    rows = [figures(n, plans[n], results[n], peak.core_seconds, s.slo_seconds) for n in names]
    return rows, results


def table(rows: list[Figures], slo: float) -> str:
    head = (
        f"| trace | policy | minutes within the {slo:g} s SLO | core-seconds vs fixed at peak "
        "| rescales per hour | worst latency | worst minute's p99 | batches over the SLO | records lost |"
    )
    lines = [head, "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r.trace} | {r.label} | {r.pct_minutes_within_slo:.1f}% ({r.minutes_within_slo}/{r.minutes}) "
            f"| {r.core_seconds_vs_peak:.0%} | {r.rescales_per_hour:.1f} ({r.rescales}) "
            f"| {r.worst_latency_seconds:,.1f} s | {r.worst_minute_p99_seconds:,.1f} s | {r.batches_over_slo} "
            f"| {round(r.records_lost):d} |"
        )
    return "\n".join(lines)


#: Colour and line style per policy (dashed where a line may lie on another's).
STYLES = {"fixed-peak": ("tab:gray", ":"), "fixed-average": ("tab:brown", ":"), "keyscale-reactive": ("tab:blue", "-"),
          "keyscale-slo": ("tab:green", "--"), "flink": ("tab:red", "-"), "flink-example": ("tab:orange", "-")}  # fmt: skip


def plot(trace: Trace, results: dict[str, SimulationResult], labels: dict[str, str], slo: float, path: Path) -> Path:
    """Input rate, parallelism and per-minute p99 latency of every policy, one PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 9), layout="constrained")
    FigureCanvasAgg(fig)
    ax_rate, ax_p, ax_lat = fig.subplots(3, 1, sharex=True, height_ratios=[2, 2, 3])
    hours = trace.duration_seconds >= 4 * 3600
    unit, scale = ("h", 3600.0) if hours else ("min", 60.0)
    t = [p.time / scale for p in trace.points] + [trace.duration_seconds / scale]
    r = [p.input_rate for p in trace.points] + [trace.points[-1].input_rate]
    ax_rate.step(t, r, where="post", color="black", lw=0.8)
    ax_rate.set_ylabel("input (records/s)")
    ax_rate.set_title(f"{trace.name}: {trace.description}")
    for name, res in results.items():
        color, ls = STYLES.get(name, (None, "-"))
        ax_p.step([x / scale for x in res.times], res.parallelism, where="post", color=color, ls=ls, label=labels[name], lw=1.2)
        per_minute = minute_p99(res)
        xs = [(i + 0.5) * 60 / scale for i, v in enumerate(per_minute) if v is not None]
        ys = [v for v in per_minute if v is not None]
        ax_lat.plot(xs, ys, color=color, ls=ls, lw=1.0, label=labels[name])
    ax_p.set_ylabel("parallelism")
    ax_p.set_ylim(bottom=0)
    ax_p.legend(loc="upper left", fontsize=8)
    ax_lat.axhline(slo, color="black", ls="--", lw=0.8, label=f"SLO {slo:g} s")
    ax_lat.set_yscale("log")
    ax_lat.set_ylabel("p99 latency per minute (s)")
    ax_lat.set_xlabel(f"time ({unit})")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=80)
    return path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--real" in argv:
        sys.path.insert(0, str(HERE))
        import autoscale_real

        return autoscale_real.main([a for a in argv if a != "--real"])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", default=",".join(SHAPES), help=f"comma-separated, of: {', '.join(SHAPES)}")
    ap.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                    help=f"comma-separated, of: {', '.join(POLICIES)} (default: all but flink-example)")  # fmt: skip
    ap.add_argument("--slo", type=float, default=SLO_SECONDS, help="latency SLO in seconds (p99 per minute)")
    ap.add_argument("--flink-restart-seconds", type=float, default=FLINK_RESTART_SECONDS,
                    help="downtime of each of the Flink policy's rescales")  # fmt: skip
    ap.add_argument("--png-dir", type=Path, default=ROOT / "docs" / "img", help="where the plots go")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--out", type=Path, default=HERE / "out" / "autoscale.json")
    ap.add_argument("--real", action="store_true", help="one short trace through the real job on a local cluster "
                    "(bench/autoscale_real.py; see --real --help)")
    args = ap.parse_args(argv)
    traces = [t for t in args.traces.split(",") if t]
    names = [p for p in args.policies.split(",") if p]
    for bad in [t for t in traces if t not in SHAPES] + [p for p in names if p not in POLICIES]:
        ap.error(f"unknown trace or policy {bad!r}")
    s = Settings(args.slo, args.flink_restart_seconds)
    rows: list[Figures] = []
    for tname in traces:
        trace = SHAPES[tname]()
        got, results = bench_trace(trace, names, s)
        rows += got
        if not args.no_plots:
            labels = {r.policy: r.label for r in got}
            out = plot(trace, results, labels, s.slo_seconds, args.png_dir / f"autoscale_{tname}.png")
            print(f"plot: {out}", file=sys.stderr)
    print(table(rows, s.slo_seconds))
    print("\nLower bounds (bench/autoscale.py bound()):\n" + bounds_table(traces))
    jumps = [(t, p) for t, ps in (("spike_10x", (4, 16, 32)), ("step", (4, 8, 16))) if t in traces for p in ps]
    print(f"\nThe minute of a jump, by the parallelism before it (jump_minute()):\n| trace | parallelism before "
          f"the jump | its first batch | records of the minute over {s.slo_seconds:g} s | minute's p99 |\n"
          "|---|---:|---|---:|---:|\n" + "\n".join(jump_minute(SHAPES[t](), p, s.slo_seconds) for t, p in jumps))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"settings": asdict(s), "rows": [asdict(r) for r in rows]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
