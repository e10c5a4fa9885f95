"""The order of a key's rows in a state file: key group, then a 16-bit *sub key* of the key.

A state file is sorted by key group (:mod:`keyscale.checkpoint.files`). Within a key group
the rows are ordered by :func:`sub_keys` of the key's first column, so that a point lookup
on an object store can tell which small record batch of the key group can hold a key from
a *fence* (the first row's ``key group << 16 | sub key`` of each record batch, kept in the
file's footer) and fetch that batch alone, not every batch of the key group.

Why a 16-bit sub key of the first key column, and not the key itself or Spark's hash:

- it costs a snapshot little: the sub key of a string key comes from its last eight
  bytes and its length (one numpy gather over the Arrow buffers, no per-value hashing), and a stable radix sort of 16-bit values (numpy's ``kind="stable"`` on
  ``uint16``) orders the rows, fused with the key-group sort a snapshot already does
  (:meth:`keyscale.state.table.KeyedStateTable.to_arrow`); a full sort by key (strings)
  and a ``take`` of the whole table cost 2-3x the snapshot's own write (docs/design.md);
- the first key column is a column of the routing key of every operator (a window
  operator's ``window_start`` is its last key column), so all rows of one routing key
  share a sub key and sit together;
- ties only cost reads, never answers: keys with equal sub keys (keys that share their
  length and last eight bytes, or collide in 16 bits) may straddle a record batch boundary, and a lookup then reads every
  batch whose fence range holds the sub key.

The sub key is not a hash anyone relies on for anything else; changing it needs a new
``FENCE_RULE`` (a file records the rule its fences follow; a reader ignores fences of a
rule it does not know and reads the whole key group, as for files written before fences).

>>> import pyarrow as pa
>>> a = sub_keys(pa.array(["user-1", "user-2", None]))
>>> a.dtype, a[2]
(dtype('uint16'), np.uint16(0))
>>> bool(sub_keys(pa.array(["user-1"]))[0] == a[0])
True
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
from numpy.lib.stride_tricks import as_strided

__all__ = ["FENCE_RULE", "order_rows", "sort_keys", "sub_keys"]

#: The sub-key rule of fences this code writes and reads (a file's ``keyscale.fence_rule``).
FENCE_RULE = "1"

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix16(x: np.ndarray) -> np.ndarray:
    """The top 16 bits of ``x * golden`` (Fibonacci hashing): every input bit moves them."""
    with np.errstate(over="ignore"):
        return ((x.astype(np.uint64) * _GOLDEN) >> np.uint64(48)).astype(np.uint16)


def _binary_words(arr: Any) -> np.ndarray:
    """Per string or binary value, its last eight bytes (fewer: zeros before them) as one
    uint64, mixed with its length: one gather of 8 bytes a value from an overlapping
    window view of the data buffer, no per-value work and no copy of the buffer."""
    n = len(arr)
    bufs = arr.buffers()
    wide = pa.types.is_large_string(arr.type) or pa.types.is_large_binary(arr.type)
    offsets = np.frombuffer(bufs[1], dtype=np.int64 if wide else np.int32)[arr.offset : arr.offset + n + 1].astype(np.int64)
    start, end = offsets[:-1], offsets[1:]
    data = np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None else np.zeros(0, np.uint8)
    if data.size < 8:
        data = np.concatenate([data, np.zeros(8, np.uint8)])
    windows = as_strided(data, shape=(data.size - 7, 8), strides=(1, 1))  # windows[p] = data[p : p + 8]
    last8 = windows[np.maximum(end - 8, 0)]
    length = end - start
    short = np.flatnonzero(length < 8)
    if len(short):  # the bytes before a short value are another value's: zeros instead
        s, e = start[short], end[short]
        for j in range(8):
            pos = e - 8 + j
            ok = pos >= s
            last8[short, j] = np.where(ok, data[np.where(ok, pos, 0)], 0)
    words: np.ndarray = last8.view("<u8").ravel() ^ (length.astype(np.uint64) * np.uint64(0x100000001B3))
    return words


def sub_keys(column: Any) -> np.ndarray:
    """The 16-bit sub key (uint16) of each value of an Arrow key column (0 for a null; 0 for
    every value of a type it does not read, which makes fences select the whole key group).

    Strings and binaries: length and last eight bytes. Integers, dates, timestamps,
    booleans: the value; floats: the value with ``-0.0`` as ``0.0`` (they are one key)."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    if not isinstance(column, pa.Array):
        column = pa.array(column)
    if pa.types.is_dictionary(column.type):
        column = column.dictionary_decode()
    t = column.type
    n = len(column)
    if n == 0:
        return np.zeros(0, dtype=np.uint16)
    if pa.types.is_string(t) or pa.types.is_binary(t) or pa.types.is_large_string(t) or pa.types.is_large_binary(t):
        x = _binary_words(column)
    elif pa.types.is_floating(t):
        vals = np.asarray(column.fill_null(0).to_numpy(zero_copy_only=False), dtype=np.float64) + 0.0  # -0.0 -> 0.0
        x = vals.view(np.uint64)
    elif pa.types.is_integer(t) or pa.types.is_boolean(t) or pa.types.is_date(t) or pa.types.is_timestamp(t):
        ints = column.cast(pa.int64()) if not pa.types.is_integer(t) else column
        x = np.asarray(ints.fill_null(0).to_numpy(zero_copy_only=False)).astype(np.int64).view(np.uint64)
    else:
        return np.zeros(n, dtype=np.uint16)
    sub = _mix16(x)
    if column.null_count:
        sub[~np.asarray(column.is_valid().to_numpy(zero_copy_only=False), dtype=bool)] = 0
    return sub


def sort_keys(kgs: np.ndarray, first_key: Any) -> np.ndarray:
    """``key group << 16 | sub key`` of each row (int64): the order of a state file's rows,
    and what its fences hold."""
    return (np.asarray(kgs).astype(np.int64) << 16) | sub_keys(first_key).astype(np.int64)


def order_rows(kgs: np.ndarray, first_key: Any) -> np.ndarray:
    """The permutation that puts rows in state-file order (key group, then sub key), stable
    (rows of one key keep their order). Two stable radix passes of 16-bit values when key
    groups fit (numpy sorts ``uint16``/``int16`` with ``kind="stable"`` by radix).

    >>> import pyarrow as pa
    >>> kg = np.array([1, 0, 1, 0], dtype=np.int16)
    >>> keys = pa.array(["a", "b", "c", "d"])
    >>> p = order_rows(kg, keys)
    >>> kg[p].tolist(), bool((np.diff(sort_keys(kg, keys)[p]) >= 0).all())
    ([0, 0, 1, 1], True)
    """
    kgs = np.asarray(kgs)
    by_sub = np.argsort(sub_keys(first_key), kind="stable")
    k = kgs[by_sub]
    if len(k) and int(k.min()) >= 0 and int(k.max()) < (1 << 15):
        k = k.astype(np.int16)
    return by_sub[np.argsort(k, kind="stable")]
