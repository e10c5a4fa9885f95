"""The watermark's arithmetic: pure, property-tested."""

from __future__ import annotations

from datetime import timedelta

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


@pytest.mark.parametrize("name", ["keyscale", "keyscale.operators.eventtime", "keyscale.operators.windows", "keyscale.sources.reader", "keyscale.checkpoint.manifest"])
def test_docstring_examples_run(name: str) -> None:
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(name))
    assert result.attempted > 0 and result.failed == 0
