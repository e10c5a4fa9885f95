"""Savepoint schemas: Arrow type strings, Spark SQL type names, state descriptors in the
metadata, and the schema evolution rules a restore applies."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from keyscale.errors import StateError
from keyscale.state.types import StateDescriptor

# pyarrow's stubs type many constructors narrowly; calls through this alias stay Any.
_PA: Any = pa


_ARROW_PRIMITIVES: dict[str, pa.DataType] = {
    "null": pa.null(),
    "bool": pa.bool_(),
    "int8": pa.int8(),
    "int16": pa.int16(),
    "int32": pa.int32(),
    "int64": pa.int64(),
    "uint8": pa.uint8(),
    "uint16": pa.uint16(),
    "uint32": pa.uint32(),
    "uint64": pa.uint64(),
    "halffloat": pa.float16(),
    "float": pa.float32(),
    "double": pa.float64(),
    "string": pa.string(),
    "large_string": pa.large_string(),
    "binary": pa.binary(),
    "large_binary": pa.large_binary(),
    "date32[day]": pa.date32(),
    "date64[ms]": pa.date64(),
}


def _split_args(text: str) -> list[str]:
    """Split on commas that are not nested in ``<>``, ``()`` or ``[]``."""
    parts: list[str] = []
    depth = 0
    start = 0
    for i, ch in enumerate(text):
        if ch in "<([":
            depth += 1
        elif ch in ">)]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    parts.append(text[start:].strip())
    return [p for p in parts if p]


def parse_arrow_type(text: str) -> pa.DataType:
    """The Arrow type whose ``str()`` is ``text`` (the form checkpoints and savepoints store).

    >>> parse_arrow_type("map<string, list<item: int64>>")
    MapType(map<string, list<item: int64>>)
    >>> parse_arrow_type("struct<a: int32, b: timestamp[us, tz=UTC]>")
    StructType(struct<a: int32, b: timestamp[us, tz=UTC]>)
    """
    s = text.strip()
    if s in _ARROW_PRIMITIVES:
        return _ARROW_PRIMITIVES[s]
    try:
        if s.startswith(("timestamp[", "duration[", "time32[", "time64[")) and s.endswith("]"):
            kind, _, inner = s[:-1].partition("[")
            unit, _, tz = inner.partition(",")
            unit = unit.strip()
            if kind == "timestamp":
                tz = tz.strip()
                ts: pa.DataType = _PA.timestamp(unit, tz=tz[3:] if tz.startswith("tz=") else None)
                return ts
            other: pa.DataType = getattr(_PA, kind)(unit)
            return other
        if s.startswith(("decimal128(", "decimal256(")) and s.endswith(")"):
            p, sc = (int(x) for x in s[s.index("(") + 1 : -1].split(","))
            return pa.decimal128(p, sc) if s.startswith("decimal128") else pa.decimal256(p, sc)
        for prefix, make_list in (("list<", pa.list_), ("large_list<", pa.large_list)):
            if s.startswith(prefix) and s.endswith(">"):
                name, _, inner = s[len(prefix) : -1].partition(": ")
                return make_list(pa.field(name.strip(), parse_arrow_type(inner)))
        if s.startswith("map<") and s.endswith(">"):
            args = _split_args(s[4:-1])
            keys_sorted = len(args) == 3 and args[2] == "keys_sorted"
            mt: pa.DataType = _PA.map_(parse_arrow_type(args[0]), parse_arrow_type(args[1]), keys_sorted)
            return mt
        if s.startswith("struct<") and s.endswith(">"):
            fields = []
            for part in _split_args(s[7:-1]):
                name, _, inner = part.partition(": ")
                fields.append(pa.field(name, parse_arrow_type(inner)))
            return pa.struct(fields)
    except (ValueError, KeyError, TypeError, pa.ArrowInvalid) as e:
        raise StateError(f"cannot read the Arrow type {text!r} ({e})") from None
    raise StateError(f"cannot read the Arrow type {text!r}")


def spark_type_name(t: pa.DataType) -> str:
    """The Spark SQL type name of an Arrow type (what ``hash()`` and DDL strings use).

    >>> spark_type_name(pa.map_(pa.string(), pa.list_(pa.int64())))
    'map<string,array<long>>'
    >>> spark_type_name(pa.struct([("a", pa.int32()), ("b", pa.float64())]))
    'struct<a:int,b:double>'
    """
    simple = {
        pa.int8(): "byte", pa.int16(): "short", pa.int32(): "int", pa.int64(): "long",
        pa.float32(): "float", pa.float64(): "double", pa.bool_(): "boolean",
        pa.string(): "string", pa.large_string(): "string", pa.binary(): "binary",
        pa.large_binary(): "binary", pa.date32(): "date", pa.null(): "void",
    }
    if t in simple:
        return simple[t]
    if pa.types.is_timestamp(t):
        return "timestamp" if t.tz else "timestamp_ntz"
    if pa.types.is_decimal(t):
        return f"decimal({t.precision},{t.scale})"
    if pa.types.is_map(t):
        return f"map<{spark_type_name(t.key_type)},{spark_type_name(t.item_type)}>"
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return f"array<{spark_type_name(t.value_type)}>"
    if pa.types.is_struct(t):
        return "struct<" + ",".join(f"{f.name}:{spark_type_name(f.type)}" for f in t) + ">"
    return str(t)


def descriptor_json(d: StateDescriptor) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": d.name,
        "kind": d.kind,
        "type": str(d.column_type),
        "spark_type": spark_type_name(d.column_type),
        "value_type": spark_type_name(d.value_type),
        "map_key_type": spark_type_name(d.map_key_type) if d.map_key_type is not None else None,
    }
    if d.ttl_seconds is not None:
        out["ttl_seconds"] = d.ttl_seconds
    return out


def descriptor_from(name: str, kind: str, column_type: pa.DataType, ttl: float | None = None) -> StateDescriptor:
    if kind == "value":
        return StateDescriptor(name, "value", column_type, None, ttl)
    if kind == "list" and (pa.types.is_list(column_type) or pa.types.is_large_list(column_type)):
        return StateDescriptor(name, "list", column_type.value_type, None, ttl)
    if kind == "map" and pa.types.is_map(column_type):
        return StateDescriptor(name, "map", column_type.item_type, column_type.key_type, ttl)
    raise StateError(f"state '{name}': kind {kind!r} does not fit its type {column_type}")


# -- schema evolution -------------------------------------------------------------------------


def _int_fits(src: pa.DataType, dst: pa.DataType) -> bool:
    s_signed, d_signed = pa.types.is_signed_integer(src), pa.types.is_signed_integer(dst)
    if s_signed == d_signed:
        return bool(src.bit_width <= dst.bit_width)
    return not s_signed and d_signed and src.bit_width < dst.bit_width


def evolution_problem(src: pa.DataType, dst: pa.DataType, where: str = "") -> str | None:
    """None when state stored as ``src`` can be read as ``dst``, else why not.

    Allowed: the same type; a numeric widening (int8 -> int16 -> int32 -> int64, any int ->
    double, int8/int16 -> float, float -> double); inside lists, map values and structs the
    same rules, where a struct may also gain fields (absent: null) and lose fields.

    >>> evolution_problem(pa.int32(), pa.int64()) is None
    True
    >>> evolution_problem(pa.string(), pa.int64())
    'string cannot become int64'
    >>> evolution_problem(pa.struct([("a", pa.int32())]), pa.struct([("a", pa.string())]))
    "field 'a': int32 cannot become string"
    """
    if src.equals(dst):
        return None
    if pa.types.is_integer(src) and pa.types.is_integer(dst) and _int_fits(src, dst):
        return None
    # A float holds every integer of up to its mantissa's width exactly.
    if pa.types.is_integer(src) and pa.types.is_floating(dst) and (
        dst == pa.float64() or (dst == pa.float32() and src.bit_width <= 16) or (dst == pa.float16() and src.bit_width <= 8)
    ):
        return None
    if pa.types.is_floating(src) and pa.types.is_floating(dst) and src.bit_width <= dst.bit_width:
        return None
    lists = (pa.types.is_list, pa.types.is_large_list)
    if any(f(src) for f in lists) and any(f(dst) for f in lists):
        s_any: Any = src
        d_any: Any = dst
        return evolution_problem(s_any.value_type, d_any.value_type, where or "element: ")
    if pa.types.is_map(src) and pa.types.is_map(dst):
        return evolution_problem(src.key_type, dst.key_type, f"{where}map key: ") or evolution_problem(
            src.item_type, dst.item_type, f"{where}map value: "
        )
    if pa.types.is_struct(src) and pa.types.is_struct(dst):
        old = {f.name: f.type for f in src}
        for f in dst:
            if f.name in old:
                problem = evolution_problem(old[f.name], f.type, f"field '{f.name}': ")
                if problem:
                    return problem
        return None
    return f"{where}{src} cannot become {dst}"


def evolve(arr: Any, dst: pa.DataType) -> Any:
    """``arr`` (a compatible type, see :func:`evolution_problem`) as type ``dst``."""
    if isinstance(arr, pa.ChunkedArray):
        return _PA.chunked_array([evolve(c, dst) for c in arr.chunks], type=dst)
    src = arr.type
    if src.equals(dst) or (not pa.types.is_nested(src) and not pa.types.is_nested(dst)):
        return arr.cast(dst)
    mask = arr.is_null() if arr.null_count else None
    if pa.types.is_struct(dst):
        children = {f.name: c for f, c in zip(src, arr.flatten(), strict=True)}
        out = [evolve(children[f.name], f.type) if f.name in children else _PA.nulls(len(arr), f.type) for f in dst]
        return pa.StructArray.from_arrays(out, fields=list(dst), mask=mask)
    if len(arr) == 0:
        return pa.array([], type=dst)
    if pa.types.is_map(dst):
        return _PA.MapArray.from_arrays(arr.offsets, evolve(arr.keys, dst.key_type), evolve(arr.items, dst.item_type), type=dst, mask=mask)
    # lists: offsets index the whole child array, even for a slice
    dst_any: Any = dst
    values = evolve(arr.values, dst_any.value_type)
    return type(arr).from_arrays(arr.offsets, values, type=dst, mask=mask)

