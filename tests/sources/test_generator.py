"""Rate schedules (pure maths, property-tested) and the load generator (fake clock, real logs)."""

from __future__ import annotations

import logging
import math
import threading
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keyscale.sources import (
    GENERATOR_SCHEMA,
    LogError,
    RateSchedule,
    ScheduleError,
    Segment,
    create_log,
    generate,
    generated_records,
    partition_of,
    start_generator,
)

# -- parsing ----------------------------------------------------------------------------------------


def test_parse_the_documented_forms() -> None:
    s = RateSchedule.parse("2000/s for 30s, 20000/s for 60s, 2000/s for 30s")
    assert [(int(x.rate), int(x.duration)) for x in s.segments] == [(2000, 30), (20000, 60), (2000, 30)]
    assert s.duration == 120 and s.total_records == 1_320_000
    assert str(s) == "2000/s for 30s, 20000/s for 60s, 2000/s for 30s"
    assert RateSchedule.parse(str(s)) == s
    r = RateSchedule.parse("1.5k/s for 1m30s; 120/min for 2m ;  0/s to 1M/h for 500ms")
    assert r.segments[0] == Segment(1500, 90)
    assert r.segments[1] == Segment(2, 120)
    assert r.segments[2] == Segment(0, Fraction(1, 2), Fraction(1_000_000, 3600))
    assert RateSchedule.parse("10/s to 0/s for 10s").total_records == 50


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "segment 1 is empty"),
        ("2000/s for 30s,", "segment 2 is empty"),
        ("fast for 30s", "segment 1: rate 'fast' is not NUMBER/UNIT"),
        ("2000 for 30s", "rate '2000' is not NUMBER/UNIT"),
        ("100/s for 30s, 5/s for a while", "segment 2: duration 'a while' is not NUMBER UNIT"),
        ("100/s for 0s", "segment 1: a segment's duration must be positive"),
        ("100/s", "is not 'RATE for DURATION'"),
        ("100/s for 10 parsecs", "duration '10 parsecs'"),
    ],
)
def test_parse_errors_name_the_segment(text: str, message: str) -> None:
    with pytest.raises(ScheduleError, match=message.replace("(", "\\(")):
        RateSchedule.parse(text)


# -- the maths, property-tested ----------------------------------------------------------------------

rates = st.one_of(st.integers(0, 50_000), st.fractions(min_value=0, max_value=1000, max_denominator=100))
durations = st.one_of(st.integers(1, 120), st.fractions(min_value=Fraction(1, 1000), max_value=60, max_denominator=1000).filter(lambda f: f > 0))
segments = st.builds(Segment, rates, durations, st.none() | rates)
schedules = st.lists(segments, min_size=1, max_size=6).map(RateSchedule)


@settings(max_examples=300, deadline=None)
@given(schedules, st.lists(st.floats(-5, 1000, allow_nan=False), min_size=2, max_size=20))
def test_records_due_is_monotone_and_ends_at_the_sum_of_segments(s: RateSchedule, times: list[float]) -> None:
    times.sort()
    due = [s.records_due(t) for t in times]
    assert due == sorted(due)
    assert all(0 <= d <= s.total_records for d in due)
    exact_total = sum(((x.rate + x.end_rate) / 2 * x.duration for x in s.segments), Fraction(0))
    assert s.total_records == math.floor(exact_total)
    assert s.records_due(s.duration) == s.records_due(s.duration + 1) == s.total_records
    assert s.records_due(0) == 0 and s.records_due(-1) == 0


@settings(max_examples=300, deadline=None)
@given(schedules)
def test_segment_boundaries_and_rates(s: RateSchedule) -> None:
    t = Fraction(0)
    cum = Fraction(0)
    for seg in s.segments:
        assert s.expected_records(t) == cum
        mid = t + seg.duration / 2
        assert s.rate_at(mid) == pytest.approx(float((seg.rate + seg.end_rate) / 2))
        # a linear rate: the records in a segment are its mean rate times its length
        assert s.expected_records(t + seg.duration) - cum == (seg.rate + seg.end_rate) / 2 * seg.duration
        t += seg.duration
        cum += seg.records
    assert s.rate_at(t) == 0.0 and s.rate_at(-0.1) == 0.0


@settings(max_examples=200, deadline=None)
@given(schedules)
def test_each_record_is_emitted_when_it_falls_due(s: RateSchedule) -> None:
    n = s.total_records
    seq = np.unique(np.linspace(0, max(n - 1, 0), num=min(n, 50)).astype(np.int64)) if n else np.array([], np.int64)
    times = s.emission_times(seq)
    assert np.all(np.diff(times) >= 0)
    for k, t in zip(seq.tolist(), times.tolist(), strict=True):
        assert 0 <= t <= s.duration + 1e-9
        # record k is due at its time (up to float rounding), not noticeably before
        assert s.expected_records(t + 1e-6) >= k + 1 - 1e-6 * 50_000
        assert s.expected_records(max(0.0, t - 1e-3)) < k + 1


# -- record content ---------------------------------------------------------------------------------


