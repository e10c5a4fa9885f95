"""The simulator's latency model: records read oldest first, each batch's end-to-end latency."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from keyscale.latency import window_quantile
from keyscale.scaling.arrivals import ArrivalQueue, Segment, batch_latency
from keyscale.scaling.simulate import simulate
from keyscale.scaling.traces import default_job, steady, step_up

segments = st.lists(
    st.tuples(st.floats(0.1, 50.0), st.floats(1.0, 5000.0)), min_size=1, max_size=8
)


def queue_of(spec: list[tuple[float, float]]) -> tuple[ArrivalQueue, float]:
    q, t = ArrivalQueue(), 0.0
    for width, count in spec:
        q.push(t, t + width, count)
        t += width
    return q, t


@given(segments, st.floats(0.0, 1.0))
def test_a_batch_reads_the_oldest_records_and_none_is_lost(spec: list[tuple[float, float]], share: float) -> None:
    q, _ = queue_of(spec)
    total = q.records
    read = q.pop(total * share)
    got = sum(s.count for s in read)
    assert abs(got + q.records - total) < 1e-6 * total + 1e-6
    assert abs(got - total * share) < 1e-6 * total + 1e-6
    # Oldest first: everything read arrived no later than anything left.
    if read and q.oldest is not None:
        assert max(s.end for s in read) <= q.oldest + 1e-9


@given(segments, st.floats(0.0, 30.0))
def test_a_batch_latency_is_commit_minus_arrival(spec: list[tuple[float, float]], after: float) -> None:
    q, end = queue_of(spec)
    read = q.pop(q.records)
    committed = end + after
    lat = batch_latency(read, committed)
    assert lat is not None
    assert lat.records == round(sum(s.count for s in read))
    assert lat.max_seconds == committed - read[0].start  # the oldest record, exactly
    assert lat.min_seconds == committed - read[-1].end
    assert lat.min_seconds <= lat.p50_seconds <= lat.p99_seconds <= lat.max_seconds
    assert sum(lat.buckets.values()) == lat.records


def test_no_records_no_latency() -> None:
    assert batch_latency([], committed=3.0) is None
    assert batch_latency([Segment(0.0, 1.0, 0.0)], committed=3.0) is None


@given(st.floats(500.0, 3500.0), st.floats(1.05, 3.0))
def test_latency_is_monotone_in_load_at_a_fixed_parallelism(rate: float, more: float) -> None:
    job = default_job(initial_parallelism=4, max_records_per_subtask=10_000)
    low = simulate(steady(rate=rate, duration=120, job=job), mode="off")
    high = simulate(steady(rate=rate * more, duration=120, job=job), mode="off")
    assert window_quantile([b.metrics.latency for b in high.batches], 0.99) >= window_quantile(
        [b.metrics.latency for b in low.batches], 0.99
    )


def test_latency_grows_with_the_backlog() -> None:
    # P=4 does 4,000 rec/s: from t=60 s on 8,000 arrive, the backlog and the latency grow.
    job = default_job(initial_parallelism=4, max_records_per_subtask=5000)
    r = simulate(step_up(low=2000, high=8000, at=60, duration=300, job=job), mode="off")
    behind = [(b.pending_records, b.metrics.latency.p99_seconds) for b in r.batches if b.metrics.time > 70]
    assert all(a[0] < b[0] and a[1] < b[1] for a, b in itertools.pairwise(behind))
    # Keeping up, a record waits at most one trigger interval plus its batch.
    steady_part = [b for b in r.batches if 5 < b.metrics.time < 60]
    assert all(b.metrics.latency.max_seconds <= 5.0 + b.metrics.batch_seconds + 1e-9 for b in steady_part)


def test_a_restart_delays_every_record_that_arrives_during_it() -> None:
    trace = step_up(low=2400, high=20000, at=120, duration=600)
    live = simulate(trace)
    restarted = simulate(trace, rescale_seconds=30.0)
    assert restarted.downtime_seconds == 30.0 * len(restarted.changes) > 0
    worst = lambda r: max(b.metrics.latency.max_seconds for b in r.batches)  # noqa: E731
    assert worst(restarted) >= worst(live) + 30.0 - 5.0
    # Records are neither lost nor made up by a pause.
    for r in (live, restarted):
        last = r.batches[-1]
        arrived = trace.arrivals(-trace.job.trigger_interval_seconds, last.metrics.time)
        assert abs(arrived - sum(b.metrics.input_records for b in r.batches) - last.unread_records) < 1
