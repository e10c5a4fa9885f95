"""Replay a load trace through the autoscaler policy, without Spark.

:func:`simulate` runs a :class:`~keyscale.scaling.traces.SimulatedJob` on a
:class:`~keyscale.scaling.traces.Trace` batch by batch, feeds every batch's
metrics to an :class:`~keyscale.scaling.policy.Autoscaler`, and (in active mode)
applies its decisions before the next batch. A few hundred batches take a few
milliseconds.

>>> from keyscale.scaling.traces import step_up
>>> result = simulate(step_up(low=2400, high=20000, at=120, duration=600))
>>> [(d.action, d.current_parallelism, d.target_parallelism) for d in result.changes]
[('scale_up', 4, 32)]
>>> result.parallelism[-1], result.reversals
(32, 0)

``keyscale autoscaler simulate TRACE [--png PATH] [--mode recommend|active]``
is :func:`add_simulate_parser` / :func:`main`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from keyscale.errors import KeyscaleError
from keyscale.scaling.policy import Autoscaler, AutoscalerConfig, BatchMetrics, Decision, Mode
from keyscale.scaling.traces import SimulatedBatch, Trace, load_trace

__all__ = [
    "LoadChange",
    "Policy",
    "SimulationResult",
    "add_simulate_parser",
    "format_decisions",
    "main",
    "plot",
    "simulate",
]


class Policy(Protocol):
    """What :func:`simulate` feeds batches to: :class:`Autoscaler`, or another policy
    (``keyscale.scaling.flink.FlinkAutoscaler``) with the same call."""

    def observe(self, m: BatchMetrics) -> Decision:
        """Take one batch's metrics into account and decide."""
        ...


@dataclass(frozen=True)
class LoadChange:
    """A change of the input rate and how long the job took to catch up after it.

    ``drain_seconds`` runs from the change to the end of the first batch that
    read everything available and finished within its trigger interval;
    ``None`` if that never happened before the end of the trace.
    """

    time: float
    from_rate: float
    to_rate: float
    drain_seconds: float | None


@dataclass(frozen=True)
class SimulationResult:
    """Everything a simulation produced; the series have one entry per batch.

    Attributes:
        trace, config, mode: what was simulated.
        batches: each batch's metrics and ground truth.
        decisions: the policy's decision for every batch (empty in mode ``off``).
        times: batch start times (s).
        load: true input rate during the interval each batch read (rec/s).
        capacity: records/s the job sustains at the batch's parallelism.
        parallelism: subtasks each batch ran with.
        backlog: records arrived but not processed when each batch started.
        reversals: scaling decisions whose direction differs from the previous one.
        core_seconds: sum of parallelism x time (one core per subtask), including the
            downtime of restarts (at the new parallelism).
        downtime_seconds: time the job was down for rescales (``rescale_seconds`` each).
        load_changes: rate changes of the trace with the time to drain after each.
    """

    trace: Trace
    config: AutoscalerConfig
    mode: Mode
    batches: tuple[SimulatedBatch, ...]
    decisions: tuple[Decision, ...]
    times: tuple[float, ...]
    load: tuple[float, ...]
    capacity: tuple[float, ...]
    parallelism: tuple[int, ...]
    backlog: tuple[float, ...]
    reversals: int
    core_seconds: float
    load_changes: tuple[LoadChange, ...]
    downtime_seconds: float = 0.0

    @property
    def changes(self) -> tuple[Decision, ...]:
        """Decisions that asked for another parallelism."""
        return tuple(d for d in self.decisions if d.changes)

    @property
    def max_backlog(self) -> float:
        """Largest backlog at any batch start."""
        return max(self.backlog, default=0.0)

    @property
    def worst_p99_seconds(self) -> float:
        """Highest p99 end-to-end latency of any batch (0 when none read a record)."""
        lat = [b.metrics.latency.p99_seconds for b in self.batches if b.metrics.latency]
        return max(lat, default=0.0)


