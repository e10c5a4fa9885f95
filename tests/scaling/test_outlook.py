"""The SLO's part of a decision (keyscale.scaling.outlook): the rate sized for, and each row
of the guard's table."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from keyscale.scaling.decision import Verdict
from keyscale.scaling.forecast import Forecast, RateHistory
from keyscale.scaling.model import AutoscalerConfig
from keyscale.scaling.outlook import Context, Outlook, guard, outlook, sizing_rate, slo_floor
from keyscale.scaling.slo import Slo, SloReading

CFG = AutoscalerConfig(max_rescales_per_hour=4)


def _outlook(value: float, projected: float | None = None, up: float = 1000.0, down: float = 1000.0) -> Outlook:
    reading = SloReading(Slo("latency", 10.0), value, value if projected is None else projected, 5.0, "p99 latency")
    return Outlook(reading, Forecast(up, 5.0, "current", "u"), Forecast(down, 600.0, "current", "d"), 5.0, 20.0)


def _ctx(p: int = 8, slo_target: int = 16, busy: float = 0.9, backlog: float = 0.0, rescales: int = 0, cost: float = 1.0) -> Context:
    return Context(p, slo_target, busy, backlog, rescales, cost, 5.0)


DOWN = Verdict("scale_down", 4, "scale down 8 -> 4: r")
UP = Verdict("scale_up", 16, "scale up 8 -> 16: r")
KEEP = Verdict("none", 8, "keep 8: r")


def test_a_missed_slo_scales_up_even_within_the_band() -> None:
    v = guard(KEEP, _outlook(12.0), _ctx(), CFG)
    assert (v.action, v.target) == ("scale_up", 16) and v.reason.startswith("scale up 8 -> 16: SLO latency=10s missed")
    risky = guard(KEEP, _outlook(8.0, projected=11.0), _ctx(), CFG)
    assert risky.action == "scale_up" and "about to be missed" in risky.reason


def test_a_missed_slo_that_parallelism_cannot_help_is_said_so() -> None:
    v = guard(KEEP, _outlook(12.0), _ctx(busy=0.1), CFG)
    assert v.action == "none" and "parallelism is not what limits it" in v.reason


def test_an_idle_job_keeps_the_scale_up_its_load_or_forecast_decided() -> None:
    """The SLO adds no subtask when idle subtasks and no backlog say parallelism does not
    limit it; a scale-up the decision made by load (here for a forecast rise, while the
    subtasks still idle) is not taken back for that (the real-cluster bench's second spike)."""
    v = guard(Verdict("scale_up", 12, "scale up 8 -> 12: forecast"), _outlook(8.0, projected=11.0), _ctx(busy=0.1), CFG)
    assert (v.action, v.target) == ("scale_up", 12) and v.reason.startswith("scale up 8 -> 12: forecast; SLO latency=10s")


def test_the_rescale_cap_holds_unless_the_slo_is_missed() -> None:
    assert guard(UP, _outlook(5.0), _ctx(rescales=4), CFG).action == "none"
    assert guard(UP, _outlook(12.0), _ctx(slo_target=16, rescales=4), CFG).action == "scale_up"
    capped_down = guard(DOWN, _outlook(1.0), _ctx(rescales=4), CFG)
    assert capped_down.action == "none" and "reach the cap of 4" in capped_down.reason


def test_a_scale_down_needs_the_slo_met_with_room_and_no_backlog() -> None:
    assert guard(DOWN, _outlook(1.0, up=100.0), _ctx(busy=0.2), CFG).action == "scale_down"
    # Met at 7 s; at 4 subtasks instead of 8, the busiest subtask's 0.9 x 5 s doubles: 11.5 s.
    tight = guard(DOWN, _outlook(7.0), _ctx(), CFG)
    assert tight.action == "none" and "would take 4.5 s longer, 11.5 s: above 95% of the target" in tight.reason
    assert guard(DOWN, _outlook(7.0), _ctx(busy=0.2), CFG).action == "scale_down"  # 8.0 s: room enough
    missed = guard(DOWN, _outlook(12.0), _ctx(slo_target=8), CFG)
    assert missed.action == "none" and "no scale-down until it is met" in missed.reason
    behind = guard(DOWN, _outlook(1.0), _ctx(backlog=5000.0), CFG)
    assert behind.action == "none" and "backlog of 5,000 records is being worked off" in behind.reason


def test_a_scale_down_that_saves_less_than_it_costs_is_not_made() -> None:
    # 8 -> 4 for 600 s saves 2,400 core-s; a rescale whose first batch costs 200 s more, there and back, 3,200.
    v = guard(DOWN, _outlook(1.0), _ctx(cost=200.0), CFG)
    assert v.action == "none" and "less than the 3,200 core-s" in v.reason
    assert guard(DOWN, _outlook(1.0), _ctx(cost=100.0), CFG).action == "scale_down"


def test_a_decision_the_guard_lets_through_quotes_the_slo_and_the_forecast() -> None:
    v = guard(DOWN, _outlook(1.0), _ctx(), CFG)
    assert v.reason.startswith("scale down 8 -> 4: r; SLO latency=10s met") and v.reason.endswith("forecast d")


@given(st.floats(min_value=0, max_value=1e5), st.floats(min_value=0, max_value=1e5), st.floats(min_value=0, max_value=1e5))
def test_the_rate_sized_for_is_never_below_the_load_or_the_near_forecast(target: float, up: float, down: float) -> None:
    rate, _ = sizing_rate(_outlook(1.0, up=up, down=down), target, capacity=4000.0, cfg=CFG)
    assert rate >= max(target, up)
    if max(target, up) / 4000.0 < CFG.scale_down_threshold:
        # Going down: only as low as the coming peak allows, but the horizon alone scales
        # nothing up: at most what the current parallelism carries at the target.
        assert rate >= min(down, 4000.0 * CFG.target_utilization)
        assert rate <= max(target, up, 4000.0 * CFG.target_utilization)


@given(st.integers(min_value=1, max_value=64), st.floats(min_value=0, max_value=100), st.integers(min_value=1, max_value=128))
def test_the_slo_floor_is_always_more_than_now(p: int, value: float, raw: int) -> None:
    reading = SloReading(Slo("lag", 10.0), value, value, 5.0, "lag")
    assert slo_floor(reading, p, raw) >= max(p + 1, raw)


def test_the_slo_leaves_the_catch_up_time_and_the_lead_counts_the_rescale_cost() -> None:
    o = outlook(Slo("lag", 30.0), [], RateHistory(), 0.0, 100.0, slot=5.0, rescale_cost=2.0, cfg=CFG)
    assert o.catch_up_seconds == 20.0 and o.lead == 7.0 and o.reading.value is None
    assert outlook(Slo("lag", 6.0), [], RateHistory(), 0.0, 1.0, 5.0, 0.0, CFG).catch_up_seconds == 5.0  # one interval at least


def test_a_window_still_over_the_slo_but_a_latest_batch_back_within_it_scales_no_further() -> None:
    # The window's p99 lags: the batches before the last rescale are still in it.
    reading = SloReading(Slo("latency", 10.0), 20.5, 20.5, 5.0, "p99 latency over 6 batches", latest=7.8)
    o = Outlook(reading, Forecast(1000.0, 5.0, "current", "u"), Forecast(1000.0, 600.0, "current", "d"), 5.0, 20.0)
    v = guard(KEEP, o, _ctx(), CFG)
    assert v.action == "none" and "the latest batch back within it (7.8 s)" in v.reason
    worse = Outlook(replace(reading, latest=12.0), o.up, o.down, 5.0, 20.0)
    assert guard(KEEP, worse, _ctx(), CFG).action == "scale_up"
