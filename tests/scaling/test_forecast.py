"""The input-rate forecast (keyscale.scaling.forecast): its history and the three ways it forecasts."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from keyscale.scaling.forecast import VERSION, RateHistory, forecast

batches = st.lists(
    st.tuples(st.floats(min_value=0, max_value=1e6), st.floats(min_value=0, max_value=1e5), st.floats(min_value=0.1, max_value=60)),
    max_size=60,
)


@given(batches)
def test_a_history_survives_its_json_form(points: list[tuple[float, float, float]]) -> None:
    h = RateHistory(bucket_seconds=60.0, keep_seconds=3600.0 * 24)
    for t, rate, period in sorted(points):
        h.add(t, rate, period)
    back = RateHistory.from_json(json.loads(json.dumps(h.to_json())))
    assert back.bucket_seconds == h.bucket_seconds and back.buckets.keys() == h.buckets.keys()
    for b, (r, s) in h.buckets.items():
        assert back.buckets[b][0] == pytest.approx(r, abs=1e-3) and back.buckets[b][1] == pytest.approx(s, abs=1e-3)


@given(batches)
def test_a_history_keeps_its_last_keep_seconds_and_weighs_by_time(points: list[tuple[float, float, float]]) -> None:
    h = RateHistory(bucket_seconds=10.0, keep_seconds=100.0)
    for t, rate, period in sorted(points):
        h.add(t, rate, period)
    if h.buckets:
        assert max(h.buckets) - min(h.buckets) <= 10
        for r, s in h.buckets.values():
            assert s > 0 and 0 <= r / s <= 1e5 * (1 + 1e-9)


def test_another_version_is_refused_not_misread() -> None:
    with pytest.raises(ValueError, match="version 2 is not 1"):
        RateHistory.from_json({"version": VERSION + 1, "bucket_seconds": 60, "keep_seconds": 60, "buckets": []})
    with pytest.raises(ValueError, match="malformed"):
        RateHistory.from_json({"version": VERSION, "bucket_seconds": 60, "keep_seconds": 60, "buckets": [[1, 2]]})


def _history(rate_at: object, until: float, bucket: float = 60.0) -> RateHistory:
    h = RateHistory(bucket_seconds=bucket)
    t = 0.0
    while t < until:
        h.add(t, rate_at(t), 5.0)  # type: ignore[operator]
        t += 5.0
    return h


def test_seasonal_forecast_sees_a_rise_it_saw_a_season_ago_and_follows_the_level() -> None:
    def daily(t: float) -> float:  # a "day" of one hour: 1,000 rec/s, 5,000 from minute 40 to 50
        return 5000.0 if 2400 <= t % 3600 < 3000 else 1000.0

    h = _history(lambda t: daily(t) * (1.5 if t >= 3600 else 1.0), until=3600 + 2340)  # today 1.5x yesterday
    f = forecast(h, now=3600 + 2340, current_rate=1500.0, horizon=120.0, seasons=(3600.0,))
    assert f.method == "seasonal" and f.rate == pytest.approx(7500.0)  # yesterday's peak, times today's level
    assert "1 h ago the rate went from 1,000 to 5,000" in f.text and "1.50x" in f.text
    calm = forecast(h, now=3600 + 600, current_rate=1500.0, horizon=120.0, seasons=(3600.0,))
    assert calm.rate == pytest.approx(1500.0)  # nothing coming: the current rate


def test_a_level_far_from_the_seasons_is_not_scaled_by_them_and_a_step_is_not_a_trend() -> None:
    h = _history(lambda t: 1000.0 if t < 3600 else 20000.0, until=4200)  # 20x: the season says nothing
    f = forecast(h, now=4200, current_rate=20000.0, horizon=600.0, seasons=(3600.0,))
    assert (f.method, f.rate) == ("current", 20000.0) and "no rise that holds" in f.text
    ramp = _history(lambda t: 1000.0 + t, until=1800)
    r = forecast(ramp, now=1800, current_rate=2800.0, horizon=600.0, seasons=(3600.0,))
    assert r.method == "trend" and r.rate == pytest.approx(2770 + 600, rel=0.02)  # a rise that holds: 1 rec/s per s


def test_without_history_the_forecast_is_the_current_rate() -> None:
    f = forecast(RateHistory(), now=100.0, current_rate=1234.0, horizon=60.0)
    assert (f.method, f.rate) == ("current", 1234.0) and "too little history" in f.text


@given(st.floats(min_value=0, max_value=1e5), st.floats(min_value=1, max_value=3600))
def test_the_forecast_is_never_below_the_current_rate(current: float, horizon: float) -> None:
    h = _history(lambda t: 5000.0 - t, until=1800)  # falling
    assert forecast(h, now=1800.0, current_rate=current, horizon=horizon).rate >= current