def simulate(
    trace: Trace,
    config: AutoscalerConfig | None = None,
    mode: Mode = "active",
    *,
    policy: Policy | None = None,
    rescale_seconds: float = 0.0,
) -> SimulationResult:
    """Run ``trace`` through the policy.

    ``config`` defaults to the trace's own ``autoscaler`` settings, else to
    :class:`AutoscalerConfig` defaults. ``mode``: ``"active"`` applies decisions
    before the next batch, ``"recommend"`` records them only, ``"off"`` runs the
    job at its initial parallelism without a policy.

    ``policy`` replaces the :class:`Autoscaler` built from ``config`` (``config`` is then
    only recorded). ``rescale_seconds``: downtime an applied rescale costs (a
    restart-based rescale: no batch runs meanwhile, records keep arriving); 0 is a live
    rescale between two batches.

    >>> from keyscale.scaling.traces import step_up
    >>> r = simulate(step_up(), rescale_seconds=20.0)
    >>> r.downtime_seconds, r.max_backlog > simulate(step_up()).max_backlog
    (20.0, True)

    >>> from keyscale.scaling.traces import steady
    >>> r = simulate(steady(rate=2400, duration=300), mode="recommend")
    >>> len(r.decisions) == len(r.times), set(r.parallelism)
    (True, {4})
    """
    if mode not in ("off", "recommend", "active"):
        raise ValueError(f"mode must be off, recommend or active, got {mode!r}")
    if not (rescale_seconds >= 0 and rescale_seconds < float("inf")):
        raise ValueError(f"rescale_seconds must be a number >= 0, got {rescale_seconds}")
    cfg = config if config is not None else trace.autoscaler or AutoscalerConfig()
    scaler: Policy = policy if policy is not None else Autoscaler(cfg)
    run = trace.job.start(trace)
    p = trace.job.initial_parallelism
    batches: list[SimulatedBatch] = []
    decisions: list[Decision] = []
    core_seconds = 0.0
    downtime = 0.0
    while run.now < trace.duration_seconds:
        batch = run.run_batch(p)
        batches.append(batch)
        core_seconds += p * min(batch.period, trace.duration_seconds - batch.metrics.time)
        if mode == "off":
            continue
        decision = scaler.observe(batch.metrics)
        decisions.append(decision)
        if mode == "active" and decision.changes:
            p = decision.target_parallelism
            if rescale_seconds > 0:
                pause = min(rescale_seconds, max(0.0, trace.duration_seconds - run.now))
                run.pause(rescale_seconds)
                downtime += pause
                core_seconds += p * pause

    return SimulationResult(
        trace=trace,
        config=cfg,
        mode=mode,
        batches=tuple(batches),
        decisions=tuple(decisions),
        times=tuple(b.metrics.time for b in batches),
        load=tuple(b.input_rate for b in batches),
        capacity=tuple(b.capacity_rps for b in batches),
        parallelism=tuple(b.metrics.parallelism for b in batches),
        backlog=tuple(b.pending_records for b in batches),
        reversals=_reversals(decisions),
        core_seconds=core_seconds,
        load_changes=_drains(trace, batches),
        downtime_seconds=downtime,
    )


def _reversals(decisions: list[Decision]) -> int:
    """How often an applied decision went the other way from the one before (up after down)."""
    reversals, last_action = 0, None
    for d in decisions:
        if d.changes:
            if last_action is not None and d.action != last_action:
                reversals += 1
            last_action = d.action
    return reversals


def _drains(trace: Trace, batches: list[SimulatedBatch]) -> tuple[LoadChange, ...]:
    """Each change of the trace's load, with how long after it the job had caught up."""
    changes = []
    for time, before, after in trace.load_changes():
        drain = next((b.metrics.time + b.metrics.batch_seconds - time for b in batches if b.metrics.time > time and b.caught_up), None)
        changes.append(LoadChange(time, before, after, drain))
    return tuple(changes)


