"""Unit and property tests of the pure autoscaler policy (no Spark, milliseconds)."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keyscale.scaling.policy import (
    Autoscaler,
    AutoscalerConfig,
    BatchMetrics,
    Decision,
    aligned_parallelism,
)

CAP = 1000.0  # records one subtask processes per busy second
T = 5.0  # trigger interval


def batch(
    t: float,
    p: int,
    rate: float,
    *,
    cap: float = CAP,
    skew: float = 1.0,
    m: int = 128,
    backlog: int | None = None,
    input_rate: float | None = None,
    busy: bool = True,
    uid: str = "op",
) -> BatchMetrics:
    """A batch that read ``rate * T`` records, processed at ``cap`` per subtask."""
    n = int(rate * T)
    hot = 1.0 if p == 1 else min(1.0, skew / p)
    other = 0 if p == 1 else int(n * (1 - hot) / (p - 1))
    records = (n - other * (p - 1),) + (other,) * (p - 1)
    busy_s = tuple(r / cap if busy else 0.0 for r in records)
    return BatchMetrics(
        time=t,
        uid=uid,
        parallelism=p,
        max_parallelism=m,
        input_records=n,
        batch_seconds=max(busy_s),
        trigger_interval_seconds=T,
        busy_seconds=busy_s,
        records=records,
        backlog_records=backlog,
        input_rate=input_rate,
    )


def feed(
    scaler: Autoscaler, start: float, end: float, p: int, rate: float, **kw: object
) -> list[Decision]:
    """Feed batches every T seconds in [start, end) at a fixed parallelism."""
    out = []
    t = start
    while t < end:
        out.append(scaler.observe(batch(t, p, rate, **kw)))  # type: ignore[arg-type]
        t += T
    return out


# --- data classes ------------------------------------------------------------------


def test_batch_metrics_validates_per_subtask_lengths() -> None:
    with pytest.raises(ValueError, match="one entry per subtask"):
        BatchMetrics(0.0, "op", 2, 8, 1, 1.0, None, (1.0,), (1,))
    with pytest.raises(ValueError, match="max_parallelism"):
        BatchMetrics(0.0, "op", 4, 2, 1, 1.0, None, (1.0,) * 4, (1,) * 4)
    with pytest.raises(ValueError, match=">= 0"):
        BatchMetrics(0.0, "op", 1, 2, 1, 1.0, None, (-1.0,), (1,))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"target_utilization": 0.0},
        {"utilization_band": 0.8},
        {"catch_up_seconds": 0.0},
        {"scale_up_max_factor": 1.0},
        {"min_parallelism": 0},
        {"min_parallelism": 8, "max_parallelism": 4},
        {"stabilization_seconds": -1.0},
    ],
)
def test_config_rejects_nonsense(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        AutoscalerConfig(**kwargs)  # type: ignore[arg-type]


def test_config_thresholds_and_bounds() -> None:
    cfg = AutoscalerConfig(target_utilization=0.9, utilization_band=0.3)
    assert cfg.scale_up_threshold == 1.0  # never tolerate running above capacity
    assert cfg.scale_down_threshold == pytest.approx(0.6)
    assert AutoscalerConfig(max_parallelism=None).bounds(120) == (1, 120)
    assert AutoscalerConfig(min_parallelism=300).bounds(128) == (128, 128)


@pytest.mark.parametrize(
    ("target", "m", "lower", "upper", "expected"),
    [
        (5, 128, 1, 128, 8),
        (9, 128, 1, 128, 16),
        (7, 120, 1, 120, 8),
        (13, 120, 1, 120, 15),
        (70, 128, 1, 100, 70),  # no divisor under the bound: keep the target
        (200, 128, 1, 128, 128),
        (0, 128, 4, 128, 4),
        (3, 128, 1, 64, 4),
    ],
)
def test_aligned_parallelism(target: int, m: int, lower: int, upper: int, expected: int) -> None:
    assert aligned_parallelism(target, m, lower, upper) == expected


@given(
    target=st.integers(-5, 400),
    m=st.integers(1, 400),
    lower=st.integers(1, 50),
    extra=st.integers(0, 400),
)
def test_aligned_parallelism_properties(target: int, m: int, lower: int, extra: int) -> None:
    lower = min(lower, m)
    upper = lower + extra
    p = aligned_parallelism(target, m, lower, upper)
    hi = min(upper, m)
    assert lower <= p <= hi
    divisors = [d for d in range(max(lower, min(target, hi)), hi + 1) if m % d == 0]
    if divisors:
        assert p == divisors[0]


def test_decision_to_dict_round_trips_fields() -> None:
    d = Decision(1.0, "op", 2, 4, "scale_up", "because", {"utilization": 1.2})
    assert d.to_dict() == {
        "time": 1.0,
        "uid": "op",
        "current_parallelism": 2,
        "target_parallelism": 4,
        "action": "scale_up",
        "reason": "because",
        "inputs": {"utilization": 1.2},
    }
    assert d.changes


# --- decisions -----------------------------------------------------------------------


def test_no_decision_while_stabilising_after_start() -> None:
    scaler = Autoscaler(AutoscalerConfig(stabilization_seconds=30))
    decisions = feed(scaler, 0, 40, 4, 3800)  # utilisation 0.95 from the start
    # a decision is made at the end of its batch (start + 4.75 s)
    early = [d for d in decisions if d.time < 30]
    assert [d.time for d in early] == [4.75 + 5 * i for i in range(6)]
    assert all(d.action == "none" and "stabilising" in d.reason for d in early)
    assert decisions[len(early)].action == "scale_up"


def test_scales_up_to_cover_load_and_explains() -> None:
    scaler = Autoscaler()
    feed(scaler, 0, 60, 4, 2400)
    d = scaler.observe(batch(60, 4, 6000))  # busy 7.5 s per 5 s interval
    assert d.action == "scale_up"
    # 6,000 rec/s + 15,000 records left by the 2.5 s overrun, over 60 s: 6,250 rec/s;
    # 1,000 rec/s per subtask at 70% -> 9 subtasks -> 16 (divides 128)
    assert d.inputs["true_rate_per_subtask"] == pytest.approx(CAP)
    assert d.inputs["input_rate"] == pytest.approx(6000)
    assert d.inputs["backlog"] == pytest.approx(6000 * 2.5)
    assert d.inputs["target_rate"] == pytest.approx(6250)
    assert d.inputs["raw_target_parallelism"] == 9
    assert d.target_parallelism == 16
    assert "one subtask processes 1,000 rec/s" in d.reason
    assert "70% target utilisation" in d.reason
    assert "divides 128" in d.reason


def test_within_band_keeps_parallelism() -> None:
    scaler = Autoscaler()
    decisions = feed(scaler, 0, 600, 4, 2400)  # utilisation 0.6
    assert all(d.action == "none" for d in decisions)
    assert decisions[-1].inputs["utilization"] == pytest.approx(0.6)
    assert decisions[-1].reason.startswith("keep 4: utilisation 0.60")


def test_backlog_and_restart_raise_the_target_rate() -> None:
    cfg = AutoscalerConfig(catch_up_seconds=100, restart_seconds=10, warmup_batches=0)
    scaler = Autoscaler(cfg)
    feed(scaler, 0, 60, 8, 4000)
    d = scaler.observe(batch(60, 8, 4000, backlog=400_000))
    assert d.inputs["catch_up_rate"] == pytest.approx((400_000 + 4000 * 10) / 100)
    assert d.inputs["target_rate"] == pytest.approx(4000 + 4400)
    assert d.action == "scale_up"
    assert "backlog 400,000 (+10 s restart) over 100 s catch-up" in d.reason


def test_reported_input_rate_wins_over_derived() -> None:
    scaler = Autoscaler(AutoscalerConfig(stabilization_seconds=0))
    d = scaler.observe(batch(0, 4, 2400, input_rate=9000.0))
    assert d.inputs["input_rate"] == 9000.0
    scaler2 = Autoscaler(AutoscalerConfig(stabilization_seconds=0))
    scaler2.observe(batch(0, 4, 2400))
    d2 = scaler2.observe(batch(10, 4, 2400))  # 12,000 records over 10 s since last start
    assert d2.inputs["input_rate"] == pytest.approx(1200)


def test_scale_down_only_after_the_delay_to_the_highest_target() -> None:
    cfg = AutoscalerConfig(scale_down_delay_seconds=120, stabilization_seconds=30)
    scaler = Autoscaler(cfg)
    feed(scaler, 0, 60, 32, 16_000)  # utilisation 0.5: in band
    low = feed(scaler, 60, 100, 32, 4000)  # target 8 ...
    low += feed(scaler, 100, 120, 32, 6000)  # ... then 16 (6000 / 700 -> 9 -> 16)
    low += feed(scaler, 120, 300, 32, 2000)  # ... then 4
    downs = [d for d in low if d.action == "scale_down"]
    assert len(downs) == 1
    down = downs[0]
    since = down.inputs["scale_down_pending_since"]
    assert down.time - since >= 120
    assert all(d.action == "none" for d in low if d.time < since + 120)
    assert down.target_parallelism == 16  # the highest target seen during the delay
    assert "below band for" in down.reason


def test_in_band_evaluation_cancels_a_pending_scale_down() -> None:
    scaler = Autoscaler(AutoscalerConfig(scale_down_delay_seconds=120))
    feed(scaler, 0, 60, 16, 8000)
    a = feed(scaler, 60, 150, 16, 2000)  # below band for 90 s
    b = feed(scaler, 150, 160, 16, 8000)  # back in band: pending cancelled
    c = feed(scaler, 160, 270, 16, 2000)  # below band again, only 110 s
    assert all(d.action == "none" for d in a + b + c)
    assert "has held" in c[-1].reason
    d = feed(scaler, 270, 300, 16, 2000)
    assert [x.action for x in d].count("scale_down") == 1


def test_stabilisation_after_a_change_and_old_metrics_ignored() -> None:
    scaler = Autoscaler(AutoscalerConfig(stabilization_seconds=30, warmup_batches=1))
    feed(scaler, 0, 60, 4, 2400, cap=1000)
    # the job was rescaled to 8 (by anyone); its subtasks are now slower
    after = feed(scaler, 60, 90, 8, 2400, cap=500)
    assert all(d.action == "none" and "stabilising" in d.reason for d in after if d.time < 90)
    d = scaler.observe(batch(95, 8, 2400, cap=500))
    assert d.inputs["true_rate_per_subtask"] == pytest.approx(500)  # not mixed with 1,000


def test_recommendations_repeat_at_most_once_per_stabilisation() -> None:
    scaler = Autoscaler(AutoscalerConfig(stabilization_seconds=30))
    feed(scaler, 0, 60, 4, 2400)
    decisions = feed(scaler, 60, 300, 4, 3800)  # never applied: recommend mode
    ups = [d for d in decisions if d.action == "scale_up"]
    assert len(ups) >= 5
    assert all(b.time - a.time >= 30 for a, b in itertools.pairwise(ups))
    assert all(d.current_parallelism == 4 for d in decisions)


def test_skew_sizes_for_the_hottest_subtask() -> None:
    scaler = Autoscaler()
    # 8 subtasks, mean busy 31%, hottest subtask (3x fair share) busy 94%
    decisions = feed(scaler, 0, 60, 8, 2500, skew=3.0)
    d = next(d for d in decisions if d.action != "none")
    assert d.action == "scale_up" and d.target_parallelism == 16
    assert d.inputs["skew"] == pytest.approx(3.0, rel=0.01)
    assert d.inputs["mean_rate_per_subtask"] == pytest.approx(CAP, rel=0.01)
    assert d.inputs["true_rate_per_subtask"] == pytest.approx(CAP / 3, rel=0.01)
    assert "hottest subtask, skew 3.00x" in d.reason


def test_no_measurement_never_scales_to_min_blindly() -> None:
    scaler = Autoscaler(AutoscalerConfig(scale_down_delay_seconds=60))
    # the operator reports no busy time: the rate cannot be measured
    decisions = feed(scaler, 0, 600, 16, 200, busy=False)
    assert all(d.action == "none" for d in decisions)
    assert "no reliable processing-rate measurement" in decisions[-1].reason
    # nothing at all arrives and nothing was ever measured: hold as well
    idle = Autoscaler()
    assert all(d.action == "none" for d in feed(idle, 0, 600, 16, 0))


def test_idle_source_with_known_rate_scales_down_through_delay_and_step() -> None:
    cfg = AutoscalerConfig(scale_down_delay_seconds=60, scale_down_max_factor=2.0)
    scaler = Autoscaler(cfg)
    feed(scaler, 0, 60, 16, 8000)  # measured: 1,000 rec/s per subtask
    decisions = feed(scaler, 60, 200, 16, 0)
    downs = [d for d in decisions if d.action == "scale_down"]
    assert len(downs) == 1
    assert downs[0].target_parallelism == 8  # at most a 2x step
    assert downs[0].inputs["rate_from_history"] == 1.0
    assert downs[0].time >= 60 + 60


def test_bounds_and_step_factors() -> None:
    cfg = AutoscalerConfig(max_parallelism=12, min_parallelism=3, align_to_key_groups=False)
    scaler = Autoscaler(cfg)
    feed(scaler, 0, 30, 4, 2000)
    d = scaler.observe(batch(30, 4, 50_000))
    assert d.action == "scale_up" and d.target_parallelism == 12  # upper bound
    scaler2 = Autoscaler(AutoscalerConfig(scale_up_max_factor=2.0))
    feed(scaler2, 0, 30, 4, 2000)
    d2 = scaler2.observe(batch(30, 4, 50_000))
    assert d2.target_parallelism == 8 and "capped at 2x step" in d2.reason
    at_max = Autoscaler(AutoscalerConfig(max_parallelism=4))
    decisions = feed(at_max, 0, 100, 4, 50_000)
    assert all(d.action == "none" for d in decisions)
    assert "upper bound" in decisions[-1].reason
    floor = Autoscaler(AutoscalerConfig(min_parallelism=8, scale_down_delay_seconds=10))
    downs = [d for d in feed(floor, 0, 300, 32, 100) if d.action == "scale_down"]
    assert downs and all(d.target_parallelism >= 8 for d in downs)


def _first_change(decisions: list[Decision]) -> Decision:
    changes = [d for d in decisions if d.changes]
    assert changes, decisions[-1].reason
    return changes[0]


def test_parallelism_below_the_lower_bound_comes_back_while_under_utilised() -> None:
    scaler = Autoscaler(AutoscalerConfig(min_parallelism=3, stabilization_seconds=30))
    decisions = feed(scaler, 0, 60, 2, 200)  # utilisation 0.1: the load alone says "smaller"
    d = _first_change(decisions)
    assert all(x.action == "none" and "stabilising" in x.reason for x in decisions if x.time < 30)
    assert d.time < 35  # the first decision after stabilisation, no delay
    assert (d.action, d.current_parallelism, d.target_parallelism) == ("scale_up", 2, 4)
    assert d.reason.startswith(
        "scale up 2 -> 4: parallelism 2 is below the lower bound 3, so it goes to the nearest "
        "parallelism within [3, 128], aligned to 4 (divides 128); by load alone: keep 2"
    )
    assert (d.inputs["lower_bound"], d.inputs["upper_bound"]) == (3, 128)
    after = feed(scaler, 60, 120, 4, 200)  # back within bounds: no more bound decisions
    assert all("bound" not in x.reason for x in after)


def test_parallelism_above_the_upper_bound_comes_back_at_once() -> None:
    for rate, state in ((200, "under-utilised"), (44_800, "in band"), (100_000, "overloaded")):
        scaler = Autoscaler(AutoscalerConfig(max_parallelism=24, scale_down_delay_seconds=120))
        d = _first_change(feed(scaler, 0, 60, 64, rate))
        assert d.time < 35, state  # not after the 120 s scale-down delay
        assert (d.action, d.target_parallelism) == ("scale_down", 16), state  # largest divisor of 128 <= 24
        assert "above the upper bound 24" in d.reason and "aligned to 16" in d.reason, state
    unaligned = Autoscaler(AutoscalerConfig(max_parallelism=24, align_to_key_groups=False))
    d = _first_change(feed(unaligned, 0, 60, 64, 200))
    assert d.target_parallelism == 24 and "aligned" not in d.reason.split(";")[0]
    # no divisor of M within the bounds: the bound itself
    none_fit = Autoscaler(AutoscalerConfig(min_parallelism=30, max_parallelism=40))
    d = _first_change(feed(none_fit, 0, 60, 10, 200, m=100))
    assert (d.action, d.target_parallelism) == ("scale_up", 30)


def test_load_driven_scale_up_from_below_the_bound_goes_further() -> None:
    scaler = Autoscaler(AutoscalerConfig(min_parallelism=3, warmup_batches=0))
    d = _first_change(feed(scaler, 0, 60, 2, 20_000))
    assert d.action == "scale_up" and d.target_parallelism == 8  # the load's target, not the nearest (4)
    assert "bound" not in d.reason


def test_alignment_can_be_disabled() -> None:
    scaler = Autoscaler(AutoscalerConfig(align_to_key_groups=False))
    feed(scaler, 0, 30, 4, 2000)
    d = scaler.observe(batch(30, 4, 6000))
    assert d.target_parallelism == 9  # 6,250 / 700 -> 8.9 -> 9, not 16


def test_behind_but_idle_subtasks_do_not_scale_up() -> None:
    scaler = Autoscaler()
    # a growing backlog the subtasks are not busy with: a per-batch read limit
    decisions = feed(scaler, 0, 120, 16, 2000, backlog=1_000_000)
    assert all(d.action == "none" for d in decisions)
    assert "maxOffsetsPerTrigger" in decisions[-1].reason


def test_operators_are_independent_and_time_must_not_go_back() -> None:
    scaler = Autoscaler()
    feed(scaler, 0, 60, 4, 2400, uid="a")
    d = feed(scaler, 0, 60, 4, 20_000, uid="b")
    assert any(x.action == "scale_up" for x in d)
    assert scaler.observe(batch(60, 4, 2400, uid="a")).action == "none"
    with pytest.raises(ValueError, match="back in time"):
        scaler.observe(batch(10, 4, 2400, uid="a"))


# --- properties ------------------------------------------------------------------


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[AutoscalerConfig, int, list[float], float]:
    m = draw(st.sampled_from([1, 7, 60, 100, 120, 128]))
    lo = draw(st.integers(1, max(1, m // 4)))
    hi = draw(st.one_of(st.none(), st.integers(lo, m)))
    cfg = AutoscalerConfig(
        target_utilization=draw(st.floats(0.4, 0.9)),
        utilization_band=draw(st.floats(0.0, 0.3)),
        metrics_window_seconds=draw(st.floats(5, 120)),
        stabilization_seconds=draw(st.floats(0, 60)),
        scale_up_max_factor=draw(st.floats(1.1, 16)),
        scale_down_max_factor=draw(st.floats(1.1, 16)),
        scale_down_delay_seconds=draw(st.floats(0, 200)),
        catch_up_seconds=draw(st.floats(5, 300)),
        min_parallelism=lo,
        max_parallelism=hi,
        align_to_key_groups=draw(st.booleans()),
        warmup_batches=draw(st.integers(0, 2)),
    )
    rates = draw(st.lists(st.floats(0, 60_000), min_size=1, max_size=12))
    skew = draw(st.floats(1.0, 4.0))
    return cfg, m, rates, skew


def run_closed_loop(
    cfg: AutoscalerConfig, m: int, rates: list[float], skew: float
) -> list[tuple[BatchMetrics, Decision]]:
    """Apply every decision; each rate holds for 60 s; batches every T seconds."""
    scaler = Autoscaler(cfg)
    lo, hi = cfg.bounds(m)
    p = max(lo, min(hi, 4))
    out = []
    t = 0.0
    for rate in rates:
        end = t + 60
        while t < end:
            mt = batch(t, p, rate, skew=skew, m=m)
            d = scaler.observe(mt)
            out.append((mt, d))
            if d.changes:
                p = d.target_parallelism
            t += max(T, mt.batch_seconds)
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_invariants_hold_on_random_loads(
    scenario: tuple[AutoscalerConfig, int, list[float], float],
) -> None:
    cfg, m, rates, skew = scenario
    history = run_closed_loop(cfg, m, rates, skew)
    lo, hi = cfg.bounds(m)
    last_event = -math.inf  # last parallelism change (batch start) or scaling decision
    prev_p = None
    for i, (mt, d) in enumerate(history):
        if mt.parallelism != prev_p:
            last_event = max(last_event, mt.time)
            prev_p = mt.parallelism
        assert d.current_parallelism == mt.parallelism
        if not d.changes:
            assert d.target_parallelism == d.current_parallelism
            continue
        # the target is always within bounds, and moves in the stated direction
        assert lo <= d.target_parallelism <= hi
        if d.action == "scale_up":
            assert d.target_parallelism > d.current_parallelism
        else:
            assert d.target_parallelism < d.current_parallelism
        # no decision within stabilisation of a change or of the previous decision
        assert d.time - last_event >= cfg.stabilization_seconds - 1e-9
        # aligned whenever a divisor of M exists within the bounds
        if cfg.align_to_key_groups and cfg.max_parallelism is None:
            assert m % d.target_parallelism == 0
        if d.action == "scale_down":
            # never within the delay: a lower target held the whole delay, at this P
            since = d.inputs["scale_down_pending_since"]
            assert d.time - since >= cfg.scale_down_delay_seconds - 1e-9
            assert since >= last_event + cfg.stabilization_seconds - 1e-9
            for mt2, d2 in history[:i]:
                # (With no stabilisation and no delay, batches of zero duration share a time:
                # the change that brought this parallelism may carry the pending time itself.)
                if d2.time > since or (d2.time == since and mt2.parallelism == mt.parallelism):
                    assert d2.action == "none" and mt2.parallelism == mt.parallelism
        last_event = max(last_event, d.time)


@settings(max_examples=30, deadline=None)
@given(scenarios())
def test_policy_is_deterministic(
    scenario: tuple[AutoscalerConfig, int, list[float], float],
) -> None:
    cfg, m, rates, skew = scenario
    a = [d for _, d in run_closed_loop(cfg, m, rates, skew)]
    b = [d for _, d in run_closed_loop(cfg, m, rates, skew)]
    assert a == b


@settings(max_examples=80, deadline=None)
@given(m=st.sampled_from([1, 7, 60, 100, 128]), data=st.data())
def test_any_parallelism_outside_the_bounds_is_brought_back(m: int, data: st.DataObject) -> None:
    lo = data.draw(st.integers(1, m))
    hi = data.draw(st.integers(lo, m))
    p = data.draw(st.integers(1, m))
    rate = data.draw(st.floats(0, 60_000))
    cfg = AutoscalerConfig(min_parallelism=lo, max_parallelism=hi, stabilization_seconds=data.draw(st.floats(0, 60)),
                           align_to_key_groups=data.draw(st.booleans()))  # fmt: skip
    scaler = Autoscaler(cfg)
    start, t, decisions = p, 0.0, []
    while t < cfg.stabilization_seconds + 4 * T:
        mt = batch(t, p, rate, m=m)
        d = scaler.observe(mt)
        decisions.append(d)
        if d.changes:
            assert lo <= d.target_parallelism <= hi
            p = d.target_parallelism
        t += max(T, mt.batch_seconds)
    assert lo <= p <= hi
    if not lo <= start <= hi:
        # the first decision after stabilisation moves it, inwards, whatever the load
        first = next(d for d in decisions if d.time >= cfg.stabilization_seconds)
        assert first.action == ("scale_up" if start < lo else "scale_down"), first.reason


def test_a_notable_gc_share_is_in_the_reason_and_the_inputs() -> None:
    # 2,400 rec/s on 4 subtasks of 1,000 rec/s (utilisation 0.6, in band), each batch's busy
    # time a third GC pauses; and the same with 5%: an input, not worth a word.
    def with_gc(share: float) -> list[Decision]:
        scaler = Autoscaler()
        out = []
        for i in range(12):
            b = batch(5.0 * i, 4, 2400)
            busy = tuple(x / (1 - share) for x in b.busy_seconds)
            out.append(scaler.observe(replace(b, busy_seconds=busy, batch_seconds=max(busy), gc_seconds=tuple(x * share for x in busy))))
        return out

    d = with_gc(1 / 3)[-1]
    assert d.action == "none" and d.inputs["utilization"] == pytest.approx(0.6)
    assert d.inputs["gc_share"] == pytest.approx(1 / 3) and d.inputs["true_rate_per_subtask"] == pytest.approx(CAP)
    assert d.reason.endswith("capacity 4,000 rec/s (net of garbage-collector pauses: 33% of the busy time, not counted as work)")
    d = with_gc(0.05)[-1]
    assert d.inputs["gc_share"] == pytest.approx(0.05) and "garbage" not in d.reason
