"""The watermark's arithmetic: pure, property-tested."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

from keyscale.errors import JobDefinitionError
from keyscale.operators.eventtime import (
    END_OF_TIME,
    NO_WATERMARK,
    WatermarkSpec,
    WatermarkState,
    advance,
    describe,
    event_time_ms,
    parse_duration_ms,
)

batch = st.fixed_dictionaries({"a": st.none() | st.integers(0, 10**6), "b": st.none() | st.integers(0, 10**6)})


@given(st.lists(batch, max_size=30), st.integers(0, 5000), st.none() | st.integers(1, 10_000))
def test_the_watermark_never_goes_back(seen: list[dict[str, int | None]], ooo: int, idle: int | None) -> None:
    spec = WatermarkSpec("ts", ooo, idle)
    state = WatermarkState()
    for i, s in enumerate(seen):
        nxt = advance(spec, state, s, batch_time_ms=i * 1000)
        assert nxt.watermark_ms >= state.watermark_ms
        assert WatermarkState.from_json(nxt.to_json()) == nxt  # what the checkpoint stores
        state = nxt


def test_the_slowest_active_input_holds_it_back() -> None:
    spec = WatermarkSpec("ts", 100)
    s = advance(spec, WatermarkState(), {"a": 5000, "b": 1000}, 0)
    assert s.watermark_ms == 1000 - 100 - 1


def test_an_idle_input_stops_holding_it_back() -> None:
    spec = WatermarkSpec("ts", 0, idleness_ms=10_000)
    s = advance(spec, WatermarkState(), {"a": 5000, "b": 1000}, 0)
    s = advance(spec, s, {"a": 9000, "b": None}, 5_000)
    assert s.watermark_ms == 999  # b is quiet for 5 s: not idle yet
    s = advance(spec, s, {"a": 20_000, "b": None}, 10_000)
    assert s.watermark_ms == 19_999  # b idle for 10 s: only a counts


def test_when_all_inputs_are_idle_it_follows_the_clock() -> None:
    spec = WatermarkSpec("ts", 0, idleness_ms=10_000)
    s = advance(spec, WatermarkState(), {"a": 1000}, 100_000)
    s = advance(spec, s, {"a": None}, 105_000)
    assert s.watermark_ms == 999
    s = advance(spec, s, {"a": None}, 200_000)
    assert s.watermark_ms == 190_000


def test_without_idleness_a_quiet_input_holds_it_forever() -> None:
    spec = WatermarkSpec("ts", 0)
    s = advance(spec, WatermarkState(), {"a": 1000, "b": 50}, 0)
    s = advance(spec, s, {"a": 10**9, "b": None}, 10**9)
    assert s.watermark_ms == 49


def test_describe() -> None:
    assert describe(NO_WATERMARK) == "none"
    assert describe(END_OF_TIME) == "end of time"
    assert describe(0) == "1970-01-01T00:00:00.000Z"


@pytest.mark.parametrize(("text", "ms"), [("10 seconds", 10_000), ("1 minute", 60_000), ("250ms", 250), ("2h", 7_200_000), (1.5, 1500), (timedelta(seconds=3), 3000)])
def test_durations(text: object, ms: int) -> None:
    assert parse_duration_ms(text) == ms  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["soon", "5 fortnights", "", None])
def test_bad_durations_are_named(bad: object) -> None:
    with pytest.raises(JobDefinitionError, match="duration"):
        parse_duration_ms(bad, "duration")  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["keyscale", "keyscale.operators.eventtime", "keyscale.operators.windows", "keyscale.sources.reader", "keyscale.checkpoint.manifest",
                                  "keyscale.runtime.task.counters"])
def test_docstring_examples_run(name: str) -> None:
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(name))
    assert result.attempted > 0 and result.failed == 0


# -- how far ahead an event time may be (issue 10, case 7) ----------------------------------------


def test_a_far_future_event_time_never_moves_the_watermark() -> None:
    """Year 9999, or microseconds read as milliseconds: beyond the bound, left out of the maximum."""
    import numpy as np

    from keyscale.operators.eventtime import DEFAULT_MAX_AHEAD_MS, ahead_limit_ms, max_event_within

    now = 1_790_000_000_000
    year_9999 = 253_402_300_799_000
    micros = now * 1000
    spec = WatermarkSpec("ts", 1000)
    assert spec.max_ahead_ms == DEFAULT_MAX_AHEAD_MS == 3_600_000
    limit = ahead_limit_ms(spec.max_ahead_ms, now)
    seen, ahead = max_event_within(np.array([now - 5000, year_9999, micros, now - 2000]), limit)
    assert (seen, ahead) == (now - 2000, 2)
    state = advance(spec, WatermarkState(), {"source": seen}, now)
    assert state.watermark_ms == now - 2000 - 1000 - 1
    # Exactly at the bound is believed; without a bound everything is.
    assert max_event_within(np.array([now + 3_600_000]), limit) == (now + 3_600_000, 0)
    assert max_event_within(np.array([year_9999]), ahead_limit_ms(None, now)) == (year_9999, 0)
    assert max_event_within(np.array([year_9999]), limit) == (None, 1)
    assert ahead_limit_ms(10**18, END_OF_TIME - 5) == END_OF_TIME - 1  # never overflows


def test_with_watermark_takes_max_ahead(tmp_path: Path) -> None:
    import keyscale as ks
    from keyscale.sources import create_log

    df = ks.sources.log_source(create_log(tmp_path / "log", "key string, ts timestamp", 1))
    assert ks.stream(df).with_watermark("ts", "1 s").watermark.max_ahead_ms == 3_600_000  # type: ignore[union-attr]
    assert ks.stream(df).with_watermark("ts", "1 s", max_ahead="1 day").watermark.max_ahead_ms == 86_400_000  # type: ignore[union-attr]
    assert ks.stream(df).with_watermark("ts", "1 s", max_ahead=None).watermark.max_ahead_ms is None  # type: ignore[union-attr]
    with pytest.raises(JobDefinitionError, match="max_ahead"):
        ks.stream(df).with_watermark("ts", max_ahead="soon")


@pytest.mark.parametrize(("unit", "per_ms"), [("ms", 1), ("us", 1_000), ("ns", 1_000_000)])
def test_event_times_finer_than_a_millisecond_are_floored_to_it(unit: str, per_ms: int) -> None:
    # Spark's timestamps are microseconds: a time like 00:00:00.000800 must not fail the batch.
    ms = [1_436_918_400_000, 1_436_918_400_001, -1, -1_000, 0]
    within = [0, per_ms * 4 // 5, per_ms // 2, 0, per_ms - 1]  # offsets inside the millisecond
    raw = [m * per_ms + e for m, e in zip(ms, within, strict=True)]
    assert event_time_ms(pa.table({"ts": pa.array(raw, pa.timestamp(unit, tz="UTC"))}), "ts").tolist() == ms
    got = event_time_ms(pa.table({"ts": pa.array([*raw, None], pa.timestamp(unit))}), "ts")
    assert got[:-1].tolist() == ms and np.isnan(got[-1])


def test_event_times_in_seconds() -> None:
    got = event_time_ms(pa.table({"ts": pa.array([1, -2, 0], pa.timestamp("s"))}), "ts")
    assert got.tolist() == [1000, -2000, 0]