def test_generated_records_are_a_function_of_the_record_number() -> None:
    s = RateSchedule.parse("1000/s for 2s")
    a = generated_records(s, 0, 2000, keys=7, start_time_ms=1_000)
    assert a.schema.equals(GENERATOR_SCHEMA)
    assert a.column("seq").to_pylist() == list(range(2000))
    assert set(a.column("key").to_pylist()) == {f"k{i}" for i in range(7)}
    assert a.slice(500, 700).equals(generated_records(s, 500, 1200, keys=7, start_time_ms=1_000))
    ms = [v.value // 1000 for v in a.column("ts")]
    assert ms[0] == 1_001 and ms[999] == 2_000 and ms[-1] == 3_000
    assert ms == sorted(ms)
    values = a.column("value").to_pylist()
    assert min(values) >= 1 and max(values) <= 100
    assert not generated_records(s, 0, 100, keys=7, start_time_ms=1_000, seed=1).equals(a.slice(0, 100))


# -- generate() ---------------------------------------------------------------------------------------


class FakeClock:
    def __init__(self, step_jitter: float = 0.0) -> None:
        self.now = 1000.0
        self.jitter = step_jitter
        self.sleeps = 0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps += 1
        self.now += seconds + self.jitter * (self.sleeps % 3)


def _all_records(log: Any) -> pa.Table:
    ends = log.end_offsets()
    return pa.concat_tables([log.read(p, 0, e) for p, e in enumerate(ends)]).sort_by("seq")


def test_generate_writes_exactly_the_schedule_with_a_fake_clock(make_log: Any, caplog: pytest.LogCaptureFixture) -> None:
    log = make_log("key string, value long, ts timestamp, seq long", 3)
    sched = RateSchedule.parse("2000/s for 3s, 500/s to 0/s for 2s, 333/s for 0.5s")
    clock = FakeClock(step_jitter=0.013)
    with caplog.at_level(logging.INFO, logger="keyscale"):
        r = generate(log, sched, keys=20, start_time=1_700_000_000.5, tick=0.1, clock=clock, sleep=clock.sleep, report_every=1.0)
    assert r.records == sched.total_records == 6000 + 500 + 166
    assert r.start_time_ms == 1_700_000_000_500 and not r.stopped_early
    assert 5.5 <= r.seconds <= 5.7
    assert sum(log.end_offsets()) == r.records
    got = _all_records(log)
    assert got.equals(generated_records(sched, 0, r.records, keys=20, start_time_ms=r.start_time_ms))
    for p, e in enumerate(log.end_offsets()):  # keyed on key
        assert set(partition_of(log.read(p, 0, e), ["key"], 3).tolist()) <= {p}
    progress = [rec.getMessage() for rec in caplog.records if "records written" in rec.getMessage()]
    assert len(progress) >= 4 and any("2,000/s now" in m for m in progress)


def test_generate_catches_up_in_bounded_batches_and_writes_a_subset_of_columns(tmp_path: Path) -> None:
    log = create_log(tmp_path / "l", "ts timestamp, key string", 2)
    sched = RateSchedule.parse("10000/s for 1s")
    clock = FakeClock()
    clock.sleep = lambda s: setattr(clock, "now", clock.now + 0.75)  # type: ignore[method-assign]
    r = generate(log, sched, keys=3, start_time=0, tick=0.1, clock=clock, sleep=clock.sleep, max_batch=999)
    assert r.records == 10_000 == sum(log.end_offsets())
    rows = pa.concat_tables([log.read(p, 0, e) for p, e in enumerate(log.end_offsets())])
    assert rows.column_names == ["ts", "key"]
    expected = generated_records(sched, 0, 10_000, keys=3, start_time_ms=0)
    assert sorted(zip(rows.column("ts").to_pylist(), rows.column("key").to_pylist(), strict=True)) == sorted(
        zip(expected.column("ts").to_pylist(), expected.column("key").to_pylist(), strict=True)
    )


def test_generate_stops_early_and_refuses_foreign_columns(tmp_path: Path) -> None:
    log = create_log(tmp_path / "l", "key string, seq long", 1)
    stop = threading.Event()
    clock = FakeClock()

    def sleep(s: float) -> None:
        clock.now += s
        if clock.now - 1000.0 >= 1.0:
            stop.set()

    r = generate(log, "100/s for 10s", keys=2, clock=clock, sleep=sleep, stop=stop)
    assert r.stopped_early and 95 <= r.records <= 110 and log.end_offsets() == [r.records]
    other = create_log(tmp_path / "o", "key string, price double", 1)
    with pytest.raises(LogError, match="column 'price', which the generator does not produce"):
        generate(other, "1/s for 1s")
    with pytest.raises(ScheduleError, match="number of keys"):
        generate(log, "1/s for 1s", keys=0)


def test_generator_in_a_background_thread(make_log: Any) -> None:
    log = make_log("key string, value long, ts timestamp, seq long", 2)
    g = start_generator(log, "4000/s for 0.5s", keys=5, tick=0.05)
    g.join(30)
    assert not g.is_alive() and g.error is None and g.result is not None
    assert g.result.records == 2000 == sum(log.end_offsets())
    assert _all_records(log).column("seq").to_pylist() == list(range(2000))
