"""The partitioned-log interface every backend implements: :class:`PartitionedLog`, the
:class:`LogError` it raises, and what backends share (the schema's stored form, argument
checks). The backends (:mod:`keyscale.sources.local_log`, :mod:`keyscale.sources.redis_log`)
build on it; :mod:`keyscale.sources.log` opens either kind and writes to any.

A log has a fixed Arrow schema and a number of partitions that can only grow. Each
partition is a sequence of records numbered from offset 0 without gaps; ``append`` adds a
table of records at the end of one partition atomically (a reader sees all of it or none
of it), and ``read(p, start, end)`` returns exactly the records ``[start, end)`` of
partition ``p`` in offset order.

>>> ddl(schema_from_bytes(schema_to_bytes(check_schema("key string, value long"))))
'key string, value int64'
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from keyscale.errors import InputDataError, KeyscaleError
from keyscale.state.types import arrow_schema

__all__ = [
    "FORMAT",
    "AppendTimes",
    "LogError",
    "PartitionedLog",
    "check_count",
    "check_schema",
    "ddl",
    "first_line",
    "schema_from_bytes",
    "schema_to_bytes",
]


class LogError(KeyscaleError):
    """A log is missing, unreachable, or asked for a partition or offsets it does not have."""


FORMAT = "keyscale-log"  # the format name every backend records beside a log's schema


def schema_to_bytes(schema: pa.Schema) -> bytes:
    """The schema as Arrow IPC bytes (how both backends store it)."""
    return bytes(schema.serialize().to_pybytes())


def schema_from_bytes(data: bytes) -> pa.Schema:
    """Inverse of :func:`schema_to_bytes`."""
    return pa.ipc.read_schema(pa.py_buffer(data))


def check_schema(schema: str | pa.Schema) -> pa.Schema:
    s = arrow_schema(schema)
    if len(s) == 0:
        raise LogError("a log needs at least one column")
    names = s.names
    for n in names:
        if not n:
            raise LogError("a log's columns need names (found an empty column name)")
        if names.count(n) > 1:
            raise LogError(f"column {n!r} appears twice in the log's schema")
    return s


def check_count(what: str, n: int, least: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < least:
        raise LogError(f"{what} must be an integer >= {least}, not {n!r}")


@dataclass(frozen=True)
class AppendTimes:
    """When a read's records were appended to their log: Unix seconds per record (NaN: the
    record has none), and what the time is (``clock``, e.g. ``"kafka LogAppendTime"``)."""

    seconds: np.ndarray[Any, Any]
    clock: str


class PartitionedLog(ABC):
    """A partitioned, append-only log of Arrow records (see the module doc).

    Offsets of a partition start at 0 and are contiguous. All methods may be called from
    several threads and processes at once; ``add_partitions`` may run while others read
    and write.

    >>> import tempfile, pyarrow as pa
    >>> from keyscale.sources.log import create_log
    >>> log = create_log(tempfile.mkdtemp() + "/l", "n long", partitions=1)
    >>> log.append(0, pa.table({"n": [7, 8, 9]}))
    (0, 3)
    >>> log.add_partitions(2), log.num_partitions(), log.end_offsets()
    (3, 3, [3, 0, 0])
    """

    @property
    @abstractmethod
    def schema(self) -> pa.Schema:
        """The records' schema, fixed when the log was created."""

    @property
    @abstractmethod
    def uri(self) -> str:
        """The URI that :func:`~keyscale.sources.log.open_log` opens this log from."""

    @abstractmethod
    def num_partitions(self) -> int:
        """The current number of partitions (it only grows)."""

    @abstractmethod
    def end_offsets(self) -> list[int]:
        """Per partition, the offset the next record will get (= its number of records)."""

    @abstractmethod
    def read(self, partition: int, start: int, end: int) -> pa.Table:
        """Exactly the records ``[start, end)`` of ``partition``, in offset order.

        Raises :class:`LogError` naming the partition when it or the range does not exist.
        """

    @abstractmethod
    def append(self, partition: int, table: pa.Table) -> tuple[int, int]:
        """Append ``table``'s rows to ``partition`` atomically; returns the offsets ``(start, end)`` they got.

        The table must have the log's columns (in any order) with types that cast safely to
        the schema's; anything else raises :class:`~keyscale.errors.InputDataError`.
        """

    @abstractmethod
    def add_partitions(self, n: int) -> int:
        """Add ``n`` new, empty partitions (safe while others read and write); returns the new count."""

    @abstractmethod
    def describe(self) -> str:
        """A few lines for people: where the log is, its schema, partitions and end offsets."""

    def read_timed(self, partition: int, start: int, end: int) -> tuple[pa.Table, AppendTimes | None]:
        """:meth:`read`, with each record's append time if the log keeps one (None: it keeps
        none, as a Redis log; no latency is measured for its records, rather than a made-up
        one). Used by the reader tasks for :mod:`keyscale.latency`."""
        return self.read(partition, start, end), None

    def read_ranges_timed(self, ranges: Sequence[tuple[int, int, int]]) -> list[tuple[pa.Table, AppendTimes | None]]:
        """:meth:`read_timed` of each ``(partition, start, end)`` (an empty range reads
        nothing); a log whose reads have a fixed cost each reads them at once (Kafka: one
        consumer for all the partitions)."""
        return [self.read_timed(p, start, end) if end > start else (self.schema.empty_table(), None) for p, start, end in ranges]

    def first_offsets(self) -> list[int]:
        """Per partition, where a reader that has never read it starts (0 here; a Kafka
        topic's first record still held, or its end)."""
        return [0] * self.num_partitions()

    def fingerprints(self) -> bool:
        """Whether the record before a committed offset can be read back to check it is
        the one the job read (False where offsets have gaps, as Kafka's do)."""
        return True

    def positions_committed(self, positions: dict[int, int]) -> None:
        """Told after each checkpoint: the next offset per partition the job will read (a
        Kafka topic commits them to a consumer group for monitoring tools; others ignore it)."""
        return None

    def take_skipped(self) -> int:
        """Records the last reads in this process dropped as undecodable (and resets the count)."""
        return 0

    def identity(self) -> str | None:
        """The id the log got when it was created, read now (None: the log has none).

        A log deleted and created again at the same URI gets a new id, so a reader that
        kept the id with its offsets knows they belong to another log. A copy of the log
        (a backup restored, a Redis replica) keeps it.
        """
        return None

    # -- shared helpers ---------------------------------------------------------------------------

    def _conform(self, table: pa.Table | pa.RecordBatch) -> pa.Table:
        """``table`` with exactly the schema's columns and types, or an InputDataError naming the column."""
        if isinstance(table, pa.RecordBatch):
            table = pa.Table.from_batches([table])
        if not isinstance(table, pa.Table):
            raise InputDataError(f"append to log {self.uri} takes a pyarrow Table, not {type(table).__name__}")
        schema = self.schema
        have = set(table.column_names)
        for name in schema.names:
            if name not in have:
                raise InputDataError(f"records for log {self.uri} have no column {name!r} (the log's schema: {ddl(schema)})")
        for name in table.column_names:
            if name not in schema.names:
                raise InputDataError(f"records for log {self.uri} have column {name!r}, which the log does not have (its schema: {ddl(schema)})")
        if len(set(table.column_names)) != len(table.column_names):
            raise InputDataError(f"records for log {self.uri} have a column name twice: {table.column_names}")
        cols = []
        for field in schema:
            col = table.column(field.name)
            if col.type != field.type:
                try:
                    col = col.cast(field.type, safe=True)
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
                    raise InputDataError(
                        f"column {field.name!r} for log {self.uri} has type {col.type}, which does not convert to {field.type}: {first_line(e)}"
                    ) from None
            cols.append(col)
        return pa.Table.from_arrays(cols, schema=schema)

    def _check_partition(self, partition: int, count: int | None = None) -> None:
        if isinstance(partition, bool) or not isinstance(partition, int | np.integer):
            raise LogError(f"partition of log {self.uri} must be an integer, not {partition!r}")
        n = self.num_partitions() if count is None else count
        if not 0 <= partition < n:
            raise LogError(f"log {self.uri} has no partition {partition} (it has partitions 0..{n - 1})")

    def _check_range(self, partition: int, start: int, end: int) -> None:
        for v in (start, end):
            if isinstance(v, bool) or not isinstance(v, int | np.integer):
                raise LogError(f"offsets of partition {partition} of log {self.uri} must be integers, not {v!r}")
        if not 0 <= start <= end:
            raise LogError(f"partition {partition} of log {self.uri}: offsets [{start}, {end}) are not a range (need 0 <= start <= end)")

    def _range_error(self, partition: int, start: int, end: int, have: int) -> LogError:
        return LogError(f"partition {partition} of log {self.uri} has offsets [0, {have}); cannot read [{start}, {end})")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"


def ddl(schema: pa.Schema) -> str:
    return ", ".join(f"{f.name} {f.type}" for f in schema)


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
