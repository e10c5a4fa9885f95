"""Flink's Kubernetes-operator autoscaler, reimplemented from its documentation, for
side-by-side comparisons with keyscale's policy (``bench/autoscale.py``). Pure: batch
metrics in, decisions out, the same call as :class:`keyscale.scaling.policy.Autoscaler`.

Followed (facts from the documentation, no code copied), flink-kubernetes-operator:

* ``docs/content/docs/custom-resource/autoscaler.md`` (the algorithm's overview, after
  Kalavri et al., "Three steps is all you need", OSDI 2018) and
  ``docs/content/docs/internals/autoscaler.md`` (its formulas: target data rate, catch-up
  rate, utilisation band, true processing rate, scale factor, alignment, delayed
  scale-down);
* ``docs/layouts/shortcodes/generated/auto_scaler_configuration.html`` (the
  ``job.autoscaler.*`` options and defaults: the fields of :class:`FlinkConfig`).

One vertex here: keyscale's keyed operator reads the source itself, so it is a source
vertex (its target data rate is the source's). Per evaluation, over the samples of the
metrics window:

* ``TARGET = max(0, input rate + lag rate)`` (records read per second, plus the growth
  of the source's lag: the arrival rate), ``CATCH_UP = lag / catch-up.duration`` (the
  internals page reads as if it were undefined outside a backlog, which would leave both
  thresholds undefined and no scaling at all without one; it is taken as defined always,
  0 without a lag);
* backlog: ``lag / input rate > backlog-processing.lag-threshold``: then the upper
  utilisation is 1.0 and the lower one 0 (no scale-down while catching up); else
  ``target ± boundary`` (0.7 ± 0.3 = 1.0 / 0.4 by default);
* true processing rate (busy-time aggregator MAX): the mean records-in rate over the mean
  busy share of the busiest subtask (busy time whole: Flink's busyTimeMsPerSecond does not
  take GC pauses out either, so ``BatchMetrics.gc_seconds`` is not read); switched to the observed rate (records-in rate over
  the non-backpressured share, 1 here: one vertex has nothing downstream to wait for) of
  samples taken while catching up, when there are at least 2 of them and the busy-time
  estimate is more than 15 % above it;
* ``SCALE_UP = CATCH_UP + TARGET / upper``,
  ``SCALE_DOWN = CATCH_UP + TARGET * restart / catch-up + TARGET / lower``;
* ``factor = (CATCH_UP + TARGET * restart / catch-up + TARGET / target) / TPR``, capped to
  ``[1 - scale-down.max-factor, 1 + scale-up.max-factor]``; ``P' = ceil(P * factor)``
  within ``[vertex.min-parallelism, min(vertex.max-parallelism, key groups)]``, then the
  first divisor of the key groups from ``P'`` up (to the key groups on a scale-up, below
  ``P`` on a scale-down), ``P'`` itself if there is none;
* a scale-up is applied when ``TPR < SCALE_UP``; a scale-down is recorded, and applied
  once ``scale-down.interval`` has passed since the first of an uninterrupted run of
  scale-down recommendations, at the highest parallelism recommended in that interval,
  if ``TPR > SCALE_DOWN`` then; an evaluation that recommends no scale-down ends the run;
* after the job (re)starts, no metrics are collected for ``stabilization.interval``, and
  no decision is made until the samples span ``metrics.window``; one sample per
  ``reconcile_seconds`` (the operator's reconcile loop).

Rescaling through the operator is a job upgrade (a stop with savepoint and a restore):
the simulator charges ``rescale_seconds`` of downtime per rescale
(``keyscale.scaling.simulate.simulate``). ``restart.time`` stays at its default (5 min)
for sizing, as ``restart.time-tracking.enabled`` is off by default. Not modelled:
memory tuning, quotas, excluded periods, the observed-scalability correction and
effectiveness detection (both off by default), GC-pressure gates (1.0: never).

A step from 2,400 to 20,000 rec/s at 2 min: the first decision comes once 5 min of
stabilisation and a 15 min window have passed; the scale-down to what the load needs
waits an hour:

>>> from keyscale.scaling.simulate import simulate
>>> from keyscale.scaling.traces import default_job, step_up
>>> job = default_job(max_records_per_subtask=10_000)
>>> r = simulate(step_up(duration=7200, job=job), policy=FlinkAutoscaler(), rescale_seconds=20)
>>> [(d.time // 60, d.current_parallelism, d.target_parallelism) for d in r.changes]
[(20.0, 4, 64), (100.0, 64, 32)]
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from keyscale.scaling.model import Action, BatchMetrics, Decision

__all__ = ["FlinkAutoscaler", "FlinkConfig"]


@dataclass(frozen=True)
class FlinkConfig:
    """``job.autoscaler.*`` options at their documented defaults (durations in seconds).

    >>> c = FlinkConfig()
    >>> c.metrics_window_seconds / 60, c.upper_utilization, round(c.lower_utilization, 2)
    (15.0, 1.0, 0.4)
    """

    metrics_window_seconds: float = 900.0  # metrics.window: 15 min
    stabilization_seconds: float = 300.0  # stabilization.interval: 5 min
    target_utilization: float = 0.7  # target.utilization
    utilization_boundary: float = 0.3  # target.utilization.boundary
    scale_down_interval_seconds: float = 3600.0  # scale-down.interval: 1 h
    scale_down_max_factor: float = 0.6  # scale-down.max-factor
    scale_up_max_factor: float = 100000.0  # scale-up.max-factor
    restart_seconds: float = 300.0  # restart.time: 5 min
    catch_up_seconds: float = 1800.0  # catch-up.duration: 30 min
    backlog_lag_threshold_seconds: float = 300.0  # backlog-processing.lag-threshold: 5 min
    observed_lag_threshold_seconds: float = 30.0  # observed-true-processing-rate.lag-threshold
    observed_min_observations: int = 2  # observed-true-processing-rate.min-observations
    observed_switch_threshold: float = 0.15  # observed-true-processing-rate.switch-threshold
    min_parallelism: int = 1  # vertex.min-parallelism
    max_parallelism: int = 200  # vertex.max-parallelism
    reconcile_seconds: float = 60.0  # kubernetes.operator.reconcile.interval: 1 min

    @property
    def upper_utilization(self) -> float:
        """Utilisation above which it scales up, outside a backlog (``utilization.max``)."""
        return self.target_utilization + self.utilization_boundary

    @property
    def lower_utilization(self) -> float:
        """Utilisation below which it scales down, outside a backlog (``utilization.min``)."""
        return max(0.0, self.target_utilization - self.utilization_boundary)


@dataclass(frozen=True)
class _Sample:
    time: float
    records_in: float  # since the (re)start
    lag: float
    rate: float  # records read per second since the previous sample
    load: float  # the busiest subtask's busy share since the previous sample


@dataclass
class _Vertex:
    parallelism: int = 0
    started: float = 0.0
    last_tick: float | None = None
    records_in: float = 0.0
    interval_records: float = 0.0
    interval_busy: float = 0.0
    samples: list[_Sample] = field(default_factory=list)
    down_since: float | None = None
    down_recommended: list[tuple[float, int]] = field(default_factory=list)


class FlinkAutoscaler:
    """Flink's operator autoscaler as a policy: :meth:`observe` one batch at a time.

    >>> scaler = FlinkAutoscaler()
    >>> m = BatchMetrics(time=0.0, uid="op", parallelism=4, max_parallelism=128,
    ...                  input_records=5000, batch_seconds=1.25,
    ...                  trigger_interval_seconds=5.0, busy_seconds=(1.25,) * 4,
    ...                  records=(1250,) * 4, backlog_records=0)
    >>> scaler.observe(m).reason
    'between two reconciles'
    >>> from dataclasses import replace
    >>> print(scaler.observe(replace(m, time=60.0)).reason)
    stabilising: no metrics for 300 s after the job (re)started at parallelism 4
    """

    def __init__(self, config: FlinkConfig | None = None) -> None:
        self.config = config if config is not None else FlinkConfig()
        self._vertices: dict[str, _Vertex] = {}

    def observe(self, m: BatchMetrics) -> Decision:
        """Take one batch's metrics into account; decide at each reconcile tick."""
        cfg = self.config
        v = self._vertices.get(m.uid)
        if v is None or v.parallelism != m.parallelism:
            # A (re)start: the history describes another job (the docs: history cleared).
            v = self._vertices[m.uid] = _Vertex(parallelism=m.parallelism, started=m.time)
        now = m.time + m.batch_seconds
        v.records_in += m.input_records
        v.interval_records += m.input_records
        v.interval_busy += max(m.busy_seconds, default=0.0)
        P = m.parallelism

        def none(reason: str, inputs: dict[str, float] | None = None) -> Decision:
            return Decision(now, m.uid, P, P, "none", reason, inputs or {})

        if v.last_tick is None:
            v.last_tick = m.time
        if now - v.last_tick < cfg.reconcile_seconds:
            return none("between two reconciles")
        elapsed = now - v.last_tick
        sample = _Sample(
            now,
            v.records_in,
            float(m.backlog_records or 0),
            v.interval_records / elapsed,
            min(1.0, v.interval_busy / elapsed),
        )
        v.last_tick, v.interval_records, v.interval_busy = now, 0.0, 0.0
        if now - v.started < cfg.stabilization_seconds:
            return none(
                f"stabilising: no metrics for {cfg.stabilization_seconds:g} s after the job "
                f"(re)started at parallelism {P}"
            )
        v.samples.append(sample)
        first = v.samples[0]
        if now - first.time < cfg.metrics_window_seconds:
            return none(
                f"collecting metrics: {now - first.time:.0f} of {cfg.metrics_window_seconds:g} s"
            )
        v.samples = [s for s in v.samples if s.time >= now - cfg.metrics_window_seconds]
        return self._evaluate(m, v, now)

    def _evaluate(self, m: BatchMetrics, v: _Vertex, now: float) -> Decision:
        """The documented evaluation over the window's samples, then the decision."""
        cfg = self.config
        P = m.parallelism
        first, last = v.samples[0], v.samples[-1]
        span = max(last.time - first.time, 1e-9)
        input_rate = (last.records_in - first.records_in) / span
        target = max(0.0, input_rate + (last.lag - first.lag) / span)
        lag = last.lag
        backlog = lag > 0 and (
            input_rate <= 0 or lag / input_rate > cfg.backlog_lag_threshold_seconds
        )
        catch_up = lag / cfg.catch_up_seconds
        upper = 1.0 if backlog else cfg.upper_utilization
        lower = 0.0 if backlog else cfg.lower_utilization
        tpr = _true_processing_rate(v.samples, cfg)
        restart_rate = target * cfg.restart_seconds / cfg.catch_up_seconds
        up_threshold = catch_up + target / upper
        down_threshold = math.inf if lower == 0 else catch_up + restart_rate + target / lower
        inputs = {
            "input_rate": input_rate,
            "target_rate": target,
            "backlog": lag,
            "catch_up_rate": catch_up,
            "true_processing_rate": tpr,
            "scale_up_threshold": up_threshold,
            "scale_down_threshold": down_threshold,
        }
        if not tpr > 0 or not math.isfinite(tpr):
            return Decision(now, m.uid, P, P, "none", "no true processing rate measured", inputs)
        factor = (catch_up + restart_rate + target / cfg.target_utilization) / tpr
        factor = min(max(factor, 1 - cfg.scale_down_max_factor), 1 + cfg.scale_up_max_factor)
        upper_p = min(cfg.max_parallelism, m.max_parallelism)
        raw = min(max(math.ceil(P * factor - 1e-9), cfg.min_parallelism), upper_p)
        new = _align(raw, P, m.max_parallelism, upper_p)
        inputs["scale_factor"] = factor
        why = (
            f"target {target:,.0f} rec/s + catch-up {catch_up:,.0f} rec/s, true processing "
            f"rate {tpr:,.0f} rec/s at {P}: factor {factor:.2f} -> {raw}, aligned {new}"
        )
        action: Action = "none"
        if new > P:
            v.down_since, v.down_recommended = None, []
            if tpr < up_threshold:
                action = "scale_up"
            else:
                why = f"within the band (scale-up threshold {up_threshold:,.0f} rec/s): {why}"
        elif new < P:
            v.down_since = now if v.down_since is None else v.down_since
            v.down_recommended = [
                (t, p) for t, p in v.down_recommended if t > now - cfg.scale_down_interval_seconds
            ] + [(now, new)]
            if now - v.down_since < cfg.scale_down_interval_seconds:
                why = (
                    f"scale-down to {new} delayed: {now - v.down_since:.0f} of "
                    f"{cfg.scale_down_interval_seconds:g} s; {why}"
                )
            elif tpr > down_threshold:
                new = max(p for _, p in v.down_recommended)
                action = "scale_down"
                why = f"{why}; highest parallelism recommended in the interval {new}"
            else:
                why = f"within the band (scale-down threshold {down_threshold:,.0f} rec/s): {why}"
        else:
            v.down_since, v.down_recommended = None, []
        if action == "none":
            return Decision(now, m.uid, P, P, "none", why, inputs)
        v.down_since, v.down_recommended = None, []
        return Decision(
            now, m.uid, P, new, action, f"{action.replace('_', ' ')} {P} -> {new}: {why}", inputs
        )


