"""Spark SQL's ``hash()`` in pure Python, bit for bit.

Key groups are ``pmod(hash(key columns), M)``, computed by Spark in the pipeline. The driver
and tests need the same number without a JVM, so this module re-implements Spark's
``Murmur3Hash`` expression (``Murmur3_x86_32``, seed 42) exactly, quirks included:

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
"""

from __future__ import annotations

import datetime as _dt
import functools
import math
import numbers
import operator
import struct
from collections.abc import Callable, Sequence
from typing import SupportsIndex

from keyscale.errors import InputDataError, KeyscaleError
from keyscale.state.keygroups import UPPER_BOUND_MAX_PARALLELISM, check_parallelism

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
    "routing_values",
    "spark_hash",
]

#: The seed of Spark SQL's ``hash()`` and of ``HashPartitioning``.
SPARK_HASH_SEED = 42

_MASK = 0xFFFFFFFF
_C1 = 0xCC9E2D51
_C2 = 0x1B873593
_INT_MIN, _INT_MAX = -(1 << 31), (1 << 31) - 1
_LONG_MIN, _LONG_MAX = -(1 << 63), (1 << 63) - 1
_CANONICAL_NAN_INT_BITS = 0x7FC00000  # Float.floatToIntBits(Float.NaN)
_CANONICAL_NAN_LONG_BITS = 0x7FF8000000000000  # Double.doubleToLongBits(Double.NaN)


# The helpers below work on unsigned 32-bit values (Java's int, reinterpreted), masking after
# every multiply/add because Python ints never overflow.


def _mix_k1(k1: int) -> int:
    k1 = (k1 * _C1) & _MASK
    k1 = ((k1 << 15) | (k1 >> 17)) & _MASK
    return (k1 * _C2) & _MASK


def _mix_h1(h1: int, k1: int) -> int:
    h1 ^= k1
    h1 = ((h1 << 13) | (h1 >> 19)) & _MASK
    return (h1 * 5 + 0xE6546B64) & _MASK


def _fmix(h1: int, length: int) -> int:
    h1 ^= length
    h1 ^= h1 >> 16
    h1 = (h1 * 0x85EBCA6B) & _MASK
    h1 ^= h1 >> 13
    h1 = (h1 * 0xC2B2AE35) & _MASK
    h1 ^= h1 >> 16
    return h1


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
}
# Spark's own type names (DataType.simpleString / typeName) for the same types.
_ALIASES = {
    "integer": "int",
    "bigint": "long",
    "smallint": "short",
    "tinyint": "byte",
    "timestamp_ntz": "timestamp",
}
_HASHERS.update({alias: _HASHERS[name] for alias, name in _ALIASES.items()})

#: Every type name :func:`spark_hash` accepts.
TYPE_NAMES: frozenset[str] = frozenset(_HASHERS)


def spark_hash(values: Sequence[object], types: Sequence[str], seed: int = SPARK_HASH_SEED) -> int:
    """Spark's ``hash(col1, col2, ...)`` of one row; ``None`` is SQL null.

    ``types`` names each column's Spark type: int, long, short, byte, boolean, string,
    binary, double, float, date (days since epoch, or a ``datetime.date``), timestamp
    (microseconds since epoch, or an aware ``datetime``), or Spark's aliases integer,
    bigint, smallint, tinyint, timestamp_ntz. Each column's hash seeds the next one.

    >>> spark_hash([1], ["int"]), spark_hash([1, None], ["int", "string"])
    (-559580957, -559580957)
    >>> spark_hash([1, "a"], ["long", "string"]) == hash_string("a", hash_long(1))
    True
    """
    if len(values) != len(types):
        raise KeyscaleError(f"{len(values)} key values but {len(types)} key types")
    h = seed
    for v, t in zip(values, types, strict=True):
        hasher = _HASHERS.get(t)
        if hasher is None:
            raise KeyscaleError(
                f"cannot hash Spark type {t!r}; supported: {', '.join(sorted(TYPE_NAMES))}"
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
    found: list[int | None] = [None] * parallelism
    missing = parallelism
    x = 0
    # hash_int is a bijection on 32-bit ints, so every residue turns up; about P * ln(P)
    # candidates are needed (coupon collector), so the loop inlines the hash for speed.
    c1, c2, mask, seed = _C1, _C2, _MASK, SPARK_HASH_SEED
    while missing:
        if x > _INT_MAX:  # pragma: no cover - impossible for P <= 32768
            raise AssertionError("ran out of int routing values")
        k1 = (x * c1) & mask
        k1 = (((k1 << 15) | (k1 >> 17)) * c2) & mask
        h1 = seed ^ k1
        h1 = ((((h1 << 13) | (h1 >> 19)) & mask) * 5 + 0xE6546B64) & mask
        h1 ^= 4
        h1 ^= h1 >> 16
        h1 = (h1 * 0x85EBCA6B) & mask
        h1 ^= h1 >> 13
        h1 = (h1 * 0xC2B2AE35) & mask
        h1 ^= h1 >> 16
        i = (h1 - (1 << 32) if h1 & 0x80000000 else h1) % parallelism
        if found[i] is None:
            found[i] = x
            missing -= 1
        x += 1
    return tuple(v for v in found if v is not None)
