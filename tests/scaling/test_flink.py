"""Flink's operator autoscaler as reimplemented from its documentation (scaling/flink.py):
its documented behaviours, run in the simulator."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from keyscale.scaling.flink import FlinkAutoscaler, FlinkConfig, _align
from keyscale.scaling.shapes import bench_job, flat_noisy, spike_10x, step
from keyscale.scaling.simulate import simulate
from keyscale.scaling.traces import Trace, TracePoint


def run(trace: Trace, config: FlinkConfig | None = None, restart: float = 20.0):  # type: ignore[no-untyped-def]
    return simulate(trace, policy=FlinkAutoscaler(config), rescale_seconds=restart)


def test_no_decision_before_stabilisation_and_a_full_window() -> None:
    # Overloaded from the start (10,000 rec/s at P=4): still nothing for 5 + 15 min.
    r = run(step(low=10000, high=10000, at=60))
    first = r.changes[0]
    assert first.action == "scale_up"
    assert 20 * 60 <= first.time < 21 * 60 + 10
    # After the restart, the same wait again before the next decision.
    if len(r.changes) > 1:
        assert r.changes[1].time - first.time >= 20 * 60


def test_scale_up_sizes_for_target_utilisation_and_catch_up_aligned_to_key_groups() -> None:
    r = run(step(low=10000, high=10000, at=60))
    d = r.changes[0]
    assert 128 % d.target_parallelism == 0
    needed = (d.inputs["catch_up_rate"] + d.inputs["target_rate"] * 300 / 1800 + d.inputs["target_rate"] / 0.7)
    assert d.target_parallelism * 1000 >= needed
    assert d.target_parallelism // 2 * 1000 < needed  # the next divisor down would not do


def test_a_scale_down_waits_the_scale_down_interval() -> None:
    # 20,000 rec/s at P=32, then 2,000: the recommendation comes at the first evaluation,
    # the scale-down an hour after it.
    job = bench_job(initial_parallelism=32)
    trace = Trace("down", (TracePoint(0, 20000), TracePoint(600, 2000)), 3 * 3600, job)
    r = run(trace)
    assert [d.action for d in r.changes][:1] == ["scale_down"]
    pending = [d for d in r.decisions if d.reason.startswith("scale-down to")]
    assert r.changes[0].time - pending[0].time >= 3600
    # At most 1 - 0.6 of the parallelism goes in one step: 32 -> 13 at the lowest, aligned 16.
    assert r.changes[0].target_parallelism == 16


def test_no_scale_down_while_working_off_a_backlog() -> None:
    # A long overload builds a backlog of more than 5 min of input: the lower utilisation
    # is 0 then, and the evaluations during it never recommend a scale-down.
    r = run(spike_10x(at=60, length=1800, duration=3 * 3600))
    in_backlog = [d for d in r.decisions if d.inputs.get("scale_down_threshold") == float("inf")]
    assert in_backlog
    assert all(d.action != "scale_down" for d in in_backlog)


def test_a_flat_noisy_load_makes_no_rescale() -> None:
    assert run(flat_noisy(duration=2 * 3600)).changes == ()


@given(st.integers(1, 128), st.integers(1, 128))
def test_alignment_finds_a_divisor_in_the_direction_of_the_change(target: int, current: int) -> None:
    p = _align(target, current, 128, 128)
    assert p >= target
    if 128 % p != 0:
        assert p == target  # only when there is no divisor to move to
    if target < current:
        assert p < current or p == target


def test_config_defaults_are_the_documented_ones() -> None:
    c = FlinkConfig()
    assert (c.metrics_window_seconds, c.stabilization_seconds, c.scale_down_interval_seconds) == (900, 300, 3600)
    assert (c.target_utilization, c.utilization_boundary, c.restart_seconds, c.catch_up_seconds) == (0.7, 0.3, 300, 1800)
    assert (c.scale_down_max_factor, c.max_parallelism) == (0.6, 200)
    assert c.upper_utilization == pytest.approx(1.0) and c.lower_utilization == pytest.approx(0.4)
