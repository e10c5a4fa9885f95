"""The forms a column of keyed state takes in memory, and the few operations on them.

Numeric columns are numpy arrays (states with a validity mask beside them), other key
columns Arrow arrays and other states object arrays; key groups are int16. Apart from
:mod:`keyscale.state.table` because these are rules about one column, whatever table holds
it: the state table, and what converts to and from its files (:func:`numpy_to_arrow`).

>>> import pyarrow as pa
>>> values, valid = arrow_to_numpy(pa.array([1, None, 3]), pa.int64())
>>> values.tolist(), valid.tolist()
([1, 0, 3], [True, False, True])
>>> numpy_to_arrow(values, valid, pa.int64()).to_pylist()
[1, None, 3]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from keyscale.state.types import is_numeric


def arrow_to_numpy(arr: Any, t: pa.DataType) -> tuple[np.ndarray, np.ndarray]:
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


def index_columns(index: pd.Index) -> list[np.ndarray]:
    """The key columns of a lookup index (one, or a MultiIndex's levels)."""
    if isinstance(index, pd.MultiIndex):
        return [np.asarray(index.get_level_values(i)) for i in range(index.nlevels)]
    return [np.asarray(index)]


# A key column as the table holds it: numpy for numeric keys, Arrow for the others.
KeyColumn = Any
# Keys handed to the table: their columns (numpy, Arrow) or a pandas index of them.
Keys = Sequence[Any] | pd.Index

KG_DTYPE = np.int16  # key groups are below the maximum parallelism, at most 32768
KG_MAX = int(np.iinfo(KG_DTYPE).max)
LARGE = {pa.string(): pa.large_string(), pa.binary(): pa.large_binary()}  # the 64-bit-offset type of a string or binary type
_OFFSETS_LIMIT = 2**31 - 1  # bytes a string or binary column with 32-bit offsets can hold


def kg_array(kgs: Any) -> np.ndarray:
    """Key groups as the table holds them (int16), refused when one is out of range."""
    k = np.asarray(kgs)
    if k.dtype != KG_DTYPE:
        if len(k) and (int(k.min()) < 0 or int(k.max()) > KG_MAX):
            raise ValueError(f"key group out of range 0..{KG_MAX}: {int(k.min())}..{int(k.max())}")
        k = k.astype(KG_DTYPE)
    return k


def arrow_equal(a: Any, b: Any) -> np.ndarray:
    """Where two Arrow arrays of the same length hold equal values (nested types compared as Python values)."""
    try:
        eq = pc.equal(a, b)
    except (pa.ArrowNotImplementedError, pa.ArrowInvalid):  # nested types: by Python value
        return np.array([x == y for x, y in zip(a.to_pylist(), b.to_pylist(), strict=True)], dtype=bool)
    return np.asarray(eq.fill_null(False).to_numpy(zero_copy_only=False), dtype=bool)


def concat_arrow(old: Any, new: Any) -> Any:
    """``old`` then ``new`` in new buffers (never a view of a mapped file); string and
    binary keys move to 64-bit offsets before their bytes outgrow 32-bit ones."""
    if old.type in LARGE and old.nbytes + new.nbytes >= _OFFSETS_LIMIT:
        old = old.cast(LARGE[old.type])
    if new.type != old.type:
        new = new.cast(old.type)
    return pa.concat_arrays([old, new])


def filter_column(col: KeyColumn, mask: np.ndarray) -> KeyColumn:
    """The rows of either form where ``mask`` is true."""
    return col[mask] if isinstance(col, np.ndarray) else col.filter(pa.array(mask))