def _true_processing_rate(samples: list[_Sample], cfg: FlinkConfig) -> float:
    """Busy-time estimate (MAX aggregator), switched to the observed one as documented.

    >>> s = [_Sample(60.0 * i, 0.0, 0.0, 1000.0, 0.5) for i in range(3)]
    >>> _true_processing_rate(s, FlinkConfig())
    2000.0
    """
    mean_rate = sum(s.rate for s in samples) / len(samples)
    mean_load = sum(s.load for s in samples) / len(samples)
    busy_tpr = mean_rate / mean_load if mean_load > 0 else math.inf
    observed = [
        s.rate
        for s in samples
        if s.rate > 0 and s.lag >= s.rate * cfg.observed_lag_threshold_seconds
    ]
    if len(observed) < cfg.observed_min_observations:
        return busy_tpr
    observed_tpr = sum(observed) / len(observed)
    if not math.isfinite(busy_tpr) or busy_tpr > observed_tpr * (1 + cfg.observed_switch_threshold):
        return observed_tpr
    return busy_tpr


def _align(target: int, current: int, key_groups: int, upper: int) -> int:
    """The first divisor of ``key_groups`` from ``target`` up: to ``upper`` on a scale-up,
    below ``current`` on a scale-down; ``target`` itself when there is none.

    >>> _align(29, 4, 128, 128), _align(13, 32, 128, 128), _align(5, 4, 7, 7)
    (32, 16, 7)
    """
    stop = upper if target > current else current - 1
    return next((p for p in range(target, stop + 1) if key_groups % p == 0), target)
