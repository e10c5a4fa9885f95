"""Byte encodings of the RocksDB state backend: keys whose byte order is (key group, key) order, rows as bytes.

A state row's RocksDB key is ``b"\\x00"``, the key group as two big-endian bytes, then each
key column in an order-preserving encoding:

- integers, dates, times, timestamps, durations: 8 bytes, big-endian, sign bit flipped;
- floats: the IEEE bits, sign bit flipped for positives, all bits flipped for negatives
  (``-0.0`` is stored as ``0.0``: they are one key);
- booleans: one byte;
- strings and binary: the bytes with ``00`` written ``00 FF``, then ``00 00``: prefix-free,
  so the columns after a string column keep their order.

So all keys of one key group, and of a range of key groups, are one contiguous byte range
(a rescale drops a range with one DeleteRange), and the keys of one routing key with
further key columns after it (a window's start) share a prefix. Only RocksDB's byte order
needs this; the checkpoint files stay the source of truth.

A row's value: per state a validity byte and, for a numeric state, its value (fixed
width, numpy's native order); then, when the operator has non-numeric states (strings,
lists, maps, structs), those values pickled as one tuple. A numeric-only row decodes with
one ``numpy.frombuffer`` per batch, not a Python call per key.

>>> import numpy as np, pyarrow as pa
>>> enc = encode_keys(np.array([3, 3]), [np.array([-1, 2])], [pa.int64()])
>>> [e.hex() for e in enc]
['0000037fffffffffffffff', '0000038000000000000002']
>>> decode_keys(enc, [pa.int64()])[1][0].tolist()
[-1, 2]
"""

from __future__ import annotations

import pickle
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from keyscale.state.types import StateDescriptor, is_numeric

DATA = b"\x00"  # state rows: DATA + kg + key
INDEX = b"\x01"  # time indexes: INDEX + column id + kg + time + key (value empty)
META = b"\x02"  # what the DB reflects: per key group the checkpoint batch, and key counts

_SIGN = np.uint64(1 << 63)
_ALL = np.uint64(0xFFFFFFFFFFFFFFFF)


def key_supported(t: pa.DataType) -> bool:
    """Whether a key column of type ``t`` has an order-preserving encoding here."""
    return bool(
        pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t) or pa.types.is_temporal(t)
        or pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t)
    )


def _fixed(t: pa.DataType) -> bool:
    return not (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t))


def _width(t: pa.DataType) -> int:
    return 1 if pa.types.is_boolean(t) else 8


