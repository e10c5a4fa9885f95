"""State declarations and the mapping from Spark type names to Arrow types.

State values are declared with Spark SQL type names (``"long"``, ``"string"``,
``"array<double>"``, ``"map<string,long>"``, ``"struct<a:int,b:string>"``) or with a
:class:`pyarrow.DataType`. The Arrow type is what the checkpoint stores, so it is part of
the state's schema.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import pyarrow as pa

from keyscale.errors import JobDefinitionError

StateKind = Literal["value", "list", "map"]

_PRIMITIVES: dict[str, pa.DataType] = {
    "long": pa.int64(),
    "bigint": pa.int64(),
    "int": pa.int32(),
    "integer": pa.int32(),
    "short": pa.int16(),
    "smallint": pa.int16(),
    "byte": pa.int8(),
    "tinyint": pa.int8(),
    "double": pa.float64(),
    "float": pa.float32(),
    "boolean": pa.bool_(),
    "bool": pa.bool_(),
    "string": pa.string(),
    "binary": pa.binary(),
    "date": pa.date32(),
    "timestamp": pa.timestamp("us", tz="UTC"),
    "timestamp_ltz": pa.timestamp("us", tz="UTC"),
    "timestamp_ntz": pa.timestamp("us"),
    "real": pa.float32(),
}

TypeLike = str | pa.DataType

# Spark's decimal names: ``decimal``, ``decimal(p)``, ``decimal(p,s)`` (also ``dec``, ``numeric``).
_DECIMAL = re.compile(r"(?:decimal|dec|numeric)\s*(?:\(\s*(?P<precision>\d+)\s*(?:,\s*(?P<scale>\d+)\s*)?\))?")


def _split_top(text: str, sep: str) -> list[str]:
    """Split on ``sep`` where it is not nested in ``<...>`` or ``(...)`` (``decimal(12,3)``)."""
    parts: list[str] = []
    depth = 0
    start = 0
    for i, ch in enumerate(text):
        if ch in "<(":
            depth += 1
        elif ch in ">)":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts]


def arrow_type(spec: TypeLike) -> pa.DataType:
    """Arrow type for a Spark SQL type name (or an Arrow type, returned as is).

    >>> arrow_type("map<string,array<long>>")
    MapType(map<string, list<item: int64>>)
    """
    if isinstance(spec, pa.DataType):
        return spec
    text = spec.strip()
    low = text.lower()
    if low in _PRIMITIVES:
        return _PRIMITIVES[low]
    dec = _DECIMAL.fullmatch(low)
    if dec is not None:
        precision, scale = int(dec["precision"] or 10), int(dec["scale"] or 0)
        if scale <= precision <= 38:
            return pa.decimal128(precision, scale)
    if low.startswith("array<") and low.endswith(">"):
        return pa.list_(arrow_type(text[6:-1]))
    if low.startswith("map<") and low.endswith(">"):
        parts = _split_top(text[4:-1], ",")
        if len(parts) == 2:
            return pa.map_(arrow_type(parts[0]), arrow_type(parts[1]))
    if low.startswith("struct<") and low.endswith(">"):
        fields = []
        for part in _split_top(text[7:-1], ","):
            name, _, ftype = part.partition(":")
            if not ftype:
                name, _, ftype = part.partition(" ")
            fields.append(pa.field(name.strip(), arrow_type(ftype)))
        return pa.struct(fields)
    raise JobDefinitionError(f"unknown type {spec!r}: use a Spark SQL type name such as 'long', 'string', 'array<double>'")


def arrow_schema(ddl: str | pa.Schema) -> pa.Schema:
    """Arrow schema for a Spark DDL column list such as ``"key string, count long"``.

    >>> arrow_schema("key string, n long").names
    ['key', 'n']
    """
    if isinstance(ddl, pa.Schema):
        return ddl
    fields = []
    for part in _split_top(ddl, ","):
        if not part:
            continue
        name, _, ftype = part.strip().partition(" ")
        if not ftype.strip():
            raise JobDefinitionError(f"column {name!r} in schema {ddl!r} has no type")
        fields.append(pa.field(name.strip("`"), arrow_type(ftype)))
    return pa.schema(fields)


def is_numeric(t: pa.DataType) -> bool:
    """True for types stored as numpy arrays with a validity mask (ints, floats, bools)."""
    return bool(pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t))


@dataclass(frozen=True)
class StateDescriptor:
    """A named piece of keyed state: its kind and the Arrow type of what it stores.

    The stored column type is the value type for ``value`` state, ``list<element>`` for
    ``list`` state and ``map<key, value>`` for ``map`` state.
    """

    name: str
    kind: StateKind
    value_type: pa.DataType
    map_key_type: pa.DataType | None = None
    ttl_seconds: float | None = None
    #: When the TTL clock restarts: "on_write" (Flink's OnCreateAndWrite) or "on_read_and_write".
    ttl_refresh: str = "on_write"

    @property
    def column_type(self) -> pa.DataType:
        if self.kind == "value":
            return self.value_type
        if self.kind == "list":
            return pa.list_(self.value_type)
        assert self.map_key_type is not None
        return pa.map_(self.map_key_type, self.value_type)

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {"name": self.name, "kind": self.kind, "type": str(self.column_type)}
        if self.ttl_seconds is not None:
            out["ttl_seconds"] = self.ttl_seconds
            out["ttl_refresh"] = self.ttl_refresh
        return out
