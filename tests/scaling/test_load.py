"""The autoscaler's load (keyscale.scaling.load): pure functions of the batches' metrics."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

import keyscale.scaling.load as load_module
from keyscale.scaling.load import Sample, arrival_period, batch_sample, measure_load
from keyscale.scaling.model import AutoscalerConfig, BatchMetrics


def _metrics(
    records: int, batch_seconds: float, trigger: float | None, backlog: int | None
) -> BatchMetrics:
    return BatchMetrics(
        time=10.0, uid="op", parallelism=1, max_parallelism=8, input_records=records,
        batch_seconds=batch_seconds, trigger_interval_seconds=trigger, busy_seconds=(batch_seconds,),
        records=(records,), backlog_records=backlog,
    )  # fmt: skip


def test_the_source_s_input_rate_wins_over_records_per_period() -> None:
    m = BatchMetrics(time=0.0, uid="op", parallelism=1, max_parallelism=1, input_records=50,
                     batch_seconds=1.0, trigger_interval_seconds=None, busy_seconds=(1.0,),
                     records=(50,), input_rate=7.0)  # fmt: skip
    assert batch_sample(m, period=5.0, warmup=False).input_rate == 7.0
    assert batch_sample(_metrics(50, 1.0, None, None), period=5.0, warmup=True).input_rate == 10.0
    assert batch_sample(_metrics(50, 0.0, None, None), period=0.0, warmup=True).input_rate == 0.0


def test_an_overrun_adds_what_arrived_meanwhile_to_the_backlog() -> None:
    m = _metrics(1_000, 8.0, 5.0, 100)
    load = measure_load(m, [], 100.0, AutoscalerConfig(catch_up_seconds=10.0))
    assert load.backlog == 100 + 100.0 * 3.0
    assert load.target_rate == 100.0 + 40.0
    assert "backlog 400 over 10 s catch-up" in load.text(AutoscalerConfig(catch_up_seconds=10.0))


def test_arrival_period_is_the_time_since_the_previous_batch() -> None:
    m = _metrics(0, 2.0, None, None)
    assert arrival_period(m, 4.0) == 6.0
    assert arrival_period(m, 10.0) == 2.0  # the same start: the batch's own duration


# A rate is 0 or at least a record per ~12 days: a subnormal rate (hypothesis found
# 5e-324) underflows rate * period to 0, a number no batch measures.
rates = st.one_of(st.just(0.0), st.floats(min_value=1e-6, max_value=1e7))


@settings(max_examples=100, deadline=None)
@given(
    rate=rates,
    backlog=st.one_of(st.none(), st.integers(min_value=0, max_value=10**9)),
    batch_seconds=st.floats(min_value=0.0, max_value=600.0),
    trigger=st.one_of(st.none(), st.floats(min_value=0.1, max_value=600.0)),
    restart=st.floats(min_value=0.0, max_value=600.0),
)
def test_the_target_rate_is_the_input_plus_a_catch_up_that_is_never_negative(
    rate: float, backlog: int | None, batch_seconds: float, trigger: float | None, restart: float
) -> None:
    cfg = AutoscalerConfig(restart_seconds=restart)
    load = measure_load(_metrics(0, batch_seconds, trigger, backlog), [], rate, cfg)
    assert load.rate == rate
    assert load.catch_up_rate >= 0.0
    assert load.target_rate >= rate
    if not backlog and not restart and (trigger is None or batch_seconds <= trigger):
        assert load.target_rate == rate and load.text(cfg).endswith(
            " needs " + load_module.fmt(rate) + " rec/s"
        )


@settings(max_examples=100, deadline=None)
@given(
    # A batch's busy period is 0 (nothing ran) or at least a millisecond: a subnormal period
    # would underflow rate * period to 0, a case no batch produces.
    st.lists(st.tuples(rates, st.one_of(st.just(0.0), st.floats(min_value=1e-3, max_value=100.0))), min_size=1, max_size=12)
)
def test_the_window_rate_is_a_weighted_mean_of_the_samples(
    samples: list[tuple[float, float]],
) -> None:
    window = [
        Sample(float(i), period, rate, 0, 0.0, 0.0, False)
        for i, (rate, period) in enumerate(samples)
    ]
    load = measure_load(_metrics(0, 1.0, None, None), window, 42.0, AutoscalerConfig())
    if sum(p for _, p in samples) > 0:
        lo, hi = min(r for r, p in samples if p > 0), max(r for r, p in samples if p > 0)
        assert lo * (1 - 1e-9) <= load.rate_window <= hi * (1 + 1e-9)
    else:
        assert load.rate_window == 42.0


def test_a_sample_keeps_the_batch_latency_for_a_latency_slo_over_the_window() -> None:
    import numpy as np

    from keyscale.latency import ages, at_commit, window_quantile

    def batch(t: float, latency_s: float) -> BatchMetrics:
        lat = at_commit([ages(np.array([t - latency_s] * 10), ended=t, clock="test")], committed=t)
        return BatchMetrics(time=t, uid="op", parallelism=1, max_parallelism=8, input_records=10, batch_seconds=1.0,
                            trigger_interval_seconds=None, busy_seconds=(0.5,), records=(10,), latency=lat)

    window = [batch_sample(batch(float(t), s), period=1.0, warmup=False) for t, s in ((1, 0.5), (2, 0.5), (3, 6.0))]
    p99 = window_quantile([s.latency for s in window], 0.99)
    assert p99 is not None and abs(p99 - 6.0) <= 0.05 * 6.0
    assert batch_sample(BatchMetrics(time=1.0, uid="op", parallelism=1, max_parallelism=8, input_records=0, batch_seconds=1.0,
                                     trigger_interval_seconds=None, busy_seconds=(0.0,), records=(0,)), 1.0, False).latency is None


@given(st.integers(0, 10**6), st.integers(0, 10**6), st.integers(0, 10**6), st.floats(0.5, 60.0))
def test_a_batch_s_input_is_its_reads_plus_the_backlog_s_growth(read: int, before: int, after: int, period: float) -> None:
    """What arrived over a batch's period is what it read plus how much the source's backlog
    grew (a read limit leaves the rest there); never negative."""
    m = BatchMetrics(time=0.0, uid="op", parallelism=1, max_parallelism=8, input_records=read, batch_seconds=1.0,
                     trigger_interval_seconds=5.0, busy_seconds=(1.0,), records=(read,), backlog_records=after)  # fmt: skip
    s = batch_sample(m, period, warmup=False, last_backlog=before)
    assert math.isclose(s.input_rate, max(0, read + after - before) / period)
    assert batch_sample(m, period, warmup=False).input_rate == read / period  # no earlier backlog: reads only
