"""The autoscaler's capacity (keyscale.scaling.capacity): the rate per subtask from the window,
from busy time net of garbage-collector pauses."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keyscale.scaling.capacity import Capacity, Unmeasured, measure_capacity, needed_parallelism
from keyscale.scaling.load import GC_FLOOR, Sample, batch_sample
from keyscale.scaling.model import BatchMetrics


def _sample(records: int, busy_total: float, busy_hot: float, warmup: bool = False) -> Sample:
    return Sample(0.0, 5.0, 0.0, records, busy_total, busy_hot, warmup)


def test_the_hottest_subtask_bounds_the_rate_and_skew_is_reported() -> None:
    # 2 subtasks: 1,000 records, one busy 1.5 s, the other 0.5 s.
    c = measure_capacity([_sample(1_000, 2.0, 1.5)], 2, 1.5, 5.0, None, 0.05)
    assert isinstance(c, Capacity)
    assert c.rate_per_subtask == 1_000 / 1.5 / 2
    assert c.mean_rate == 500.0 and abs(c.skew - 1.5) < 1e-12
    assert "(hottest subtask, skew 1.50x)" in c.text()
    assert list(c.inputs(100.0)) == [
        "mean_rate_per_subtask", "skew", "busy_ratio", "true_rate_per_subtask", "capacity", "utilization",
    ]  # fmt: skip


def test_warm_up_batches_are_not_measured_and_history_fills_in() -> None:
    window = [_sample(1_000, 2.0, 1.0, warmup=True)]
    assert measure_capacity(window, 2, 1.0, 5.0, None, 0.05) == Unmeasured(0, 0.0)
    c = measure_capacity(window, 2, 1.0, 5.0, 300.0, 0.05)
    assert isinstance(c, Capacity) and c.from_history and c.rate_per_subtask == 300.0
    assert c.text() == "one subtask processes 300 rec/s (measured earlier)"
    assert c.inputs(0.0)["rate_from_history"] == 1.0


def test_too_little_busy_time_is_not_a_measurement() -> None:
    assert isinstance(
        measure_capacity([_sample(1_000, 0.02, 0.01)], 2, 0.01, 5.0, None, 0.05), Unmeasured
    )


def test_busy_ratio_of_an_empty_slot_is_zero() -> None:
    c = measure_capacity([], 1, 0.0, 0.0, 10.0, 0.05)
    assert isinstance(c, Capacity) and c.busy_ratio == 0.0


@settings(max_examples=200, deadline=None)
@given(
    parallelism=st.integers(min_value=1, max_value=64),
    batches=st.lists(
        st.tuples(st.integers(min_value=0, max_value=10**7), st.lists(st.floats(0.0, 100.0), min_size=1, max_size=64)),
        min_size=1, max_size=8,
    ),
)  # fmt: skip
def test_a_measured_rate_never_exceeds_the_mean_so_skew_is_at_least_one(
    parallelism: int, batches: list[tuple[int, list[float]]]
) -> None:
    window = []
    for records, busy in batches:
        busy = (busy * parallelism)[:parallelism]
        window.append(_sample(records, sum(busy), max(busy)))
    c = measure_capacity(window, parallelism, 1.0, 5.0, None, 0.05)
    if isinstance(c, Capacity):
        assert c.rate_per_subtask > 0
        assert c.skew >= 1.0 - 1e-9
        assert c.total == c.rate_per_subtask * parallelism


@settings(max_examples=200, deadline=None)
@given(
    target_rate=st.floats(min_value=0.0, max_value=1e9),
    rate=st.floats(min_value=1e-3, max_value=1e7),
    utilization=st.floats(min_value=0.05, max_value=1.0),
    lower=st.integers(min_value=1, max_value=16),
)
def test_the_needed_parallelism_carries_the_target_rate(
    target_rate: float, rate: float, utilization: float, lower: int
) -> None:
    raw = needed_parallelism(target_rate, rate, utilization, lower)
    assert raw >= 1
    assert raw * rate * utilization >= target_rate * (1 - 1e-9)
    if target_rate > 0 and raw > 1:
        assert (raw - 1) * rate * utilization < target_rate * (1 + 1e-9)


# --- rates net of garbage-collector pauses (FLINK-33764: GC pressure read as load) -----------


def _metrics(records: tuple[int, ...], busy: tuple[float, ...], gc: tuple[float, ...] = ()) -> BatchMetrics:
    return BatchMetrics(time=0.0, uid="op", parallelism=len(records), max_parallelism=128, input_records=sum(records),
                        batch_seconds=max(busy), trigger_interval_seconds=None, busy_seconds=busy, records=records, gc_seconds=gc)


def _rate(m: BatchMetrics) -> Capacity:
    c = measure_capacity([batch_sample(m, 5.0, warmup=False)], m.parallelism, max(m.busy_seconds), 5.0, None, 0.0)
    assert isinstance(c, Capacity)
    return c


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 10**7), st.floats(1e-3, 1e4)), min_size=1, max_size=16),
    st.floats(0.0, 0.5),
)
def test_a_subtask_half_in_gc_pauses_is_measured_at_twice_the_rate(subtasks: list[tuple[int, float]], other_gc: float) -> None:
    records = tuple(r for r, _ in subtasks)
    busy = tuple(b for _, b in subtasks)
    plain = _rate(_metrics(records, busy))
    halved = _rate(_metrics(records, busy, tuple(b / 2 for b in busy)))
    assert halved.rate_per_subtask == pytest.approx(2 * plain.rate_per_subtask, rel=1e-9)
    assert halved.mean_rate == pytest.approx(2 * (plain.mean_rate or 0.0), rel=1e-9)
    assert halved.gc_share == pytest.approx(0.5) and halved.inputs(1.0)["gc_share"] == pytest.approx(0.5)
    assert "net of garbage-collector pauses: 50% of the busy time" in halved.text()
    # The busy ratio is the whole busy time: a subtask in a GC pause is not idle.
    assert halved.busy_ratio == plain.busy_ratio
    # So the same load needs no more subtasks at all than without the pauses (half as many, rounded up).
    assert needed_parallelism(1e6, halved.rate_per_subtask, 0.7, 1) <= needed_parallelism(1e6, plain.rate_per_subtask, 0.7, 1)
    # Any share of GC pauses: the rate rises by busy / (busy - gc), never beyond 1 / GC_FLOOR.
    some = _rate(_metrics(records, busy, tuple(b * other_gc for b in busy)))
    assert some.rate_per_subtask == pytest.approx(plain.rate_per_subtask / (1 - other_gc), rel=1e-9)


def test_gc_pauses_beyond_the_busy_time_leave_the_floor() -> None:
    plain = _rate(_metrics((1_000,), (2.0,)))
    floored = _rate(_metrics((1_000,), (2.0,), (5.0,)))  # more than the busy time: counted as at most 90% of it
    assert floored.rate_per_subtask == pytest.approx(plain.rate_per_subtask / GC_FLOOR)
    assert floored.gc_share == pytest.approx(1 - GC_FLOOR)


def test_a_small_gc_share_goes_unmentioned_but_is_an_input() -> None:
    c = _rate(_metrics((1_000, 1_000), (2.0, 2.0), (0.1, 0.1)))  # 5%
    assert c.gc_share == pytest.approx(0.05) and "garbage" not in c.text() and c.inputs(1.0)["gc_share"] == pytest.approx(0.05)
    assert "gc_share" not in _rate(_metrics((1_000,), (2.0,))).inputs(1.0)  # no pauses reported: no input


def test_batch_metrics_check_their_gc_seconds() -> None:
    assert _metrics((1, 1), (1.0, 1.0)).gc_seconds == (0.0, 0.0)
    with pytest.raises(ValueError, match="one entry per subtask"):
        _metrics((1, 1), (1.0, 1.0), (0.5,))
    for bad in (-0.1, math.nan, math.inf):
        with pytest.raises(ValueError, match="gc_seconds must be finite numbers >= 0"):
            _metrics((1,), (1.0,), (bad,))
