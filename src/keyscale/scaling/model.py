"""The autoscaler's inputs, settings and outputs: what one keyed operator did in a
micro-batch (:class:`BatchMetrics`), how the policy is tuned (:class:`AutoscalerConfig`),
and what it decided and why (:class:`Decision`). Plain frozen records; the policy itself
is :mod:`keyscale.scaling.policy`, which re-exports them.

    >>> from keyscale.scaling.model import AutoscalerConfig
    >>> AutoscalerConfig(target_utilization=0.6).utilization_band
    0.2
    >>> AutoscalerConfig(target_utilization=0.1)
    Traceback (most recent call last):
    ValueError: utilization_band must be in [0, target_utilization), got 0.2
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from keyscale.latency import Latency

Mode = Literal["off", "recommend", "active"]
"""How the caller uses the policy; see the module docstring."""

MODES: tuple[Mode, ...] = ("off", "recommend", "active")

Action = Literal["scale_up", "scale_down", "none"]


@dataclass(frozen=True)
class BatchMetrics:
    """What one keyed operator did in one micro-batch.

    Attributes:
        time: batch start, in seconds (any origin; must not decrease per operator).
        uid: operator uid.
        parallelism: number of subtasks the batch ran with.
        max_parallelism: number of key groups (``M``).
        input_records: records the operator read in this batch.
        batch_seconds: wall-clock duration of the batch.
        trigger_interval_seconds: the trigger's processing-time interval, or
            ``None`` when batches run back to back.
        busy_seconds: busy time of each subtask (length ``parallelism``).
        records: records processed by each subtask (length ``parallelism``).
        backlog_records: records available at the source but not read by this
            batch, when the source reports it (e.g. Kafka lag at the batch's
            end offsets); ``None`` when unknown.
        input_rate: records/s arriving at the source when it reports it;
            ``None`` derives it from ``input_records`` over the time since the
            previous batch started (what Spark's ``inputRowsPerSecond`` does).
        latency: the batch's end-to-end latency (:class:`keyscale.latency.Latency`:
            p50, p99, max and a histogram that :func:`keyscale.latency.window_quantile`
            merges over a window), or ``None`` when its source keeps no append times.
        executor_start_seconds: on a cluster, how long a scale-up is expected to wait
            for the executors it asks Spark for (the longest of the job's last three
            measured waits; 0 where keyscale does not size executors): an SLO policy acts
            on a predicted rise this much earlier.
        gc_seconds: of each subtask's busy time, the seconds the Python garbage
            collector paused it (:mod:`keyscale.runtime.task.gcpauses`); the policy
            measures rates from busy time net of them
            (:func:`keyscale.scaling.load.net_busy`). Left empty: zeros, one per subtask.

    >>> m = BatchMetrics(time=0.0, uid="op", parallelism=2, max_parallelism=8,
    ...                  input_records=10, batch_seconds=1.0,
    ...                  trigger_interval_seconds=None, busy_seconds=(0.5, 0.4),
    ...                  records=(6, 4))
    >>> m.backlog_records is None, m.gc_seconds
    (True, (0.0, 0.0))
    """

    time: float
    uid: str
    parallelism: int
    max_parallelism: int
    input_records: int
    batch_seconds: float
    trigger_interval_seconds: float | None
    busy_seconds: tuple[float, ...]
    records: tuple[int, ...]
    backlog_records: int | None = None
    input_rate: float | None = None
    latency: Latency | None = None
    executor_start_seconds: float = 0.0
    gc_seconds: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not math.isfinite(self.time):
            raise ValueError(f"time must be finite, got {self.time}")
        if self.parallelism < 1:
            raise ValueError(f"parallelism must be >= 1, got {self.parallelism}")
        if self.max_parallelism < self.parallelism:
            raise ValueError(
                f"max_parallelism {self.max_parallelism} < parallelism {self.parallelism}"
            )
        if len(self.busy_seconds) != self.parallelism or len(self.records) != self.parallelism:
            raise ValueError(
                f"busy_seconds ({len(self.busy_seconds)}) and records ({len(self.records)}) "
                f"need one entry per subtask ({self.parallelism})"
            )
        if self.input_records < 0 or any(r < 0 for r in self.records):
            raise ValueError("record counts must be >= 0")
        if not (self.batch_seconds >= 0) or any(not (b >= 0) for b in self.busy_seconds):
            raise ValueError("batch_seconds and busy_seconds must be >= 0")
        if self.trigger_interval_seconds is not None and not self.trigger_interval_seconds > 0:
            raise ValueError("trigger_interval_seconds must be > 0 or None")
        if self.backlog_records is not None and self.backlog_records < 0:
            raise ValueError("backlog_records must be >= 0 or None")
        if self.input_rate is not None and not self.input_rate >= 0:
            raise ValueError("input_rate must be >= 0 or None")
        if not (math.isfinite(self.executor_start_seconds) and self.executor_start_seconds >= 0):
            raise ValueError(f"executor_start_seconds must be a finite number >= 0, got {self.executor_start_seconds}")
        if not self.gc_seconds:
            object.__setattr__(self, "gc_seconds", (0.0,) * self.parallelism)
        if len(self.gc_seconds) != self.parallelism:
            raise ValueError(f"gc_seconds ({len(self.gc_seconds)}) needs one entry per subtask ({self.parallelism}) or none")
        if any(not (math.isfinite(g) and g >= 0) for g in self.gc_seconds):
            raise ValueError(f"gc_seconds must be finite numbers >= 0, got {self.gc_seconds}")


@dataclass(frozen=True)
class AutoscalerConfig:
    """Knobs of the policy, with defaults for live-rescalable micro-batch jobs.

    Flink's defaults (15 min window, 5 min stabilisation, 1 h scale-down interval)
    assume a rescale restarts the job. Here a rescale happens between two batches,
    so the windows are in tens of seconds.

    Attributes:
        target_utilization: busy fraction to size for (0.7 leaves 30% headroom).
        utilization_band: no action while ``target rate / capacity`` stays within
            ``target_utilization ± utilization_band`` (upper edge capped at 1.0).
        metrics_window_seconds: how far back metrics are aggregated.
        stabilization_seconds: no decision for this long after a change.
        scale_up_max_factor: one step multiplies parallelism by at most this.
        scale_down_max_factor: one step divides parallelism by at most this.
        scale_down_delay_seconds: a lower target must persist this long before
            scaling down.
        catch_up_seconds: the backlog should be worked off within this time.
        restart_seconds: downtime a rescale causes (0 for a live rescale); the
            input arriving meanwhile is added to the backlog to catch up.
        min_parallelism: lower bound.
        max_parallelism: upper bound; ``None`` means the number of key groups.
        align_to_key_groups: prefer parallelisms dividing the number of key groups.
        warmup_batches: batches right after a change not used to measure the
            processing rate (they include moving state).
        min_busy_seconds: busy time (of the busiest subtask, summed over the
            window) below which the processing rate is not trusted.
        max_rescales_per_hour: at most this many rescales in any hour (``None``: no
            cap); with an SLO, a scale-up for a missed SLO goes beyond it.
        season_seconds: the input's season for the forecast (with an SLO): a day by
            default; a week (7 seasons) is used once the history covers it.
        forecast_horizon_seconds: with an SLO, a scale-down goes only as low as the
            forecast peak of this many seconds ahead allows.
        forecast_bucket_seconds: the rate history's resolution (with an SLO).
        executor_wait_seconds: on a cluster, how long a scale-up waits for the
            executors it asked Spark for; batches keep running at the old parallelism
            meanwhile, and after this long it goes ahead on the cores there are.

    >>> AutoscalerConfig().target_utilization
    0.7
    >>> AutoscalerConfig(target_utilization=1.5)
    Traceback (most recent call last):
    ...
    ValueError: target_utilization must be in (0, 1], got 1.5
    """

    target_utilization: float = 0.7
    utilization_band: float = 0.2
    metrics_window_seconds: float = 60.0
    stabilization_seconds: float = 30.0
    scale_up_max_factor: float = 8.0
    scale_down_max_factor: float = 8.0
    scale_down_delay_seconds: float = 120.0
    catch_up_seconds: float = 60.0
    restart_seconds: float = 0.0
    min_parallelism: int = 1
    max_parallelism: int | None = None
    align_to_key_groups: bool = True
    warmup_batches: int = 1
    min_busy_seconds: float = 0.05
    max_rescales_per_hour: int | None = None
    season_seconds: float = 86400.0
    forecast_horizon_seconds: float = 600.0
    forecast_bucket_seconds: float = 300.0
    executor_wait_seconds: float = 30.0

    def __post_init__(self) -> None:
        if not 0 < self.target_utilization <= 1:
            raise ValueError(f"target_utilization must be in (0, 1], got {self.target_utilization}")
        if not 0 <= self.utilization_band < self.target_utilization:
            raise ValueError(
                f"utilization_band must be in [0, target_utilization), got {self.utilization_band}"
            )
        for name in (
            "metrics_window_seconds",
            "stabilization_seconds",
            "scale_down_delay_seconds",
            "restart_seconds",
            "min_busy_seconds",
            "executor_wait_seconds",
        ):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if not self.metrics_window_seconds > 0:
            raise ValueError("metrics_window_seconds must be > 0")
        if not (math.isfinite(self.catch_up_seconds) and self.catch_up_seconds > 0):
            raise ValueError(f"catch_up_seconds must be > 0, got {self.catch_up_seconds}")
        if not self.scale_up_max_factor > 1 or not self.scale_down_max_factor > 1:
            raise ValueError("scale_up_max_factor and scale_down_max_factor must be > 1")
        if self.min_parallelism < 1:
            raise ValueError(f"min_parallelism must be >= 1, got {self.min_parallelism}")
        if self.max_parallelism is not None and self.max_parallelism < self.min_parallelism:
            raise ValueError(
                f"max_parallelism {self.max_parallelism} < min_parallelism {self.min_parallelism}"
            )
        if self.warmup_batches < 0:
            raise ValueError(f"warmup_batches must be >= 0, got {self.warmup_batches}")
        if self.max_rescales_per_hour is not None and self.max_rescales_per_hour < 1:
            raise ValueError(f"max_rescales_per_hour must be >= 1 or None, got {self.max_rescales_per_hour}")
        for name in ("season_seconds", "forecast_horizon_seconds", "forecast_bucket_seconds"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")

    @property
    def scale_up_threshold(self) -> float:
        """Utilisation above which the policy scales up.

        >>> round(AutoscalerConfig().scale_up_threshold, 2)
        0.9
        """
        return min(self.target_utilization + self.utilization_band, 1.0)

    @property
    def scale_down_threshold(self) -> float:
        """Utilisation below which the policy (after the delay) scales down.

        >>> round(AutoscalerConfig().scale_down_threshold, 2)
        0.5
        """
        return max(self.target_utilization - self.utilization_band, 0.0)

    def bounds(self, key_groups: int) -> tuple[int, int]:
        """``(lower, upper)`` parallelism for an operator with ``key_groups`` key groups.

        >>> AutoscalerConfig(min_parallelism=2, max_parallelism=500).bounds(128)
        (2, 128)
        """
        upper = (
            key_groups if self.max_parallelism is None else min(self.max_parallelism, key_groups)
        )
        return min(self.min_parallelism, upper), upper


@dataclass(frozen=True)
class Decision:
    """The policy's answer for one batch of one operator.

    ``time`` is when the decision was made: the end of the observed batch
    (``m.time + m.batch_seconds``); stabilisation and the scale-down delay are
    measured on this clock. ``target_parallelism`` equals
    ``current_parallelism`` when ``action`` is ``"none"``.

    ``inputs`` holds the numbers the decision was computed from (rates in
    records/s, backlog in records, times in seconds); keys are present only when
    known: ``input_rate``, ``input_rate_window``, ``input_rate_recent``,
    ``backlog``, ``catch_up_rate``, ``target_rate``, ``true_rate_per_subtask``,
    ``mean_rate_per_subtask``, ``skew``, ``gc_share`` (of the window's busy time, the
    share in garbage-collector pauses, which the rates leave out; when above 0),
    ``capacity``, ``utilization``,
    ``busy_ratio`` (the busiest subtask's busy share of the latest batch's
    slot: its trigger interval, or its duration if it overran),
    ``raw_target_parallelism``, ``window_batches``,
    ``seconds_since_change``, ``scale_down_pending_since``,
    ``rate_from_history`` (1.0 when the rate came from an earlier window),
    ``lower_bound`` and ``upper_bound`` (when the current parallelism was outside them);
    with an SLO also ``slo_target_seconds``, ``slo_value_seconds``,
    ``slo_projected_seconds``, ``slo_catch_up_seconds``, ``forecast_input_rate`` (the
    forecast over the lead), ``forecast_input_rate_horizon`` (over the scale-down horizon),
    ``lead_seconds``, ``rescale_cost_seconds`` and ``rescales_last_hour``.

    With an SLO, ``slo`` is its reading (:meth:`keyscale.scaling.slo.SloReading.to_dict`)
    and ``forecast`` the forecast the decision used
    (:meth:`keyscale.scaling.forecast.Forecast.to_dict`), both in :meth:`to_dict`.

    >>> d = Decision(time=0.0, uid="op", current_parallelism=4, target_parallelism=4,
    ...              action="none", reason="stabilising")
    >>> d.changes
    False
    """

    time: float
    uid: str
    current_parallelism: int
    target_parallelism: int
    action: Action
    reason: str
    inputs: dict[str, float] = field(default_factory=dict)
    slo: dict[str, Any] | None = None
    forecast: dict[str, Any] | None = None

    @property
    def changes(self) -> bool:
        """Whether the decision asks for another parallelism."""
        return self.action != "none"

    def to_dict(self) -> dict[str, object]:
        """JSON-friendly form, e.g. for the events file.

        >>> Decision(1.0, "op", 2, 4, "scale_up", "r", {"x": 1.0}).to_dict()["target_parallelism"]
        4
        """
        return {
            "time": self.time,
            "uid": self.uid,
            "current_parallelism": self.current_parallelism,
            "target_parallelism": self.target_parallelism,
            "action": self.action,
            "reason": self.reason,
            "inputs": dict(self.inputs),
            **({"slo": dict(self.slo)} if self.slo is not None else {}),
            **({"forecast": dict(self.forecast)} if self.forecast is not None else {}),
        }
