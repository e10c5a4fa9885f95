"""The simulated job the autoscaler's simulations run: a keyed operator's batches,
their records per subtask and busy time, under a :class:`Load` (a trace, usually:
:mod:`keyscale.scaling.traces`). Pure arithmetic, no Spark.

The job model, per micro-batch starting at ``t`` with parallelism ``P``:

* the batch reads everything that arrived and was not read yet, up to its read
  limit (the rest is the source's backlog, reported when ``reports_backlog``):
  ``max_records_per_subtask`` per subtask, so ``P`` subtasks read ``P`` times as
  much (a source read in parallel by the subtasks, each with a per-batch limit),
  and at most ``max_records_per_batch`` in all, a limit that does *not* grow
  with ``P`` (like ``maxOffsetsPerTrigger``: adding subtasks does not help, and
  the policy's busy guard declines to scale up against it);
* the hottest subtask gets ``min(1, skew / P)`` of the records (``skew`` times
  its fair share), the others share the rest evenly;
* subtask ``i`` is busy ``records_i / per_subtask_capacity_rps +
  task_overhead_seconds + gc_pause_seconds``, of which it reports ``gc_pause_seconds``
  as garbage-collector pauses (``BatchMetrics.gc_seconds``); the batch lasts as long as
  the busiest subtask;
* the next batch starts one trigger interval later, or when this one ends if it
  overran;
* each batch's end-to-end latency (``BatchMetrics.latency``): per record, from its
  arrival to the batch's end (its commit), records read oldest first
  (:mod:`keyscale.scaling.arrivals` has the formula);
* :meth:`JobRun.pause` stops the job for a while (a restart): records keep arriving
  and wait.

>>> class Steady:  # any Load: records arriving between two instants
...     def arrivals(self, start: float, end: float) -> float:
...         return 2000 * (end - start)
>>> run = SimulatedJob(per_subtask_capacity_rps=1000).start(Steady())
>>> first = run.run_batch(4)
>>> first.metrics.input_records, first.metrics.records
(10000, (2500, 2500, 2500, 2500))
>>> first.metrics.busy_seconds
(2.5, 2.5, 2.5, 2.5)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from keyscale.scaling.arrivals import ArrivalQueue, batch_latency
from keyscale.scaling.policy import BatchMetrics

__all__ = ["JobRun", "Load", "SimulatedBatch", "SimulatedJob"]


class Load(Protocol):
    """Anything that says how many records arrive between two instants."""

    def arrivals(self, start: float, end: float) -> float:
        """Records arriving in ``[start, end)``."""
        ...


@dataclass(frozen=True)
class SimulatedBatch:
    """One simulated batch: the metrics the autoscaler sees, and the ground truth.

    ``pending_records`` are records that had arrived but were not processed when
    the batch started; ``unread_records`` what the batch left at the source;
    ``caught_up`` means it read everything and finished within its trigger
    interval (the job is keeping up).
    """

    metrics: BatchMetrics
    input_rate: float
    capacity_rps: float
    pending_records: float
    unread_records: float
    period: float
    caught_up: bool


@dataclass(frozen=True)
class SimulatedJob:
    """Parameters of the simulated keyed operator.

    Attributes:
        per_subtask_capacity_rps: records one subtask processes per busy second.
        max_parallelism: number of key groups.
        initial_parallelism: parallelism at the start of a run.
        trigger_interval_seconds: processing-time trigger.
        skew: the hottest subtask's share of the records relative to a fair share
            (1.0 = no skew); capped so it never exceeds all records.
        max_records_per_batch: cap on records one batch reads, whatever its
            parallelism (``None``: no such cap).
        reports_backlog: whether the source reports unread records.
        reports_input_rate: whether the source reports its arrival rate (else the
            policy derives it from records read per batch interval).
        task_overhead_seconds: fixed busy time per task per batch.
        uid: operator uid in the metrics.
        max_records_per_subtask: cap on records one batch reads per subtask, so
            ``P`` subtasks read up to ``P`` times this (``None``: no such cap).
        gc_pause_seconds: garbage-collector pauses per task per batch, whatever its
            records (a worker under memory pressure): busy time, reported as GC.

    >>> SimulatedJob(1000.0, skew=2.0).capacity_rps(8)
    4000.0
    >>> job = SimulatedJob(1000.0, max_records_per_subtask=2500)
    >>> job.read_limit(4), job.capacity_rps(4), job.capacity_rps(1)
    (10000, 2000.0, 500.0)
    """

    per_subtask_capacity_rps: float
    max_parallelism: int = 128
    initial_parallelism: int = 4
    trigger_interval_seconds: float = 5.0
    skew: float = 1.0
    max_records_per_batch: int | None = None
    reports_backlog: bool = True
    reports_input_rate: bool = False
    task_overhead_seconds: float = 0.0
    uid: str = "keyed"
    max_records_per_subtask: int | None = None
    gc_pause_seconds: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.per_subtask_capacity_rps) and self.per_subtask_capacity_rps > 0):
            raise ValueError("per_subtask_capacity_rps must be a number > 0")
        if self.max_parallelism < 1:
            raise ValueError("max_parallelism must be >= 1")
        if not 1 <= self.initial_parallelism <= self.max_parallelism:
            raise ValueError("initial_parallelism must be in [1, max_parallelism]")
        if not (math.isfinite(self.trigger_interval_seconds) and self.trigger_interval_seconds > 0):
            raise ValueError("trigger_interval_seconds must be > 0")
        if not (math.isfinite(self.skew) and self.skew >= 1):
            raise ValueError("skew must be >= 1")
        if self.max_records_per_batch is not None and self.max_records_per_batch < 1:
            raise ValueError("max_records_per_batch must be >= 1 or null")
        if self.max_records_per_subtask is not None and self.max_records_per_subtask < 1:
            raise ValueError("max_records_per_subtask must be >= 1 or null")
        if not (math.isfinite(self.task_overhead_seconds) and self.task_overhead_seconds >= 0):
            raise ValueError("task_overhead_seconds must be >= 0")
        if not (math.isfinite(self.gc_pause_seconds) and self.gc_pause_seconds >= 0):
            raise ValueError("gc_pause_seconds must be >= 0")

    def hot_share(self, parallelism: int) -> float:
        """Fraction of the records the hottest subtask gets at ``parallelism``."""
        return 1.0 if parallelism <= 1 else min(1.0, self.skew / parallelism)

    def read_limit(self, parallelism: int) -> int | None:
        """Most records one batch at ``parallelism`` reads (``None``: all that arrived)."""
        limits = [self.max_records_per_batch]
        if self.max_records_per_subtask is not None:
            limits.append(self.max_records_per_subtask * parallelism)
        return min((x for x in limits if x is not None), default=None)

    def capacity_rps(self, parallelism: int) -> float:
        """Records/s the job sustains at ``parallelism``: bounded by the hottest subtask,
        and by the read limit per trigger interval."""
        rate = self.per_subtask_capacity_rps / self.hot_share(parallelism)
        limit = self.read_limit(parallelism)
        return rate if limit is None else min(rate, limit / self.trigger_interval_seconds)

    def start(self, load: Load) -> JobRun:
        """A fresh run of this job on ``load``, at time 0."""
        return JobRun(self, load)


class JobRun:
    """A simulated job running on a load, one batch at a time.

    >>> class Steady:
    ...     def arrivals(self, start: float, end: float) -> float:
    ...         return 1000 * (end - start)
    >>> run = SimulatedJob(1000.0).start(Steady())
    >>> [round(run.run_batch(2).metrics.time) for _ in range(3)]
    [0, 5, 10]
    """

    def __init__(self, job: SimulatedJob, load: Load) -> None:
        self.job = job
        self.load = load
        self.now = 0.0
        # The first batch reads one trigger interval's worth of input.
        self._read_until = -job.trigger_interval_seconds
        self._unread = 0.0
        self._queue = ArrivalQueue()

    def pause(self, seconds: float) -> None:
        """Run no batch for ``seconds`` (a restart): the next batch starts that much later
        and reads what arrived meanwhile too.

        >>> class Steady:
        ...     def arrivals(self, start: float, end: float) -> float:
        ...         return 1000 * (end - start)
        >>> run = SimulatedJob(1000.0).start(Steady())
        >>> _ = run.run_batch(4)
        >>> run.pause(20.0)
        >>> b = run.run_batch(4)
        >>> b.metrics.time, b.metrics.input_records, b.metrics.latency.max_seconds
        (25.0, 25000, 31.25)
        """
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"pause must be a number of seconds >= 0, got {seconds}")
        self.now += seconds

    def run_batch(self, parallelism: int) -> SimulatedBatch:
        """Run the batch that starts now with ``parallelism`` subtasks."""
        job = self.job
        if not 1 <= parallelism <= job.max_parallelism:
            raise ValueError(f"parallelism {parallelism} outside [1, {job.max_parallelism}]")
        t = self.now
        arrived = self.load.arrivals(self._read_until, t)
        input_rate = arrived / (t - self._read_until)
        self._queue.push(self._read_until, t, arrived)
        self._read_until = t
        self._unread += arrived
        pending = self._unread
        available = math.floor(self._unread + 1e-6)
        limit = job.read_limit(parallelism)
        read = available if limit is None else min(available, limit)
        self._unread = max(0.0, self._unread - read)

        hot = job.hot_share(parallelism)
        if parallelism == 1:
            records = [read]
        else:
            # Subtask 0 is the hot one; integer counts by largest remainder.
            exact = [read * hot] + [read * (1.0 - hot) / (parallelism - 1)] * (parallelism - 1)
            records = [math.floor(x) for x in exact]
            by_remainder = sorted(range(parallelism), key=lambda i: (records[i] - exact[i], i))
            for i in by_remainder[: read - sum(records)]:
                records[i] += 1
        gc = job.gc_pause_seconds
        busy = tuple(r / job.per_subtask_capacity_rps + job.task_overhead_seconds + gc for r in records)
        duration = max(busy)
        period = max(job.trigger_interval_seconds, duration)
        latency = batch_latency(self._queue.pop(read), committed=t + duration)
        self.now = t + period
        metrics = BatchMetrics(
            time=t,
            uid=job.uid,
            parallelism=parallelism,
            max_parallelism=job.max_parallelism,
            input_records=read,
            batch_seconds=duration,
            trigger_interval_seconds=job.trigger_interval_seconds,
            busy_seconds=busy,
            records=tuple(records),
            backlog_records=math.floor(self._unread) if job.reports_backlog else None,
            input_rate=input_rate if job.reports_input_rate else None,
            latency=latency,
            gc_seconds=(gc,) * parallelism,
        )
        return SimulatedBatch(
            metrics=metrics,
            input_rate=input_rate,
            capacity_rps=job.capacity_rps(parallelism),
            pending_records=pending,
            unread_records=self._unread,
            period=period,
            caught_up=self._unread < 1 and duration <= job.trigger_interval_seconds,
        )
