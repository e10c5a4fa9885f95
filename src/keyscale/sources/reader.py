"""Reading a partitioned log as a job's source: offsets as split/merge operator state.

:func:`log_source` makes a log a job's source and :func:`broadcast` a stage's broadcast
input (:class:`~keyscale.operators.nonkeyed.BroadcastStream`: the operators know the
stream as data and never import the sources).

The source is a non-keyed operator with ``parallelism`` reader subtasks. Its state is one
list state, ``offsets``: entries ``(partition, next offset)``, each held by one reader
(FLIP-8's example). On a change of parallelism the entries are pooled and split evenly
(:func:`keyscale.state.redistribution.split_merge`): scale down and no partition is
dropped, scale up and no reader idles while there are partitions for it. Partitions added
to the log while the job runs are picked up at the next batch, starting at offset 0, by
the reader holding the fewest.

Per batch the driver fixes each reader's ranges ``(partition, start, end)`` in the batch's
intent (so a replay reads exactly the same records); the next offsets are committed in the
batch's manifest, atomically with the keyed state and after the sink output. The readers
themselves are Spark tasks: :mod:`keyscale.runtime.task.reader`.

The offsets are only meaningful for the log they were read from. The state keeps that
log's id (:meth:`PartitionedLog.identity`), and before each batch :func:`check_positions`
stops the job when the log was recreated (another id) or a partition now ends before the
committed offset (records removed: a Redis failover to a replica that was behind, segments
deleted): reading on would skip records without a sign.

>>> plan_batch([[(0, 5), (1, 0)], [(2, 7)]], [9, 4, 7], limit=3)
[[(0, 5, 8), (1, 0, 3)], [(2, 7, 7)]]
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from keyscale._keywords import checked_keywords
from keyscale.errors import JobDefinitionError
from keyscale.operators.nonkeyed import BroadcastStream
from keyscale.sources.log import open_log
from keyscale.sources.partitioned import LogError, PartitionedLog
from keyscale.state.redistribution import split_merge

Assignment = list[list[tuple[int, int]]]  # per reader: (partition, next offset)
Plan = Sequence[Sequence[tuple[int, int, int]]]  # per reader: (partition, start, end); a batch intent's SourcePlan is one

OFFSETS = "offsets"
LOG_ID = "log_id"
LAST_RECORDS = "last_records"


@dataclass(frozen=True)
class LogSource:
    """A partitioned log read by ``parallelism`` readers (see :func:`keyscale.sources.log_source`)."""

    log: PartitionedLog
    uid: str
    parallelism: int | None = None
    max_records_per_partition: int | None = None

    @property
    def schema(self) -> pa.Schema:
        return self.log.schema


@checked_keywords
def log_source(log: PartitionedLog | str, uid: str = "source", parallelism: int | None = None, max_records_per_batch: int | None = None) -> LogSource:
    """A partitioned log as a job's source; give the result to :func:`keyscale.stream`.

    ``log``: a :class:`PartitionedLog` or its URI (a folder, or ``redis://host:port/db?name=N``).
    ``max_records_per_batch`` caps what one batch reads from each partition.

    ``ks.stream(ks.sources.log_source(ctx.arg("log"), uid="events")).key_by("key")...``
    """
    opened = open_log(log) if isinstance(log, str) else log
    if max_records_per_batch is not None and max_records_per_batch < 1:
        raise JobDefinitionError(f"source '{uid}': max_records_per_batch must be at least 1")
    return LogSource(opened, uid, parallelism, max_records_per_batch)


def broadcast(source: LogSource, apply: Callable[[dict[str, Any], Any], None]) -> BroadcastStream:
    """A low-volume stream (a :func:`keyscale.sources.log_source`) of rules or configuration,
    delivered to every subtask of a stage as broadcast state.

    ``apply(state, row)`` updates the state (a dict of JSON-serialisable values) with one
    rules record; it runs on the driver, records in partition then offset order, before the
    main stream's records of the same batch.

    ``ks.sources.broadcast(ks.sources.log_source(ctx.arg("rules"), uid="rules"), lambda s, r: s.__setitem__(r.key, r.threshold))``
    """
    if not isinstance(source, LogSource):
        raise JobDefinitionError(f"broadcast() takes a log_source(), not {type(source).__name__}")
    if not callable(apply):
        raise JobDefinitionError("broadcast(): apply must be a function (state, row) -> None")
    return BroadcastStream(source, apply)


# -- pure planning -----------------------------------------------------------------------------


def initial_assignment(partitions: int, parallelism: int, firsts: Sequence[int] | None = None) -> Assignment:
    """Every partition from its first offset (``firsts``, default 0), split evenly over the readers."""
    return [list(s) for s in split_merge([[(p, firsts[p] if firsts else 0) for p in range(partitions)]], parallelism)]


def rescale_assignment(old: Assignment, parallelism: int) -> Assignment:
    """FLIP-8: all entries pooled, each new reader gets a contiguous share."""
    return [list(s) for s in split_merge(old, parallelism)]


def add_partitions(assignment: Assignment, partitions: int, firsts: Sequence[int] | None = None) -> tuple[Assignment, list[tuple[int, int]]]:
    """Assign partitions the log has and the assignment does not, each to the reader holding
    the fewest (lowest index on a tie), from its first offset (``firsts``, default 0);
    returns (assignment, [(partition, reader)])."""
    known = {p for entries in assignment for p, _ in entries}
    out = [list(e) for e in assignment]
    added = []
    for p in range(partitions):
        if p not in known:
            r = min(range(len(out)), key=lambda i: (len(out[i]), i))
            out[r].append((p, firsts[p] if firsts else 0))
            added.append((p, r))
    return out, added


def plan_batch(assignment: Assignment, end_offsets: Sequence[int], limit: int | None = None) -> Plan:
    """Each reader's ranges for one batch: from its offsets to the log's end (at most ``limit`` per partition)."""
    plan: list[list[tuple[int, int, int]]] = []
    for entries in assignment:
        ranges = []
        for p, start in entries:
            end = end_offsets[p]
            if limit is not None:
                end = min(end, start + limit)
            ranges.append((p, start, max(start, end)))
        plan.append(ranges)
    return plan


def advance(plan: Plan) -> Assignment:
    """The assignment after a batch read its plan."""
    return [[(p, end) for p, _, end in ranges] for ranges in plan]


def lag(assignment: Assignment, end_offsets: Sequence[int]) -> dict[int, int]:
    """Records behind the end, per partition."""
    return {p: max(0, end_offsets[p] - off) for entries in assignment for p, off in entries if p < len(end_offsets)}


def to_state(assignment: Assignment, log_id: str | None = None, last: dict[int, tuple[int, int]] | None = None) -> dict[str, Any]:
    """The source's operator state as the manifest and savepoints store it (with the id of
    the log the offsets belong to, when it has one, and per partition the offset and
    fingerprint of the last record read)."""
    out: dict[str, Any] = {OFFSETS: {"mode": "split_merge", "subtasks": [[[p, o] for p, o in e] for e in assignment]}}
    if log_id is not None:
        out[LOG_ID] = log_id
    if last:
        out[LAST_RECORDS] = {str(p): [o, c] for p, (o, c) in sorted(last.items())}
    return out


def last_records_of(state: dict[str, Any] | None) -> dict[int, tuple[int, int]]:
    """Per partition: (offset, fingerprint) of the last record the committed state read."""
    return {int(p): (int(o), int(c)) for p, (o, c) in ((state or {}).get(LAST_RECORDS) or {}).items()}


def last_records_after(state: dict[str, Any] | None, reads: Iterable[tuple[int, int, int, int | None]]) -> dict[int, tuple[int, int]]:
    """The committed fingerprints updated with what a batch's readers read last: ``reads``
    holds, per partition read, (partition, start, end, fingerprint of its last record or
    None), as their reports say (``TaskReport.partitions``).

    >>> last_records_after(None, [(0, 5, 8, 1234), (1, 3, 3, None)])
    {0: (7, 1234)}
    """
    out = last_records_of(state)
    for p, start, end, crc in reads:
        if crc is not None and end > start:
            out[int(p)] = (int(end) - 1, int(crc))
    return out


def fingerprint(record: pa.Table) -> int:
    """A checksum of one record as the log returns it: the same record, the same number."""
    return zlib.crc32(repr(record.to_pylist()).encode())


def check_last_records(uid: str, log: PartitionedLog, committed: Assignment, last: dict[int, tuple[int, int]]) -> None:
    """Read again the last record each partition gave (one record per partition): after a
    failover that lost records and got new ones, the offsets look fine but the record at
    the committed offset is another one. Call after :func:`check_positions`. Not for a log
    whose offsets have gaps (``log.fingerprints()`` False: in a Kafka topic, the offset
    before a committed one may be a transaction's marker, which reads as no record)."""
    if not log.fingerprints():
        return
    for entries in committed:
        for p, off in entries:
            if p in last and last[p][0] == off - 1 and fingerprint(log.read(p, off - 1, off)) != last[p][1]:
                raise LogError(
                    f"source '{uid}': partition {p} of log {log.uri} holds another record at offset {off - 1} than the job read "
                    f"there: records the job read were lost and others written in their place (a Redis failover to a replica "
                    f"that was behind, or the log recreated). {WHAT_TO_DO}"
                )


def log_id_of(state: dict[str, Any] | None) -> str | None:
    """The id of the log a committed state's offsets belong to (None: not recorded)."""
    found = (state or {}).get(LOG_ID)
    return None if found is None else str(found)


WHAT_TO_DO = (
    "The job stops so that no record is skipped without a sign. If the records should be there, restore the log "
    "(or fail over back to the node that has them) and run the job again. To read this log from its start instead, "
    "take a savepoint (keyscale savepoint JOB_DIR), give the source a new uid in the job, and start it in a new job "
    "directory with --from-savepoint SP --allow-non-restored-state."
)


def check_positions(uid: str, log_uri: str, committed: Assignment, ends: Sequence[int], committed_id: str | None, current_id: str | None) -> None:
    """Stop when the committed offsets do not belong to the log as it is now (see the module doc).

    >>> check_positions("reader", "/logs/l", [[(0, 5)]], [7], "a", "a")
    >>> check_positions("reader", "/logs/l", [[(0, 5)]], [3], "a", "a")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    keyscale.sources.partitioned.LogError: source 'reader': partition 0 of log /logs/l ends at offset 3, but the job has committed offset 5 ...
    """
    if committed_id is not None and current_id != committed_id:
        raise LogError(
            f"source '{uid}': log {log_uri} was recreated (its id is {current_id or 'missing'}; the job's offsets belong to "
            f"the log with id {committed_id}), so the committed offsets mean other records. {WHAT_TO_DO}"
        )
    for entries in committed:
        for p, off in entries:
            if p >= len(ends):
                raise LogError(
                    f"source '{uid}': log {log_uri} has no partition {p} any more (it has {len(ends)}), but the job has committed "
                    f"offset {off} there: the log was recreated or lost partitions. {WHAT_TO_DO}"
                )
            if ends[p] < off:
                raise LogError(
                    f"source '{uid}': partition {p} of log {log_uri} ends at offset {ends[p]}, but the job has committed offset {off} "
                    f"there: records [{ends[p]}, {off}) it read are gone (a Redis failover to a replica that was behind, "
                    f"deleted segments, or the log recreated). {WHAT_TO_DO}"
                )


def from_state(state: dict[str, Any]) -> Assignment | None:
    entry = state.get(OFFSETS)
    if not entry:
        return None
    return [[(int(p), int(o)) for p, o in e] for e in entry["subtasks"]]
