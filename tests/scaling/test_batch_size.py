"""The latency-aware batch size (keyscale.scaling.batch_size, issue 35 item 3): throughput
holds first (a batch reads at least what arrives while it runs), the latency target when
the rate allows, and the limit moves the right way with the rate and the target."""

from __future__ import annotations

import math

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from keyscale.scaling.batch_size import (
    GROWTH,
    HEADROOM,
    PROBE_RECORDS,
    arrival_rate,
    batch_records,
    fit_cost,
    keep_up_records,
    latency_records,
    next_batch,
    waiting_records,
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


# -- a running job's next batch (next_batch, arrival_rate): what runtime/batch/sizing.py uses

histories = st.lists(st.tuples(st.integers(0, 10**6), st.floats(0.0, 30.0)), min_size=1, max_size=20)


@settings(max_examples=300, deadline=None)
@given(targets, histories, rates)
def test_the_next_batch_is_never_below_keeping_up_nor_far_beyond_what_was_measured(t: float, batches: list[tuple[int, float]], rate: float) -> None:
    f, c = fit_cost(batches)
    s = next_batch(t, batches, rate)
    bound = GROWTH * max(PROBE_RECORDS, max(n for n, _ in batches))
    assert s.records is not None and s.records >= 1
    if rate * c >= 1:  # no size keeps up: the measured bound, and said so
        assert s.records == bound and not s.meets_target
        return
    need = math.ceil(keep_up_records(rate, f, c) * HEADROOM)
    assert s.records >= need  # throughput first: the lag does not grow, whatever was measured
    assert s.records <= max(bound, need)  # and no further beyond the batches measured than that needs
    unbounded = batch_records(t, f, c, rate)
    if unbounded.records is not None and unbounded.records <= max(bound, need):
        assert s == unbounded


@settings(max_examples=200, deadline=None)
@given(targets, histories)
def test_without_a_measured_rate_the_next_batch_grows_from_the_batches_measured(t: float, batches: list[tuple[int, float]]) -> None:
    s = next_batch(t, batches, None)
    assert s.records == GROWTH * max(PROBE_RECORDS, max(n for n, _ in batches))
    assert not s.meets_target and "not measured yet" in s.reason


@settings(max_examples=200, deadline=None)
@given(targets, histories, st.one_of(st.none(), rates), st.floats(1.0, 100.0))
def test_a_looser_target_never_shrinks_the_next_batch(t: float, batches: list[tuple[int, float]], rate: float | None, looser: float) -> None:
    a, b = next_batch(t, batches, rate), next_batch(t * looser, batches, rate)
    assert a.records is not None and b.records is not None and b.records >= a.records


@settings(max_examples=200, deadline=None)
@given(targets, st.one_of(st.none(), st.integers(1, 10**6)))
def test_the_first_batch_probes_the_costs_within_the_jobs_cap(t: float, cap: int | None) -> None:
    s = next_batch(t, [], None, cap=cap)
    assert s.records == (PROBE_RECORDS if cap is None else min(cap, PROBE_RECORDS))
    assert not s.meets_target and "no batch measured" in s.reason


@settings(max_examples=300, deadline=None)
@given(st.floats(0.0, 1e5), st.floats(0.0, 1e4), st.lists(st.tuples(st.floats(0.01, 10.0), st.floats(0.0, 1.0)), min_size=1, max_size=15))
def test_arrival_rate_is_the_rate_records_arrived_at_whatever_the_batches_read(rate: float, backlog: float, batches: list[tuple[float, float]]) -> None:
    """A model of the input: records arrive at ``rate``; each batch takes some seconds and
    reads a share of what waits. The rate measured from the batches is the model's."""
    now, waiting, seen = 0.0, backlog, [(0.0, 0, int(backlog))]
    for seconds, share in batches:
        now += seconds
        waiting += rate * seconds
        read = math.floor(waiting * share)
        waiting -= read
        seen.append((now, read, math.floor(waiting)))
    got = arrival_rate(seen)
    assert got is not None
    # Whole records: the backlog's fractions are at most one record at either end.
    assert got == pytest.approx(rate, abs=2 / now + 1e-6 * rate)


def test_arrival_rate_needs_two_batches_with_a_known_backlog() -> None:
    assert arrival_rate([]) is None
    assert arrival_rate([(1.0, 10, 0)]) is None
    assert arrival_rate([(1.0, 10, None), (2.0, 10, 0)]) is None
    assert arrival_rate([(1.0, 10, 0), (1.0, 10, 0)]) is None  # no time between them


@settings(max_examples=300, deadline=None)
@given(st.floats(0.01, 3.0), st.floats(1e-6, 1e-2), st.integers(1, 10**6), st.floats(0.5, 10.0))
def test_while_executors_are_awaited_a_batch_runs_about_the_window_and_grows_to_it(f: float, c: float, n: int, within: float) -> None:
    """A job whose batches cost ``f + c n``: a batch sized from the last one's pace takes at
    most the fixed cost plus the window (so the job looks for its executors again that
    soon), and after a batch shorter than the window the next one is larger (one tiny batch
    does not keep the job in tiny batches)."""
    seconds = f + c * n
    nxt = waiting_records(n, seconds, within)
    assert nxt is not None and nxt >= 1
    assert f + c * nxt <= f + within + c * 1.000001  # rounding up adds at most one record
    if seconds < within:
        assert nxt > n


def test_a_batch_that_read_nothing_measures_no_pace_and_sets_no_limit() -> None:
    assert waiting_records(0, 0.4) is None and waiting_records(10, 0.0) is None
