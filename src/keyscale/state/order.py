"""The order of a key's rows in a state file: key group, then an 8-bit *sub key* of the key.

A state file is sorted by key group (:mod:`keyscale.checkpoint.files`). Within a key group
the rows are ordered by :func:`sub_keys` of the key's first column, so that a point lookup
on an object store can tell which small record batch of the key group can hold a key from
a *fence* (the first row's ``key group << 8 | sub key`` of each record batch, kept in the
file's footer) and fetch that batch alone, not every batch of the key group.

Why an 8-bit sub key of the first key column, and not the key itself or Spark's hash:

- it is cheap to find: the sub key of a string key comes from its first, middle and last
  four bytes and its length (numpy gathers over the Arrow buffers, no per-value hashing), so
  keys that share a suffix (e-mail addresses) or a prefix still spread, read from
  the table's key column as it is held, and stable radix passes of 16-bit values order the
  rows after the key-group sort a snapshot always did
  (:meth:`keyscale.state.table.KeyedStateTable.arrow_parts`); a sort by the key itself, or
  by Spark's Murmur3 of it, cost about a snapshot's write again (docs/design.md). The
  reordering itself is not free: a snapshot's write takes 1.5x as long with it
  (docs/benchmarks.md, "State lookups with fences");
- 8 bits are enough: a key group of N rows falls into 256 runs of about N/256 rows, so a
  lookup reads one record batch (1,024 rows) while N/256 stays below that, ~260,000 rows a
  key group (beyond, two or more: still a few batches);
- the first key column is a column of the routing key of every operator (a window
  operator's ``window_start`` is its last key column), so all rows of one routing key
  share a sub key and sit together;
- ties only cost reads, never answers: keys with equal sub keys (keys alike in the
  bytes read, or colliding in 8 bits) may straddle a record batch boundary, and a lookup then reads every
  batch whose fence range holds the sub key.

The sub key is not a hash anyone relies on for anything else; changing it needs a new
``FENCE_RULE`` (a file records the rule its fences follow; a reader ignores fences of a
rule it does not know and reads the whole key group, as for files written before fences).

>>> import pyarrow as pa
>>> a = sub_keys(pa.array(["user-1", "user-2", None]))
>>> a.dtype, a[2]
(dtype('uint8'), np.uint8(0))
>>> bool(sub_keys(pa.array(["user-1"]))[0] == a[0])
True
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

__all__ = ["FENCE_RULE", "order_rows", "sort_key", "sort_keys", "sub_key", "sub_keys"]

#: The sub-key rule of fences this code writes and reads (a file's ``keyscale.fence_rule``).
FENCE_RULE = "1"

_GOLDEN64 = np.uint64(0x9E3779B97F4A7C15)
_GOLDEN32 = np.uint32(0x9E3779B1)


def _last4(arr: Any) -> np.ndarray:
    """Per string or binary value, its last four bytes (fewer: zeros before them) as a
    uint32, mixed with its length: gathers of one word a value from an overlapping window
    view of the data buffer, no per-value work and no copy of the buffer."""
    n = len(arr)
    bufs = arr.buffers()
    wide = pa.types.is_large_string(arr.type) or pa.types.is_large_binary(arr.type)
    offsets: np.ndarray[Any, np.dtype[np.int64]] = np.frombuffer(bufs[1], dtype=np.int64 if wide else np.int32)[arr.offset : arr.offset + n + 1].astype(np.int64)
    start, end = offsets[:-1], offsets[1:]
    data = np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None else np.zeros(0, np.uint8)
    if data.size < 4:
        data = np.concatenate([data, np.zeros(4, np.uint8)])
    # Every 4-byte window of the data buffer as one little-endian word (a view with a stride
    # of one byte): ``windows[p]`` is ``data[p : p + 4]``, and a gather of words takes half
    # the time of a gather of 4-byte rows.
    windows = np.ndarray(shape=(data.size - 3,), dtype="<u4", buffer=data.data, strides=(1,))
    length = end - start
    last4 = windows[np.maximum(end - 4, 0)]
    short = np.flatnonzero(length < 4)
    if len(short):  # the bytes before a short value are another value's: zeros instead
        s, e = start[short], end[short]
        word = np.zeros(len(short), dtype=np.uint32)
        for j in range(4):
            pos = e - 4 + j
            word |= np.where(pos >= s, data[np.maximum(pos, 0)], 0).astype(np.uint32) << np.uint32(8 * j)
        last4[short] = word
    words: np.ndarray = last4 ^ (length.astype(np.uint32) * np.uint32(0x01000193))
    # Keys that share a suffix (e-mail addresses: ".com") or a prefix and suffix (ids with a
    # region tag) differ in their first or middle bytes: mix those in too, for values of
    # four bytes or more (a shorter value's windows would reach into its neighbour).
    whole = np.flatnonzero(length >= 4) if len(short) else slice(None)
    s = start[whole]
    first4 = windows[s]
    mid4 = windows[s + (length[whole] - 4) // 2]
    words[whole] ^= (first4 * np.uint32(0x85EBCA6B)) ^ ((mid4 * np.uint32(0xC2B2AE35)) >> np.uint32(7))
    return words


def sub_keys(column: Any) -> np.ndarray:
    """The 8-bit sub key (uint8) of each value of an Arrow key column (0 for a null; 0 for
    every value of a type it does not read, which makes fences select the whole key group).

    Strings and binaries: length and first, middle and last four bytes. Integers, dates, timestamps,
    booleans: the value; floats: the value with ``-0.0`` as ``0.0`` (they are one key).
    The top byte of the word times a golden-ratio constant (Fibonacci hashing)."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    if not isinstance(column, pa.Array):
        column = pa.array(column)
    if pa.types.is_dictionary(column.type):
        column = column.dictionary_decode()
    t = column.type
    n = len(column)
    if n == 0:
        return np.zeros(0, dtype=np.uint8)
    with np.errstate(over="ignore"):
        if pa.types.is_string(t) or pa.types.is_binary(t) or pa.types.is_large_string(t) or pa.types.is_large_binary(t):
            sub = ((_last4(column) * _GOLDEN32) >> np.uint32(24)).astype(np.uint8)
        elif pa.types.is_floating(t) or pa.types.is_integer(t) or pa.types.is_boolean(t) or pa.types.is_date(t) or pa.types.is_timestamp(t):
            if pa.types.is_floating(t):
                vals = np.asarray(column.fill_null(0).to_numpy(zero_copy_only=False), dtype=np.float64) + 0.0  # -0.0 -> 0.0
                x = vals.view(np.uint64)
            else:
                # dates as days (Arrow casts a date32 to int32, not to int64), the rest as their value
                ints = column if pa.types.is_integer(t) else column.cast(pa.int32() if pa.types.is_date32(t) else pa.int64())
                x = np.asarray(ints.fill_null(0).to_numpy(zero_copy_only=False)).astype(np.int64).view(np.uint64)
            sub = ((x * _GOLDEN64) >> np.uint64(56)).astype(np.uint8)
        else:
            return np.zeros(n, dtype=np.uint8)
    if column.null_count:
        sub[~np.asarray(column.is_valid().to_numpy(zero_copy_only=False), dtype=bool)] = 0
    return sub


