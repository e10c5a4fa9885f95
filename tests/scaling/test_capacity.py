"""The autoscaler's capacity (keyscale.scaling.capacity): the rate per subtask from the window."""

from __future__ import annotations

import doctest

from hypothesis import given, settings
from hypothesis import strategies as st

import keyscale.scaling.capacity as capacity_module
from keyscale.scaling.capacity import Capacity, Unmeasured, measure_capacity, needed_parallelism
from keyscale.scaling.load import Sample


def test_docstring_examples_run() -> None:
    result = doctest.testmod(capacity_module)
    assert result.failed == 0 and result.attempted >= 2


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
