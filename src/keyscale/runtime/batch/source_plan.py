"""A keyscale log source on the driver: which records a batch reads, the reader tasks, the lag.

A batch's source plan (per reader: partition, start and end offset) is fixed in its intent
(commit protocol step 2), so a replay reads exactly the same records; the offsets after it
go into the batch's manifest with the state they produced. Rules streams (broadcasts) are
planned the same way, with one reader. Reads ``job.committed.manifest`` and the log; writes
``job.batch.log_ids`` (the logs the plans are for), ``job.log_ends`` (a log's end offsets as
last read, for the next plan) and the ``job.plans`` cache. The reader tasks it makes run on
the executors (:mod:`keyscale.runtime.task.reader`; :mod:`keyscale.sources.reader` plans
their ranges).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from keyscale._spark_map import map_in_arrow
from keyscale._spark_types import to_arrow_schema
from keyscale._steps import source_schema
from keyscale.checkpoint.intent import SourcePlan, source_plan
from keyscale.errors import KeyscaleError
from keyscale.runtime.batch import sizing
from keyscale.runtime.batch.jobstate import JobState, session_cache
from keyscale.runtime.task.reader import make_reader_function, make_stage_reader_function
from keyscale.runtime.task.spec import KG, SEQ, StageTask
from keyscale.sources import reader
from keyscale.sources.reader import LogSource

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

log = logging.getLogger("keyscale")


def describe_assignment(a: reader.Assignment) -> str:
    return "; ".join(f"reader {i}: {', '.join(str(p) for p, _ in e) or 'none'}" for i, e in enumerate(a))


def committed_assignment(job: JobState, src: LogSource) -> reader.Assignment | None:
    """The readers' committed partitions and offsets (None before the source's first batch)."""
    prev = job.committed.manifest.operators.get(src.uid) if job.committed.manifest else None
    return reader.from_state(prev.operator_state) if prev is not None else None


def plan_source(job: JobState, src: LogSource, batch_id: int, p: int, read: bool = True) -> SourcePlan:
    """Batch ``batch_id``'s plan of ``src`` over ``p`` readers (``read`` False: read nothing,
    as a drain does), after checking the log still holds the committed positions."""
    current = committed_assignment(job, src)
    ends = ends_for_plan(job, src)
    log_id = src.log.identity()
    if current is not None:  # a log that shrank or was recreated would be read from the wrong offsets
        state = job.committed.manifest.operators[src.uid].operator_state if job.committed.manifest else None
        reader.check_positions(src.uid, src.log.uri, current, ends, reader.log_id_of(state), log_id)
        reader.check_last_records(src.uid, src.log, current, reader.last_records_of(state))
    job.batch.log_ids[src.uid] = log_id
    firsts = src.log.first_offsets() if current is None or len(ends) > sum(len(e) for e in current) else None
    if current is None:
        current = reader.initial_assignment(len(ends), p, firsts)
        log.info("source '%s': %d partitions over %d readers: %s", src.uid, len(ends), p, describe_assignment(current))
    if len(current) != p:
        current = reader.rescale_assignment(current, p)
        log.info("batch %d: source '%s' rescaled to %d readers: partitions %s", batch_id, src.uid, p, describe_assignment(current))
    # The partitions are those the ends were read for: one view of the log for the whole plan.
    current, added = reader.add_partitions(current, len(ends), firsts)
    for part, r in added:
        log.info("batch %d: source '%s': partition %d is new; reader %d reads it from offset %d", batch_id, src.uid, part, r, firsts[part] if firsts else 0)
    # The job's own source reads up to its latency target's limit (sizing.py); a side log or rules stream up to its own.
    driving = job.pipeline is not None and src is job.pipeline.log_source
    limit = 0 if not read else sizing.read_limit(job, src, len(ends)) if driving else src.max_records_per_partition
    plan = reader.plan_batch(current, ends, limit)
    return source_plan(plan)


# A log's end read on the driver after the last commit (the status's lag, or a poll while
# the job waits for input) is the next plan's when it is this fresh: a batch that follows at
# once would otherwise read the end again milliseconds later, which costs a Kafka log ~20
# ms (a consumer opened and its fetches answered; bench/kafka_task_cost.py).
FRESH_ENDS_SECONDS = 0.1


def read_ends(job: JobState, src: LogSource) -> list[int]:
    """The log's end offsets now, kept for the next plan (:func:`ends_for_plan`)."""
    ends = src.log.end_offsets()
    job.log_ends[src.uid] = (time.monotonic(), ends)
    return ends


