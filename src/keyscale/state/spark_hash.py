"""Spark SQL's ``hash()``, the key -> key group rule, in each form keyscale runs it.

Key groups are ``pmod(hash(key columns), M)``, computed by Spark in the pipeline. The driver,
the State Processor and tests need the same number without a JVM, so this module
re-implements Spark's ``Murmur3Hash`` expression (``Murmur3_x86_32``, seed 42) exactly, and
is the one place that rule lives, in three forms:

- per value in pure Python (:func:`spark_hash`, :func:`key_group_of`, :func:`routing_values`);
- per Arrow column in numpy (:func:`spark_hashes`, :func:`key_groups`), from the same
  Murmur3 steps (they are written once for Python ints and numpy ``uint32`` arrays);
- as the Spark SQL the stages and the bootstrap run (:func:`key_group_sql`,
  :func:`route_sql`; the key group -> subtask part is
  :func:`keyscale.state.keygroups.subtask_of_sql`).

Spark's quirks, which every form keeps:

- a long is hashed as two ints, low word then high word (``hashLong``);
- strings and binaries use ``hashUnsafeBytes``: 4-byte little-endian words, then each tail
  byte *sign-extended* and mixed as a whole block of its own. Standard Murmur3 packs the
  tail into one block, so for lengths not divisible by 4 the results differ;
- booleans hash as ints 1/0; bytes, shorts and dates as ints; timestamps as longs;
- floats hash ``floatToIntBits`` and doubles ``doubleToLongBits`` (NaN canonical), with
  ``-0.0`` first turned into ``0.0``;
- several columns chain: the hash of one column is the seed of the next, and a null column
  leaves the running hash unchanged (so ``hash(1, null) == hash(1)``).

All results are signed 32-bit ints, as Spark returns them.

It is one module, longer than most, on purpose: one rule in every form keyscale runs it,
side by side, so that no second copy of the constants or the quirks exists.
"""

from __future__ import annotations

import datetime as _dt
import decimal
import functools
import math
import numbers
import operator
import struct
from collections.abc import Callable, Sequence
from typing import Any, SupportsIndex

import numpy as np
import pyarrow as pa

from keyscale.errors import InputDataError, JobDefinitionError, KeyscaleError
from keyscale.state.keygroups import UPPER_BOUND_MAX_PARALLELISM, check_parallelism
from keyscale.state.types import arrow_type

__all__ = [
    "SPARK_HASH_SEED",
    "TYPE_NAMES",
    "hash_boolean",
    "hash_bytes",
    "hash_double",
    "hash_float",
    "hash_int",
    "hash_long",
    "hash_string",
    "key_group_of",
    "key_group_sql",
    "key_groups",
    "route_sql",
    "routing_values",
    "spark_hash",
    "spark_hashes",
]

#: The seed of Spark SQL's ``hash()`` and of ``HashPartitioning``.
SPARK_HASH_SEED = 42

_PA: Any = pa

_MASK = 0xFFFFFFFF
_C1 = 0xCC9E2D51
_C2 = 0x1B873593
_INT_MIN, _INT_MAX = -(1 << 31), (1 << 31) - 1
_LONG_MIN, _LONG_MAX = -(1 << 63), (1 << 63) - 1
_CANONICAL_NAN_INT_BITS = 0x7FC00000  # Float.floatToIntBits(Float.NaN)
_CANONICAL_NAN_LONG_BITS = 0x7FF8000000000000  # Double.doubleToLongBits(Double.NaN)

#: A 32-bit word: a Python int in ``0..2**32-1`` (Java's int, reinterpreted), or a numpy
#: ``uint32`` array of them. The Murmur3 steps below are written once for both: a Python
#: int is masked after every multiply/add/shift (it never overflows), a ``uint32`` array
#: wraps by itself and the masks change nothing.
_Word = Any


def _mix_k1(k1: _Word) -> _Word:
    k1 = (k1 * _C1) & _MASK
    k1 = ((k1 << 15) | (k1 >> 17)) & _MASK
    return (k1 * _C2) & _MASK


