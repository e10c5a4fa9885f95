"""The RocksDB state backend's store: one operator's state for some key groups, on local disk.

A :class:`RocksState` is one RocksDB (through ``rocksdict``) in an executor's scratch space
(:mod:`keyscale.storage.scratch`). It holds, in one byte-ordered key space
(:mod:`keyscale.state.rockskeys`):

- the state rows, by (key group, key): a key-group range is one contiguous range, dropped
  with one DeleteRange;
- time indexes by (column, key group, time, key) for the states that make a key due
  without a record: timers, window ends, TTL clocks; a batch finds its due keys by range
  iteration, never by reading every key;
- what it reflects: per key group the checkpoint batch it is at (-1: unknown or being
  changed) and its number of keys.

It is a cache of the checkpoint's state files, which stay the source of truth. A batch
works on a :class:`Working` set: the rows of the batch's keys (multi-gets in key order), of its due
keys (index ranges) and, for windows, every window of the batch's keys (prefix scans),
copied into a small :class:`~keyscale.state.table.KeyedStateTable`; the operator code runs
on that table unchanged, and the rows it changed go back in one WriteBatch
(:meth:`RocksState.write_back`).

>>> import os, tempfile, numpy as np, pyarrow as pa
>>> from keyscale.state.types import StateDescriptor
>>> os.environ["KEYSCALE_LOCAL_DIR"] = tempfile.mkdtemp()
>>> from keyscale.storage.scratch import scratch_dir
>>> db = RocksState(scratch_dir("doc"), ["k"], [pa.int64()], [StateDescriptor("n", "value", pa.int64())], 128)
>>> w = db.working()
>>> rows = w.table.upsert([np.array([7])], np.array([3]), {"n": (np.array([5]), np.array([True]))})
>>> db.write_back(w, rows); db.set_versions(0, 127, 0)
>>> w2 = db.working(); db.fetch(w2, np.array([3, 3]), [np.array([7, 8])])
>>> w2.table.to_arrow().to_pylist(), int(db.counts[3]), int(db.versions[3])
([{'k': 7, '__kg': 3, 'n': 5}], 1, 0)
>>> db.close()
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from keyscale._env import env_number
from keyscale.state.keygroups import mask_runs
from keyscale.state.rockskeys import (
    DATA,
    INDEX,
    META,
    RowCodec,
    decode_keys,
    encode_keys,
    encode_time,
    kg_bytes,
    time_bytes,
)
from keyscale.state.table import KG_COLUMN, KeyedStateTable, numpy_to_arrow
from keyscale.state.types import StateDescriptor
from keyscale.storage.scratch import copy_rocksdb, open_rocksdb

_VERSIONS = META + b"versions"
_COUNTS = META + b"counts"
_SIGNATURE = META + b"signature"

MB = 2**20
# Memory a database may use, whatever the state's size: KEYSCALE_ROCKSDB_BLOCK_CACHE_MB and
# KEYSCALE_ROCKSDB_WRITE_BUFFER_MB (executor environment, per open DB: a task opens one). The
# block cache is shared by every DB a Python worker opens.
_CACHE: Any = None
MULTI_GET_KEYS = 1 << 16


def _options() -> Any:
    import rocksdict as rd

    global _CACHE
    if _CACHE is None:
        _CACHE = rd.Cache(int(env_number("KEYSCALE_ROCKSDB_BLOCK_CACHE_MB", 64, "megabytes", above=0) * MB))
    o = rd.Options(raw_mode=True)
    o.create_if_missing(True)
    o.set_write_buffer_size(int(env_number("KEYSCALE_ROCKSDB_WRITE_BUFFER_MB", 32, "megabytes", above=0) * MB))
    o.set_max_write_buffer_number(2)
    # Index and filter blocks in the block cache: bounded by it, not by the number of files.
    # Partitioned (a two-level index, filters in 4 KB partitions, the small top level pinned):
    # a whole file's filter block (~3 MB per 64 MB file) evicted from a small cache and read
    # back for one lookup made point reads 50x slower (10M keys, 64 MB cache: 100 us per get
    # against 2 us; docs/benchmarks.md "RocksDB lookups").
    t = rd.BlockBasedOptions()
    t.set_block_cache(_CACHE)
    t.set_cache_index_and_filter_blocks(True)
    t.set_bloom_filter(10, False)
    t.set_index_type(rd.BlockBasedIndexType.two_level_index_search())
    t.set_partition_filters(True)
    t.set_metadata_block_size(4096)
    t.set_pin_top_level_index_and_filter(True)
    t.set_pin_l0_filter_and_index_blocks_in_cache(True)
    o.set_block_based_table_factory(t)
    o.set_max_open_files(256)
    return o


def _next_kg(kg: int) -> bytes:
    return kg.to_bytes(2, "big") if kg < 2**16 else b"\xff\xff\xff"


class Working:
    """The rows one batch works on: a small table, and what they were when fetched (their
    time-index entries are replaced when they change; rows past ``fetched`` are new)."""

    def __init__(self, table: KeyedStateTable, indexed: Sequence[str]):
        self.table = table
        self.indexed = list(indexed)
        self.fetched = 0
        self.orig: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def freeze(self) -> None:
        """Every fetched row is in: remember their indexed times."""
        self.fetched = len(self.table)
        self.orig = {c: (self.table.values[c].copy(), self.table.valid[c].copy()) for c in self.indexed}


class RocksState:
    """One RocksDB of one operator's state (see module doc). ``indexed``: the int64 states
    kept in time indexes (timers, window ends, TTL clocks), in a fixed order."""

    def __init__(
        self, path: Path, key_names: Sequence[str], key_types: Sequence[pa.DataType], states: Sequence[StateDescriptor],
        max_parallelism: int, indexed: Sequence[str] = (),
    ):
        self.path = path
        self.key_names, self.key_types, self.states = list(key_names), list(key_types), list(states)
        self.max_parallelism = max_parallelism
        self.indexed = list(indexed)
        self.codec = RowCodec(self.states)
        self.db = open_rocksdb(path, _options())
        # No write-ahead log: the database is a cache of the state files. A process that dies
        # loses the writes not yet flushed, and RocksDB recovers to a prefix of the writes
        # (memtables flush in order); every task marks its range unusable before its first
        # change, so a prefix is either that mark or what was there before the task.
        import rocksdict as rd

        wo = rd.WriteOptions()
        setattr(wo, "disable_wal", True)  # a property at run time (the stubs call it a method)  # noqa: B010
        self.db.set_write_options(wo)
        sig = hashlib.sha256(repr((self.key_names, [str(t) for t in key_types], states, max_parallelism, self.indexed)).encode()).digest()
        self.versions = np.full(max_parallelism, -1, dtype=np.int64)
        self.counts = np.zeros(max_parallelism, dtype=np.int64)
        if self.db.get(_SIGNATURE) == sig:
            v, c = self.db.get(_VERSIONS), self.db.get(_COUNTS)
            if v is not None and c is not None and len(v) == 8 * max_parallelism:
                self.versions = np.frombuffer(v, dtype=np.int64).copy()
                self.counts = np.frombuffer(c, dtype=np.int64).copy()
        else:  # another operator's layout (or new): nothing here is usable
            self.db.delete_range(DATA, META)
            self.db.put(_SIGNATURE, sig)
        self._closed = False

    # -- what it reflects ------------------------------------------------------------------

    def _put_meta(self, batch: Any) -> None:
        batch.put(_VERSIONS, self.versions.tobytes())
        batch.put(_COUNTS, self.counts.tobytes())

    def set_versions(self, start: int, end: int, version: int) -> None:
        """Record that key groups ``start..end`` are at checkpoint batch ``version`` (-1:
        being changed: a process that dies now leaves them marked unusable)."""
        import rocksdict as rd

        self.versions[start : end + 1] = version
        wb = rd.WriteBatch(raw_mode=True)
        self._put_meta(wb)
        self.db.write(wb)

    def drop_groups(self, groups: np.ndarray) -> None:
        """Forget key groups ``groups``: one DeleteRange per run, for the rows and each index."""
        mask = np.zeros(self.max_parallelism, dtype=bool)
        mask[groups] = True
        for a, b in mask_runs(mask):
            self.db.delete_range(DATA + kg_bytes(a), DATA + _next_kg(b + 1))
            for cid in range(len(self.indexed)):
                head = INDEX + bytes([cid])
                self.db.delete_range(head + kg_bytes(a), head + _next_kg(b + 1))
        self.counts[groups] = 0
        self.versions[groups] = -1

    # -- reading into a working set ----------------------------------------------------------

    def working(self) -> Working:
        return Working(KeyedStateTable(self.key_names, self.key_types, self.states), self.indexed)

    def _add(self, w: Working, keys: list[bytes], values: list[bytes]) -> None:
        """Rows (RocksDB keys and values) into the working table, those it has not already."""
        if not keys:
            return
        kgs, cols = decode_keys(keys, self.key_types)
        if len(w.table):
            new = w.table.positions(cols) < 0
            if not new.all():
                keep = np.flatnonzero(new)
                kgs, cols = kgs[keep], [c.take(pa.array(keep)) for c in cols]
                values = [values[i] for i in keep]
        vals, ok = self.codec.decode(values)
        w.table.upsert(cols, kgs, {s.name: (vals[s.name], ok[s.name]) for s in self.states})

    def _multi_get(self, keys: list[bytes]) -> tuple[list[bytes], list[bytes]]:
        """The keys that exist and their values, by multi-gets of ``MULTI_GET_KEYS``: one
        multi-get of 1.9M keys peaked at +860 MB of RSS (rocksdict's buffers), in chunks at
        +42 MB, and faster (2.7 s against 3.7 s)."""
        hits: list[bytes] = []
        values: list[bytes] = []
        for i in range(0, len(keys), MULTI_GET_KEYS):
            part = keys[i : i + MULTI_GET_KEYS]
            for k, v in zip(part, self.db.get(part), strict=True):
                if v is not None:
                    hits.append(k)
                    values.append(v)
        return hits, values

    def fetch(self, w: Working, kgs: np.ndarray, key_cols: Sequence[Any]) -> None:
        """Rows of the keys (distinct; key groups ``kgs``, columns ``key_cols``) that exist:
        multi-gets in key order (RocksDB reads sorted keys faster)."""
        # Key groups without a key (new, just dropped) are not asked: a first batch or a
        # rescale's new keys cost no lookup (the counts are exact or, after a crash, high).
        held = self.counts[np.asarray(kgs, dtype=np.int64)] > 0
        if not held.all():
            keep = np.flatnonzero(held)
            kgs = np.asarray(kgs)[keep]
            key_cols = [c[keep] if isinstance(c, np.ndarray) else c.take(pa.array(keep)) for c in key_cols]
        if not len(kgs):
            return
        keys = encode_keys(kgs, key_cols, self.key_types, sort=True)
        self._add(w, *self._multi_get(keys))

    def fetch_prefixes(self, w: Working, kgs: np.ndarray, key_cols: Sequence[Any], types: Sequence[pa.DataType]) -> None:
        """Every row whose key starts with one of the given (leading) keys: e.g. all
        windows of the batch's keys (the window start is the key's last column)."""
        if not len(kgs):
            return
        prefixes = sorted(encode_keys(kgs, key_cols, types))
        keys: list[bytes] = []
        values: list[bytes] = []
        it = self.db.iter()
        for p in prefixes:
            it.seek(p)
            while it.valid():
                k = it.key()
                if not k.startswith(p):
                    break
                keys.append(k)
                values.append(it.value())
                it.next()
        del it
        self._add(w, keys, values)

    def fetch_due(self, w: Working, column: str, upto: int, start: int, end: int) -> None:
        """Rows of key groups ``start..end`` whose indexed time ``column`` is at most ``upto``."""
        head = INDEX + bytes([self.indexed.index(column)])
        data_keys: list[bytes] = []
        it = self.db.iter()
        stop_time = time_bytes(upto)
        for kg in np.flatnonzero(self.counts[start : end + 1]) + start:
            p = head + kg_bytes(int(kg))
            it.seek(p)
            while it.valid():
                k = it.key()
                if not k.startswith(p) or k[4:12] > stop_time:
                    break
                data_keys.append(DATA + k[2:4] + k[12:])
                it.next()
        del it
        if data_keys:
            self._add(w, *self._multi_get(data_keys))

    # -- writing back ------------------------------------------------------------------------

    def write_back(self, w: Working, rows: np.ndarray) -> None:
        """Store the working rows ``rows`` (the ones the batch changed): live rows put,
        deleted ones removed, their time-index entries moved; one WriteBatch."""
        import rocksdict as rd

        t = w.table
        mask = np.zeros(len(t), dtype=bool)  # distinct rows, in order (cheaper than np.unique's sort or hash)
        mask[rows[rows >= 0]] = True
        rows = np.flatnonzero(mask)
        if not len(rows):
            return
        kgs = t.kg[rows]
        keys = encode_keys(kgs, [t.key_arrow(i, rows) for i in range(len(self.key_names))], self.key_types)
        alive = np.zeros(len(rows), dtype=bool)
        for s in self.states:
            alive |= t.valid[s.name][rows]
        existed = rows < w.fetched
        cols = {s.name: (t.values[s.name][rows], t.valid[s.name][rows]) for s in self.states}
        wb = rd.WriteBatch(raw_mode=True)
        live = np.flatnonzero(alive)
        values = self.codec.encode({n: (v[live], ok[live]) for n, (v, ok) in cols.items()}, len(live))
        for i, v in zip(live.tolist(), values, strict=True):
            wb.put(keys[i], v)
        for i in np.flatnonzero(~alive & existed).tolist():
            wb.delete(keys[i])
        for cid, c in enumerate(self.indexed):
            old_v = np.zeros(len(rows), dtype=np.int64)
            old_ok = np.zeros(len(rows), dtype=bool)
            if existed.any():
                ov, ook = w.orig[c]
                old_v[existed], old_ok[existed] = ov[rows[existed]], ook[rows[existed]]
            new_v, new_ok = t.values[c][rows].astype(np.int64), t.valid[c][rows] & alive
            moved = (old_ok != new_ok) | (old_ok & new_ok & (old_v != new_v))
            head = INDEX + bytes([cid])
            for i in np.flatnonzero(moved & old_ok).tolist():
                wb.delete(head + keys[i][1:3] + time_bytes(int(old_v[i])) + keys[i][3:])
            put = np.flatnonzero(moved & new_ok)
            if len(put):
                times = encode_time(new_v[put])
                for i, tb in zip(put.tolist(), np.ascontiguousarray(times).view("V8").ravel().tolist(), strict=True):
                    wb.put(head + keys[i][1:3] + tb + keys[i][3:], b"")
        np.add.at(self.counts, kgs[alive & ~existed], 1)
        np.subtract.at(self.counts, kgs[~alive & existed], 1)
        self._put_meta(wb)
        self.db.write(wb)

    # -- exporting ---------------------------------------------------------------------------

    def range_parts(self, start: int, end: int, chunk: int = 1 << 20) -> Iterator[pa.Table]:
        """Every row of key groups ``start..end`` as a state file's table (by key group), in
        parts of ``chunk`` rows (for inspection: a snapshot is built from the state files,
        faster than walking the database row by row)."""
        import rocksdict as rd

        ro = rd.ReadOptions()
        ro.set_iterate_upper_bound(DATA + _next_kg(end + 1))
        keys: list[bytes] = []
        values: list[bytes] = []
        for k, v in self.db.items(from_key=DATA + kg_bytes(start), read_opt=ro):
            keys.append(k)
            values.append(v)
            if len(keys) >= chunk:
                yield self._to_arrow(keys, values)
                keys, values = [], []
        if keys:
            yield self._to_arrow(keys, values)

    def _to_arrow(self, keys: list[bytes], values: list[bytes]) -> pa.Table:
        kgs, cols = decode_keys(keys, self.key_types) if keys else (np.empty(0, dtype=np.int16), [pa.array([], type=t) for t in self.key_types])
        vals, ok = self.codec.decode(values)
        arrays: list[Any] = [*cols, pa.array(kgs.astype(np.int32), type=pa.int32())]
        names = [*self.key_names, KG_COLUMN]
        for s in self.states:
            arrays.append(numpy_to_arrow(vals[s.name], ok[s.name], s.column_type))
            names.append(s.name)
        return pa.Table.from_arrays(arrays, names=names)

    def copy_to(self, path: Path) -> None:
        """A copy of this database in new scratch folder ``path`` (hard links: instant)."""
        copy_rocksdb(self.db, path)

    def flush(self) -> None:
        """Make what was written durable (the write-ahead log is off)."""
        self.db.flush()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.db.close()
