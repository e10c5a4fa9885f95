"""A log source's reader as a Spark task (``mapInArrow``): one task per reader subtask reads
the ranges its batch's plan gives it (:mod:`keyscale.sources.reader` plans them) and
reports, per partition, what it read (a :class:`~keyscale.runtime.task.report.TaskReport`),
and its records' ages at its end where the log keeps append times (:mod:`keyscale.latency`).
For a small batch the first keyed stage's tasks run the readers themselves
(:func:`make_stage_reader_function`), with no reader tasks and no shuffle.
Here, beside the keyed and non-keyed tasks, so that the sources never import the runtime."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from keyscale.errors import InputDataError, KeyscaleError, encode_error
from keyscale.latency import ages, merge_ages
from keyscale.operators.eventtime import event_time_ms, max_event_within
from keyscale.runtime.task import report as reports
from keyscale.runtime.task.report import PartitionRead, TaskReport
from keyscale.runtime.task.spec import KG, SEQ
from keyscale.sources.partitioned import AppendTimes, PartitionedLog
from keyscale.sources.reader import WHAT_TO_DO, Plan, fingerprint
from keyscale.state.keygroups import key_group_range
from keyscale.state.spark_hash import key_groups

Range = tuple[int, int, int]  # partition, start offset, end offset


def _read(log: PartitionedLog, uid: str, batch: int, ranges: Sequence[Range]) -> list[tuple[pa.Table, AppendTimes | None]]:
    """The batch's records of each range, with their append times if the log keeps them;
    records gone since the batch was planned (a replay after the log shrank) stop the job
    with the same advice as a shrink at planning."""
    try:
        return log.read_ranges_timed(ranges)
    except KeyscaleError as e:
        ends = log.end_offsets()
        for p, start, end in ranges:
            if end > start and p < len(ends) and ends[p] < end:
                raise RuntimeError(encode_error(KeyscaleError(
                    f"source '{uid}': partition {p} of log {log.uri} ends at offset {ends[p]}, but batch {batch} "
                    f"was planned to read [{start}, {end}): records are gone (a Redis failover to a replica that was behind, deleted "
                    f"segments, or the log recreated). {WHAT_TO_DO}"
                ))) from None
        raise RuntimeError(encode_error(type(e)(f"source '{uid}', batch {batch}: {e}"))) from None


def _check_identity(log: PartitionedLog, uid: str, batch: int, log_id: str | None) -> Callable[[], None]:
    """With ``log_id``: check, beside the read, that the log is still the one the batch was
    planned on (a Kafka topic's id is a request to the broker: ~10 ms a task). Returns the
    wait for the check, which raises if it failed: called before any record leaves the task."""
    if log_id is None:
        return lambda: None
    found: list[str | BaseException | None] = []

    def check() -> None:
        try:
            found.append(log.identity())
        except BaseException as e:  # raised where the task waits for it
            found.append(e)

    worker = threading.Thread(target=check, name=f"keyscale-identity-{uid}", daemon=True)
    worker.start()

    def wait() -> None:
        worker.join()
        if isinstance(found[0], BaseException):
            raise found[0]
        if found[0] != log_id:
            raise RuntimeError(encode_error(KeyscaleError(
                f"source '{uid}': log {log.uri} was recreated after batch {batch} was planned "
                f"(its id was {log_id}, now {found[0]}); the batch's offsets mean other records. {WHAT_TO_DO}"
            )))

    return wait


class _Tally:
    """What one reader read, for its report: per partition its records, offsets, largest
    event time and last record's fingerprint; event times after ``event_time_limit_ms`` are
    not believed: counted, left out of the maximum (so they never move the partition's
    clock), and passed on like any record."""

    def __init__(self, uid: str, target: pa.Schema, event_time: str | None, event_time_limit_ms: int | None) -> None:
        self.uid, self.target, self.event_time, self.limit = uid, target, event_time, event_time_limit_ms
        self.partitions: dict[int, PartitionRead] = {}
        self.ahead = 0
        self.appended: list[AppendTimes] = []

    def add(self, rng: Range, t: pa.Table, times: AppendTimes | None) -> pa.Table:
        """Count range ``rng``'s records ``t``; returns them in the log's Spark types."""
        p, start, end = rng
        if times is not None:
            self.appended.append(times)
        max_event_ms: int | None = None
        if self.event_time and t.num_rows:
            max_event_ms, n = max_event_within(event_time_ms(t, self.event_time), self.limit)
            self.ahead += n
        last_crc = fingerprint(t.slice(t.num_rows - 1)) if t.num_rows else None
        self.partitions[p] = PartitionRead(t.num_rows, start, end, max_event_ms, last_crc)
        try:
            return t.select(self.target.names).cast(self.target)
        except (pa.ArrowInvalid, KeyError) as e:
            raise RuntimeError(encode_error(InputDataError(f"source '{self.uid}', partition {p}: records do not fit the log's schema ({e})"))) from None

    def report(self, subtask: int, skipped: int, busy_seconds: float) -> TaskReport:
        """The reader's report, with its records' ages now, at its end (the driver adds the
        time to the commit)."""
        ended = time.time()
        summary = None
        for times in self.appended:
            summary = merge_ages(summary, ages(times.seconds, ended, times.clock))
        return TaskReport(
            subtask=subtask, records=sum(i.records for i in self.partitions.values()), partitions=self.partitions, ages=summary,
            counters={**({"too_far_ahead": self.ahead} if self.ahead else {}), **({"skipped_records": skipped} if skipped else {})},
            busy_seconds=busy_seconds,
        )


def make_reader_function(
    log: PartitionedLog, uid: str, batch: int, plan: Plan, target: pa.Schema, event_time: str | None,
    event_time_limit_ms: int | None = None, log_id: str | None = None, report_to: Any = None,
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """The ``mapInArrow`` function of the readers: input rows are reader indexes, one per task.

    Each reader reports what it read (:class:`_Tally`) to ``report_to``
    (:mod:`keyscale.runtime.task.report`). With ``log_id``, a reader first checks the log
    is still the one the batch was planned on. It reads a partition at a time: a large
    batch's reader holds one partition's records, not all of them.
    """

    def read(rows: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for rb in rows:
            for value in rb.column(0).to_pylist():
                subtask = int(value or 0)
                started = time.perf_counter()
                checked = _check_identity(log, uid, batch, log_id)
                tally = _Tally(uid, target, event_time, event_time_limit_ms)
                for rng in plan[subtask]:
                    ((t, times),) = _read(log, uid, batch, [rng])
                    checked()
                    yield from tally.add(rng, t, times).to_batches()
                checked()
                reports.send(report_to, uid, batch, subtask, tally.report(subtask, log.take_skipped(), time.perf_counter() - started))

    return read


def make_stage_reader_function(
    log: PartitionedLog, uid: str, batch: int, plan: Plan, target: pa.Schema, event_time: str | None,
    event_time_limit_ms: int | None, log_id: str | None, report_to: Any,
    columns: Sequence[str], key_names: Sequence[str], key_types: Sequence[str], max_parallelism: int, parallelism: int,
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """The ``mapInArrow`` function that reads a small batch's records inside the keyed stage's
    own tasks, with no shuffle: input rows are the stage's subtask indexes, one per task.

    Subtask ``s`` reads every reader's ranges of the plan at once (one Kafka consumer for
    all of them), then goes through the readers in turn as :func:`make_reader_function`
    would (reader ``r``'s report sent once, by subtask ``r % parallelism``), keeping the
    records whose key group (``key_types``: the key columns' Spark types, whose hash Spark's
    ``hash()`` computes) is in its range: exactly the rows the shuffle would have sent it,
    with the same columns (``columns``, then the arrival sequence and key group). The
    sequence is what ``monotonically_increasing_id()`` gives the reader's output (the
    reader's index in the upper bits, the row's place in its output in the lower 33), so
    the task sorts them into the same order either way. Every subtask reads all of the
    batch's records, so this pays only for small batches (``runtime/batch/stages.py``
    decides)."""
    names = list(columns)

    def read(rows: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for rb in rows:
            for value in rb.column(0).to_pylist():
                subtask = int(value or 0)
                own = key_group_range(subtask, max_parallelism, parallelism)
                started = time.perf_counter()
                checked = _check_identity(log, uid, batch, log_id)
                everything = _read(log, uid, batch, [rng for ranges in plan for rng in ranges])
                checked()
                # The read's skip count and time are the whole batch's: all to reader 0's
                # report, the time shared by the readers' offsets.
                skipped, busy = log.take_skipped(), time.perf_counter() - started
                offsets = max(sum(e - s for ranges in plan for _, s, e in ranges), 1)
                at = 0
                for r, ranges in enumerate(plan):
                    tally = _Tally(uid, target, event_time, event_time_limit_ms)
                    position = 0
                    for rng, (t, times) in zip(ranges, everything[at:at + len(ranges)], strict=True):
                        t = tally.add(rng, t, times)
                        kg = key_groups(t, key_names, key_types, max_parallelism)
                        seq = (np.int64(r) << np.int64(33)) + position + np.arange(t.num_rows, dtype=np.int64)
                        position += t.num_rows
                        keep = (kg >= own.start) & (kg <= own.end)
                        if keep.any():
                            yield from t.select(names).append_column(SEQ, pa.array(seq)).append_column(KG, pa.array(kg)).filter(pa.array(keep)).to_batches()
                    at += len(ranges)
                    if r % parallelism == subtask:
                        share = busy * sum(e - s for _, s, e in ranges) / offsets
                        reports.send(report_to, uid, batch, r, tally.report(r, skipped if r == 0 else 0, share))

    return read