def format_decisions(result: SimulationResult, *, all_decisions: bool = False) -> str:
    """A readable report: a summary, then one row (and its reason) per scaling decision.

    >>> from keyscale.scaling.traces import step_up
    >>> print(format_decisions(simulate(step_up())).splitlines()[0])
    trace step_up: 2,400 rec/s, 20,000 rec/s from t=120 s
    """
    tr = result.trace
    lines = [
        f"trace {tr.name}: {tr.description}" if tr.description else f"trace {tr.name}",
        (
            f"mode {result.mode}; {len(result.times)} batches over {tr.duration_seconds:g} s; "
            f"parallelism {result.parallelism[0] if result.parallelism else '-'} -> "
            f"{result.parallelism[-1] if result.parallelism else '-'} "
            f"(max {max(result.parallelism, default=0)}); "
            f"{len(result.changes)} scaling decisions, {result.reversals} reversals; "
            f"{result.core_seconds:,.0f} core-seconds; max backlog {result.max_backlog:,.0f} records; "
            f"worst batch p99 latency {result.worst_p99_seconds:,.1f} s"
        ),
    ]
    for change in result.load_changes:
        drained = (
            f"drained in {change.drain_seconds:.0f} s"
            if change.drain_seconds is not None
            else "not drained by the end"
        )
        lines.append(
            f"load change at {change.time:g} s: {change.from_rate:,.0f} -> "
            f"{change.to_rate:,.0f} rec/s, {drained}"
        )
    shown = result.decisions if all_decisions else result.changes
    lines.append("")
    if not shown:
        lines.append("no scaling decisions" if result.mode != "off" else "autoscaler off")
        return "\n".join(lines)
    header = f"{'time':>8}  {'action':<10}  {'from':>4}  {'to':>4}  {'util':>5}  {'input/s':>9}  {'backlog':>10}  {'target/s':>9}"
    lines += [header, "-" * len(header)]
    for d in shown:
        inp = d.inputs

        def num(key: str, fmt: str, width: int, inputs: dict[str, float] = inp) -> str:
            return format(inputs[key], fmt).rjust(width) if key in inputs else "-".rjust(width)

        lines.append(
            f"{d.time:>8.1f}  {d.action:<10}  {d.current_parallelism:>4}  "
            f"{d.target_parallelism:>4}  {num('utilization', '.2f', 5)}  "
            f"{num('input_rate', ',.0f', 9)}  {num('backlog', ',.0f', 10)}  "
            f"{num('target_rate', ',.0f', 9)}"
        )
        lines.append(f"{'':>10}{d.reason}")
    return "\n".join(lines)


