"""In-memory keyed state of one operator for a set of key groups, stored column by column.

One row per key: the key column(s), the key group, and one column per declared state
(null where that state is absent). A key whose states are all null does not exist; such
rows are dropped by :meth:`KeyedStateTable.compact`.

Numeric states live in numpy arrays with a validity mask so the vectorized path can
update them without touching Python objects; everything else (strings, lists, maps) is an
object array. Lookups go through a :class:`pandas.Index` (hash lookup, vectorized).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from keyscale.state.types import StateDescriptor, is_numeric

KG_COLUMN = "__kg"


def _arrow_to_numpy(arr: Any, t: pa.DataType) -> tuple[np.ndarray, np.ndarray]:
    """Values and validity of an Arrow column in the table's in-memory form."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks() if arr.num_chunks != 1 else arr.chunk(0)
    valid = np.asarray(arr.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
    if is_numeric(t):
        filled = arr.fill_null(pa.scalar(False if pa.types.is_boolean(t) else 0, type=t))
        return np.asarray(filled.to_numpy(zero_copy_only=False)), valid
    values = arr.to_pylist()
    if pa.types.is_map(t):
        values = [dict(v) if v is not None else None for v in values]
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out, valid


def numpy_to_arrow(values: np.ndarray, valid: np.ndarray, t: pa.DataType) -> Any:
    """Arrow array from the in-memory form (inverse of the reader)."""
    if is_numeric(t):
        return pa.array(values, type=t, mask=~valid)
    items: list[Any] = values.tolist()
    if pa.types.is_map(t):
        items = [list(v.items()) if ok and v is not None else None for v, ok in zip(items, valid, strict=True)]
    else:
        items = [v if ok else None for v, ok in zip(items, valid, strict=True)]
    return pa.array(items, type=t)


def make_index(key_arrays: Sequence[np.ndarray]) -> pd.Index:
    """A lookup index over one or more key columns."""
    if len(key_arrays) == 1:
        single: pd.Index = pd.Index(key_arrays[0])
        return single
    # Levels in first-appearance order: from_arrays sorts each level, which for strings
    # costs more than everything else a batch does with its keys.
    codes, levels = zip(*(pd.factorize(k) for k in key_arrays), strict=True)
    index: pd.Index = pd.MultiIndex(levels=levels, codes=codes, verify_integrity=False)
    return index


def factorize_keys(key_arrays: Sequence[np.ndarray]) -> tuple[np.ndarray, pd.Index, list[np.ndarray]]:
    """Group rows by their key (one or more columns), by hashing, never sorting: each
    row's group (groups in first-appearance order), the groups' keys as a lookup index,
    and as one array per column."""
    if len(key_arrays) == 1:
        codes, uniques = pd.factorize(key_arrays[0])
        return np.asarray(codes, dtype=np.int64), pd.Index(uniques), [np.asarray(uniques)]
    level_codes, levels = zip(*(pd.factorize(k) for k in key_arrays), strict=True)
    sizes = [max(len(lv), 1) for lv in levels]
    if float(np.prod(sizes, dtype=np.float64)) >= 2.0**62:  # the combined code would overflow: pandas' way
        codes, uniq = pd.MultiIndex.from_arrays(list(key_arrays)).factorize()
        assert isinstance(uniq, pd.MultiIndex)
        return np.asarray(codes, dtype=np.int64), uniq, [np.asarray(uniq.get_level_values(i)) for i in range(len(key_arrays))]
    combined = np.zeros(len(level_codes[0]), dtype=np.int64)
    for lc, n in zip(level_codes, sizes, strict=True):
        combined = combined * n + lc
    codes, _ = pd.factorize(combined)
    ungroupable = np.logical_or.reduce([np.asarray(lc) < 0 for lc in level_codes])  # null or NaN in a column
    if ungroupable.any():
        codes[ungroupable] = -1  # the caller names the key
    _, first = np.unique(codes, return_index=True)
    group_codes = [np.asarray(lc)[first] for lc in level_codes]
    index = pd.MultiIndex(levels=levels, codes=group_codes, verify_integrity=False)  # type: ignore[arg-type]
    return np.asarray(codes, dtype=np.int64), index, [np.asarray(lv)[gc] for lv, gc in zip(levels, group_codes, strict=True)]


def _hash(columns: Sequence[np.ndarray]) -> np.ndarray:
    """A 64-bit hash of each key, from its columns (pandas' vectorized SipHash per column)."""
    h = np.asarray(pd.util.hash_array(columns[0], categorize=False), dtype=np.uint64)
    for col in columns[1:]:
        h = (h * np.uint64(1_000_003)) ^ np.asarray(pd.util.hash_array(col, categorize=False), dtype=np.uint64)
    return h


def _columns(index: pd.Index) -> list[np.ndarray]:
    """The key columns of a lookup index (one, or a MultiIndex's levels)."""
    if isinstance(index, pd.MultiIndex):
        return [np.asarray(index.get_level_values(i)) for i in range(index.nlevels)]
    return [np.asarray(index)]


class KeyedStateTable:
    """Columnar keyed state for some key groups of one operator.

    >>> import pyarrow as pa
    >>> from keyscale.state.types import StateDescriptor
    >>> t = KeyedStateTable(["k"], [pa.string()], [StateDescriptor("n", "value", pa.int64())])
    >>> t.upsert([np.array(["a"], dtype=object)], np.array([3], dtype=np.int32),
    ...          {"n": (np.array([5]), np.array([True]))})
    >>> t.to_arrow().to_pylist()
    [{'k': 'a', '__kg': 3, 'n': 5}]
    """

    def __init__(self, key_names: Sequence[str], key_types: Sequence[pa.DataType], states: Sequence[StateDescriptor]):
        self.key_names = list(key_names)
        self.key_types = list(key_types)
        self.states = list(states)
        self.keys: list[np.ndarray] = [np.empty(0, dtype=self._key_dtype(t)) for t in self.key_types]
        # Lookups: a key (string-like, or of several columns) is found by a 64-bit hash of
        # it in an integer index (fast to build and probe), each hit checked against the key
        # itself; after a collision, and for one numeric column, by a pandas index of the keys.
        self._hashed = not (len(self.key_types) == 1 and is_numeric(self.key_types[0]))
        self._hashes = np.empty(0, dtype=np.uint64)
        self._lookup: pd.Index | None = None  # built at the first lookup after a change
        self.kg = np.empty(0, dtype=np.int32)
        self.values: dict[str, np.ndarray] = {}
        self.valid: dict[str, np.ndarray] = {}
        for s in self.states:
            self.values[s.name] = np.empty(0, dtype=self._value_dtype(s.column_type))
            self.valid[s.name] = np.empty(0, dtype=bool)

    @staticmethod
    def _key_dtype(t: pa.DataType) -> Any:
        return t.to_pandas_dtype() if is_numeric(t) else object

    @staticmethod
    def _value_dtype(t: pa.DataType) -> Any:
        return t.to_pandas_dtype() if is_numeric(t) else object

    def __len__(self) -> int:
        return len(self.kg)

    # -- lookups -------------------------------------------------------------------------

    def positions(self, index: pd.Index) -> np.ndarray:
        """Row of each key in ``index`` (-1 where the table has no row for it)."""
        if len(self.kg) == 0:
            return np.full(len(index), -1, dtype=np.intp)
        if self._hashed:
            probe = _columns(index)
            pos = np.asarray(self._index().get_indexer(pd.Index(_hash(probe))), dtype=np.intp)
            hit = pos >= 0
            if all((k[pos[hit]] == p[hit]).all() for k, p in zip(self.keys, probe, strict=True)):
                return pos
            self._stop_hashing()  # two keys share a hash: exact lookups from now on
        return np.asarray(self._index().get_indexer(index), dtype=np.intp)

    def _index(self) -> pd.Index:
        if self._lookup is None:
            self._lookup = pd.Index(self._hashes) if self._hashed else make_index(self.keys)
        return self._lookup

    def _stop_hashing(self) -> None:
        self._hashed = False
        self._hashes = np.empty(0, dtype=np.uint64)
        self._lookup = None

    def gather(self, name: str, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Values and validity of state ``name`` at rows ``pos`` (-1 gives invalid)."""
        vals = self.values[name]
        have = pos >= 0
        safe = np.where(have, pos, 0)
        if len(vals) == 0:
            out = np.zeros(len(pos), dtype=vals.dtype) if vals.dtype != object else np.full(len(pos), None, dtype=object)
            return out, np.zeros(len(pos), dtype=bool)
        out = vals[safe]
        ok = self.valid[name][safe] & have
        return out, ok

    # -- updates -------------------------------------------------------------------------

    def upsert(
        self,
        key_arrays: Sequence[np.ndarray],
        kgs: np.ndarray,
        columns: dict[str, tuple[np.ndarray, np.ndarray]],
        index: pd.Index | None = None,
    ) -> None:
        """Set the given states of the given keys (one row per key, keys unique).

        States not named in ``columns`` keep their values for existing keys and are
        absent for new keys.
        """
        n = len(kgs)
        if n == 0:
            return
        if index is None:
            index = make_index(key_arrays)
        pos = self.positions(index)
        old = pos >= 0
        if old.any():
            rows = pos[old]
            for name, (vals, ok) in columns.items():
                self.values[name][rows] = vals[old]
                self.valid[name][rows] = ok[old]
        new = ~old
        if new.any():
            self._append([k[new] for k in key_arrays], kgs[new], {c: (v[new], ok[new]) for c, (v, ok) in columns.items()})

    def _append(self, key_arrays: Sequence[np.ndarray], kgs: np.ndarray, columns: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
        n = len(kgs)
        if self._hashed:  # the new keys are not in the table; their hashes must not be either
            new_hashes = _hash(list(key_arrays))
            if len(np.unique(new_hashes)) < n or self._index().isin(new_hashes).any():
                self._stop_hashing()
            else:
                self._hashes = np.concatenate([self._hashes, new_hashes])
        self.keys = [np.concatenate([old, new.astype(old.dtype, copy=False)]) for old, new in zip(self.keys, key_arrays, strict=True)]
        self._lookup = None
        self.kg = np.concatenate([self.kg, kgs.astype(np.int32, copy=False)])
        for s in self.states:
            if s.name in columns:
                vals, ok = columns[s.name]
            else:
                vals = np.zeros(n, dtype=self.values[s.name].dtype) if self.values[s.name].dtype != object else np.full(n, None, dtype=object)
                ok = np.zeros(n, dtype=bool)
            self.values[s.name] = np.concatenate([self.values[s.name], vals.astype(self.values[s.name].dtype, copy=False)])
            self.valid[s.name] = np.concatenate([self.valid[s.name], ok])

    def apply(self, table: pa.Table) -> None:
        """Upsert the rows of a state file (or a slice of one); all-null rows delete."""
        if table.num_rows == 0:
            return
        keys = [np.asarray(_arrow_to_numpy(table.column(k), t)[0]) for k, t in zip(self.key_names, self.key_types, strict=True)]
        kgs = table.column(KG_COLUMN).to_numpy().astype(np.int32)
        # A state added since this file was written is left out: absent for its keys.
        cols = {s.name: _arrow_to_numpy(table.column(s.name), s.column_type) for s in self.states if s.name in table.column_names}
        self.upsert(keys, kgs, cols)

    def drop_key_groups(self, start: int, end: int) -> None:
        """Forget every key of key groups ``start..end`` (before reloading them)."""
        keep = (self.kg < start) | (self.kg > end)
        if not keep.all():
            self._take(np.flatnonzero(keep))

    def compact(self) -> None:
        """Drop rows whose states are all absent (deleted keys)."""
        if not len(self.kg):
            return
        alive = np.zeros(len(self.kg), dtype=bool)
        for ok in self.valid.values():
            alive |= ok
        if not alive.all():
            self._take(np.flatnonzero(alive))

    def _take(self, rows: np.ndarray) -> None:
        self.keys = [k[rows] for k in self.keys]
        if self._hashed:
            self._hashes = self._hashes[rows]
        self._lookup = None
        self.kg = self.kg[rows]
        for name in self.values:
            self.values[name] = self.values[name][rows]
            self.valid[name] = self.valid[name][rows]

    def expire(self, name: str, clock: str, ttl_ms: int, now_ms: int, start: int, end: int) -> np.ndarray:
        """Remove values of state ``name`` in key groups ``start..end`` whose clock (the
        hidden state ``clock``: when it was last refreshed) is ``ttl_ms`` or more before
        ``now_ms``; returns the rows changed. A value without a clock gets ``now_ms``."""
        rows = self.rows_in_range(start, end)
        if not len(rows):
            return rows
        has = self.valid[name][rows]
        ts, ts_ok = self.values[clock][rows], self.valid[clock][rows]
        gone = rows[has & ts_ok & (ts <= now_ms - ttl_ms)]
        unclocked = rows[has & ~ts_ok]
        for col in (name, clock):
            self.valid[col][gone] = False
            if self.values[col].dtype == object:
                self.values[col][gone] = None
        self.values[clock][unclocked] = now_ms
        self.valid[clock][unclocked] = True
        return self.rows_union(gone, unclocked)

    def rows_union(self, *rows: np.ndarray) -> np.ndarray:
        """Sorted distinct rows of several row arrays (a mask over the table: much cheaper
        than ``np.union1d``'s sort or hash for the large arrays of a batch)."""
        mask = np.zeros(len(self.kg), dtype=bool)
        for r in rows:
            mask[r[r >= 0]] = True
        return np.flatnonzero(mask)

    def dead_share(self) -> float:
        """The share of rows whose states are all absent (deleted, expired, purged)."""
        if not len(self.kg):
            return 0.0
        alive = np.zeros(len(self.kg), dtype=bool)
        for ok in self.valid.values():
            alive |= ok
        return 1.0 - float(alive.mean())

    def due(self, column: str, now_ms: int, start: int, end: int) -> np.ndarray:
        """Rows of key groups ``start..end`` whose int64 state ``column`` is set and at most ``now_ms``."""
        rows = self.rows_in_range(start, end)
        return np.asarray(rows[self.valid[column][rows] & (self.values[column][rows] <= now_ms)])

    # -- export --------------------------------------------------------------------------

    def rows_in_range(self, start: int, end: int, live_only: bool = False) -> np.ndarray:
        """Rows of key groups ``start..end`` (with ``live_only``, not deleted ones)."""
        mask = (self.kg >= start) & (self.kg <= end)
        if live_only and self.valid:
            alive = np.zeros(len(self.kg), dtype=bool)
            for ok in self.valid.values():
                alive |= ok
            mask &= alive
        return np.flatnonzero(mask)

    def to_arrow(self, rows: np.ndarray | None = None) -> pa.Table:
        """The given rows (default: all) as an Arrow table sorted by key group."""
        if rows is None:
            rows = np.arange(len(self.kg))
        rows = rows[np.argsort(self.kg[rows], kind="stable")]
        arrays: list[Any] = []
        names: list[str] = []
        for name, t, k in zip(self.key_names, self.key_types, self.keys, strict=True):
            arrays.append(pa.array(k[rows], type=t) if is_numeric(t) else pa.array(k[rows].tolist(), type=t))
            names.append(name)
        arrays.append(pa.array(self.kg[rows], type=pa.int32()))
        names.append(KG_COLUMN)
        for s in self.states:
            arrays.append(numpy_to_arrow(self.values[s.name][rows], self.valid[s.name][rows], s.column_type))
            names.append(s.name)
        return pa.Table.from_arrays(arrays, names=names)

    def schema(self) -> pa.Schema:
        fields = [pa.field(n, t) for n, t in zip(self.key_names, self.key_types, strict=True)]
        fields.append(pa.field(KG_COLUMN, pa.int32()))
        fields.extend(pa.field(s.name, s.column_type) for s in self.states)
        return pa.schema(fields)
