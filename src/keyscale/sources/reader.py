"""Reading a partitioned log as a job's source: offsets as split/merge operator state.

The source is a non-keyed operator with ``parallelism`` reader subtasks. Its state is one
list state, ``offsets``: entries ``(partition, next offset)``, each held by one reader
(FLIP-8's example). On a change of parallelism the entries are pooled and split evenly
(:func:`keyscale.state.redistribution.split_merge`): scale down and no partition is
dropped, scale up and no reader idles while there are partitions for it. Partitions added
to the log while the job runs are picked up at the next batch, starting at offset 0, by
the reader holding the fewest.

Per batch the driver fixes each reader's ranges ``(partition, start, end)`` in the batch's
intent (so a replay reads exactly the same records); the next offsets are committed in the
batch's manifest, atomically with the keyed state and after the sink output.

>>> plan_batch([[(0, 5), (1, 0)], [(2, 7)]], [9, 4, 7], limit=3)
[[(0, 5, 8), (1, 0, 3)], [(2, 7, 7)]]
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from keyscale.checkpoint.files import write_report
from keyscale.errors import JobDefinitionError
from keyscale.operators.eventtime import event_time_ms
from keyscale.operators.poison import max_event_time
from keyscale.sources.log import PartitionedLog, open_log
from keyscale.state.redistribution import split_merge

Assignment = list[list[tuple[int, int]]]  # per reader: (partition, next offset)
Plan = list[list[tuple[int, int, int]]]  # per reader: (partition, start, end)

OFFSETS = "offsets"


@dataclass(frozen=True)
class LogSource:
    """A partitioned log read by ``parallelism`` readers (see :func:`keyscale.log_source`)."""

    log: PartitionedLog
    uid: str
    parallelism: int | None = None
    max_records_per_partition: int | None = None

    @property
    def schema(self) -> pa.Schema:
        return self.log.schema


def log_source(log: PartitionedLog | str, uid: str = "source", parallelism: int | None = None, max_records_per_batch: int | None = None) -> LogSource:
    """A partitioned log as a job's source; give the result to :func:`keyscale.stream`.

    ``log``: a :class:`PartitionedLog` or its URI (a folder, or ``redis://host:port/db?name=N``).
    ``max_records_per_batch`` caps what one batch reads from each partition.

    ``ks.stream(ks.log_source(ctx.arg("log"), uid="events")).key_by("key")...``
    """
    opened = open_log(log) if isinstance(log, str) else log
    if max_records_per_batch is not None and max_records_per_batch < 1:
        raise JobDefinitionError(f"source '{uid}': max_records_per_batch must be at least 1")
    return LogSource(opened, uid, parallelism, max_records_per_batch)


# -- pure planning -----------------------------------------------------------------------------


def initial_assignment(partitions: int, parallelism: int) -> Assignment:
    """Every partition from offset 0, split evenly over the readers."""
    return [list(s) for s in split_merge([[(p, 0) for p in range(partitions)]], parallelism)]


def rescale_assignment(old: Assignment, parallelism: int) -> Assignment:
    """FLIP-8: all entries pooled, each new reader gets a contiguous share."""
    return [list(s) for s in split_merge(old, parallelism)]


def add_partitions(assignment: Assignment, partitions: int) -> tuple[Assignment, list[tuple[int, int]]]:
    """Assign partitions the log has and the assignment does not, each to the reader holding
    the fewest (lowest index on a tie), from offset 0; returns (assignment, [(partition, reader)])."""
    known = {p for entries in assignment for p, _ in entries}
    out = [list(e) for e in assignment]
    added = []
    for p in range(partitions):
        if p not in known:
            r = min(range(len(out)), key=lambda i: (len(out[i]), i))
            out[r].append((p, 0))
            added.append((p, r))
    return out, added


def plan_batch(assignment: Assignment, end_offsets: Sequence[int], limit: int | None = None) -> Plan:
    """Each reader's ranges for one batch: from its offsets to the log's end (at most ``limit`` per partition)."""
    plan: Plan = []
    for entries in assignment:
        ranges = []
        for p, start in entries:
            end = end_offsets[p]
            if limit is not None:
                end = min(end, start + limit)
            ranges.append((p, start, max(start, end)))
        plan.append(ranges)
    return plan


def plan_to_json(plan: Plan) -> list[list[list[int]]]:
    """The plan as the intent file stores it."""
    return [[[p, a, b] for p, a, b in ranges] for ranges in plan]


def plan_from_json(plan: list[list[list[int]]]) -> Plan:
    return [[(int(p), int(a), int(b)) for p, a, b in ranges] for ranges in plan]


def advance(plan: Plan) -> Assignment:
    """The assignment after a batch read its plan."""
    return [[(p, end) for p, _, end in ranges] for ranges in plan]


def lag(assignment: Assignment, end_offsets: Sequence[int]) -> dict[int, int]:
    """Records behind the end, per partition."""
    return {p: max(0, end_offsets[p] - off) for entries in assignment for p, off in entries if p < len(end_offsets)}


def to_state(assignment: Assignment) -> dict[str, Any]:
    """The source's operator state as the manifest and savepoints store it."""
    return {OFFSETS: {"mode": "split_merge", "subtasks": [[[p, o] for p, o in e] for e in assignment]}}


def from_state(state: dict[str, Any]) -> Assignment | None:
    entry = state.get(OFFSETS)
    if not entry:
        return None
    return [[(int(p), int(o)) for p, o in e] for e in entry["subtasks"]]


# -- the Spark task ----------------------------------------------------------------------------


def make_reader_function(
    log: PartitionedLog, uid: str, job_dir: str, batch: int, plan: Plan, target: pa.Schema, event_time: str | None,
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """The ``mapInArrow`` function of the readers: input rows are reader indexes, one per task."""

    def read(rows: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for rb in rows:
            for value in rb.column(0).to_pylist():
                subtask = int(value or 0)
                started = time.perf_counter()
                report: dict[str, Any] = {"subtask": subtask, "partitions": {}}
                for p, start, end in plan[subtask]:
                    t = log.read(p, start, end) if end > start else log.schema.empty_table()
                    info: dict[str, Any] = {"records": t.num_rows, "start": start, "end": end, "max_event_ms": None}
                    if event_time and t.num_rows:
                        info["max_event_ms"] = max_event_time(event_time_ms(t, event_time))  # nulls never move the watermark
                    report["partitions"][str(p)] = info
                    try:
                        t = t.select(target.names).cast(target)
                    except (pa.ArrowInvalid, KeyError) as e:
                        raise RuntimeError(f"KEYSCALE-ERROR InputDataError: source '{uid}', partition {p}: records do not fit the log's schema ({e})") from None
                    yield from t.to_batches()
                report["records"] = sum(i["records"] for i in report["partitions"].values())
                report["busy_seconds"] = time.perf_counter() - started
                write_report(Path(job_dir), uid, batch, subtask, report)

    return read
