"""How much a log source's batch reads: under the job's latency target (``RunOptions.latency_target``;
issue 35, item 3), and while a scale-up waits for its executors.

The rule is :mod:`keyscale.scaling.batch_size`'s (pure); here its inputs are read off the
run: the recent batches' records and seconds and the input rate measured from them
(``job.history.batches``: records read, time, backlog after), and the source's own limit
(``max_records_per_batch``, per partition), which the target never raises: the smaller
limit wins, and the status says whose it is (``batch_size``). Without a target a batch
reads what its source's own limit allows. While the autoscaler's scale-up waits for the
executors it asked Spark for (``batch/parallelism.py``), a batch at the old parallelism
reads about two seconds' worth at most, so the rescale comes soon after they do.

Runs on the driver, as the batch's intent is fixed (``source_plan.plan_source``): the
limit is in the plan the intent keeps, so a replay reads the same records whatever the
limit would be now. Writes ``job.batch.read_limit``; reads the rest.

>>> target_seconds("1s"), target_seconds("250 ms"), target_seconds(None)
(1.0, 0.25, None)
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from keyscale.errors import JobDefinitionError
from keyscale.operators.eventtime import Duration, parse_duration_ms
from keyscale.scaling.batch_size import (
    TARGET,
    WAITING,
    WAITING_SECONDS,
    ReadLimit,
    arrival_rate,
    fit_cost,
    meets,
    next_batch,
    per_partition,
    waiting_records,
)

if TYPE_CHECKING:
    from keyscale._steps import JobGraph
    from keyscale.runtime.batch.jobstate import JobState
    from keyscale.sources.reader import LogSource

WINDOW = 20
"""The recent batches the costs and the input rate are measured over."""
RECENT = 3
"""The last batches the input rate is measured over as well."""

def target_seconds(value: Duration | None) -> float | None:
    """Seconds of a latency target (``"1s"``, ``"500 ms"``, a number of seconds); None: no
    target. Raises a :class:`~keyscale.errors.JobDefinitionError` naming the option for
    anything else, and for a target of 0."""
    if value is None:
        return None
    ms = parse_duration_ms(value, "latency_target")
    if ms <= 0:
        raise JobDefinitionError(f"latency_target {value!r} must be more than 0 ms")
    return ms / 1000


def check_target(value: Duration | None, pipeline: JobGraph) -> None:
    """Refuse a latency target the job cannot serve: its batches are a Spark source's,
    sized by Spark (its own options: ``maxOffsetsPerTrigger``, ``maxFilesPerTrigger``)."""
    if target_seconds(value) is not None and pipeline.log_source is None:
        raise JobDefinitionError(
            f"latency_target {value!r}: the job reads a Spark source, whose batches Spark sizes (its maxOffsetsPerTrigger or "
            "maxFilesPerTrigger option); a latency target sizes a keyscale log source's batches (keyscale.sources.log_source, keyscale.kafka.kafka_source)")


def measured(job: JobState) -> tuple[list[tuple[int, float]], float | None]:
    """The recent batches' ``(records, seconds)`` and the input rate (records/s) measured
    over them. The run's first batch is left out: it starts the Python workers and
    compiles what later batches reuse, a cost the next batch does not pay."""
    recent = list(job.history.batches)[1:][-WINDOW:]
    costs = [(int(b["records"]), float(b["seconds"])) for b in recent]
    points = [(b["time_ms"] / 1000, int(b["records"]), b.get("backlog")) for b in recent]
    # Over the last few batches too, the larger: a rise in the input shows at once (too low a
    # rate is what would let the lag grow; too high one only makes a batch larger).
    rates = [r for r in (arrival_rate(points), arrival_rate(points[-RECENT:])) if r is not None]
    return costs, max(rates) if rates else None


def read_limit(job: JobState, src: LogSource, partitions: int) -> int | None:
    """The next batch's limit per partition of ``src`` (read in ``partitions`` partitions)
    under the job's latency target, or the source's own without one; kept in
    ``job.batch.read_limit`` for the status. While a scale-up waits for its executors, at
    most what the old parallelism gets through in about two seconds
    (:func:`~keyscale.scaling.batch_size.waiting_records`)."""
    limit = _target_limit(job, src, partitions)
    last = job.history.batches[-1] if job.history.batches else None
    waiting = None if job.scaling.executors_asked is None or last is None else waiting_records(int(last["records"]), float(last["seconds"]))
    per = None if waiting is None else per_partition(waiting, partitions)
    if per is None or (limit is not None and limit <= per):
        return limit
    shown = job.batch.read_limit
    if shown is not None:  # the status says whose limit holds
        job.batch.read_limit = replace(shown, per_partition=per, limited_by=WAITING, expected_seconds=WAITING_SECONDS,
                                       meets_target=meets(WAITING_SECONDS, shown.target_seconds))
    return per


def _target_limit(job: JobState, src: LogSource, partitions: int) -> int | None:
    own = src.max_records_per_partition
    target = target_seconds(job.opts.latency_target)
    if target is None:
        return own
    costs, rate = measured(job)
    size = next_batch(target, costs, rate)
    wanted = size.per_partition(partitions)
    if own is None or (wanted is not None and wanted <= own):
        limit = ReadLimit(target, partitions, wanted, size, TARGET, size.batch_seconds, size.meets_target)
    else:  # the source's own limit is the smaller: it stays, and the target may not hold at it
        f, c = fit_cost(costs) if costs else (None, None)
        seconds = None if f is None or c is None else f + c * own * partitions
        keeps_up = seconds is not None and own * partitions >= (rate or 0.0) * seconds
        holds = seconds is not None and keeps_up and meets(seconds, target)
        limit = ReadLimit(target, partitions, own, size, f"source '{src.uid}' max_records_per_batch", seconds, holds)
    job.batch.read_limit = limit
    return limit.per_partition