def _as_int64(col: Any, t: pa.DataType) -> np.ndarray:
    """A temporal or integer column as int64 (its unit's count since the epoch)."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    if isinstance(col, pa.Array):
        if pa.types.is_temporal(t):
            col = col.cast(pa.int64() if pa.types.is_timestamp(t) or pa.types.is_duration(t) or pa.types.is_date64(t) or pa.types.is_time64(t) else pa.int32())
        return np.asarray(col.to_numpy(zero_copy_only=False)).astype(np.int64)
    arr = np.asarray(col)
    if arr.dtype == object or pa.types.is_temporal(t):
        return _as_int64(pa.array(arr, type=t) if arr.dtype == object else pa.array(arr).cast(t), t)
    return arr.astype(np.int64)


def _fixed_bytes(col: Any, t: pa.DataType) -> np.ndarray:
    """Big-endian order-preserving bytes of a fixed-width column: (n, width) uint8."""
    if pa.types.is_boolean(t):
        arr = np.asarray(col.to_numpy(zero_copy_only=False) if isinstance(col, pa.Array | pa.ChunkedArray) else col)
        return arr.astype(np.uint8).reshape(-1, 1)
    if pa.types.is_floating(t):
        arr = np.asarray(col.to_numpy(zero_copy_only=False) if isinstance(col, pa.Array | pa.ChunkedArray) else col, dtype=np.float64) + 0.0
        bits = arr.view(np.uint64)
        u = np.where(bits & _SIGN, bits ^ _ALL, bits ^ _SIGN)
    elif pa.types.is_unsigned_integer(t):
        arr = np.asarray(col.to_numpy(zero_copy_only=False) if isinstance(col, pa.Array | pa.ChunkedArray) else col)
        u = arr.astype(np.uint64)
    else:
        u = _as_int64(col, t).view(np.uint64) ^ _SIGN
    return u.astype(">u8").view(np.uint8).reshape(-1, 8)


def _escape(b: bytes) -> bytes:
    return b.replace(b"\x00", b"\x00\xff") + b"\x00\x00"


def _var_values(col: Any, t: pa.DataType) -> list[bytes]:
    items: list[Any] = col.to_pylist() if isinstance(col, pa.Array | pa.ChunkedArray) else list(col)
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return [_escape(s.encode()) for s in items]
    return [_escape(bytes(b)) for b in items]


def encode_keys(kgs: Any, columns: Sequence[Any], types: Sequence[pa.DataType], prefix: bytes = DATA, sort: bool = False) -> list[bytes]:
    """Each row's RocksDB key: ``prefix``, its key group (2 bytes, big-endian), its key
    columns; with ``sort``, in byte order instead of row order."""
    kg = np.asarray(kgs).astype(">u2").view(np.uint8).reshape(-1, 2)
    n = len(kg)
    fixed = [_fixed(t) for t in types]
    if all(fixed):
        mat = np.empty((n, len(prefix) + 2 + sum(_width(t) for t in types)), dtype=np.uint8)
        mat[:, : len(prefix)] = np.frombuffer(prefix, dtype=np.uint8)
        at = len(prefix)
        mat[:, at : at + 2] = kg
        at += 2
        for c, t in zip(columns, types, strict=True):
            w = _width(t)
            mat[:, at : at + w] = _fixed_bytes(c, t)
            at += w
        if sort:  # equal widths: numpy's "S" order (trailing zeros ignored) is the byte order
            mat = mat[np.argsort(mat.view(f"S{mat.shape[1]}").ravel(), kind="stable")]
        out: list[bytes] = np.ascontiguousarray(mat).view(f"V{mat.shape[1]}").ravel().tolist()
        return out
    parts: list[list[bytes]] = []
    for c, t, f in zip(columns, types, fixed, strict=True):
        parts.append(np.ascontiguousarray(_fixed_bytes(c, t)).view(f"V{_width(t)}").ravel().tolist() if f else _var_values(c, t))
    heads = np.ascontiguousarray(kg).view("V2").ravel().tolist()
    keys = [b"".join((prefix, h, *p)) for h, *p in zip(heads, *parts, strict=True)]
    return sorted(keys) if sort else keys


def _unfix(raw: np.ndarray, t: pa.DataType) -> Any:
    """Inverse of :func:`_fixed_bytes`: an Arrow array of type ``t``."""
    if pa.types.is_boolean(t):
        return pa.array(raw[:, 0].astype(bool), type=t)
    u = np.ascontiguousarray(raw).view(">u8").ravel().astype(np.uint64)
    if pa.types.is_floating(t):
        bits = np.where(u & _SIGN, u ^ _SIGN, u ^ _ALL)
        return pa.array(bits.view(np.float64)).cast(t)
    if pa.types.is_unsigned_integer(t):
        return pa.array(u).cast(t)
    ints = (u ^ _SIGN).view(np.int64)
    if pa.types.is_temporal(t):
        small = pa.types.is_date32(t) or pa.types.is_time32(t)
        return pa.array(ints.astype(np.int32) if small else ints).cast(t)
    return pa.array(ints).cast(t)


def _unescape(b: bytes, at: int) -> tuple[bytes, int]:
    out = bytearray()
    while True:
        z = b.index(b"\x00", at)
        out += b[at:z]
        if b[z + 1] == 0:
            return bytes(out), z + 2
        out += b"\x00"
        at = z + 2


def decode_keys(keys: Sequence[bytes], types: Sequence[pa.DataType], skip: int = 1) -> tuple[np.ndarray, list[Any]]:
    """Key groups (int16) and key columns (Arrow arrays) of RocksDB keys (``skip``: prefix length)."""
    n = len(keys)
    if all(_fixed(t) for t in types):
        w = skip + 2 + sum(_width(t) for t in types)
        mat = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(n, w)
        kgs = mat[:, skip : skip + 2].copy().view(">u2").ravel().astype(np.int16)
        cols, at = [], skip + 2
        for t in types:
            cols.append(_unfix(mat[:, at : at + _width(t)], t))
            at += _width(t)
        return kgs, cols
    kgs = np.fromiter((int.from_bytes(k[skip : skip + 2], "big") for k in keys), dtype=np.int16, count=n)
    values: list[list[Any]] = [[] for _ in types]
    for k in keys:
        at = skip + 2
        for i, t in enumerate(types):
            if _fixed(t):
                w = _width(t)
                values[i].append(k[at : at + w])
                at += w
            else:
                raw, at = _unescape(k, at)
                values[i].append(raw.decode() if pa.types.is_string(t) or pa.types.is_large_string(t) else raw)
    out: list[Any] = []
    for vs, t in zip(values, types, strict=True):
        if _fixed(t):
            w = _width(t)
            out.append(_unfix(np.frombuffer(b"".join(vs), dtype=np.uint8).reshape(n, w), t))
        else:
            out.append(pa.array(vs, type=t))
    return kgs, out


def encode_time(t: np.ndarray) -> np.ndarray:
    """int64 times as order-preserving 8-byte rows ((n, 8) uint8)."""
    return (np.asarray(t, dtype=np.int64).view(np.uint64) ^ _SIGN).astype(">u8").view(np.uint8).reshape(-1, 8)


def time_bytes(t: int) -> bytes:
    return struct.pack(">Q", (t + (1 << 63)) & 0xFFFFFFFFFFFFFFFF)


def kg_bytes(kg: int) -> bytes:
    return struct.pack(">H", kg)


class RowCodec:
    """A state row's value bytes: validity and numeric values packed, other values pickled.

    >>> import numpy as np, pyarrow as pa
    >>> c = RowCodec([StateDescriptor("n", "value", pa.int64())])
    >>> b = c.encode({"n": (np.array([7, 0]), np.array([True, False]))}, 2)
    >>> vals, ok = c.decode(b)
    >>> vals["n"].tolist(), ok["n"].tolist()
    ([7, 0], [True, False])
    """

    def __init__(self, states: Sequence[StateDescriptor]):
        self.states = list(states)
        self.numeric = [s for s in self.states if is_numeric(s.column_type)]
        self.other = [s for s in self.states if not is_numeric(s.column_type)]
        fields: list[tuple[str, Any]] = []
        for s in self.states:
            fields.append((f"ok_{s.name}", np.bool_))
        for s in self.numeric:
            fields.append((f"v_{s.name}", np.dtype(s.column_type.to_pandas_dtype())))
        self.dtype = np.dtype(fields)
        self.width = self.dtype.itemsize

    def encode(self, columns: dict[str, tuple[np.ndarray, np.ndarray]], n: int) -> list[bytes]:
        """Value bytes of ``n`` rows; ``columns``: each state's values and validity."""
        rec = np.zeros(n, dtype=self.dtype)
        for s in self.states:
            vals, ok = columns[s.name]
            rec[f"ok_{s.name}"] = ok
            if is_numeric(s.column_type):
                rec[f"v_{s.name}"] = np.where(ok, vals, 0) if len(vals) else vals
        fixed: list[bytes] = rec.view(f"V{self.width}").tolist() if self.width else [b""] * n
        if not self.other:
            return fixed
        objs = zip(*(columns[s.name][0].tolist() for s in self.other), strict=True)
        oks = zip(*(columns[s.name][1].tolist() for s in self.other), strict=True)
        return [
            f + pickle.dumps(tuple(v if k else None for v, k in zip(o, ok, strict=True)), protocol=pickle.HIGHEST_PROTOCOL)
            for f, o, ok in zip(fixed, objs, oks, strict=True)
        ]

    def decode(self, values: Sequence[bytes]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """Each state's values and validity for rows ``values`` (inverse of :meth:`encode`)."""
        n = len(values)
        fixed = b"".join(v[: self.width] for v in values) if self.other else b"".join(values)
        rec = np.frombuffer(fixed, dtype=self.dtype, count=n) if n else np.zeros(0, dtype=self.dtype)
        vals: dict[str, np.ndarray] = {}
        ok: dict[str, np.ndarray] = {}
        for s in self.numeric:
            vals[s.name] = rec[f"v_{s.name}"].copy()
        for s in self.states:
            ok[s.name] = rec[f"ok_{s.name}"].copy()
        if self.other:
            tuples = [pickle.loads(v[self.width :]) for v in values]
            for i, s in enumerate(self.other):
                col = np.empty(n, dtype=object)
                for j, t in enumerate(tuples):  # one by one: a list value must stay one object
                    col[j] = t[i]
                vals[s.name] = col
        return vals, ok
