"""In-memory keyed state of one operator for a set of key groups, stored column by column.

One row per key: the key column(s), the key group, and one column per declared state
(null where that state is absent). A key whose states are all null does not exist; such
rows are dropped by :meth:`KeyedStateTable.compact`.

What a row costs (issue 15; figures in docs/benchmarks.md): numeric key columns are numpy
arrays, other key columns (strings, binary, dates, decimals, ...) Arrow arrays, so no key
is a Python object; the key group is an int16 (key groups are below the maximum
parallelism, at most 32768); numeric states are numpy arrays with a validity mask so the
vectorized path updates them without touching Python objects; other states (strings,
lists, maps) are object arrays, the form the per-key path reads and writes. Lookups go
through a :class:`~keyscale.state.keyindex.KeyIndex`: row numbers in hash slots, about
4-10 bytes per key, no copy of the keys. The column forms and their operations are
:mod:`keyscale.state.columns`; merging rows per key, :func:`keyscale.state.factorize.last_rows`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from keyscale.state.columns import (
    KG_DTYPE,
    KG_MAX,
    LARGE,
    KeyColumn,
    Keys,
    arrow_equal,
    arrow_to_numpy,
    concat_arrow,
    filter_column,
    index_columns,
    kg_array,
    numpy_to_arrow,
)
from keyscale.state.factorize import last_rows
from keyscale.state.keyindex import KeyIndex, key_hash
from keyscale.state.order import order_rows, sub_keys
from keyscale.state.types import StateDescriptor, is_numeric

KG_COLUMN = "__kg"

# Names callers import from here, where they were defined first.
__all__ = ["KG_COLUMN", "KG_DTYPE", "KeyedStateTable", "applied_rows", "last_rows", "numpy_to_arrow"]


def _hash(columns: Sequence[KeyColumn]) -> np.ndarray:
    """The 64-bit hash of each key that places it in the index (tests replace it by one
    that collides on purpose: lookups must stay exact)."""
    return key_hash(columns)


def applied_rows(parts: Sequence[pa.Table], key_names: Sequence[str], states: Sequence[StateDescriptor]) -> list[dict[str, Any]]:
    """What :meth:`KeyedStateTable.apply` of ``parts`` in order leaves of their keys, as
    Python rows (key columns and states, ``None`` where absent; keys whose states are all
    absent left out), in the order the keys first appear. The same rule in the form a few
    rows want: a point lookup applies the handful of rows one key has in its restore chain
    without building a table (tests/state/test_table.py checks the two agree).

    >>> import pyarrow as pa
    >>> n = StateDescriptor("n", "value", pa.int64())
    >>> snapshot = pa.table({"k": ["a", "b"], "n": [5, 7]})
    >>> delta = pa.table({"k": ["b", "a"], "n": [None, 6]})   # b deleted, a changed
    >>> applied_rows([snapshot, delta], ["k"], [n])
    [{'k': 'a', 'n': 6}]
    """
    held: dict[tuple[Any, ...], dict[str, Any]] = {}
    for part in parts:
        if not part.num_rows:
            continue
        present = [s.name for s in states if s.name in part.column_names]  # a state added since: left as it is
        for row in part.select([*key_names, *present]).to_pylist():
            key = tuple(row[k] for k in key_names)
            state = held.get(key)
            if state is None:
                state = held[key] = {**{k: row[k] for k in key_names}, **{s.name: None for s in states}}
            for name in present:
                state[name] = row[name]
    return [r for r in held.values() if any(r[s.name] is not None for s in states)]


class KeyedStateTable:
    """Columnar keyed state for some key groups of one operator.

    >>> import pyarrow as pa
    >>> from keyscale.state.types import StateDescriptor
    >>> t = KeyedStateTable(["k"], [pa.string()], [StateDescriptor("n", "value", pa.int64())])
    >>> t.upsert([np.array(["a"], dtype=object)], np.array([3], dtype=np.int32),
    ...          {"n": (np.array([5]), np.array([True]))}).tolist()
    [0]
    >>> t.to_arrow().to_pylist()
    [{'k': 'a', '__kg': 3, 'n': 5}]
    >>> t.positions([pa.array(["b", "a"])]).tolist()
    [-1, 0]
    """

    def __init__(self, key_names: Sequence[str], key_types: Sequence[pa.DataType], states: Sequence[StateDescriptor]):
        self.key_names = list(key_names)
        self.key_types = list(key_types)
        self.states = list(states)
        self._numeric = [is_numeric(t) for t in self.key_types]
        self._keys: list[KeyColumn] = [
            np.empty(0, dtype=t.to_pandas_dtype()) if num else pa.array([], type=t) for t, num in zip(self.key_types, self._numeric, strict=True)
        ]
        self._index = KeyIndex()
        self.kg = np.empty(0, dtype=KG_DTYPE)
        self._group_rows: np.ndarray | None = None  # group_rows(), kept up to date once asked for
        self.values: dict[str, np.ndarray] = {}
        self.valid: dict[str, np.ndarray] = {}
        for s in self.states:
            self.values[s.name] = np.empty(0, dtype=self._value_dtype(s.column_type))
            self.valid[s.name] = np.empty(0, dtype=bool)

    @staticmethod
    def _value_dtype(t: pa.DataType) -> Any:
        return t.to_pandas_dtype() if is_numeric(t) else object

    def __len__(self) -> int:
        return len(self.kg)

    # -- keys ----------------------------------------------------------------------------

    def key_values(self, rows: np.ndarray) -> list[np.ndarray]:
        """The keys at ``rows``, one numpy array per key column (Python objects for
        non-numeric columns, as :func:`keyscale.state.factorize.factorize_keys` gives them)."""
        out = []
        for k in self._keys:
            if isinstance(k, np.ndarray):
                out.append(k[rows])
                continue
            part = k.take(pa.array(rows, type=pa.int64()))
            if part.type in LARGE or part.type in LARGE.values():
                out.append(np.asarray(part.to_numpy(zero_copy_only=False), dtype=object))
            else:  # dates, timestamps, decimals: the Python objects, not numpy's datetime64
                col = np.empty(len(part), dtype=object)
                col[:] = part.to_pylist()
                out.append(col)
        return out

    def key_arrow(self, i: int, rows: np.ndarray) -> Any:
        """Key column ``i`` at ``rows`` as an Arrow array of its declared type."""
        k, t = self._keys[i], self.key_types[i]
        if isinstance(k, np.ndarray):
            return pa.array(k[rows], type=t)
        part = k.take(pa.array(rows, type=pa.int64()))
        return part if part.type == t else part.cast(t)

    def _probe(self, keys: Keys) -> list[KeyColumn]:
        """Looked-up keys in the table's column forms."""
        cols: list[Any] = index_columns(keys) if isinstance(keys, pd.Index) else list(keys)
        out: list[KeyColumn] = []
        for c, k, t in zip(cols, self._keys, self.key_types, strict=True):
            if isinstance(c, pa.ChunkedArray):
                c = c.combine_chunks()
            if isinstance(k, np.ndarray):
                num = np.asarray(c.to_numpy(zero_copy_only=False)) if isinstance(c, pa.Array) else np.asarray(c)
                out.append(num.astype(k.dtype) if num.dtype == object else num)  # numbers as Python objects: hashed as numbers
                continue
            if isinstance(c, pa.Array):
                if pa.types.is_dictionary(c.type):
                    c = c.dictionary_decode()  # type: ignore[attr-defined]
                out.append(c if c.type == k.type else c.cast(k.type))
            else:
                a = pa.array(np.asarray(c, dtype=object), type=t)
                out.append(a if a.type == k.type else a.cast(k.type))
        return out

    def _same(self, rows: np.ndarray, probe: list[KeyColumn], at: np.ndarray) -> np.ndarray:
        """Whether the key of row ``rows[j]`` is the looked-up key ``at[j]``, for each j."""
        eq: np.ndarray | None = None
        for k, p in zip(self._keys, probe, strict=True):
            if isinstance(k, np.ndarray):
                e = np.asarray(k[rows] == p[at], dtype=bool)
            else:
                e = arrow_equal(k.take(pa.array(rows, type=pa.int64())), p.take(pa.array(at, type=pa.int64())))
            eq = e if eq is None else eq & e
        assert eq is not None
        return eq

    def _find(self, probe: list[KeyColumn], h: np.ndarray) -> np.ndarray:
        return self._index.find(h, lambda rows, at: self._same(rows, probe, at))

    def _rehash(self) -> np.ndarray:
        return _hash(self._keys)

    # -- lookups -------------------------------------------------------------------------

    def positions(self, keys: Keys) -> np.ndarray:
        """Row of each key (-1 where the table has no row for it); ``keys`` are key
        columns (numpy or Arrow) or a pandas index of them."""
        probe = self._probe(keys)
        n = len(probe[0]) if probe else 0
        if not len(self) or not n:
            return np.full(n, -1, dtype=np.intp)
        return self._find(probe, _hash(probe))

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
        key_arrays: Keys,
        kgs: np.ndarray,
        columns: dict[str, tuple[np.ndarray, np.ndarray]],
        pos: np.ndarray | None = None,
    ) -> np.ndarray:
        """Set the given states of the given keys (one row per key, keys unique); returns
        each key's row. ``pos``: the keys' rows as :meth:`positions` gave them, when the
        caller has them (nothing changed the table since).

        States not named in ``columns`` keep their values for existing keys and are
        absent for new keys.
        """
        n = len(kgs)
        if n == 0:
            return np.empty(0, dtype=np.intp)
        probe = self._probe(key_arrays)
        h: np.ndarray | None = None
        if pos is None:
            if len(self):
                h = _hash(probe)
                pos = self._find(probe, h)
            else:
                pos = np.full(n, -1, dtype=np.intp)
        pos = np.array(pos, dtype=np.intp)
        old = pos >= 0
        if old.any():
            rows = pos[old]
            for name, (vals, ok) in columns.items():
                self.values[name][rows] = vals[old]
                self.valid[name][rows] = ok[old]
        new = ~old
        if new.any():
            pos[new] = self._append(
                [filter_column(p, new) for p in probe], kgs[new], {c: (v[new], ok[new]) for c, (v, ok) in columns.items()},
                h[new] if h is not None else None,
            )
        return pos

    def _append(self, keys: list[KeyColumn], kgs: np.ndarray, columns: dict[str, tuple[np.ndarray, np.ndarray]], h: np.ndarray | None) -> np.ndarray:
        """Add rows for new keys (not in the table, distinct); returns their rows."""
        n0, n = len(self), len(kgs)
        if h is None:
            h = _hash(keys)
        self._keys = [
            np.concatenate([old, new.astype(old.dtype, copy=False)]) if isinstance(old, np.ndarray) else concat_arrow(old, new)
            for old, new in zip(self._keys, keys, strict=True)
        ]
        self.kg = np.concatenate([self.kg, kg_array(kgs)])
        if self._group_rows is not None:
            self._group_rows = self._group_rows + np.bincount(self.kg[n0:], minlength=KG_MAX + 1)
            self._group_rows.flags.writeable = False
        for s in self.states:
            if s.name in columns:
                vals, ok = columns[s.name]
            else:
                vals = np.zeros(n, dtype=self.values[s.name].dtype) if self.values[s.name].dtype != object else np.full(n, None, dtype=object)
                ok = np.zeros(n, dtype=bool)
            self.values[s.name] = np.concatenate([self.values[s.name], vals.astype(self.values[s.name].dtype, copy=False)])
            self.valid[s.name] = np.concatenate([self.valid[s.name], ok])
        rows = np.arange(n0, n0 + n, dtype=np.intp)
        self._index.insert(rows, h, self._rehash)
        return rows

    def apply(self, table: pa.Table) -> None:
        """Upsert the rows of a state file (or a slice of one); all-null rows delete."""
        if table.num_rows == 0:
            return
        keys = [table.column(k) for k in self.key_names]  # Arrow as it is: no Python object per key
        kgs = kg_array(table.column(KG_COLUMN).to_numpy())
        # A state added since this file was written is left out: absent for its keys.
        cols = {s.name: arrow_to_numpy(table.column(s.name), s.column_type) for s in self.states if s.name in table.column_names}
        pos = None
        if len(self):  # a key of a key group the table holds nothing of is new: no lookup
            maybe = self.group_rows()[kgs] > 0
            if not maybe.all():
                pos = np.full(len(kgs), -1, dtype=np.intp)
                if maybe.any():
                    pos[maybe] = self.positions([filter_column(k, maybe) for k in keys])
        self.upsert(keys, kgs, cols, pos=pos)

    def apply_all(self, parts: Sequence[pa.Table]) -> None:
        """:meth:`apply` of several state files (or slices) in their order, as applying
        each in turn would. A restore reads a snapshot and the deltas after it, and most
        keys are in several of them: with a state held as Python objects each key is
        converted and stored once, from its last row; numeric states go file by file, as a
        lookup per file costs less than finding the last rows, which encodes every key of
        every file (``bench/state_reload.py``)."""
        parts = [p for p in parts if p.num_rows]
        names = parts[0].column_names if parts else []
        numeric = all(is_numeric(s.column_type) for s in self.states)
        if len(parts) > 1 and not numeric and all(sorted(p.column_names) == sorted(names) for p in parts):
            try:
                combined = pa.concat_tables([p.select(names) for p in parts])
            except (pa.ArrowInvalid, pa.ArrowTypeError):  # not one schema: file by file
                combined = None
            last = last_rows(combined, self.key_names) if combined is not None else None
            if combined is not None and last is not None:
                parts = [combined.take(pa.array(last))]
        for p in parts:
            self.apply(p)

    def drop_key_groups(self, start: int, end: int) -> None:
        """Forget every key of key groups ``start..end`` (before reloading them)."""
        keep = (self.kg < start) | (self.kg > end)
        if not keep.all():
            self._take(np.flatnonzero(keep))

    def drop_groups(self, groups: np.ndarray) -> None:
        """Forget every key of the key groups ``groups`` (one pass, however scattered)."""
        if not len(groups) or not len(self.kg):
            return
        gone = np.zeros(max(int(np.max(groups)), int(self.kg.max())) + 1, dtype=bool)
        gone[groups] = True
        keep = ~gone[self.kg]
        if not keep.all():
            self._take(np.flatnonzero(keep))

    def _alive(self) -> np.ndarray:
        alive = np.zeros(len(self.kg), dtype=bool)
        for ok in self.valid.values():
            alive |= ok
        return alive

    def compact(self) -> None:
        """Drop rows whose states are all absent (deleted keys)."""
        if not len(self.kg):
            return
        alive = self._alive()
        if not alive.all():
            self._take(np.flatnonzero(alive))

    def _take(self, rows: np.ndarray) -> None:
        """Keep ``rows`` (ascending), renumbered ``0..len(rows)-1``."""
        new_row = np.full(len(self.kg), -1, dtype=np.int64)
        new_row[rows] = np.arange(len(rows))
        self._keys = [k[rows] if isinstance(k, np.ndarray) else k.take(pa.array(rows, type=pa.int64())) for k in self._keys]
        self.kg = self.kg[rows]
        self._group_rows = None
        for name in self.values:
            self.values[name] = self.values[name][rows]
            self.valid[name] = self.valid[name][rows]
        self._index.renumber(new_row, len(rows), self._rehash)

    def group_rows(self) -> np.ndarray:
        """Rows per key group (deleted keys' rows too), indexed by key group: counted once,
        then kept up to date as keys are added (a count over every row cost a worker holding
        10M keys ~20 ms, in every batch that asked: a delta's apply, the stale copies' budget).
        Read only.

        >>> t = KeyedStateTable(["k"], [pa.string()], [StateDescriptor("n", "value", pa.int64())])
        >>> _ = t.upsert([np.array(["a", "b"], dtype=object)], np.array([3, 3], dtype=np.int32), {"n": (np.array([1, 2]), np.array([True, True]))})
        >>> int(t.group_rows()[3]), int(t.group_rows()[4])
        (2, 0)
        """
        if self._group_rows is None:
            self._group_rows = np.bincount(self.kg, minlength=KG_MAX + 1)
            self._group_rows.flags.writeable = False
        return self._group_rows

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
        return 1.0 - np.count_nonzero(self._alive()) / len(self.kg)

    def due(self, column: str, now_ms: int, start: int, end: int) -> np.ndarray:
        """Rows of key groups ``start..end`` whose int64 state ``column`` is set and at most ``now_ms``."""
        rows = self.rows_in_range(start, end)
        return np.asarray(rows[self.valid[column][rows] & (self.values[column][rows] <= now_ms)])

    # -- export --------------------------------------------------------------------------

    def rows_in_range(self, start: int, end: int, live_only: bool = False) -> np.ndarray:
        """Rows of key groups ``start..end`` (with ``live_only``, not deleted ones)."""
        return np.flatnonzero(self._in_range(start, end, live_only))

    def count_in_range(self, start: int, end: int, live_only: bool = False) -> int:
        """``len(rows_in_range(...))`` without the rows (a third of its time on 10M rows)."""
        return int(np.count_nonzero(self._in_range(start, end, live_only)))

    def _in_range(self, start: int, end: int, live_only: bool) -> np.ndarray:
        mask = (self.kg >= start) & (self.kg <= end)
        if live_only and self.valid:
            mask &= self._alive()
        return mask

    def to_arrow(self, rows: np.ndarray | None = None, file_order: bool = False) -> pa.Table:
        """The given rows (default: all) as an Arrow table sorted by key group (with
        ``file_order``, then by sub key within each key group: the order of a snapshot's
        rows, :mod:`keyscale.state.order`)."""
        if rows is None:
            rows = np.arange(len(self.kg))
        rows = rows[np.argsort(self.kg[rows], kind="stable")]
        return self._file_ordered(rows) if file_order and self.key_names else self._arrow(rows)

    def _file_ordered(self, rows: np.ndarray) -> pa.Table:
        """``rows`` (in key-group order, whole key groups) as Arrow in file order. Converted in
        key-group order first, then reordered by an Arrow ``take``: the Python objects of
        list, map and string states are read in the order they were made (in sub-key order
        their conversion took 2-3x as long: every object a cache miss), and a take of Arrow
        buffers costs less than that (docs/design.md, "Record batches and fences"). The sub
        keys come from the converted key column (a second conversion of it cost a slice's
        snapshot a sixth of its time)."""
        table = self._arrow(rows)
        order = order_rows(self.kg[rows], subs=sub_keys(table.column(0)))
        if np.array_equal(order, np.arange(len(order))):
            return table
        return table.take(pa.array(order))

    def _arrow(self, rows: np.ndarray) -> pa.Table:
        arrays: list[Any] = [self.key_arrow(i, rows) for i in range(len(self.key_names))]
        names: list[str] = list(self.key_names)
        arrays.append(pa.array(self.kg[rows], type=pa.int32()))
        names.append(KG_COLUMN)
        for s in self.states:
            arrays.append(numpy_to_arrow(self.values[s.name][rows], self.valid[s.name][rows], s.column_type))
            names.append(s.name)
        return pa.Table.from_arrays(arrays, names=names)

    def arrow_parts(self, rows: np.ndarray, chunk: int = 1 << 20, file_order: bool = True) -> Iterator[pa.Table]:
        """``to_arrow(rows, file_order)`` in tables of about ``chunk`` rows (whole key groups:
        a part is ordered within its key groups), in order: a snapshot of a range holds one
        part in memory at a time."""
        rows = rows[np.argsort(self.kg[rows], kind="stable")]
        kgs = self.kg[rows]
        start = 0
        while start < len(rows):
            end = min(len(rows), start + chunk)
            if file_order and end < len(rows):  # to the end of the key group the part ends in
                end = int(np.searchsorted(kgs, kgs[end - 1], side="right"))
            part = rows[start:end]
            yield self._file_ordered(part) if file_order and self.key_names else self._arrow(part)
            start = end

    def schema(self) -> pa.Schema:
        fields = [pa.field(n, t) for n, t in zip(self.key_names, self.key_types, strict=True)]
        fields.append(pa.field(KG_COLUMN, pa.int32()))
        fields.extend(pa.field(s.name, s.column_type) for s in self.states)
        return pa.schema(fields)

    def memory(self) -> dict[str, int]:
        """Bytes held, by part: key columns, key groups, state values and validity, the
        index. Object columns count their pointers only (the objects are not walked)."""
        return {
            "keys": sum(int(k.nbytes) for k in self._keys),
            "kg": int(self.kg.nbytes),
            "values": sum(int(v.nbytes) for v in self.values.values()),
            "valid": sum(int(v.nbytes) for v in self.valid.values()),
            "index": self._index.nbytes,
        }