def ends_for_plan(job: JobState, src: LogSource) -> list[int]:
    """The ends a plan reads up to: those read last, once, if within ``FRESH_ENDS_SECONDS``
    (ends read since are at least as far, so a plan on them reads no record that is not
    there, only fewer of the newest); else the log's ends now."""
    kept = job.log_ends.pop(src.uid, None)
    if kept is not None and time.monotonic() - kept[0] <= FRESH_ENDS_SECONDS:
        return kept[1]
    return src.log.end_offsets()


@dataclass(frozen=True)
class LogRead:
    """A batch's read of a log source as its intent plans it, not in Spark's plan yet: reader
    tasks and a shuffle to the stages (:func:`read_source`), or, for a small batch, the first
    keyed stage's own tasks (:func:`read_in_stage`; ``stages.py`` decides)."""

    src: LogSource
    batch_id: int
    plan: SourcePlan
    batch_time_ms: int
    log_id: str | None  # the log the plan is for (a Kafka topic's id), checked by the tasks

    @property
    def offsets(self) -> int:
        """How many offsets the plan reads: its records, or more (a Kafka transaction's
        markers take offsets too).

        >>> LogRead(None, 0, ((( 0, 10, 25),), ((1, 5, 5),)), 0, None).offsets  # type: ignore[arg-type]
        15
        """
        return sum(end - start for reader in self.plan for _, start, end in reader)


def read_source(job: JobState, read: LogRead) -> DataFrame:
    """The batch's records of ``read.src``: one reader task per reader of the plan
    (``mapInArrow``, :mod:`keyscale.runtime.task.reader`)."""
    fn = make_reader_function(**_reader_args(job, read), report_to=job.reports.sender)
    return map_in_arrow(reader_rows(job, len(read.plan)), fn, source_schema(read.src))


def read_in_stage(job: JobState, read: LogRead, spec: StageTask) -> DataFrame:
    """The keyed stage ``spec``'s input read by its own tasks, with no reader tasks and no
    shuffle: task ``i`` reads the whole batch and keeps the rows of subtask ``i``'s key groups
    (:func:`~keyscale.runtime.task.reader.make_stage_reader_function`), with the columns,
    sequence and key group the shuffle would have given it."""
    from pyspark.sql.types import IntegerType, LongType, StructField, StructType

    schema = source_schema(read.src)
    fn = make_stage_reader_function(
        **_reader_args(job, read), report_to=job.reports.sender, columns=spec.input_schema.names, key_names=spec.key_names,
        key_types=[schema[k].dataType.simpleString() for k in spec.key_names], max_parallelism=spec.max_parallelism, parallelism=spec.parallelism)
    rows = StructType([*(schema[c] for c in spec.input_schema.names), StructField(SEQ, LongType()), StructField(KG, IntegerType())])
    return map_in_arrow(reader_rows(job, spec.parallelism), fn, rows)


def _reader_args(job: JobState, read: LogRead) -> dict[str, Any]:
    """What a reader task of ``read`` needs, as :func:`make_reader_function` takes it (but where
    its reports go)."""
    assert job.pipeline is not None
    target = to_arrow_schema(source_schema(read.src), utc=True)
    # The job's clock is per partition when the log drives the batches; beside a Spark
    # source the stage's own event times move it (commit.next_watermark).
    driving = read.src is job.pipeline.log_source
    event_time = job.pipeline.watermark.column if job.pipeline.watermark and driving else None
    return {"log": read.src.log, "uid": read.src.uid, "batch": read.batch_id, "plan": read.plan, "target": target, "event_time": event_time,
            "event_time_limit_ms": job.event_time_limit(read.batch_time_ms), "log_id": read.log_id}