def _mix_h1(h1: _Word, k1: _Word) -> _Word:
    h1 = h1 ^ k1
    h1 = ((h1 << 13) | (h1 >> 19)) & _MASK
    return (h1 * 5 + 0xE6546B64) & _MASK


def _fmix(h1: _Word, length: _Word) -> _Word:
    # No augmented assignment: on an array it would change the caller's.
    h1 = h1 ^ length
    h1 = h1 ^ (h1 >> 16)
    h1 = (h1 * 0x85EBCA6B) & _MASK
    h1 = h1 ^ (h1 >> 13)
    h1 = (h1 * 0xC2B2AE35) & _MASK
    return h1 ^ (h1 >> 16)


def _signed(u: int) -> int:
    return u - (1 << 32) if u & 0x80000000 else u


def _as_int(v: object, name: str, lo: int, hi: int) -> int:
    # operator.index accepts numpy/pandas integer scalars but not floats; bool is refused
    # because Spark never hands one over for a numeric column, so it signals a wrong type.
    i: int | None = None
    if isinstance(v, SupportsIndex) and not isinstance(v, bool):
        try:
            i = operator.index(v)
        except TypeError:  # numpy.bool_ has __index__ but refuses
            i = None
    if i is None or not lo <= i <= hi:
        raise InputDataError(f"{v!r} is not a Spark {name} (an integer in {lo}..{hi})")
    return i


def _as_float(v: object, name: str) -> float:
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise InputDataError(f"{v!r} is not a Spark {name} (a real number)")
    return float(v)


def hash_int(v: int, seed: int = SPARK_HASH_SEED) -> int:
    """Spark's ``hash(CAST(v AS INT))``; also used for byte, short, date and boolean.

    >>> hash_int(1)
    -559580957
    """
    v = _as_int(v, "int", _INT_MIN, _INT_MAX)
    h1 = _mix_h1(seed & _MASK, _mix_k1(v & _MASK))
    return _signed(_fmix(h1, 4))


def hash_long(v: int, seed: int = SPARK_HASH_SEED) -> int:
    """Spark's ``hash(CAST(v AS BIGINT))``: the low int, then the high int, length 8.

    >>> hash_long(1)
    -1712319331
    """
    v = _as_int(v, "long", _LONG_MIN, _LONG_MAX)
    h1 = _mix_h1(seed & _MASK, _mix_k1(v & _MASK))
    h1 = _mix_h1(h1, _mix_k1((v >> 32) & _MASK))
    return _signed(_fmix(h1, 8))


def hash_bytes(b: bytes | bytearray | memoryview, seed: int = SPARK_HASH_SEED) -> int:
    """Spark's ``hash()`` of a binary value (``Murmur3_x86_32.hashUnsafeBytes``).

    The 1-3 tail bytes are mixed one at a time, each sign-extended to an int, unlike
    standard Murmur3 (so ``b"a"`` hashes like the int 97, but with length 1).

    >>> hash_bytes(b"a"), hash_bytes(b"")
    (1485273170, 142593372)
    """
    data = bytes(b)
    n = len(data)
    aligned = n - n % 4
    h1 = seed & _MASK
    for (word,) in struct.iter_unpack("<I", data[:aligned]):
        h1 = _mix_h1(h1, _mix_k1(word))
    for byte in data[aligned:]:
        # Java's byte is signed: 0x80..0xFF become negative ints before mixing.
        h1 = _mix_h1(h1, _mix_k1((byte - 256 if byte >= 128 else byte) & _MASK))
    return _signed(_fmix(h1, n))


def hash_string(s: str, seed: int = SPARK_HASH_SEED) -> int:
    """Spark's ``hash()`` of a string: its UTF-8 bytes (binary collation, the default).

    >>> hash_string("a")
    1485273170
    """
    return hash_bytes(s.encode("utf-8"), seed)


