"""Partitioned append-only logs: a tiny Kafka topic that a job reads and a producer appends to.

A log has a fixed Arrow schema and a number of partitions that can only grow. Each
partition is a sequence of records numbered from offset 0 without gaps; ``append`` adds a
table of records at the end of one partition atomically (a reader sees all of it or none
of it), and ``read(p, start, end)`` returns exactly the records ``[start, end)`` of
partition ``p`` in offset order.

Two backends implement :class:`PartitionedLog`, chosen by :func:`open_log` from a URI:

- ``/some/folder`` or ``file:///some/folder``: :class:`LocalLog`, a folder of Arrow IPC
  segment files (the embedded default, no server). On a cluster the folder must be on a
  file system every executor sees.
- ``redis://[[user]:password@]host[:port][/db]?name=NAME`` (or ``rediss://`` for TLS):
  :class:`~keyscale.sources.redis_log.RedisLog`, one Redis stream per partition.

Instances pickle to a few hundred bytes (the URI and the schema) and open files and
connections lazily, so they can be shipped to Spark tasks.

>>> import tempfile, pyarrow as pa
>>> log = create_log(tempfile.mkdtemp() + "/events", "key string, value long", partitions=2)
>>> log.append(1, pa.table({"key": ["a", "b"], "value": [1, 2]}))
(0, 2)
>>> log.end_offsets()
[0, 2]
>>> log.read(1, 1, 2).to_pylist()
[{'key': 'b', 'value': 2}]
"""

from __future__ import annotations

import os
import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from keyscale.errors import InputDataError, KeyscaleError
from keyscale.state.types import arrow_schema

__all__ = [
    "LogError",
    "LogWriter",
    "PartitionedLog",
    "create_log",
    "open_log",
    "partition_of",
]


class LogError(KeyscaleError):
    """A log is missing, unreachable, or asked for a partition or offsets it does not have."""


# -- the interface --------------------------------------------------------------------------------


FORMAT = "keyscale-log"  # the format name every backend records beside a log's schema


def schema_to_bytes(schema: pa.Schema) -> bytes:
    """The schema as Arrow IPC bytes (how both backends store it)."""
    return bytes(schema.serialize().to_pybytes())


def schema_from_bytes(data: bytes) -> pa.Schema:
    """Inverse of :func:`schema_to_bytes`."""
    return pa.ipc.read_schema(pa.py_buffer(data))


def _check_schema(schema: str | pa.Schema) -> pa.Schema:
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


def _check_count(what: str, n: int, least: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < least:
        raise LogError(f"{what} must be an integer >= {least}, not {n!r}")


class PartitionedLog(ABC):
    """A partitioned, append-only log of Arrow records (see the module doc).

    Offsets of a partition start at 0 and are contiguous. All methods may be called from
    several threads and processes at once; ``add_partitions`` may run while others read
    and write.

    >>> import tempfile, pyarrow as pa
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
        """The URI that :func:`open_log` opens this log from."""

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
                raise InputDataError(f"records for log {self.uri} have no column {name!r} (the log's schema: {_ddl(schema)})")
        for name in table.column_names:
            if name not in schema.names:
                raise InputDataError(f"records for log {self.uri} have column {name!r}, which the log does not have (its schema: {_ddl(schema)})")
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
                        f"column {field.name!r} for log {self.uri} has type {col.type}, which does not convert to {field.type}: {_first_line(e)}"
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


def _ddl(schema: pa.Schema) -> str:
    return ", ".join(f"{f.name} {f.type}" for f in schema)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# -- factories ----------------------------------------------------------------------------------


def _is_redis(uri: str) -> bool:
    return uri.startswith(("redis://", "rediss://"))


def _local_path(uri: str) -> Path:
    if uri.startswith("file:"):
        parts = urlsplit(uri)
        if parts.netloc not in ("", "localhost"):
            raise LogError(f"log URI {uri!r}: file URIs name a local folder (file:///path), not host {parts.netloc!r}")
        return Path(unquote(parts.path))
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", uri):
        raise LogError(f"log URI {uri!r}: unknown scheme (use a folder path, file:///path or redis://host:port/db?name=NAME)")
    return Path(uri)


def open_log(uri: str | os.PathLike[str]) -> PartitionedLog:
    """Open an existing log: a folder path or ``file://`` URI, or ``redis://host:port/db?name=NAME``.

    Raises :class:`LogError` naming the folder or Redis log when there is no log there.

    >>> import tempfile
    >>> path = tempfile.mkdtemp() + "/l"
    >>> _ = create_log(path, "k string", partitions=3)
    >>> open_log(path).num_partitions()
    3
    """
    text = os.fspath(uri)
    if _is_redis(text):
        from keyscale.sources.redis_log import RedisLog

        return RedisLog(text)
    from keyscale.sources.local_log import LocalLog

    return LocalLog(_local_path(text))


def create_log(uri: str | os.PathLike[str], schema: str | pa.Schema, partitions: int) -> PartitionedLog:
    """Create a new, empty log at ``uri`` (see :func:`open_log`) with a schema (Arrow or Spark DDL).

    >>> import tempfile
    >>> log = create_log(tempfile.mkdtemp() + "/l", "key string, ts timestamp", partitions=2)
    >>> log.end_offsets(), log.schema.names
    ([0, 0], ['key', 'ts'])
    """
    text = os.fspath(uri)
    if _is_redis(text):
        from keyscale.sources.redis_log import RedisLog

        return RedisLog.create(text, schema, partitions)
    from keyscale.sources.local_log import LocalLog

    return LocalLog.create(_local_path(text), schema, partitions)


# -- the writer ------------------------------------------------------------------------------------

_NULL_KEY = "\x00null"
_SEP = "\x1f"


def _key_text(col: pa.ChunkedArray[Any] | pa.Array[Any], name: str) -> pa.Array[Any]:
    """A column of keys as text that identifies each value (and its type family) stably."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    t = arr.type
    if pa.types.is_dictionary(t):
        arr = arr.cast(t.value_type)
        t = arr.type
    if pa.types.is_timestamp(t) or pa.types.is_duration(t) or pa.types.is_time64(t) or pa.types.is_date64(t):
        arr = arr.cast(pa.int64())
    elif pa.types.is_date32(t) or pa.types.is_time32(t):
        arr = arr.cast(pa.int32())
    elif pa.types.is_boolean(t):
        arr = arr.cast(pa.int8())
    elif pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        # hex keeps arbitrary bytes valid text
        return pa.array([None if v is None else v.hex() for v in arr.to_pylist()], pa.string())
    if pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type):
        return arr.cast(pa.string())
    try:
        return arr.cast(pa.string())
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        raise InputDataError(f"key column {name!r} has type {t}, which cannot be a partitioning key (use scalar columns)") from None