def sub_key(value: Any, t: pa.DataType) -> int:
    """:func:`sub_keys` of one value of Arrow type ``t``: a point lookup's, for which the
    vectorized form's fixed cost (~0.1 ms of numpy calls) was a tenth of the lookup. Strings,
    binaries and integers here in plain Python, the same rule byte for byte
    (``tests/state/test_order.py`` holds both forms to the rule written out); other types
    through :func:`sub_keys`.

    >>> sub_key("user-1", pa.string()) == int(sub_keys(pa.array(["user-1"]))[0])
    True
    >>> sub_key(None, pa.string()), sub_key(-3, pa.int64()) == int(sub_keys(pa.array([-3]))[0])
    (0, True)
    """
    if value is None:
        return 0
    m = 1 << 32
    if pa.types.is_integer(t):
        return ((int(value) % (1 << 64)) * int(_GOLDEN64) % (1 << 64)) >> 56
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        data = value.encode()
    elif pa.types.is_binary(t) or pa.types.is_large_binary(t):
        data = bytes(value)
    else:
        return int(sub_keys(pa.array([value], t))[0])
    n = len(data)
    word = int.from_bytes(data[-4:].rjust(4, b"\0"), "little") ^ (n * 0x01000193 % m)
    if n >= 4:
        mid = (n - 4) // 2
        first4, mid4 = int.from_bytes(data[:4], "little"), int.from_bytes(data[mid : mid + 4], "little")
        word ^= (first4 * 0x85EBCA6B % m) ^ ((mid4 * 0xC2B2AE35 % m) >> 7)
    return (word * int(_GOLDEN32) % m) >> 24


def sort_key(kg: int, value: Any, t: pa.DataType) -> int:
    """:func:`sort_keys` of one row: key group ``kg``, first key column's ``value`` (type ``t``)."""
    return kg << 8 | sub_key(value, t)


def sort_keys(kgs: np.ndarray, first_key: Any) -> np.ndarray:
    """``key group << 8 | sub key`` of each row (int64): the order of a state file's rows,
    and what its fences hold."""
    return (np.asarray(kgs).astype(np.int64) << 8) | sub_keys(first_key).astype(np.int64)


def order_rows(kgs: np.ndarray, first_key: Any = None, subs: np.ndarray | None = None) -> np.ndarray:
    """The permutation that puts rows in state-file order (key group, then sub key), stable
    (rows of one key keep their order). ``subs``: the rows' :func:`sub_keys`, if the caller
    has them (else computed from ``first_key``).

    The stable sort by key group a state file always had (a radix sort of 16-bit values),
    then, for each run of 256 key groups, a stable radix sort of ``(key group - run start) << 8
    | sub key`` as 16-bit values: in cache, no comparison sort.

    >>> import pyarrow as pa
    >>> kg = np.array([1, 0, 1, 0], dtype=np.int16)
    >>> keys = pa.array(["a", "b", "c", "d"])
    >>> p = order_rows(kg, keys)
    >>> kg[p].tolist(), bool((np.diff(sort_keys(kg, keys)[p]) >= 0).all())
    ([0, 0, 1, 1], True)
    """
    kgs = np.asarray(kgs)
    if subs is None:
        subs = sub_keys(first_key)
    by_kg = np.argsort(kgs.astype(np.int16) if len(kgs) and kgs.max() < (1 << 15) and kgs.min() >= 0 else kgs, kind="stable")
    if not len(by_kg):
        return by_kg
    k, s = kgs[by_kg], subs[by_kg]
    first, last = int(k[0]), int(k[-1])
    bounds = np.searchsorted(k, np.arange(first, last + 257, 256))
    out = np.empty_like(by_kg)
    for a, b, base in zip(bounds[:-1], bounds[1:], range(first, last + 1, 256), strict=False):
        if b > a:
            key16 = ((k[a:b] - base).astype(np.uint16) << np.uint16(8)) | s[a:b]
            out[a:b] = by_kg[a:b][np.argsort(key16, kind="stable")]
    return out