def hash_boolean(v: bool, seed: int = SPARK_HASH_SEED) -> int:
    """Spark's ``hash()`` of a boolean: the int 1 or 0.

    >>> hash_boolean(True) == hash_int(1)
    True
    """
    return hash_int(1 if v else 0, seed)


def hash_double(v: float, seed: int = SPARK_HASH_SEED) -> int:
    """Spark's ``hash(CAST(v AS DOUBLE))``: ``doubleToLongBits`` hashed as a long.

    >>> hash_double(-0.0) == hash_double(0.0) == hash_long(0)
    True
    """
    v = _as_float(v, "double")
    if v == 0.0:  # -0.0 too: Spark hashes both zeros as 0L
        return hash_long(0, seed)
    if math.isnan(v):  # doubleToLongBits collapses every NaN to one bit pattern
        return hash_long(_CANONICAL_NAN_LONG_BITS, seed)
    (bits,) = struct.unpack("<q", struct.pack("<d", v))
    return hash_long(bits, seed)


def hash_float(v: float, seed: int = SPARK_HASH_SEED) -> int:
    """Spark's ``hash(CAST(v AS FLOAT))``: ``v`` rounded to float32, ``floatToIntBits``.

    >>> hash_float(1.5) == hash_int(0x3FC00000)
    True
    """
    v = _as_float(v, "float")
    if v == 0.0:  # -0.0 too
        return hash_int(0, seed)
    if math.isnan(v):
        return hash_int(_CANONICAL_NAN_INT_BITS, seed)
    try:
        packed = struct.pack("<f", v)
    except OverflowError:
        # Java's (float) cast rounds out-of-range doubles to infinity; struct refuses.
        packed = struct.pack("<f", math.copysign(math.inf, v))
    (bits,) = struct.unpack("<i", packed)
    return hash_int(bits, seed)


_EPOCH_DATE = _dt.date(1970, 1, 1)
_EPOCH_TS = _dt.datetime(1970, 1, 1, tzinfo=_dt.UTC)
_MICRO = _dt.timedelta(microseconds=1)


def _as_days(v: object) -> int:
    # datetime is a date subclass, but a timestamp is not a date: refuse it.
    if isinstance(v, _dt.date) and not isinstance(v, _dt.datetime):
        return (v - _EPOCH_DATE).days
    return _as_int(v, "date (days since 1970-01-01)", _INT_MIN, _INT_MAX)


def _as_micros(v: object) -> int:
    if isinstance(v, _dt.datetime):
        # A naive datetime means different instants in different session time zones.
        if v.utcoffset() is None:
            raise InputDataError(f"{v!r} has no time zone; pass aware datetimes or epoch micros")
        return (v - _EPOCH_TS) // _MICRO
    return _as_int(v, "timestamp (microseconds since epoch)", _LONG_MIN, _LONG_MAX)


def _as_local_micros(v: object) -> int:
    """A TIMESTAMP_NTZ: a wall-clock time, no zone (what PySpark hands over: a naive datetime)."""
    if isinstance(v, _dt.datetime):
        if v.utcoffset() is not None:
            raise InputDataError(f"{v!r} has a time zone; a Spark timestamp_ntz is a naive datetime or epoch micros")
        return (v - _EPOCH_TS.replace(tzinfo=None)) // _MICRO
    return _as_int(v, "timestamp_ntz (microseconds since epoch)", _LONG_MIN, _LONG_MAX)