def partition_of(table: pa.Table, key_columns: Sequence[str], num_partitions: int) -> np.ndarray[Any, np.dtype[np.int64]]:
    """The partition of each row of ``table``: a stable hash of its key columns modulo ``num_partitions``.

    The hash is SipHash-2-4 with pandas' fixed key (``pandas.util.hash_array``) of the key
    values rendered as text (integers, dates and timestamps as their integer value), so it
    is the same in every process and run, and equal keys always land in the same partition
    for a given number of partitions (adding partitions moves keys, as in Kafka).

    >>> import pyarrow as pa
    >>> t = pa.table({"user": ["ann", "bob", "ann"]})
    >>> p = partition_of(t, ["user"], 4)
    >>> bool(p[0] == p[2]), p.tolist() == partition_of(t, ["user"], 4).tolist()
    (True, True)
    """
    _check_count("the number of partitions", num_partitions, 1)
    if not key_columns:
        raise InputDataError("partition_of needs at least one key column")
    texts = []
    for name in key_columns:
        if name not in table.column_names:
            raise InputDataError(f"key column {name!r} is not one of the records' columns {table.column_names}")
        texts.append(_key_text(table.column(name), name))
    join: Any = pc.binary_join_element_wise
    joined: Any = texts[0] if len(texts) == 1 else join(*texts, _SEP, null_handling="replace", null_replacement=_NULL_KEY)
    values = pc.fill_null(joined, _NULL_KEY).to_numpy(zero_copy_only=False)
    hashes = pd.util.hash_array(np.asarray(values, dtype=object), categorize=False)
    return (hashes % np.uint64(num_partitions)).astype(np.int64)


class LogWriter:
    """Appends tables to a log, splitting their rows to partitions.

    With ``key_columns``, each row goes to ``partition_of(row keys, num_partitions())``:
    records with the same key always go to the same partition (while the partition count
    stays the same), in every process. Without, each ``write`` goes whole to the next
    partition in turn (round-robin by batch, starting at partition 0).

    ``write`` appends to each partition atomically, but not to all partitions at once: a
    reader may see one partition's share of a write before another's. It reads the
    partition count at each write, so partitions added meanwhile get records from the next
    write on.

    >>> import tempfile, pyarrow as pa
    >>> log = create_log(tempfile.mkdtemp() + "/l", "key string, n long", partitions=2)
    >>> w = LogWriter(log, key_columns=["key"])
    >>> ranges = w.write(pa.table({"key": ["a", "b", "a", "c"], "n": [1, 2, 3, 4]}))
    >>> sum(e - s for s, e in ranges.values()), sum(log.end_offsets())
    (4, 4)
    """

    def __init__(self, log: PartitionedLog, key_columns: Sequence[str] | None = None) -> None:
        self.log = log
        self.key_columns = list(key_columns) if key_columns else []
        for name in self.key_columns:
            if name not in log.schema.names:
                raise InputDataError(f"key column {name!r} is not a column of log {log.uri} (its columns: {log.schema.names})")
        self._next = 0

    def write(self, table: pa.Table) -> dict[int, tuple[int, int]]:
        """Append ``table``'s rows; returns the offset range written per partition."""
        if table.num_rows == 0:
            return {}
        n = self.log.num_partitions()
        if not self.key_columns:
            p = self._next % n
            self._next += 1
            return {p: self.log.append(p, table)}
        parts = partition_of(table, self.key_columns, n)
        order = np.argsort(parts, kind="stable")
        sorted_parts = parts[order]
        cuts = np.flatnonzero(np.diff(sorted_parts)) + 1
        out: dict[int, tuple[int, int]] = {}
        for idx in np.split(order, cuts):
            p = int(parts[idx[0]])
            out[p] = self.log.append(p, table.take(idx))
        return out
