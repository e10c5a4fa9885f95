"""The pure parts of a state diff: whether two columns of state values are equal row by row,
and which keys of two tables of keyed state are only in one of them or changed.

No I/O and no Spark: :mod:`.diff` streams savepoints and checkpoints through these, key-group
range by key-group range. Values are compared as the job sees them: a null (no state) equals
only a null; NaN equals NaN (a value that was not written again is not a change); lists and
structs compare element by element and field by field; a map state compares as its set of
entries, in any order (a restore may give them in another order than the job wrote them).

>>> import pyarrow as pa
>>> a = pa.table({"user": ["ann", "bob", "cy"], "key_group": pa.array([1, 2, 3], pa.int32()), "n": [1, 2, 3]})
>>> b = pa.table({"user": ["bob", "cy", "dee"], "key_group": pa.array([2, 3, 0], pa.int32()), "n": [2, 30, 4]})
>>> rows, unchanged = diff_tables(a, b, ["user"], ["n"])
>>> [(r["user"], r["kind"], r["changed_states"]) for r in rows.to_pylist()], unchanged
([('ann', 'only_a', []), ('cy', 'changed', ['n']), ('dee', 'only_b', [])], 1)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from keyscale.checkpoint.savepoint import KEY_GROUP_COLUMN

__all__ = ["DIFF_KINDS", "diff_schema", "diff_tables", "values_equal"]

#: What a row of a diff says of its key: only in A, only in B, or in both with other values.
DIFF_KINDS = ("only_a", "only_b", "changed")

_PC: Any = pc
_PA: Any = pa


def _valid(arr: Any) -> np.ndarray:
    return np.asarray(arr.is_valid().to_numpy(zero_copy_only=False), dtype=bool)


def _array(col: Any) -> Any:
    return col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col


def _listlike_equal(x: Any, y: Any, rows: np.ndarray) -> np.ndarray:
    """Per row of ``rows`` (valid in both): same length and equal elements, in order."""
    out = np.zeros(len(x), dtype=bool)
    is_map = pa.types.is_map(x.type)
    if is_map:  # a map is a list of (key, value) entries
        entries = pa.list_(pa.struct([pa.field("key", x.type.key_type), pa.field("value", x.type.item_type)]))
        mx, my = x, y
        x, y = x.cast(entries), y.cast(entries)
    lx = np.asarray(_PC.list_value_length(x).fill_null(0).to_numpy(zero_copy_only=False))
    ly = np.asarray(_PC.list_value_length(y).fill_null(0).to_numpy(zero_copy_only=False))
    sel = rows[lx[rows] == ly[rows]]
    if not len(sel):
        return out
    idx = pa.array(sel)
    xs, ys = x.take(idx), y.take(idx)
    cx, cy = _PC.list_flatten(xs), _PC.list_flatten(ys)
    parent = np.asarray(_PC.list_parent_indices(xs).to_numpy(zero_copy_only=False), dtype=np.int64)
    bad = np.bincount(parent[~values_equal(cx, cy)], minlength=len(sel)) > 0
    out[sel[~bad]] = True
    if is_map:  # the same entries in another order are the same map
        for i in sel[bad].tolist():
            out[i] = dict(mx[i].as_py()) == dict(my[i].as_py())
    return out


def _same_values(x: Any, y: Any, rows: np.ndarray) -> np.ndarray:
    """Per row of ``rows`` (valid in both arrays): whether the values are equal."""
    t = x.type
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_map(t):
        return _listlike_equal(x, y, rows)
    if pa.types.is_struct(t):
        out = np.ones(len(x), dtype=bool)
        for fx, fy in zip(x.flatten(), y.flatten(), strict=True):
            out &= values_equal(fx, fy)
        return out
    try:
        eq = np.asarray(_PC.fill_null(_PC.equal(x, y), False).to_numpy(zero_copy_only=False), dtype=bool)
    except (pa.ArrowNotImplementedError, pa.ArrowInvalid):  # a type Arrow cannot compare: as Python values
        px, py = x.to_pylist(), y.to_pylist()
        return np.array([px[i] == py[i] for i in range(len(x))], dtype=bool)
    if pa.types.is_floating(t):
        eq |= np.asarray(_PC.fill_null(_PC.and_(_PC.is_nan(x), _PC.is_nan(y)), False).to_numpy(zero_copy_only=False), dtype=bool)
    return eq


def values_equal(x: Any, y: Any) -> np.ndarray:
    """Row by row, whether two columns of one type hold the same state values (see the module).

    >>> import pyarrow as pa
    >>> t = pa.map_(pa.string(), pa.int64())
    >>> values_equal(pa.array([[("a", 1), ("b", 2)], None, [("a", 1)]], t),
    ...              pa.array([[("b", 2), ("a", 1)], None, [("a", 2)]], t)).tolist()
    [True, True, False]
    >>> values_equal(pa.array([float("nan"), 1.0, None]), pa.array([float("nan"), 1.0, 1.0])).tolist()
    [True, True, False]
    """
    x, y = _array(x), _array(y)
    vx, vy = _valid(x), _valid(y)
    both = vx & vy
    out = ~vx & ~vy
    rows = np.flatnonzero(both)
    if len(rows):
        out |= both & _same_values(x, y, rows)
    return np.asarray(out, dtype=bool)


def diff_schema(key_columns: Sequence[tuple[str, pa.DataType]], states: Sequence[tuple[str, pa.DataType]]) -> pa.Schema:
    """The columns of a diff: the key, ``kind`` (:data:`DIFF_KINDS`), the key's key group on
    each side (null where it is absent), the states that differ, and the compared states'
    values on each side (a struct, null where the key is absent)."""
    values = pa.struct([pa.field(n, t) for n, t in states])
    return pa.schema([
        *(pa.field(k, t) for k, t in key_columns), pa.field("kind", pa.string()),
        pa.field("key_group_a", pa.int32()), pa.field("key_group_b", pa.int32()),
        pa.field("changed_states", pa.list_(pa.string())), pa.field("value_a", values), pa.field("value_b", values),
    ])


def _values(table: pa.Table, states: Sequence[str], idx: np.ndarray, t: Any) -> Any:
    if not states:
        return _PA.nulls(len(idx), t) if len(idx) else _PA.array([], t)
    cols = [_array(table.column(s)).take(pa.array(idx, pa.int64())) for s in states]
    return _PA.StructArray.from_arrays(cols, fields=list(t))


def diff_tables(a: pa.Table, b: pa.Table, key_names: Sequence[str], states: Sequence[str]) -> tuple[pa.Table, int]:
    """The keys of ``a`` and ``b`` (tables of keyed state: key columns, ``key_group``, one
    column per state, one row per key) that are only in one of them, or in both with a
    ``states`` value that differs; and how many keys are in both, unchanged.

    The rows are in the schema of :func:`diff_schema`, sorted by key; state columns of the
    same name must have the same type on both sides."""
    names = list(key_names)
    left = _PA.table({**{k: a.column(k) for k in names}, "__a": pa.array(np.arange(a.num_rows, dtype=np.int64))})
    right = _PA.table({**{k: b.column(k) for k in names}, "__b": pa.array(np.arange(b.num_rows, dtype=np.int64))})
    joined = left.join(right, keys=names, join_type="full outer")
    xa = np.asarray(_PC.fill_null(joined.column("__a"), -1).to_numpy(), dtype=np.int64)
    xb = np.asarray(_PC.fill_null(joined.column("__b"), -1).to_numpy(), dtype=np.int64)
    only_a, only_b = xa[xb < 0], xb[xa < 0]
    both = (xa >= 0) & (xb >= 0)
    pa_idx, pb_idx = xa[both], xb[both]
    same = np.ones(len(pa_idx), dtype=bool)
    differs: list[np.ndarray] = []
    for s in states:
        eq = values_equal(_array(a.column(s)).take(pa.array(pa_idx)), _array(b.column(s)).take(pa.array(pb_idx)))
        differs.append(~eq)
        same &= eq
    changed = np.flatnonzero(~same)
    ca, cb = pa_idx[changed], pb_idx[changed]
    schema = diff_schema([(k, a.schema.field(k).type) for k in names], [(s, a.schema.field(s).type) for s in states])
    vtype = schema.field("value_a").type
    n_a, n_b, n_c = len(only_a), len(only_b), len(changed)
    keys = {k: pa.concat_arrays([_array(a.column(k)).take(pa.array(only_a, pa.int64())), _array(b.column(k)).take(pa.array(only_b, pa.int64())),
                                 _array(a.column(k)).take(pa.array(ca, pa.int64()))]).cast(schema.field(k).type) for k in names}
    kg_a, kg_b = _array(a.column(KEY_GROUP_COLUMN)), _array(b.column(KEY_GROUP_COLUMN))
    # changed_states: per row, the names of the states that differ (none for a key on one side)
    grid = np.stack([d[changed] for d in differs], axis=1) if differs else np.zeros((n_c, 0), dtype=bool)
    per_row = np.concatenate([np.zeros(n_a + n_b, dtype=np.int64), grid.sum(axis=1)])
    offsets = np.concatenate([[0], np.cumsum(per_row)]).astype(np.int32)
    names_flat = _PA.array(list(states), pa.string()).take(pa.array(np.nonzero(grid)[1], pa.int64()))
    out: pa.Table = _PA.table({
        **keys,
        "kind": pa.array(["only_a"] * n_a + ["only_b"] * n_b + ["changed"] * n_c, pa.string()),
        "key_group_a": pa.concat_arrays([kg_a.take(pa.array(only_a, pa.int64())).cast(pa.int32()), pa.nulls(n_b, pa.int32()),
                                         kg_a.take(pa.array(ca, pa.int64())).cast(pa.int32())]),
        "key_group_b": pa.concat_arrays([pa.nulls(n_a, pa.int32()), kg_b.take(pa.array(only_b, pa.int64())).cast(pa.int32()),
                                         kg_b.take(pa.array(cb, pa.int64())).cast(pa.int32())]),
        "changed_states": _PA.ListArray.from_arrays(pa.array(offsets), names_flat),
        "value_a": pa.concat_arrays([_values(a, states, only_a, vtype), pa.nulls(n_b, vtype), _values(a, states, ca, vtype)]),
        "value_b": pa.concat_arrays([pa.nulls(n_a, vtype), _values(b, states, only_b, vtype), _values(b, states, cb, vtype)]),
    }, schema=schema)
    if out.num_rows > 1:
        out = out.sort_by([(k, "ascending") for k in names])
    return out, int(same.sum())