def plot(result: SimulationResult, png_path: str | Path) -> Path:
    """Write a PNG of load, capacity, parallelism, backlog and each batch's p99 latency.

    Uses matplotlib's Agg canvas directly (no pyplot, no global backend change).

    >>> import tempfile, os
    >>> from keyscale.scaling.traces import spike
    >>> with tempfile.TemporaryDirectory() as d:
    ...     out = plot(simulate(spike(duration=200)), os.path.join(d, "s.png"))
    ...     out.stat().st_size > 1000
    True
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:  # pragma: no cover - matplotlib is in the plot extra
        raise KeyscaleError("plotting needs matplotlib: pip install 'keyscale[plot]'") from err

    path = Path(png_path)
    fig = Figure(figsize=(10, 10), layout="constrained")
    FigureCanvasAgg(fig)
    ax_rate, ax_p, ax_backlog, ax_latency = fig.subplots(
        4, 1, sharex=True, height_ratios=[3, 2, 2, 2]
    )
    t = list(result.times)
    trace = result.trace
    end = max(trace.duration_seconds, t[-1] if t else 0.0)
    load_t = [0.0, *(p.time for p in trace.points if 0 < p.time < end), end]
    load_r = [trace.rate_at(x) for x in load_t]
    ax_rate.step(load_t, load_r, where="post", label="input rate", color="tab:blue")
    ax_rate.step(t, result.capacity, where="post", label="capacity", color="tab:green")
    ax_rate.set_ylabel("records/s")
    ax_rate.legend(loc="upper right")
    ax_rate.set_title(
        f"{result.trace.name} ({result.mode}): {len(result.changes)} decisions, "
        f"{result.reversals} reversals, {result.core_seconds:,.0f} core-seconds"
    )
    ax_p.step(t, result.parallelism, where="post", color="tab:orange", label="parallelism")
    for d in result.changes:
        ax_p.annotate(
            f"{d.target_parallelism}",
            (d.time, d.target_parallelism),
            textcoords="offset points",
            xytext=(3, 3),
            fontsize=8,
        )
        ax_p.axvline(
            d.time, color="tab:red" if d.action == "scale_up" else "tab:purple", alpha=0.3, lw=1
        )
    ax_p.set_ylabel("parallelism")
    ax_p.set_ylim(bottom=0)
    ax_backlog.fill_between(t, result.backlog, step="post", color="tab:gray", alpha=0.5)
    ax_backlog.set_ylabel("unprocessed records")
    latencies = [
        (b.metrics.time + b.metrics.batch_seconds, b.metrics.latency.p99_seconds)
        for b in result.batches
        if b.metrics.latency is not None
    ]
    ax_latency.plot([x for x, _ in latencies], [y for _, y in latencies], color="tab:red", lw=1)
    ax_latency.set_ylabel("p99 latency (s)")
    ax_latency.set_ylim(bottom=0)
    ax_latency.set_xlabel("time (s)")
    try:
        fig.savefig(path, format="png", dpi=100)
    except OSError as err:
        raise KeyscaleError(f"cannot write PNG {path}: {err.strerror or err}") from err
    return path


def _configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", metavar="TRACE", help="trace JSON file (see examples/traces/)")
    parser.add_argument("--png", metavar="PATH", help="write a plot of the run to PATH")
    parser.add_argument(
        "--mode",
        choices=("recommend", "active"),
        default="active",
        help="active applies decisions; recommend only records them (default: active)",
    )
    parser.add_argument(
        "--all", action="store_true", help="list every batch's decision, not only changes"
    )
    parser.add_argument(
        "--slo",
        metavar="KIND=DURATION",
        help="size for this SLO, as keyscale run --slo does: 'latency=10s' or 'lag=30s'",
    )
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    """Handler: simulate, print the decisions, plot; raises :class:`KeyscaleError`."""
    trace = load_trace(args.trace)
    policy = None
    if args.slo is not None:
        from keyscale.scaling.slo import parse_slo

        policy = Autoscaler(trace.autoscaler or AutoscalerConfig(), slo=parse_slo(args.slo))
    result = simulate(trace, mode=args.mode, policy=policy)
    print(format_decisions(result, all_decisions=args.all))
    if args.png:
        out = plot(result, args.png)
        print(f"\nplot written to {out}")
    return 0


def add_simulate_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add ``simulate`` to ``subparsers`` (of ``keyscale autoscaler``).

    The handler is set as ``func``: it returns an exit code and raises
    :class:`KeyscaleError` for a bad trace file (the CLI prints it as one line
    and exits with its code, 2).

    >>> parser = argparse.ArgumentParser(prog="keyscale autoscaler")
    >>> _ = add_simulate_parser(parser.add_subparsers(dest="command"))
    >>> args = parser.parse_args(["simulate", "t.json", "--mode", "recommend"])
    >>> args.trace, args.mode, args.png
    ('t.json', 'recommend', None)
    """
    parser = subparsers.add_parser(
        "simulate",
        help="replay a load trace through the autoscaler policy",
        description=(
            "Replay a load trace through the autoscaler policy (no Spark): print the "
            "decisions and optionally plot load, capacity and parallelism."
        ),
    )
    _configure(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``keyscale autoscaler simulate`` on its own: ``TRACE [--png PATH] [--mode ...]``.

    Returns the exit code: 0, or 2 with a one-line message on stderr for a bad trace.
    """
    parser = argparse.ArgumentParser(
        prog="keyscale autoscaler simulate",
        description="Replay a load trace through the autoscaler policy (no Spark).",
    )
    _configure(parser)
    args = parser.parse_args(argv)
    try:
        code: int = args.func(args)
    except KeyscaleError as err:
        print(f"keyscale: error: {err}", file=sys.stderr)
        return err.exit_code
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
