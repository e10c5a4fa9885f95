"""The autoscaler's load: what the batches measured of the input, and the rate it needs.

One :class:`Sample` per batch (its input rate, the records and busy time of its
subtasks, that busy time net of garbage-collector pauses (:func:`net_busy`), its
end-to-end latency) goes into the policy's metrics window; :func:`measure_load` turns the latest
batch and that window into a :class:`Load`: the input rate, the backlog (reported by the
source, plus what a batch that overran its trigger left behind) and the **target rate**
``input rate + (backlog + input rate * restart time) / catch-up duration``. Pure: no
Spark, no clocks, no state; :mod:`keyscale.scaling.policy` keeps the window.

>>> from keyscale.scaling.model import AutoscalerConfig, BatchMetrics
>>> m = BatchMetrics(time=5.0, uid="op", parallelism=1, max_parallelism=8,
...                  input_records=500, batch_seconds=1.0, trigger_interval_seconds=5.0,
...                  busy_seconds=(1.0,), records=(500,), backlog_records=600)
>>> s = batch_sample(m, period=5.0, warmup=False)
>>> s.input_rate
100.0
>>> load = measure_load(m, [s], s.input_rate, AutoscalerConfig(catch_up_seconds=60.0))
>>> load.target_rate
110.0
>>> load.text(AutoscalerConfig(catch_up_seconds=60.0))
'input 100 rec/s + backlog 600 over 60 s catch-up needs 110 rec/s'
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from keyscale.latency import Latency
from keyscale.scaling.model import AutoscalerConfig, BatchMetrics

__all__ = ["GC_FLOOR", "Load", "Sample", "arrival_period", "batch_sample", "fmt", "measure_load", "net_busy"]

#: The least share of a subtask's busy time :func:`net_busy` keeps as work, however much of
#: it the garbage collector's pauses were.
GC_FLOOR = 0.1


def fmt(x: float) -> str:
    """A rate or a count as the reasons write it: whole, with thousands separators."""
    return f"{x:,.0f}"


@dataclass(frozen=True)
class Sample:
    """What one batch measured, as the metrics window keeps it."""

    time: float
    period: float  # seconds the input of this batch arrived over
    input_rate: float
    records: int  # sum over subtasks
    busy_total: float  # sum over subtasks, net of GC pauses (net_busy)
    busy_hot: float  # busiest subtask, net of GC pauses
    warmup: bool  # right after a change: not used to measure the processing rate
    # The batch's end-to-end latency (None: not measured); a latency SLO reads the window's
    # with keyscale.latency.window_quantile.
    latency: Latency | None = None
    # What the source had not handed to the batch (None: not reported), and the batch's
    # duration: a lag SLO reads them (keyscale.scaling.slo.lag_seconds).
    backlog: int | None = None
    seconds: float = 0.0
    # The GC pauses taken out of busy_total (sum over subtasks): busy_total + gc_total is
    # the busy time the subtasks reported.
    gc_total: float = 0.0


def net_busy(m: BatchMetrics) -> tuple[float, ...]:
    """Each subtask's busy seconds net of its garbage-collector pauses: the time its
    records took, which is what every rate the policy measures divides by.

    >>> from keyscale.scaling.model import BatchMetrics
    >>> m = BatchMetrics(time=0.0, uid="op", parallelism=3, max_parallelism=8, input_records=30,
    ...                  batch_seconds=2.0, trigger_interval_seconds=None, busy_seconds=(2.0, 1.0, 1.0),
    ...                  records=(10, 10, 10), gc_seconds=(1.0, 0.0, 5.0))
    >>> net_busy(m)
    (1.0, 1.0, 0.1)
    """
    # GC pauses measure the Python worker's heap more than the batch's records: a
    # collection's pause grows with the objects it scans (warm state, caches, what earlier
    # tasks left), so memory pressure lengthens busy time without one more record. Taken as
    # work it reads as load and scales up, which is not the cure for memory pressure
    # (FLINK-33764). The price: the young collections a batch's own allocations trigger
    # are per-record work, and netting them overstates the rate by their share.
    # The floor: a subtask is never counted as working less than GC_FLOOR of its busy
    # time, so a pause that covered (nearly) all of it, or a measurement off by a little,
    # cannot make its rate unbounded (records over ~0 s) and scale the operator down to its
    # minimum: it measures at most 1 / GC_FLOOR times the rate its whole busy time gives.
    return tuple(max(b - g, b * GC_FLOOR) for b, g in zip(m.busy_seconds, m.gc_seconds, strict=True))


def arrival_period(m: BatchMetrics, last_time: float | None) -> float:
    """Seconds over which this batch's input arrived: since the previous batch started,
    else the batch's own duration or trigger interval, whichever is longer.

    >>> from keyscale.scaling.model import BatchMetrics
    >>> m = BatchMetrics(time=7.0, uid="op", parallelism=1, max_parallelism=1, input_records=0,
    ...                  batch_seconds=1.0, trigger_interval_seconds=5.0, busy_seconds=(0.0,), records=(0,))
    >>> arrival_period(m, 4.0), arrival_period(m, None)
    (3.0, 5.0)
    """
    if last_time is not None and m.time > last_time:
        return m.time - last_time
    return max(m.batch_seconds, m.trigger_interval_seconds or 0.0)


def batch_sample(m: BatchMetrics, period: float, warmup: bool, last_backlog: int | None = None) -> Sample:
    """The window's sample of batch ``m``; its input rate is the source's if reported, else
    what arrived over ``period``: the batch's records, plus the growth of the source's
    backlog since the previous batch (``last_backlog``) when the source reports one. A batch
    held to a read limit reads less than arrived, and the rest is in that growth (Flink's
    "input rate + lag rate"); without it a 10x spike met by a read limit of 4x measures 4x.

    >>> from keyscale.scaling.model import BatchMetrics
    >>> m = BatchMetrics(time=5.0, uid="op", parallelism=4, max_parallelism=8, input_records=40_000,
    ...                  batch_seconds=10.0, trigger_interval_seconds=5.0, busy_seconds=(10.0,) * 4,
    ...                  records=(10_000,) * 4, backlog_records=60_000)
    >>> batch_sample(m, 5.0, False).input_rate, batch_sample(m, 5.0, False, last_backlog=0).input_rate
    (8000.0, 20000.0)
    """
    if m.input_rate is not None:
        input_rate = m.input_rate
    else:
        growth = 0 if m.backlog_records is None or last_backlog is None else m.backlog_records - last_backlog
        input_rate = max(0, m.input_records + growth) / period if period > 0 else 0.0
    busy = net_busy(m)
    return Sample(
        time=m.time,
        period=period,
        input_rate=input_rate,
        records=sum(m.records),
        busy_total=sum(busy),
        busy_hot=max(busy),
        warmup=warmup,
        latency=m.latency,
        backlog=m.backlog_records,
        seconds=m.batch_seconds,
        gc_total=sum(m.busy_seconds) - sum(busy),
    )


@dataclass(frozen=True)
class Load:
    """The load to size for, in records/s (the backlog in records)."""

    rate: float  # the latest batch's input rate: what the policy sizes for
    rate_window: float  # the window's average, reported only
    backlog: float
    catch_up_rate: float
    target_rate: float

    def inputs(self) -> dict[str, float]:
        """The decision's ``inputs`` this load contributes, in the order they are reported."""
        return {
            "input_rate": self.rate,
            "input_rate_window": self.rate_window,
            "input_rate_recent": self.rate,
            "backlog": self.backlog,
            "catch_up_rate": self.catch_up_rate,
            "target_rate": self.target_rate,
        }

    def text(self, cfg: AutoscalerConfig) -> str:
        """The load in words, as a reason quotes it."""
        words = f"input {fmt(self.rate)} rec/s"
        if self.catch_up_rate <= 0:
            return words + " needs " + fmt(self.target_rate) + " rec/s"
        return (
            words
            + f" + backlog {fmt(self.backlog)}"
            + (f" (+{cfg.restart_seconds:.0f} s restart)" if cfg.restart_seconds else "")
            + f" over {cfg.catch_up_seconds:.0f} s catch-up needs {fmt(self.target_rate)} rec/s"
        )


def measure_load(
    m: BatchMetrics, window: Iterable[Sample], input_rate: float, cfg: AutoscalerConfig
) -> Load:
    """The load of the latest batch ``m`` (whose input rate is ``input_rate``).

    It sizes for the latest batch, not the window's average: a scale-up should follow a
    load step at once (a live rescale costs almost nothing), and a scale-down needs the
    lower target to hold for the whole scale-down delay and then goes to the highest
    target seen meanwhile, which smooths more robustly than an average would. The
    window's average is reported.
    """
    samples = list(window)
    total_period = sum(s.period for s in samples)
    rate_window = (
        sum(s.input_rate * s.period for s in samples) / total_period
        if total_period > 0
        else input_rate
    )
    backlog = float(m.backlog_records or 0)
    if m.trigger_interval_seconds is not None:
        # A batch that overran its trigger interval leaves the records that arrived
        # during the overrun for the next batch, on top of the one interval's worth
        # that is normal for micro-batches.
        backlog += input_rate * max(0.0, m.batch_seconds - m.trigger_interval_seconds)
    catch_up_rate = (backlog + input_rate * cfg.restart_seconds) / cfg.catch_up_seconds
    return Load(input_rate, rate_window, backlog, catch_up_rate, input_rate + catch_up_rate)
