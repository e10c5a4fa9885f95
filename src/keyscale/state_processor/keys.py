"""A key as a user gives it, parsed as an operator's key types: the values behind
``keyscale state get``, ``JobHandle.state``, ``GET /state/<uid>?key=...``, a patch's keys
and the ``keyscale`` data source's key filters.

A key is a value (one key column), a tuple or list (one value a column), or text (a
command line, a URL): for one key column the text itself parsed as the column's type, for
several a JSON array. Each value comes out as a value of the column's Arrow type that both
the key-group hash (:mod:`keyscale.state.spark_hash`) and an Arrow comparison take.
"""

from __future__ import annotations

import datetime as dt
import decimal
import json
from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from keyscale.checkpoint.savepoint.schema import spark_type_name
from keyscale.errors import InputDataError

__all__ = ["parse_key"]


def _coerce(value: Any, t: pa.DataType) -> Any:
    """``value`` (a Python value, or text from a command line or a URL) as a value of Arrow
    type ``t`` that both the key-group hash and an Arrow comparison take."""
    text = value if isinstance(value, str) else None
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        if text is None:
            raise ValueError("not a string")
        return text
    if value is None:
        return None
    if pa.types.is_boolean(t):
        if isinstance(value, bool):
            return value
        if text is not None and text.strip().lower() in ("true", "false"):
            return text.strip().lower() == "true"
        raise ValueError("not true or false")
    if pa.types.is_integer(t):
        if isinstance(value, bool | float):
            raise ValueError("not an integer")
        return int(text.strip(), 10) if text is not None else int(value)
    if pa.types.is_floating(t):
        return float(value)
    if pa.types.is_date(t):
        if isinstance(value, dt.date) and not isinstance(value, dt.datetime):
            return value
        if text is not None:
            return dt.date.fromisoformat(text.strip())
        return dt.date(1970, 1, 1) + dt.timedelta(days=int(value))
    if pa.types.is_timestamp(t):
        zone = dt.UTC if t.tz is not None else None  # a wall-clock time (timestamp_ntz): naive
        if isinstance(value, dt.datetime):
            stamp = value
        elif text is not None and not text.strip().lstrip("-").isdigit():
            stamp = dt.datetime.fromisoformat(text.strip())
        else:  # microseconds since the epoch
            return dt.datetime(1970, 1, 1, tzinfo=zone) + dt.timedelta(microseconds=int(value))
        if zone is None:
            if stamp.utcoffset() is not None:
                raise ValueError("a time zone given for a timestamp_ntz")
            return stamp
        return stamp if stamp.utcoffset() is not None else stamp.replace(tzinfo=dt.UTC)
    if pa.types.is_decimal(t):
        if isinstance(value, bool | float):
            raise ValueError("not a decimal (give it as text or a Decimal, not a float)")
        try:
            number = decimal.Decimal(text.strip() if text is not None else value)
            exact = number.quantize(decimal.Decimal(1).scaleb(-t.scale))
        except decimal.InvalidOperation:  # not a number, or past the context's precision
            exact = None
        if exact is None or exact != number or len(exact.as_tuple().digits) > t.precision:
            raise ValueError(f"not a number of at most {t.precision} digits, {t.scale} after the point")
        return exact
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        if isinstance(value, bytes | bytearray | memoryview):
            return bytes(value)
        if text is not None:
            return text.encode()
        raise ValueError("not bytes")
    raise ValueError(f"keys of type {t} cannot be looked up")


def parse_key(key: Any, columns: Sequence[tuple[str, pa.DataType]], uid: str) -> tuple[Any, ...]:
    """The values of a key of operator ``uid`` keyed by ``columns``, from what a caller gave:
    a value (one key column), a tuple or list (one per column), or text (a command line, a
    URL): for one key column the text itself parsed as the column's type (``42``,
    ``2024-05-01``, ``true``, ``1.25`` for a decimal; a timestamp as ISO 8601, UTC unless it
    says otherwise, a ``timestamp_ntz`` with no zone, or microseconds since the epoch), for
    several a JSON array (``'["ann", 3]'``). A key that
    is none of these is an :class:`~keyscale.errors.InputDataError` naming the operator and
    the key.

    >>> parse_key("42", [("id", pa.int64())], "totals")
    (42,)
    >>> parse_key('["ann", 3]', [("user", pa.string()), ("shard", pa.int32())], "totals")
    ('ann', 3)
    >>> parse_key("4x", [("id", pa.int64())], "totals")
    Traceback (most recent call last):
    ...
    keyscale.errors.InputDataError: operator 'totals': key '4x' is not a long (key column 'id': invalid literal for int() with base 10: '4x')
    """
    parts: Sequence[Any]
    if len(columns) == 1:
        parts = [key[0] if isinstance(key, tuple | list) and len(key) == 1 else key]
    elif isinstance(key, tuple | list):
        parts = key
    else:
        try:
            parts = json.loads(key) if isinstance(key, str) else None  # type: ignore[assignment]
        except ValueError:
            parts = None  # type: ignore[assignment]
        if not isinstance(parts, list):
            names = ", ".join(n for n, _ in columns)
            raise InputDataError(f"operator '{uid}': key {key!r} must give {len(columns)} values, one per key column ({names}), "
                                 "as a JSON array such as '[\"ann\", 3]'")
    if len(parts) != len(columns):
        names = ", ".join(n for n, _ in columns)
        raise InputDataError(f"operator '{uid}': key {key!r} has {len(parts)} values; the operator is keyed by {len(columns)} ({names})")
    out = []
    for v, (name, t) in zip(parts, columns, strict=True):
        try:
            out.append(_coerce(v, t))
        except (ValueError, TypeError, OverflowError) as e:
            raise InputDataError(f"operator '{uid}': key {key!r} is not a {spark_type_name(t)} (key column '{name}': {e})") from None
    return tuple(out)
