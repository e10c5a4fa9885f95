"""Partitioned append-only logs, opened and written: a tiny Kafka topic that a job reads
and a producer appends to.

This module picks a backend and writes to any; the interface they implement
(:class:`~keyscale.sources.partitioned.PartitionedLog`, its errors) is
:mod:`keyscale.sources.partitioned`. Two backends, chosen by :func:`open_log` and
:func:`create_log` from a URI:

- ``/some/folder`` or ``file:///some/folder``: :class:`~keyscale.sources.local_log.LocalLog`,
  a folder of Arrow IPC segment files (the embedded default, no server). On a cluster the
  folder must be on a file system every executor sees.
- ``redis://[[user]:password@]host[:port][/db]?name=NAME`` (or ``rediss://`` for TLS):
  :class:`~keyscale.sources.redis_log.RedisLog`, one Redis stream per partition.

:func:`partition_of` and :class:`LogWriter` split records to partitions by a stable key
hash. Instances pickle to a few hundred bytes (the URI and the schema) and open files and
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
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from keyscale.errors import InputDataError
from keyscale.sources.local_log import LocalLog
from keyscale.sources.partitioned import LogError, PartitionedLog, check_count
from keyscale.sources.redis_log import RedisLog

__all__ = [
    "LogWriter",
    "create_log",
    "open_log",
    "partition_of",
]


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
        return RedisLog(text)
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
        return RedisLog.create(text, schema, partitions)
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
    check_count("the number of partitions", num_partitions, 1)
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
