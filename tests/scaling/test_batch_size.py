"""The latency-aware batch size (keyscale.scaling.batch_size, issue 35 item 3): throughput
holds first (a batch reads at least what arrives while it runs), the latency target when
the rate allows, and the limit moves the right way with the rate and the target."""

from __future__ import annotations

import math

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from keyscale.scaling.batch_size import (
    HEADROOM,
    batch_records,
    fit_cost,
    keep_up_records,
    latency_records,
)

targets = st.floats(0.05, 60.0)
fixed = st.floats(0.0, 5.0)
per_record = st.one_of(st.just(0.0), st.floats(1e-8, 1e-2))
rates = st.one_of(st.just(0.0), st.floats(1e-3, 1e6))


@settings(max_examples=300, deadline=None)
@given(targets, fixed, per_record, rates)
def test_a_batch_of_the_limit_reads_at_least_what_arrives_while_it_runs(t: float, f: float, c: float, rate: float) -> None:
    s = batch_records(t, f, c, rate)
    assert s.records is None or s.records >= 1
    if rate * c >= 1:
        assert s.records is None and not s.meets_target  # no size keeps up: no limit, and said so
        return
    if s.records is not None:
        assert s.batch_seconds is not None
        assert s.records >= rate * s.batch_seconds * (1 - 1e-9)  # the lag does not grow
        assert s.records >= math.floor(keep_up_records(rate, f, c) * HEADROOM)


@settings(max_examples=300, deadline=None)
@given(targets, fixed, per_record, rates)
def test_the_target_holds_whenever_keeping_up_leaves_room_for_it(t: float, f: float, c: float, rate: float) -> None:
    assume(rate * c < 1)
    need = keep_up_records(rate, f, c) * HEADROOM
    room = latency_records(t, f, c)
    assume(room >= 1 and (math.isinf(room) or math.ceil(need) <= math.floor(room)))
    s = batch_records(t, f, c, rate)
    assert s.meets_target
    if s.records is not None:
        assert 2 * (f + c * s.records) <= t * (1 + 1e-9)  # two batch times: the record's wait and its own batch
        assert s.records >= math.floor(room * (1 - 1e-9))  # and no smaller than the target allows


@settings(max_examples=200, deadline=None)
@given(targets, fixed, per_record, rates, st.floats(1.0, 100.0))
def test_more_input_never_shrinks_the_limit(t: float, f: float, c: float, rate: float, more: float) -> None:
    a, b = batch_records(t, f, c, rate), batch_records(t, f, c, rate * more)
    assert b.records is None or (a.records is not None and b.records >= a.records)


@settings(max_examples=200, deadline=None)
@given(targets, fixed, per_record, rates, st.floats(1.0, 100.0))
def test_a_looser_target_never_shrinks_the_limit(t: float, f: float, c: float, rate: float, looser: float) -> None:
    a, b = batch_records(t, f, c, rate), batch_records(t * looser, f, c, rate)
    assert b.records is None or (a.records is not None and b.records >= a.records)


@settings(max_examples=200, deadline=None)
@given(targets, fixed, per_record, rates, st.integers(1, 10**7), st.integers(1, 64))
def test_the_jobs_cap_wins_and_partitions_share_the_limit(t: float, f: float, c: float, rate: float, cap: int, parts: int) -> None:
    s = batch_records(t, f, c, rate, cap=cap)
    if rate * c < 1:
        assert s.records is not None and s.records <= cap
    per = s.per_partition(parts)
    assert per is None or (per >= 1 and per * parts >= (s.records or 0))


@settings(max_examples=200, deadline=None)
@given(st.floats(0.0, 5.0), st.floats(0.0, 1e-3), st.lists(st.integers(0, 10**6), min_size=2, max_size=30))
def test_fit_cost_finds_the_costs_of_batches_that_follow_them(f: float, c: float, records: list[int]) -> None:
    got_f, got_c = fit_cost([(n, f + c * n) for n in records])
    assert got_f >= 0 and got_c >= 0
    if len(set(records)) > 1:
        assert got_f == pytest.approx(f, abs=1e-6 + 1e-6 * c * max(records)) and got_c == pytest.approx(c, rel=1e-6, abs=1e-12)


def test_light_input_gets_small_batches_and_heavy_input_large_ones() -> None:
    # The measured shape (docs/benchmarks.md): ~0.5 s fixed, ~20 µs a record, a 1 s target.
    light = batch_records(1.0, 0.5, 2e-5, rate=100)
    heavy = batch_records(1.0, 0.5, 2e-5, rate=40_000)
    assert light.records is not None and heavy.records is not None
    assert light.records < heavy.records
    assert not light.meets_target  # 0.5 s of fixed cost leaves no room for two batches in 1 s
    assert "keeping up" in heavy.reason


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError):
        batch_records(0, 0.1, 1e-5, 10)
    with pytest.raises(ValueError):
        fit_cost([])
