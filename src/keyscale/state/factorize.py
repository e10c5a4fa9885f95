"""Grouping rows by their key, by hashing and never sorting: :func:`factorize_keys` gives
each row its group and the groups' keys, :func:`make_index` a lookup index over key
columns (one column, or several as a ``MultiIndex`` with levels in first-appearance
order). Used wherever a batch's records are grouped per key (the keyed tasks, windows)
and by the state table's callers to look keys up; :func:`last_rows` keeps each key's last
row of an Arrow table (the state table's merge of files, a scan's). Pure pandas, numpy and
Arrow, no state.

>>> import numpy as np
>>> codes, index, columns = factorize_keys([np.array(["b", "a", "b"])])
>>> codes.tolist(), list(index), [c.tolist() for c in columns]
([0, 1, 0], ['b', 'a'], [['b', 'a']])
>>> codes, _, columns = factorize_keys([np.array([1, 1, 2]), np.array(["x", "y", "x"])])
>>> codes.tolist(), [c.tolist() for c in columns]
([0, 1, 2], [[1, 1, 2], ['x', 'y', 'x']])
>>> make_index([np.array([3, 4])]).get_indexer([4, 5]).tolist()
[1, -1]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from keyscale.state.types import is_numeric

__all__ = ["factorize_keys", "last_rows", "make_index"]


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


def _codes(col: Any) -> np.ndarray:
    """Each value's code, codes in order of first appearance (hashing in C: pandas for
    numbers, Arrow for the others)."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    if is_numeric(col.type):
        return np.asarray(pd.factorize(col.to_numpy(zero_copy_only=False))[0], dtype=np.int64)
    return np.asarray(pc.dictionary_encode(col).indices.to_numpy(zero_copy_only=False), dtype=np.int64)


def last_rows(table: pa.Table, key_names: Sequence[str]) -> np.ndarray | None:
    """The last row of each distinct key of ``table``, keys in order of first appearance
    (None when the key columns' codes cannot be combined into one integer)."""
    codes = _codes(table.column(key_names[0]))
    for name in key_names[1:]:
        more = _codes(table.column(name))
        width = int(more.max()) + 1 if len(more) else 1
        if (int(codes.max()) + 1) * width >= 2**62:
            return None
        codes = np.asarray(pd.factorize(codes * width + more)[0], dtype=np.int64)
    last = np.full(int(codes.max()) + 1 if len(codes) else 0, -1, dtype=np.int64)
    np.maximum.at(last, codes, np.arange(len(codes)))
    return last
