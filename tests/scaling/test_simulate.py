"""The simulation harness: synthetic traces with asserted decisions, plot, CLI."""

from __future__ import annotations

import argparse
import itertools
import json
import math
import re
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keyscale.errors import KeyscaleError
from keyscale.scaling.policy import Autoscaler, AutoscalerConfig, BatchMetrics, Decision
from keyscale.scaling.simulate import (
    SimulationResult,
    add_simulate_parser,
    format_decisions,
    main,
    plot,
    simulate,
)
from keyscale.scaling.traces import (
    GENERATORS,
    SimulatedJob,
    Trace,
    TracePoint,
    default_job,
    load_trace,
    save_trace,
    sawtooth,
    skewed_key_groups,
    spike,
    steady,
    step_down,
    step_up,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "traces"
CFG = AutoscalerConfig()  # defaults: 0.7 +/- 0.2, 30 s stabilisation, 120 s delay


def p_at(result: SimulationResult, t: float) -> int:
    """Parallelism of the batch running at time ``t``."""
    p = result.parallelism[0]
    for start, par in zip(result.times, result.parallelism, strict=True):
        if start > t:
            break
        p = par
    return p


def assert_common_invariants(
    result: SimulationResult, *, reversals_per_change: bool = True
) -> None:
    m = result.trace.job.max_parallelism
    lo, hi = result.config.bounds(m)
    changes = result.changes
    for d in changes:
        assert lo <= d.target_parallelism <= hi
        if result.config.align_to_key_groups and result.config.max_parallelism is None:
            assert m % d.target_parallelism == 0
    for a, b in itertools.pairwise(changes):
        assert b.time - a.time >= result.config.stabilization_seconds
    if reversals_per_change:  # at most one reversal per load change
        assert result.reversals <= max(1, len(result.load_changes))


# --- each trace, with asserted decisions ---------------------------------------------


def test_steady_makes_no_change() -> None:
    result = simulate(steady(rate=2400, noise=0.1, seed=3), CFG)
    assert result.changes == ()
    assert set(result.parallelism) == {4}
    assert all(d.action == "none" for d in result.decisions)


class _GcBlind:
    """The policy, with the subtasks' GC pauses counted as work (as before they were reported)."""

    def __init__(self, config: AutoscalerConfig) -> None:
        self.scaler = Autoscaler(config)

    def observe(self, m: BatchMetrics) -> Decision:
        return self.scaler.observe(replace(m, gc_seconds=()))


def test_gc_pressure_alone_makes_no_scale_up() -> None:
    # 1,600 rec/s on 4 subtasks of 1,000 rec/s: 2 s of work per 5 s batch, plus 2.8 s of
    # GC pauses (a worker under memory pressure): each subtask is about 96% busy.
    trace = steady(rate=1600, noise=0.1, seed=3, job=default_job(gc_pause_seconds=2.8))
    result = simulate(trace, CFG)
    assert result.changes == () and set(result.parallelism) == {4}
    measured = [d for d in result.decisions if "true_rate_per_subtask" in d.inputs]
    assert measured and all(d.inputs["true_rate_per_subtask"] == pytest.approx(1000.0, rel=0.01) for d in measured)
    assert all(d.inputs["busy_ratio"] > 0.85 for d in measured)  # busy, but not with records
    assert all(re.search(r"\(net of garbage-collector pauses: 5\d% of the busy time, not counted as work\)", d.reason) for d in measured)
    # The same batches with the pauses read as work: rate 417 rec/s per subtask, utilisation
    # above 0.9, and a scale-up that buys nothing the pauses would not take again.
    blind = simulate(trace, CFG, policy=_GcBlind(CFG))
    assert [d.action for d in blind.changes][:1] == ["scale_up"]


def test_steady_from_a_bad_start_settles_and_stays() -> None:
    trace = steady(rate=2400, duration=900, job=default_job(initial_parallelism=64), noise=0.1)
    result = simulate(trace, CFG)
    # down in at most two steps (the 8x step limit), each after the delay
    assert [d.action for d in result.changes] == ["scale_down", "scale_down"]
    assert result.changes[0].time >= CFG.stabilization_seconds + CFG.scale_down_delay_seconds
    assert result.changes[0].target_parallelism == 64 // 8
    settle = result.changes[-1]
    assert settle.target_parallelism == 4
    assert all(
        p == 4 for t, p in zip(result.times, result.parallelism, strict=True) if t > settle.time
    )
    assert_common_invariants(result)


def test_step_up_scales_up_fast_covers_the_load_and_drains() -> None:
    trace = step_up(low=2400, high=20_000, at=120, duration=600)
    result = simulate(trace, CFG)
    ups = [d for d in result.changes if d.action == "scale_up"]
    assert ups, format_decisions(result)
    first = ups[0]
    batches_after_step = [t for t in result.times if 120 < t <= first.time]
    assert len(batches_after_step) <= 2  # decided at the end of the first overloaded batch
    final_p = result.parallelism[-1]
    assert trace.job.capacity_rps(final_p) * CFG.scale_up_threshold >= 20_000
    assert [d.action for d in result.changes] == ["scale_up"]  # no flapping afterwards
    (change,) = result.load_changes
    assert change.drain_seconds is not None and change.drain_seconds < 90
    assert result.backlog[-1] <= 20_000 * trace.job.trigger_interval_seconds + 1
    assert_common_invariants(result)


def test_step_up_under_a_read_limit_that_scales_with_parallelism() -> None:
    # Each subtask reads at most 10,000 records a batch (two trigger intervals of its
    # processing): the first overloaded batch reads 40,000 of the 100,000 that arrived, so
    # it sees only part of the step, but the step is not hidden: the backlog is there, the
    # subtasks are busy, and more subtasks read more.
    trace = step_up(low=2400, high=20_000, at=120, duration=600, job=default_job(max_records_per_subtask=10_000))
    result = simulate(trace, CFG)
    first = result.changes[0]
    assert first.action == "scale_up", format_decisions(result)
    overloaded = next(b.metrics for b in result.batches if b.metrics.time > 120)
    assert overloaded.input_records == 40_000 and overloaded.backlog_records == 60_000
    assert first.time == overloaded.time + overloaded.batch_seconds  # decided at its end
    assert {d.action for d in result.changes} == {"scale_up"} and result.reversals == 0
    assert not any("maxOffsetsPerTrigger" in d.reason for d in result.decisions)  # never "not the limit"
    final_p = result.parallelism[-1]
    assert trace.job.capacity_rps(final_p) * CFG.scale_up_threshold >= 20_000
    (change,) = result.load_changes
    assert change.drain_seconds is not None and change.drain_seconds < 90
    assert_common_invariants(result)


def test_a_read_limit_that_does_not_scale_is_seen_but_not_scaled_past() -> None:
    # The same 40,000 records a batch at P=4, but fixed (maxOffsetsPerTrigger): the batches
    # read 8,000 rec/s, the source's backlog grows by the rest, so the policy sees the whole
    # 20,000 rec/s and scales up, but the subtasks then idle, the busy guard declines to go
    # further, and the backlog is never worked off: more subtasks cannot lift that limit.
    trace = step_up(low=2400, high=20_000, at=120, duration=600, job=default_job(max_records_per_batch=40_000))
    result = simulate(trace, CFG)
    assert result.changes and all(d.action == "scale_up" for d in result.changes)
    assert all(d.inputs["input_rate"] == pytest.approx(20_000) for d in result.changes)  # reads + backlog growth
    assert "maxOffsetsPerTrigger" in result.decisions[-1].reason
    assert result.load_changes[0].drain_seconds is None
    assert result.capacity[-1] == pytest.approx(40_000 / trace.job.trigger_interval_seconds)


def test_step_up_uses_far_fewer_core_seconds_than_fixed_max() -> None:
    trace = step_up(low=2400, high=20_000, at=120, duration=600)
    auto = simulate(trace, CFG)
    fixed_max = simulate(replace(trace, job=default_job(initial_parallelism=128)), mode="off")
    assert auto.core_seconds <= 0.6 * fixed_max.core_seconds


def test_step_down_waits_for_the_delay() -> None:
    trace = step_down(high=20_000, low=2400, at=120, duration=600)
    result = simulate(trace, CFG)
    downs = [d for d in result.changes if d.action == "scale_down"]
    assert [d.action for d in result.changes] == ["scale_down"]
    assert downs[0].time >= 120 + CFG.scale_down_delay_seconds
    assert p_at(result, 120 + CFG.scale_down_delay_seconds) == 32  # still up during the delay
    assert result.parallelism[-1] == 4
    assert trace.job.capacity_rps(4) * CFG.scale_up_threshold >= 2400
    assert_common_invariants(result)


def test_spike_shorter_than_delay_scales_up_once_and_does_not_flap() -> None:
    trace = spike(base=2400, peak=16_000, start=120, length=60, duration=600)
    result = simulate(trace, CFG)
    actions = [d.action for d in result.changes]
    assert actions == ["scale_up", "scale_down"], format_decisions(result)
    up, down = result.changes
    assert 120 < up.time < 180
    assert down.time >= 180 + CFG.scale_down_delay_seconds
    assert result.reversals == 1  # two load changes
    assert all(c.drain_seconds is not None for c in result.load_changes)
    assert_common_invariants(result)


def test_sawtooth_faster_than_delay_never_reverses() -> None:
    result = simulate(sawtooth(low=2400, high=10_000, period=120, duration=900), CFG)
    assert result.reversals == 0
    assert all(d.action == "scale_up" for d in result.changes)
    peak_p = result.parallelism[-1]
    assert default_job().capacity_rps(peak_p) >= 10_000  # sized for the peak
    assert_common_invariants(result)


def test_sawtooth_slower_than_delay_has_bounded_reversals() -> None:
    period = 600.0
    result = simulate(sawtooth(low=2400, high=10_000, period=period, duration=1800), CFG)
    cycles = math.ceil(1800 / period)
    assert result.reversals <= 2 * cycles  # at most one per ramp and one per drop
    assert len(result.changes) <= 2 * cycles + 2
    # (the ramps are gradual, so only the drops count as load changes of the trace)
    assert_common_invariants(result, reversals_per_change=False)


def test_skewed_key_groups_scale_by_the_hot_subtask() -> None:
    trace = skewed_key_groups(rate=2500, skew=3.0)
    result = simulate(trace, CFG)
    (up,) = result.changes
    assert up.action == "scale_up" and up.target_parallelism == 16
    # on average the 8 subtasks were only ~31% busy: a mean-based policy would not scale up
    assert up.inputs["mean_rate_per_subtask"] * 8 * 0.31 < 2500 < up.inputs["capacity"] / 0.9
    assert up.inputs["skew"] == pytest.approx(3.0, rel=0.01)
    # afterwards the hottest subtask is within the band and stays there
    last = result.batches[-1].metrics
    assert max(last.busy_seconds) / last.trigger_interval_seconds <= CFG.scale_up_threshold  # type: ignore[operator]
    assert trace.job.capacity_rps(result.parallelism[-1]) >= 2500


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_recommend_mode_never_changes_parallelism(name: str) -> None:
    trace = GENERATORS[name]()
    result = simulate(trace, CFG, mode="recommend")
    assert set(result.parallelism) == {trace.job.initial_parallelism}
    assert len(result.decisions) == len(result.times)
    if name in ("step_up", "spike", "step_down", "skewed_key_groups"):
        assert result.changes  # recommendations were recorded
    for a, b in zip(result.changes, result.changes[1:], strict=False):
        assert b.time - a.time >= CFG.stabilization_seconds


def test_off_mode_records_nothing() -> None:
    result = simulate(step_up(), CFG, mode="off")
    assert result.decisions == () and set(result.parallelism) == {4}
    with pytest.raises(ValueError):
        simulate(step_up(), CFG, mode="sometimes")  # type: ignore[arg-type]


@pytest.mark.parametrize("m", [120, 128, 360])
def test_alignment_targets_divide_max_parallelism(m: int) -> None:
    for gen in (step_up, step_down, spike, sawtooth):
        trace = gen(
            job=default_job(
                max_parallelism=m, initial_parallelism=4 if gen is not step_down else 30
            )
        )
        result = simulate(trace, CFG)
        assert result.changes
        assert all(m % d.target_parallelism == 0 for d in result.changes)
    unaligned = simulate(
        step_up(), replace(CFG, align_to_key_groups=False, scale_up_max_factor=100)
    )
    assert any(128 % d.target_parallelism for d in unaligned.changes)


def test_bounds_are_respected() -> None:
    capped = simulate(step_up(), replace(CFG, max_parallelism=16))
    assert max(capped.parallelism) == 16
    floored = simulate(step_down(), replace(CFG, min_parallelism=8))
    assert min(floored.parallelism) == 8
    assert_common_invariants(capped)
    assert_common_invariants(floored)


def test_stabilisation_is_respected() -> None:
    cfg = replace(CFG, stabilization_seconds=90, scale_up_max_factor=2.0)
    result = simulate(step_up(), cfg)
    assert len(result.changes) >= 2  # climbs in steps of 2x ...
    for a, b in zip(result.changes, result.changes[1:], strict=False):
        assert b.time - a.time >= 90  # ... at most one per stabilisation period


@settings(max_examples=25, deadline=None)
@given(
    rates=st.lists(st.floats(0, 40_000), min_size=1, max_size=6),
    hold=st.floats(20, 200),
    skew=st.floats(1, 3),
    m=st.sampled_from([60, 120, 128]),
    per_subtask=st.one_of(st.none(), st.integers(1000, 50_000)),
)
def test_random_traces_keep_the_invariants(
    rates: list[float], hold: float, skew: float, m: int, per_subtask: int | None
) -> None:
    points = tuple(TracePoint(i * hold, r) for i, r in enumerate(rates))
    job = default_job(max_parallelism=m, skew=skew, max_records_per_batch=200_000, max_records_per_subtask=per_subtask)
    trace = Trace("random", points, hold * len(rates) + 120, job)
    result = simulate(trace, CFG)
    m_lo, m_hi = CFG.bounds(m)
    assert all(m_lo <= p <= m_hi for p in result.parallelism)
    for a, b in zip(result.changes, result.changes[1:], strict=False):
        assert b.time - a.time >= CFG.stabilization_seconds
    for d in result.changes:
        assert m % d.target_parallelism == 0
        if d.action == "scale_down":
            assert d.time - d.inputs["scale_down_pending_since"] >= CFG.scale_down_delay_seconds


# --- trace files ---------------------------------------------------------------------


def test_example_trace_files_load_and_simulate() -> None:
    files = sorted(EXAMPLES.glob("*.json"))
    names = {f.stem for f in files}
    assert {"steady", "step_up", "step_down", "spike", "sawtooth", "skewed_key_groups"} <= names
    for f in files:
        trace = load_trace(f)
        result = simulate(trace)
        assert result.times, f
        assert_common_invariants(result)


def test_trace_json_round_trip(tmp_path: Path) -> None:
    trace = replace(
        spike(),
        autoscaler=AutoscalerConfig(catch_up_seconds=30, max_parallelism=64),
        job=SimulatedJob(500.0, max_parallelism=60, skew=1.5, max_records_per_batch=10_000,
                         max_records_per_subtask=2_000),
    )
    path = tmp_path / "t.json"
    save_trace(trace, path)
    assert load_trace(path) == trace
    data = json.loads(path.read_text())
    assert data["autoscaler"] == {"catch_up_seconds": 30, "max_parallelism": 64}
    assert simulate(load_trace(path)).config.catch_up_seconds == 30


def test_trace_arrivals_integrate_the_rate() -> None:
    trace = Trace(
        "t", (TracePoint(0, 100), TracePoint(10, 300), TracePoint(20, 0)), 30, default_job()
    )
    assert trace.arrivals(-5, 0) == 500
    assert trace.arrivals(5, 25) == 500 + 3000
    assert trace.arrivals(25, 40) == 0
    assert trace.rate_at(-1) == 100 and trace.rate_at(19.9) == 300


def test_job_model_accumulates_and_drains_backlog() -> None:
    job = default_job(initial_parallelism=2, max_records_per_batch=15_000)
    trace = Trace("t", (TracePoint(0, 4000), TracePoint(10, 1000)), 100, job)
    run = job.start(trace)
    first = run.run_batch(2)  # 20,000 available, reads 15,000 at 2,000 rec/s: 7.5 s
    assert first.metrics.input_records == 15_000
    assert first.metrics.backlog_records == 5000
    assert first.metrics.batch_seconds == pytest.approx(7.5)
    assert not first.caught_up
    second = run.run_batch(8)  # 5,000 + 30,000 arrived in 7.5 s; cap 15,000
    assert second.metrics.time == pytest.approx(7.5)
    assert second.metrics.backlog_records == 20_000
    for _ in range(10):
        last = run.run_batch(8)
    assert last.caught_up and last.metrics.backlog_records == 0


def test_job_model_read_limit_scales_with_parallelism() -> None:
    job = default_job(initial_parallelism=2, max_records_per_subtask=7_500)
    trace = Trace("t", (TracePoint(0, 4000), TracePoint(10, 1000)), 100, job)
    run = job.start(trace)
    first = run.run_batch(2)  # 20,000 available, 2 x 7,500 read
    assert first.metrics.input_records == 15_000 and first.metrics.backlog_records == 5000
    assert first.capacity_rps == pytest.approx(2000)  # processing, not reading, is the bound
    second = run.run_batch(8)  # 5,000 + 30,000 arrived in 7.5 s; 8 x 7,500 may be read
    assert second.metrics.input_records == 35_000 and second.metrics.backlog_records == 0
    assert job.read_limit(8) == 60_000 and job.capacity_rps(8) == pytest.approx(8000)
    capped = default_job(max_records_per_subtask=1000, max_records_per_batch=5000)
    assert capped.read_limit(2) == 2000 and capped.read_limit(16) == 5000
    assert capped.capacity_rps(16) == pytest.approx(1000)  # 5,000 per 5 s trigger
    with pytest.raises(ValueError, match="max_records_per_subtask"):
        default_job(max_records_per_subtask=0)


def test_job_model_skew_makes_one_subtask_hot() -> None:
    job = default_job(skew=3.0, initial_parallelism=8)
    b = job.start(steady(rate=8000, job=job)).run_batch(8)
    assert b.metrics.records[0] == 15_000  # 3/8 of 40,000
    assert sum(b.metrics.records) == 40_000
    assert b.metrics.busy_seconds[0] == max(b.metrics.busy_seconds) == 15.0
    assert job.capacity_rps(8) == pytest.approx(8000 / 3)


# --- bad trace files, main, plot -----------------------------------------------------


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (None, "cannot read it"),
        ("{not json", "not valid JSON"),
        ("[]", "top level must be a JSON object"),
        ('{"job": {"per_subtask_capacity_rps": 1}}', "missing 'points'"),
        ('{"points": [], "job": {"per_subtask_capacity_rps": 1}}', "non-empty list"),
        (
            '{"points": [{"time": 0, "input_rate": "fast"}], "job": {"per_subtask_capacity_rps": 1}}',
            "points[0].input_rate must be a number",
        ),
        (
            '{"points": [{"time": 5, "input_rate": 1}, {"time": 1, "input_rate": 1}], "job": {"per_subtask_capacity_rps": 1}}',
            "strictly increasing",
        ),
        (
            '{"points": [{"time": 0, "input_rate": 1}], "job": {"per_subtask_capacity_rps": 0}}',
            "per_subtask_capacity_rps must be",
        ),
        (
            '{"points": [{"time": 0, "input_rate": 1}], "job": {"per_subtask_capacity_rps": 1, "cores": 2}}',
            "unknown field job.'cores'",
        ),
        (
            '{"points": [{"time": 0, "input_rate": 1}], "job": {"per_subtask_capacity_rps": 1}, "autoscaler": {"target_utilization": 2}}',
            "target_utilization must be in",
        ),
    ],
)
def test_main_reports_a_bad_trace_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None, problem: str
) -> None:
    path = tmp_path / "bad.json"
    if content is not None:
        path.write_text(content)
    assert main([str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1
    assert str(path) in err and problem in err, err
    with pytest.raises(KeyscaleError):
        load_trace(path)


def test_main_prints_decisions_and_writes_png(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    png = tmp_path / "out.png"
    assert main([str(EXAMPLES / "step_up.json"), "--png", str(png), "--mode", "recommend"]) == 0
    out = capsys.readouterr().out
    assert "trace step_up" in out and "scale_up" in out and "mode recommend" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_writes_a_png(tmp_path: Path) -> None:
    path = plot(simulate(spike()), tmp_path / "spike.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    with pytest.raises(KeyscaleError, match="cannot write PNG"):
        plot(simulate(spike()), tmp_path / "missing" / "dir" / "x.png")


def test_add_simulate_parser_sets_a_handler(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="keyscale")
    groups = parser.add_subparsers(dest="group")
    autoscaler = groups.add_parser("autoscaler").add_subparsers(dest="command")
    add_simulate_parser(autoscaler)
    args = parser.parse_args(["autoscaler", "simulate", str(EXAMPLES / "spike.json")])
    assert args.func(args) == 0
    assert "scale_up" in capsys.readouterr().out
    bad = parser.parse_args(["autoscaler", "simulate", "/nonexistent/trace.json"])
    with pytest.raises(KeyscaleError, match=r"trace file /nonexistent/trace.json: cannot read"):
        bad.func(bad)


def test_format_decisions_table() -> None:
    text = format_decisions(simulate(step_down()))
    lines = text.splitlines()
    assert lines[0].startswith("trace step_down")
    assert any(line.split()[:2] == ["time", "action"] for line in lines)
    assert "scale down 32 -> 4" in text
    assert "load change at 120 s" in text
    assert "stabilising" in format_decisions(simulate(step_down()), all_decisions=True)