@functools.lru_cache(maxsize=64)
def _decimal_hasher(type_name: str) -> Callable[[object, int], int] | None:
    """Spark's hash of a ``decimal(p,s)`` (None: ``type_name`` is not a decimal): the unscaled
    value as a long up to 18 digits, else the bytes of Java's ``BigInteger.toByteArray`` of
    it (big-endian, shortest two's complement). Made once a type name: the row-by-row form
    asks for it every row."""
    try:
        t = arrow_type(type_name)  # Spark's decimal spellings are read in one place
    except JobDefinitionError:
        return None
    if not pa.types.is_decimal(t):
        return None
    precision, scale = t.precision, t.scale

    def hasher(v: object, seed: int) -> int:
        try:
            unscaled = decimal.Decimal(v).scaleb(scale) if isinstance(v, decimal.Decimal | int) and not isinstance(v, bool) else None
        except decimal.InvalidOperation:
            unscaled = None
        if unscaled is None or unscaled != unscaled.to_integral_value() or len(str(abs(int(unscaled)))) > precision:
            raise InputDataError(f"{v!r} is not a Spark {type_name} (a Decimal of at most {precision} digits, {scale} after the point)")
        n = int(unscaled)
        if precision <= 18:
            return hash_long(n, seed)
        return hash_bytes(n.to_bytes((~n if n < 0 else n).bit_length() // 8 + 1, "big", signed=True), seed)

    return hasher


def _hash_string_value(v: object, seed: int) -> int:
    if not isinstance(v, str):
        raise InputDataError(f"{v!r} is not a Spark string")
    return hash_string(v, seed)


def _hash_binary_value(v: object, seed: int) -> int:
    if not isinstance(v, bytes | bytearray | memoryview):
        raise InputDataError(f"{v!r} is not a Spark binary (bytes)")
    return hash_bytes(v, seed)


def _hash_boolean_value(v: object, seed: int) -> int:
    # numpy.bool_ is not a bool subclass, hence the duck-typed check on its type name.
    if not isinstance(v, bool) and type(v).__name__ not in ("bool_", "bool"):
        raise InputDataError(f"{v!r} is not a Spark boolean")
    return hash_boolean(bool(v), seed)


_HASHERS: dict[str, Callable[[object, int], int]] = {
    "int": lambda v, seed: hash_int(_as_int(v, "int", _INT_MIN, _INT_MAX), seed),
    "long": lambda v, seed: hash_long(_as_int(v, "long", _LONG_MIN, _LONG_MAX), seed),
    "short": lambda v, seed: hash_int(_as_int(v, "short", -(1 << 15), (1 << 15) - 1), seed),
    "byte": lambda v, seed: hash_int(_as_int(v, "byte", -(1 << 7), (1 << 7) - 1), seed),
    "boolean": _hash_boolean_value,
    "string": _hash_string_value,
    "binary": _hash_binary_value,
    "double": lambda v, seed: hash_double(_as_float(v, "double"), seed),
    "float": lambda v, seed: hash_float(_as_float(v, "float"), seed),
    "date": lambda v, seed: hash_int(_as_days(v), seed),
    "timestamp": lambda v, seed: hash_long(_as_micros(v), seed),
    "timestamp_ntz": lambda v, seed: hash_long(_as_local_micros(v), seed),
}
# Spark's own type names (DataType.simpleString / typeName) for the same types.
_ALIASES = {
    "integer": "int",
    "bigint": "long",
    "smallint": "short",
    "tinyint": "byte",
}
_HASHERS.update({alias: _HASHERS[name] for alias, name in _ALIASES.items()})

#: Every type name :func:`spark_hash` accepts.
TYPE_NAMES: frozenset[str] = frozenset(_HASHERS)


def spark_hash(values: Sequence[object], types: Sequence[str], seed: int = SPARK_HASH_SEED) -> int:
    """Spark's ``hash(col1, col2, ...)`` of one row; ``None`` is SQL null.

    ``types`` names each column's Spark type: int, long, short, byte, boolean, string,
    binary, double, float, date (days since epoch, or a ``datetime.date``), timestamp
    (microseconds since epoch, or an aware ``datetime``), timestamp_ntz (the same, or a
    naive ``datetime``), ``decimal(p,s)`` (a ``decimal.Decimal``), or Spark's aliases
    integer, bigint, smallint, tinyint. Each column's hash seeds the next one.

    >>> spark_hash([1], ["int"]), spark_hash([1, None], ["int", "string"])
    (-559580957, -559580957)
    >>> spark_hash([1, "a"], ["long", "string"]) == hash_string("a", hash_long(1))
    True
    """
    if len(values) != len(types):
        raise KeyscaleError(f"{len(values)} key values but {len(types)} key types")
    h = seed
    for v, t in zip(values, types, strict=True):
        hasher = _HASHERS.get(t) or _decimal_hasher(t)
        if hasher is None:
            raise KeyscaleError(
                f"cannot hash Spark type {t!r}; supported: {', '.join(sorted(TYPE_NAMES))}, decimal(p,s)"
            )
        if v is not None:
            h = hasher(v, h)
    return h


def key_group_of(values: Sequence[object], types: Sequence[str], max_parallelism: int) -> int:
    """The key group of a key: ``pmod(hash(key columns), M)``, as Spark computes it.

    >>> key_group_of([1], ["int"], 128)
    99
    """
    check_parallelism(1, max_parallelism)
    # Python's % already has pmod's sign: the result is in [0, M).
    return spark_hash(values, types) % max_parallelism


def routing_values(parallelism: int) -> list[int]:
    """For each subtask ``i``, the smallest int ``x >= 0`` with ``pmod(hash(x), P) == i``.

    Spark's ``repartition(P, col)`` puts a row on partition ``pmod(hash(col), P)``, so an
    int column holding ``routing_values(P)[i]`` sends the row to partition ``i``. The column
    must be an IntegerType column: a long hashes differently.

    >>> routing_values(4)
    [12, 6, 2, 0]
    """
    return list(_routing_values(parallelism))


@functools.lru_cache(maxsize=64)
def _routing_values(parallelism: int) -> tuple[int, ...]:
    # Cached as a tuple so no caller can change what the next caller gets.
    if not 1 <= parallelism <= UPPER_BOUND_MAX_PARALLELISM:
        raise KeyscaleError(
            f"parallelism {parallelism} must be in 1..{UPPER_BOUND_MAX_PARALLELISM}"
        )
    found = np.full(parallelism, -1, dtype=np.int64)
    # hash_int is a bijection on 32-bit ints, so every residue turns up; about P * ln(P)
    # candidates are needed (coupon collector): hash them a block at a time, in numpy.
    block = max(1024, 4 * parallelism)
    start = 0
    while (found < 0).any():
        if start > _INT_MAX:  # pragma: no cover - impossible for P <= 32768
            raise AssertionError("ran out of int routing values")
        xs = np.arange(start, min(start + block, _INT_MAX + 1), dtype=np.int64)
        residues = _hash_int32(np.full(len(xs), SPARK_HASH_SEED, dtype=np.uint32), xs).view(np.int32).astype(np.int64) % parallelism
        # np.unique's indices are first occurrences: the smallest x of the block per residue.
        seen, first = np.unique(residues, return_index=True)
        new = found[seen] < 0
        found[seen[new]] = xs[first[new]]
        start += block
    return tuple(int(x) for x in found)


# -- the same hash over Arrow columns, in numpy ------------------------------------------------
#
# The Murmur3 steps above on numpy uint32 arrays (wrapping instead of masking), for a whole
# column at once: the State Processor and the test harness hash tables of keys this way.
# tests/state/test_spark_hash.py checks they agree with the per-value functions.


def _hash_int32(h: np.ndarray, v: np.ndarray) -> np.ndarray:
    """``hash_int`` of each of ``v`` (any integer dtype, as Java ints), seeded by ``h``."""
    with np.errstate(over="ignore"):
        return _fmix(_mix_h1(h, _mix_k1(v.astype(np.int32).view(np.uint32))), 4)  # type: ignore[no-any-return]


def _hash_int64(h: np.ndarray, v: np.ndarray) -> np.ndarray:
    """``hash_long`` of each of ``v``: the low word, then the high word."""
    u = v.astype(np.int64).view(np.uint64)
    with np.errstate(over="ignore"):
        h = _mix_h1(h, _mix_k1((u & np.uint64(_MASK)).astype(np.uint32)))
        h = _mix_h1(h, _mix_k1((u >> np.uint64(32)).astype(np.uint32)))
        return _fmix(h, 8)  # type: ignore[no-any-return]


def _hash_bytes_array(h: np.ndarray, arr: Any) -> np.ndarray:
    """``hash_bytes`` of each value of a (large) string or binary Arrow array."""
    n = len(arr)
    large = pa.types.is_large_string(arr.type) or pa.types.is_large_binary(arr.type)
    bufs = arr.buffers()
    offsets = np.frombuffer(bufs[1], dtype=np.int64 if large else np.int32)[arr.offset : arr.offset + n + 1].astype(np.int64)
    data = np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None else np.empty(0, np.uint8)
    starts = offsets[:-1]
    lens = offsets[1:] - starts
    words = lens // 4
    h = h.copy()
    with np.errstate(over="ignore"):
        for j in range(int(words.max()) if n else 0):  # the 4-byte little-endian words
            idx = np.flatnonzero(words > j)
            p = starts[idx] + 4 * j
            word = data[p].astype(np.uint32) | (data[p + 1].astype(np.uint32) << 8) | (data[p + 2].astype(np.uint32) << 16) | (data[p + 3].astype(np.uint32) << 24)
            h[idx] = _mix_h1(h[idx], _mix_k1(word))
        for t in range(3):  # tail bytes, each sign-extended and mixed on its own
            idx = np.flatnonzero(lens % 4 > t)
            p = starts[idx] + 4 * words[idx] + t
            h[idx] = _mix_h1(h[idx], _mix_k1(data[p].view(np.int8).astype(np.int32).view(np.uint32)))
        return _fmix(h, lens.astype(np.uint32))  # type: ignore[no-any-return]


def _float_bits(v: np.ndarray) -> np.ndarray:
    """``floatToIntBits`` of float32s, with ``-0.0`` as ``0.0`` (as :func:`hash_float`)."""
    bits = np.where(v == 0, np.uint32(0), np.where(np.isnan(v), np.uint32(_CANONICAL_NAN_INT_BITS), v.view(np.uint32)))
    return bits.astype(np.uint32).view(np.int32)


def _double_bits(d: np.ndarray) -> np.ndarray:
    """``doubleToLongBits`` of float64s, with ``-0.0`` as ``0.0`` (as :func:`hash_double`)."""
    bits = np.where(d == 0, np.uint64(0), np.where(np.isnan(d), np.uint64(_CANONICAL_NAN_LONG_BITS), d.view(np.uint64)))
    return bits.astype(np.uint64).view(np.int64)


_ARRAY_INTS = ("int", "integer", "short", "smallint", "byte", "tinyint", "date", "boolean")
_ARRAY_LONGS = ("long", "bigint", "timestamp", "timestamp_ntz")
#: The Spark types whose hash :func:`spark_hashes` computes in numpy (others go row by row).
VECTORIZED_TYPES = frozenset({"string", "binary", *_ARRAY_INTS, *_ARRAY_LONGS, "float", "double"})


def _hash_column(h: np.ndarray, col: Any, spark_type: str) -> np.ndarray | None:
    """Spark's hash of one Arrow column seeded by ``h``, nulls not yet skipped (None: the
    type has no numpy form here)."""
    t = col.type
    if spark_type in ("string", "binary") and (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t)):
        return _hash_bytes_array(h, col)
    if spark_type in _ARRAY_INTS:
        if pa.types.is_date32(t) or pa.types.is_boolean(t):
            col = col.cast(pa.int32())
        return _hash_int32(h, np.asarray(col.fill_null(0).to_numpy(zero_copy_only=False)))
    if spark_type in _ARRAY_LONGS:
        if pa.types.is_timestamp(t):
            col = col.cast(_PA.timestamp("us", tz=t.tz)).cast(pa.int64())
        return _hash_int64(h, np.asarray(col.fill_null(0).to_numpy(zero_copy_only=False)))
    if spark_type == "float":
        v = np.asarray(col.cast(pa.float32()).fill_null(0).to_numpy(zero_copy_only=False), dtype=np.float32)
        return _hash_int32(h, _float_bits(v))
    if spark_type == "double":
        d = np.asarray(col.cast(pa.float64()).fill_null(0).to_numpy(zero_copy_only=False), dtype=np.float64)
        return _hash_int64(h, _double_bits(d))
    return None


def spark_hashes(table: pa.Table, key_names: Sequence[str], spark_types: Sequence[str]) -> np.ndarray:
    """:func:`spark_hash` of every row of ``table``'s ``key_names`` columns (an int32 array).

    Vectorized in numpy for the types keys usually have; other types go row by row through
    :func:`spark_hash`. A null leaves the running hash unchanged, as in :func:`spark_hash`.

    >>> t = pa.table({"k": ["a", None], "n": [1, 1]})
    >>> spark_hashes(t, ["k", "n"], ["string", "long"]).tolist() == [spark_hash(["a", 1], ["string", "long"]), hash_long(1)]
    True
    """
    n = table.num_rows
    h = np.full(n, SPARK_HASH_SEED, dtype=np.uint32)
    cols = [table.column(k).combine_chunks() if table.column(k).num_chunks != 1 else table.column(k).chunk(0) for k in key_names]
    for col, st in zip(cols, spark_types, strict=True):
        new = _hash_column(h, col, st)
        if new is None:
            rows = zip(*(c.to_pylist() for c in cols), strict=True)
            return np.fromiter((spark_hash(list(r), list(spark_types)) for r in rows), dtype=np.int32, count=n)
        if col.null_count:
            valid = np.asarray(col.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
            new = np.where(valid, new, h)
        h = new
    return h.view(np.int32)


def key_groups(table: pa.Table, key_names: Sequence[str], spark_types: Sequence[str], max_parallelism: int) -> np.ndarray:
    """``pmod(hash(key columns), M)`` of every row, as Spark computes it (int32 array): the
    numpy form of :func:`key_group_of`.

    ``spark_types`` name each key column's Spark type (``"string"``, ``"long"``, ...): the
    hash depends on it (``hash(1L) != hash(1)``). Vectorized for the types keys usually
    have; others go row by row through :func:`key_group_of`.

    >>> t = pa.table({"k": ["a", "bcdef"], "n": [1, None]})
    >>> key_groups(t, ["k", "n"], ["string", "long"], 128).tolist()
    [81, 26]
    >>> [key_group_of(["a", 1], ["string", "long"], 128), key_group_of(["bcdef", None], ["string", "long"], 128)]
    [81, 26]
    """
    check_parallelism(1, max_parallelism)
    # Python's % on int64 has pmod's sign, as in key_group_of.
    return (spark_hashes(table, key_names, spark_types).astype(np.int64) % max_parallelism).astype(np.int32)


# -- the same rule in Spark SQL ---------------------------------------------------------------


def key_group_sql(key_names: Sequence[str], max_parallelism: int) -> str:
    """The Spark SQL expression of a row's key group (an int): :func:`key_group_of` as Spark
    runs it in the pipeline, over the columns ``key_names`` (quoted as identifiers).

    >>> key_group_sql(["user", "a`b"], 128)
    'cast(pmod(hash(`user`, `a``b`), 128) as int)'
    """
    check_parallelism(1, max_parallelism)
    keys = ", ".join("`" + k.replace("`", "``") + "`" for k in key_names)
    return f"cast(pmod(hash({keys}), {int(max_parallelism)}) as int)"


def route_sql(subtask: str, parallelism: int) -> str:
    """The Spark SQL expression (an int) that makes ``repartition(P, expr)`` put a row on
    partition ``subtask``: the :func:`routing_values` entry of the SQL int expression
    ``subtask`` (in ``0..P-1``).

    >>> route_sql("s", 4)
    'element_at(array(12, 6, 2, 0), s + 1)'
    """
    return f"element_at(array({', '.join(str(x) for x in _routing_values(parallelism))}), {subtask} + 1)"
