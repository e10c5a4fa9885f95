"""keyscale.latency: the summaries executors send and the latency the driver computes at
the commit, against the exact figures computed from every record's append time."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keyscale.latency import (
    ALPHA,
    MIN_AGE,
    PROMETHEUS_BUCKETS,
    Ages,
    LatencyTotals,
    ages,
    at_commit,
    bucket_of,
    merge_ages,
    quantile,
    representative,
    window_quantile,
)

ages_s = st.floats(min_value=0.0, max_value=3600.0, allow_nan=False, allow_infinity=False)
# A batch: per task, its records' ages at its end, and how long before the commit it ended.
tasks = st.lists(st.tuples(st.lists(ages_s, min_size=1, max_size=40), st.floats(min_value=0.0, max_value=30.0)), min_size=1, max_size=5)


def exact_quantile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[max(1, math.ceil(q * len(s) - 1e-9)) - 1]


def batch(spec: list[tuple[list[float], float]], committed: float = 1_000_000.0) -> tuple[list[Ages | None], list[float]]:
    """The tasks' summaries and every record's true latency."""
    summaries, truth = [], []
    for record_ages, before_commit in spec:
        ended = committed - before_commit
        appended = np.array([ended - a for a in record_ages])
        summaries.append(ages(appended, ended, "test"))
        truth += [committed - t for t in appended]
    return summaries, truth


@given(ages_s)
def test_a_bucket_stands_for_its_ages_within_alpha(age: float) -> None:
    assert abs(representative(bucket_of(age)) - age) <= ALPHA * age + MIN_AGE + 1e-12


@given(tasks, st.sampled_from([0.5, 0.9, 0.99, 1.0]), st.floats(0.0, 2_000.0))
@settings(max_examples=200, deadline=None)
def test_batch_quantiles_are_within_alpha_and_max_and_lag_are_exact(spec: list[tuple[list[float], float]], q: float, took: float) -> None:
    summaries, truth = batch(spec)
    lat = at_commit(summaries, 1_000_000.0, began=1_000_000.0 - took)
    assert lat is not None and lat.records == len(truth)
    # Append times go through Unix seconds (~1e6): allow their float error.
    eps = 1e-6
    assert lat.max_seconds == pytest.approx(max(truth), abs=eps)
    assert lat.min_seconds == pytest.approx(min(truth), abs=eps)
    # The lag: the oldest record's wait when the batch began ``took`` seconds before its
    # commit; none for a record appended after it began.
    assert lat.lag_seconds == pytest.approx(max(0.0, max(truth) - took), abs=eps)
    assert at_commit(summaries, 1_000_000.0) == replace(lat, lag_seconds=None)  # no start given, no lag made up
    for got, p in ((lat.p50_seconds, 0.5), (lat.p99_seconds, 0.99)):
        want = exact_quantile(truth, p)
        assert abs(got - want) <= ALPHA * want + MIN_AGE + eps
        assert lat.min_seconds <= got <= lat.max_seconds


@given(st.lists(tasks, min_size=1, max_size=4), st.sampled_from([0.5, 0.99, 1.0]))
@settings(max_examples=100, deadline=None)
def test_a_window_of_batches_is_within_twice_alpha(specs: list[list[tuple[list[float], float]]], q: float) -> None:
    lats, truth = [], []
    for spec in specs:
        summaries, t = batch(spec)
        lats.append(at_commit(summaries, 1_000_000.0))
        truth += t
    want = exact_quantile(truth, q)
    got = window_quantile(lats, q)
    assert got is not None
    assert abs(got - want) <= ((1 + ALPHA) ** 2 - 1) * want + 2 * MIN_AGE + 1e-6


@given(st.lists(ages_s, min_size=1, max_size=30), st.lists(ages_s, min_size=1, max_size=30))
def test_summaries_of_one_task_merge_as_if_taken_at_once(a: list[float], b: list[float]) -> None:
    ended = 5000.0
    one = ages(np.array([ended - x for x in a + b]), ended, "test")
    merged = merge_ages(ages(np.array([ended - x for x in a]), ended, "test"), ages(np.array([ended - x for x in b]), ended, "test"))
    assert merged == one


@given(tasks)
@settings(deadline=None)
def test_the_wire_form_round_trips(spec: list[tuple[list[float], float]]) -> None:
    for s in batch(spec)[0]:
        assert s is not None
        assert Ages.from_wire(s.to_wire()) == s


@given(st.lists(tasks, min_size=1, max_size=3))
@settings(deadline=None)
def test_prometheus_totals_count_every_record_once(specs: list[list[tuple[list[float], float]]]) -> None:
    totals, n = LatencyTotals(), 0
    for spec in specs:
        summaries, truth = batch(spec)
        totals.add(at_commit(summaries, 1_000_000.0))
        n += len(truth)
    cum = totals.cumulative()
    assert cum[-1] == ("+Inf", n) and totals.total == n
    assert [c for _, c in cum] == sorted(c for _, c in cum)
    assert [le for le, _ in cum[:-1]] == [repr(float(b)) for b in PROMETHEUS_BUCKETS]


def test_no_append_times_is_no_latency_not_zero() -> None:
    assert ages(np.array([]), 1.0, "t") is None
    assert ages(np.array([np.nan]), 1.0, "t") is None
    assert at_commit([None, None], 10.0) is None
    assert at_commit([], 10.0) is None
    assert window_quantile([None], 0.99) is None
    totals = LatencyTotals()
    totals.add(None)
    assert totals.total == 0


def test_a_batch_record_whose_histogram_was_dropped_is_left_out_of_a_window() -> None:
    kept = at_commit([ages(np.array([9.0]), ended=10.0, clock="t")], committed=10.0)
    dropped = at_commit([ages(np.array([0.0]), ended=10.0, clock="t")], committed=10.0)
    assert kept is not None and dropped is not None
    assert window_quantile([replace(dropped, buckets={})], 0.99) is None
    assert window_quantile([kept, replace(dropped, buckets={})], 1.0) == pytest.approx(1.0, rel=ALPHA)


def test_append_times_after_the_commit_count_as_zero_latency() -> None:
    # A producer's CreateTime ahead of the driver's clock.
    lat = at_commit([ages(np.array([20.0, 21.0]), ended=10.0, clock="kafka CreateTime")], committed=11.0)
    assert lat is not None and lat.max_seconds == 0.0 and lat.p99_seconds == 0.0 and lat.records == 2


def test_quantile_needs_values() -> None:
    with pytest.raises(ValueError):
        quantile([], 0.5)


def test_metrics_serve_a_real_histogram_and_the_last_measured_batch() -> None:
    from prometheus_client.exposition import generate_latest
    from prometheus_client.parser import text_string_to_metric_families
    from prometheus_client.registry import CollectorRegistry

    from keyscale.runtime.batch.jobstate import BatchRecord, RunSummary
    from keyscale.runtime.control.metrics import families

    # 100 records: 90 appended 0.2 s and 10 appended 3 s before their task ended, 0.1 s before the commit.
    lat = at_commit([ages(np.array([99.8] * 90 + [97.0] * 10), ended=100.0, clock="test")], committed=100.1)
    assert lat is not None
    summary = RunSummary("j", "d", batches=[BatchRecord(0, 1.0, 100, 1, {}, latency=lat), BatchRecord(1, 1.0, 0, 0, {})])
    summary.latency.add(lat)
    status = {"job": "j", "state": "running", "latency": {"batch": 0, **lat.to_json()}}

    class Fixed:
        def collect(self) -> Any:
            return families(status, None, summary, 0)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Fixed())  # type: ignore[arg-type]
    parsed = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    hist = parsed["keyscale_end_to_end_latency_seconds"]
    assert hist.type == "histogram"
    got = {(s.name, s.labels.get("le")): s.value for s in hist.samples}
    assert got[("keyscale_end_to_end_latency_seconds_bucket", "0.25")] == 0 and got[("keyscale_end_to_end_latency_seconds_bucket", "0.5")] == 90
    assert got[("keyscale_end_to_end_latency_seconds_bucket", "5.0")] == 100 and got[("keyscale_end_to_end_latency_seconds_count", None)] == 100
    assert got[("keyscale_end_to_end_latency_seconds_sum", None)] == pytest.approx(90 * 0.3 + 10 * 3.1, rel=ALPHA)
    last = {s.labels["quantile"]: s.value for s in parsed["keyscale_last_batch_latency_seconds"].samples}
    assert last["0.5"] == pytest.approx(0.3, rel=ALPHA) and last["0.99"] == pytest.approx(3.1, rel=ALPHA) and last["1"] == pytest.approx(3.1)