def reader_rows(job: JobState, n: int) -> DataFrame:
    """The readers' input: ``n`` partitions, partition ``i`` holding the one row ``i`` (column
    ``subtask``), so each reader is one Spark task. A range, built once per session and
    count and kept in ``job.plans``: the same every batch. (It was a Python RDD made by
    ``createDataFrame`` each batch: ~40 ms of Py4J calls on the driver, and in each reader
    task a Python worker to unpickle its one row before the reader's own.)"""
    from pyspark.sql import functions as F

    cache = session_cache(job.plans, job.spark)
    key = ("readers", n)
    rows: DataFrame | None = cache.get(key)
    if rows is None:
        rows = cache[key] = job.spark.range(0, n, 1, n).select(F.col("id").cast("int").alias("subtask"))
    return rows


def input_waiting(job: JobState, src: LogSource) -> bool:
    """Whether ``src`` holds records the committed positions have not reached (or a partition
    no reader has yet): one read of the log's end. A log that cannot be read now says no:
    the next batch's planning reports why."""
    assignment = committed_assignment(job, src)
    try:
        ends = read_ends(job, src)
    except KeyscaleError:
        return False
    if assignment is None:
        return any(ends)
    assigned = {p for entries in assignment for p, _ in entries}
    return any(reader.lag(assignment, ends).values()) or any(e > 0 for p, e in enumerate(ends) if p not in assigned)


# An idle log source's job reads the log's end this often, and starts a batch once records arrive.
IDLE_POLL_SECONDS = 0.05


def await_input(job: JobState, src: LogSource, stop: threading.Event, batch_id: int, started: float, interval: float) -> None:
    """Between two batches of a log source (``batch_id`` just committed: its effects are
    durable; with asynchronous checkpoints its manifest is on its way): no wait while
    records wait in the log, so a record waits for the batch that runs, not for a trigger
    too; when idle, until records arrive, ``stop`` is set, or the trigger ``interval``
    since the last batch ``started`` is up (timers, idleness and windows move with time).
    The backlog after the batch is its record's (one read of the log's end per batch); an
    idle job reads the log's end every ``IDLE_POLL_SECONDS``, or every five reads' time
    where a read is slow (a Kafka log's opens a consumer)."""
    last = job.history.batches[-1] if job.history.batches else None
    if last is not None and last["batch"] == batch_id and last.get("backlog"):
        return
    poll = IDLE_POLL_SECONDS
    left = interval - (time.monotonic() - started)
    while not stop.is_set() and left > 0:
        stop.wait(min(poll, left))
        read = time.monotonic()
        if stop.is_set() or input_waiting(job, src):
            return
        poll = max(IDLE_POLL_SECONDS, 5 * (time.monotonic() - read))
        left = interval - (time.monotonic() - started)


def source_status(job: JobState, src: LogSource) -> dict[str, Any]:
    """Readers, their partitions and offsets, and the lag behind the log's end."""
    assignment = committed_assignment(job, src) or [[] for _ in range(job.scaling.parallelism[src.uid])]
    try:
        ends = read_ends(job, src)
    except KeyscaleError as e:
        return {"kind": "log", "log": src.log.describe(), "error": str(e)}
    lag = reader.lag(assignment, ends)
    return {
        "kind": "log", "log": src.log.describe(), "parallelism": job.scaling.parallelism[src.uid],
        "readers": [{"subtask": i, "partitions": {str(p): {"offset": o, "end": ends[p] if p < len(ends) else None, "lag": lag.get(p)} for p, o in e}}
                    for i, e in enumerate(assignment)],
        "unassigned_partitions": [p for p in range(len(ends)) if p not in lag],
        "lag": sum(lag.values()),
    }
