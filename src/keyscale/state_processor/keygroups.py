"""Key groups as Spark computes them (``pmod(hash(key columns), M)``), vectorized in numpy."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from keyscale.state.keygroups import check_parallelism
from keyscale.state.spark_hash import key_group_of

_PA: Any = pa

_U32 = np.uint32
_C1 = _U32(0xCC9E2D51)
_C2 = _U32(0x1B873593)


def _rotl(x: np.ndarray, r: int) -> np.ndarray:
    return (x << _U32(r)) | (x >> _U32(32 - r))


def _mix_k1(k: np.ndarray) -> np.ndarray:
    return _rotl(k * _C1, 15) * _C2


def _mix_h1(h: np.ndarray, k: np.ndarray) -> np.ndarray:
    return _rotl(h ^ k, 13) * _U32(5) + _U32(0xE6546B64)


def _fmix(h: np.ndarray, length: np.ndarray | np.uint32) -> np.ndarray:
    h = h ^ length
    h ^= h >> _U32(16)
    h = h * _U32(0x85EBCA6B)
    h ^= h >> _U32(13)
    h = h * _U32(0xC2B2AE35)
    h ^= h >> _U32(16)
    return h


def _hash_int32(h: np.ndarray, v: np.ndarray) -> np.ndarray:
    return _fmix(_mix_h1(h, _mix_k1(v.astype(np.int32).view(_U32))), _U32(4))


def _hash_int64(h: np.ndarray, v: np.ndarray) -> np.ndarray:
    u = v.astype(np.int64).view(np.uint64)
    h = _mix_h1(h, _mix_k1((u & np.uint64(0xFFFFFFFF)).astype(_U32)))
    h = _mix_h1(h, _mix_k1((u >> np.uint64(32)).astype(_U32)))
    return _fmix(h, _U32(8))


def _hash_bytes(h: np.ndarray, arr: Any) -> np.ndarray:
    """``hashUnsafeBytes`` of each value of a (large) string or binary array."""
    n = len(arr)
    large = pa.types.is_large_string(arr.type) or pa.types.is_large_binary(arr.type)
    bufs = arr.buffers()
    offsets = np.frombuffer(bufs[1], dtype=np.int64 if large else np.int32)[arr.offset : arr.offset + n + 1].astype(np.int64)
    data = np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None else np.empty(0, np.uint8)
    starts = offsets[:-1]
    lens = offsets[1:] - starts
    words = lens // 4
    h = h.copy()
    for j in range(int(words.max()) if n else 0):
        idx = np.flatnonzero(words > j)
        p = starts[idx] + 4 * j
        word = data[p].astype(_U32) | (data[p + 1].astype(_U32) << _U32(8)) | (data[p + 2].astype(_U32) << _U32(16)) | (data[p + 3].astype(_U32) << _U32(24))
        h[idx] = _mix_h1(h[idx], _mix_k1(word))
    for t in range(3):  # tail bytes, each sign-extended and mixed on its own
        idx = np.flatnonzero(lens % 4 > t)
        p = starts[idx] + 4 * words[idx] + t
        h[idx] = _mix_h1(h[idx], _mix_k1(data[p].view(np.int8).astype(np.int32).view(_U32)))
    return _fmix(h, lens.astype(_U32))


def _hash_column(h: np.ndarray, col: Any, spark_type: str) -> np.ndarray | None:
    """Spark's hash of one column seeded by ``h`` (None: type not vectorized here)."""
    t = col.type
    if spark_type in ("string", "binary") and (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t)):
        return _hash_bytes(h, col)
    if spark_type in ("int", "integer", "short", "smallint", "byte", "tinyint", "date", "boolean"):
        if pa.types.is_date32(t) or pa.types.is_boolean(t):
            col = col.cast(pa.int32())
        return _hash_int32(h, np.asarray(col.fill_null(0).to_numpy(zero_copy_only=False)))
    if spark_type in ("long", "bigint", "timestamp", "timestamp_ntz"):
        if pa.types.is_timestamp(t):
            col = col.cast(_PA.timestamp("us", tz=t.tz)).cast(pa.int64())
        return _hash_int64(h, np.asarray(col.fill_null(0).to_numpy(zero_copy_only=False)))
    if spark_type == "float":
        v = np.asarray(col.cast(pa.float32()).fill_null(0).to_numpy(zero_copy_only=False), dtype=np.float32)
        bits = np.where(v == 0, _U32(0), np.where(np.isnan(v), _U32(0x7FC00000), v.view(_U32)))
        return _hash_int32(h, bits.astype(_U32).view(np.int32))
    if spark_type == "double":
        d = np.asarray(col.cast(pa.float64()).fill_null(0).to_numpy(zero_copy_only=False), dtype=np.float64)
        bits64 = np.where(d == 0, np.uint64(0), np.where(np.isnan(d), np.uint64(0x7FF8000000000000), d.view(np.uint64)))
        return _hash_int64(h, bits64.astype(np.uint64).view(np.int64))
    return None


def key_groups(table: pa.Table, key_names: Sequence[str], spark_types: Sequence[str], max_parallelism: int) -> np.ndarray:
    """``pmod(hash(key columns), M)`` of every row, as Spark computes it (int32 array).

    ``spark_types`` name each key column's Spark type (``"string"``, ``"long"``, ...): the
    hash depends on it (``hash(1L) != hash(1)``). Vectorized for the types keys usually
    have; others go row by row through :func:`keyscale.state.spark_hash.key_group_of`.

    >>> t = pa.table({"k": ["a", "bcdef"], "n": [1, None]})
    >>> key_groups(t, ["k", "n"], ["string", "long"], 128).tolist()
    [81, 26]
    >>> [key_group_of(["a", 1], ["string", "long"], 128), key_group_of(["bcdef", None], ["string", "long"], 128)]
    [81, 26]
    """
    check_parallelism(1, max_parallelism)
    n = table.num_rows
    h = np.full(n, 42, dtype=_U32)
    cols = [table.column(k).combine_chunks() if table.column(k).num_chunks != 1 else table.column(k).chunk(0) for k in key_names]
    with np.errstate(over="ignore"):
        for col, st in zip(cols, spark_types, strict=True):
            new = _hash_column(h, col, st)
            if new is None:
                rows = zip(*(c.to_pylist() for c in cols), strict=True)
                return np.fromiter((key_group_of(list(r), list(spark_types), max_parallelism) for r in rows), dtype=np.int32, count=n)
            if col.null_count:
                valid = np.asarray(col.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
                new = np.where(valid, new, h)
            h = new
    return (h.view(np.int32).astype(np.int64) % max_parallelism).astype(np.int32)

