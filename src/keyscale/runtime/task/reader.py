"""A log source's reader as a Spark task (``mapInArrow``): one task per reader subtask reads
the ranges its batch's plan gives it (:mod:`keyscale.sources.reader` plans them) and
reports, per partition, what it read (a :class:`~keyscale.runtime.task.report.TaskReport`),
and its records' ages at its end where the log keeps append times (:mod:`keyscale.latency`).
Here, beside the keyed and non-keyed tasks, so that the sources never import the runtime."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pyarrow as pa

from keyscale.errors import InputDataError, KeyscaleError, encode_error
from keyscale.latency import ages, merge_ages
from keyscale.operators.eventtime import event_time_ms, max_event_within
from keyscale.runtime.task import report as reports
from keyscale.runtime.task.report import PartitionRead, TaskReport
from keyscale.sources.partitioned import AppendTimes, PartitionedLog
from keyscale.sources.reader import WHAT_TO_DO, Plan, fingerprint


def _read(log: PartitionedLog, uid: str, batch: int, p: int, start: int, end: int) -> tuple[pa.Table, AppendTimes | None]:
    """The batch's records of one partition, with their append times if the log keeps them;
    records gone since the batch was planned (a replay after the log shrank) stop the job
    with the same advice as a shrink at planning."""
    if end <= start:
        return log.schema.empty_table(), None
    try:
        return log.read_timed(p, start, end)
    except KeyscaleError as e:
        ends = log.end_offsets()
        if p < len(ends) and ends[p] < end:
            raise RuntimeError(encode_error(KeyscaleError(
                f"source '{uid}': partition {p} of log {log.uri} ends at offset {ends[p]}, but batch {batch} "
                f"was planned to read [{start}, {end}): records are gone (a Redis failover to a replica that was behind, deleted "
                f"segments, or the log recreated). {WHAT_TO_DO}"
            ))) from None
        raise RuntimeError(encode_error(type(e)(f"source '{uid}', batch {batch}: {e}"))) from None


def make_reader_function(
    log: PartitionedLog, uid: str, batch: int, plan: Plan, target: pa.Schema, event_time: str | None,
    event_time_limit_ms: int | None = None, log_id: str | None = None, report_to: Any = None,
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """The ``mapInArrow`` function of the readers: input rows are reader indexes, one per task.

    Each reader reports, per partition, its records and largest event time; event times
    after ``event_time_limit_ms`` are not believed: counted, left out of the maximum (so
    they never move the partition's clock), and passed on like any record. With ``log_id``,
    a reader first checks the log is still the one the batch was planned on. Reports go to
    ``report_to`` (:mod:`keyscale.runtime.task.report`).
    """

    def read(rows: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for rb in rows:
            for value in rb.column(0).to_pylist():
                subtask = int(value or 0)
                started = time.perf_counter()
                if log_id is not None and log.identity() != log_id:
                    raise RuntimeError(encode_error(KeyscaleError(
                        f"source '{uid}': log {log.uri} was recreated after batch {batch} was planned "
                        f"(its id was {log_id}, now {log.identity()}); the batch's offsets mean other records. {WHAT_TO_DO}"
                    )))
                partitions: dict[int, PartitionRead] = {}
                ahead = 0
                appended: list[AppendTimes] = []
                for p, start, end in plan[subtask]:
                    t, times = _read(log, uid, batch, p, start, end)
                    if times is not None:
                        appended.append(times)
                    max_event_ms: int | None = None
                    if event_time and t.num_rows:
                        max_event_ms, n = max_event_within(event_time_ms(t, event_time), event_time_limit_ms)
                        ahead += n
                    last_crc = fingerprint(t.slice(t.num_rows - 1)) if t.num_rows else None
                    partitions[p] = PartitionRead(t.num_rows, start, end, max_event_ms, last_crc)
                    try:
                        t = t.select(target.names).cast(target)
                    except (pa.ArrowInvalid, KeyError) as e:
                        raise RuntimeError(encode_error(InputDataError(f"source '{uid}', partition {p}: records do not fit the log's schema ({e})"))) from None
                    yield from t.to_batches()
                skipped = log.take_skipped()
                # The records' ages now, at the task's end: the driver adds the time to the commit.
                ended = time.time()
                summary = None
                for times in appended:
                    summary = merge_ages(summary, ages(times.seconds, ended, times.clock))
                report = TaskReport(
                    subtask=subtask, records=sum(i.records for i in partitions.values()), partitions=partitions, ages=summary,
                    counters={**({"too_far_ahead": ahead} if ahead else {}), **({"skipped_records": skipped} if skipped else {})},
                    busy_seconds=time.perf_counter() - started,
                )
                reports.send(report_to, uid, batch, subtask, report)

    return read
