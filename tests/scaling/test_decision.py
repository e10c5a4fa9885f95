"""The autoscaler's decision (keyscale.scaling.decision): the table of cases, alone and
through the policy."""

from __future__ import annotations

import doctest

from hypothesis import assume, given, settings
from hypothesis import strategies as st

import keyscale.scaling.decision as decision_module
from keyscale.scaling.decision import Case, PendingDown, decide, sized_target, stabilising
from keyscale.scaling.model import AutoscalerConfig, BatchMetrics
from keyscale.scaling.policy import Autoscaler


def test_docstring_examples_run() -> None:
    result = doctest.testmod(decision_module)
    assert result.failed == 0 and result.attempted >= 4


def _case(
    p: int, utilization: float, target: int, now: float = 0.0, busy_ratio: float = 0.9
) -> Case:
    return Case(p, utilization, busy_ratio, target, now, "u", "l", "s", 1.0)


def test_each_row_of_the_table() -> None:
    cfg = AutoscalerConfig(scale_down_delay_seconds=60)
    assert decide(_case(4, 0.7, 4), PendingDown(0.0, 2), cfg).pending is None
    idle = decide(_case(4, 2.0, 8, busy_ratio=0.1), None, cfg)
    assert idle.action == "none" and "only 10% busy" in idle.reason
    assert decide(_case(4, 2.0, 4), None, cfg).reason == "keep 4: u but 4 is the upper bound; s"
    assert decide(_case(4, 2.0, 8), None, cfg).reason == "scale up 4 -> 8: u; s"
    assert (
        decide(_case(4, 0.1, 4), None, cfg).reason == "keep 4: u but no smaller parallelism fits; s"
    )
    first = decide(_case(4, 0.1, 1, now=10.0), None, cfg)
    assert (first.action, first.pending, first.pending_since) == (
        "none",
        PendingDown(10.0, 1),
        10.0,
    )
    later = decide(_case(4, 0.1, 1, now=50.0), PendingDown(10.0, 2), cfg)
    assert later.pending == PendingDown(10.0, 2)  # the highest target seen
    done = decide(_case(4, 0.1, 1, now=70.0), later.pending, cfg)
    assert (done.action, done.target, done.pending, done.pending_since) == (
        "scale_down",
        2,
        None,
        10.0,
    )


def test_stabilising_names_what_it_waits_for() -> None:
    cfg = AutoscalerConfig(stabilization_seconds=30)
    assert stabilising(40.0, 20.0, 0.0, 2, cfg) == (
        "stabilising: 20 s since the last scaling decision, no decision before 30 s"
    )
    assert stabilising(50.0, 20.0, 0.0, 2, cfg) is None


configs = st.builds(
    AutoscalerConfig,
    min_parallelism=st.integers(min_value=1, max_value=40),
    max_parallelism=st.one_of(st.none(), st.integers(min_value=40, max_value=300)),
    align_to_key_groups=st.booleans(),
    scale_up_max_factor=st.floats(min_value=1.1, max_value=16.0),
    scale_down_max_factor=st.floats(min_value=1.1, max_value=16.0),
    scale_down_delay_seconds=st.floats(min_value=0.0, max_value=300.0),
)


@settings(max_examples=300, deadline=None)
@given(
    cfg=configs,
    key_groups=st.integers(min_value=1, max_value=256),
    p=st.integers(min_value=1, max_value=256),
    raw=st.integers(min_value=1, max_value=10_000),
    utilization=st.floats(min_value=0.0, max_value=50.0),
    busy_ratio=st.floats(min_value=0.0, max_value=1.0),
    pending=st.one_of(st.none(), st.tuples(st.floats(0.0, 1000.0), st.integers(1, 256))),
    now=st.floats(min_value=1000.0, max_value=2000.0),
)
def test_a_decision_never_leaves_the_bounds_and_moves_the_way_it_says(
    cfg: AutoscalerConfig,
    key_groups: int,
    p: int,
    raw: int,
    utilization: float,
    busy_ratio: float,
    pending: tuple[float, int] | None,
    now: float,
) -> None:
    assume(p <= key_groups)
    lower, upper = cfg.bounds(key_groups)
    up = utilization > cfg.scale_up_threshold
    target, _ = sized_target(raw, p, up, key_groups, (lower, upper), cfg)
    assert lower <= target <= upper
    pend = None
    if pending is not None and lower < p:
        # As the policy keeps it: a lower target within the bounds, since before now.
        pend = PendingDown(pending[0], max(lower, min(pending[1], upper, p - 1)))
    v = decide(Case(p, utilization, busy_ratio, target, now, "u", "l", "s", 1.0), pend, cfg)
    if v.action == "none":
        assert v.target == p
    else:
        assert lower <= v.target <= upper
        assert v.target > p if v.action == "scale_up" else v.target < p
        assert v.pending is None
    if cfg.scale_down_threshold <= utilization <= cfg.scale_up_threshold:
        assert v.action == "none" and v.pending is None
    if v.action == "scale_down":
        assert v.pending_since is not None and now - v.pending_since >= cfg.scale_down_delay_seconds


@settings(max_examples=60, deadline=None)
@given(
    p=st.sampled_from([1, 2, 4, 8, 16]),
    utilization=st.floats(min_value=0.52, max_value=0.88),
    batches=st.integers(min_value=1, max_value=80),
    trigger=st.floats(min_value=1.0, max_value=30.0),
)
def test_a_flat_load_inside_the_band_changes_nothing(
    p: int, utilization: float, batches: int, trigger: float
) -> None:
    # Each subtask processes 1,000 rec/s; the input asks for `utilization` of P subtasks.
    scaler = Autoscaler(AutoscalerConfig(stabilization_seconds=0, warmup_batches=0))
    rate = utilization * 1_000.0 * p
    for i in range(batches):
        records = int(rate * trigger)
        per = [records // p + (1 if s < records % p else 0) for s in range(p)]
        busy = tuple(r / 1_000.0 for r in per)
        d = scaler.observe(BatchMetrics(
            time=i * trigger, uid="op", parallelism=p, max_parallelism=128, input_records=records,
            batch_seconds=max(busy), trigger_interval_seconds=trigger, busy_seconds=busy, records=tuple(per),
            input_rate=rate,
        ))  # fmt: skip
        assert d.action == "none", d.reason
