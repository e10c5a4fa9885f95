"""Savepoints: self-contained, relocatable, parallelism-independent copies of a job's state.

A savepoint is a folder (the format is documented in ``docs/savepoint-format.md``)::

    SAVEPOINT/
      _metadata.json                        job, batch, operators, states, files, sha256s
      operators/<uid>/kg-<start>-<end>.parquet   keys, key_group, one column per state
      source/spark/                         Spark's checkpoint up to the savepoint's batch

Every path inside is relative, so the folder can be copied or moved anywhere. Data files
hold the state *per key group*, not per subtask, so a savepoint restores at any
parallelism ``1..M`` (``M`` = max parallelism). They are plain Parquet, sorted by key
group then key, with deleted keys left out: any Parquet reader can read them.

The functions here are the library behind ``keyscale savepoint``, ``keyscale run
--from-savepoint`` and ``keyscale inspect``:

- :func:`write_savepoint` turns a committed checkpoint of a job directory into a savepoint;
- :func:`read_savepoint` parses and verifies one (:class:`SavepointInfo`);
- :func:`restore_savepoint` initialises a new job directory from one, matching operators
  by uid and evolving state schemas (added, dropped and widened states);
- :func:`text_progress` is the progress bar the CLI passes as ``progress``.

>>> import tempfile, pyarrow as pa
>>> from pathlib import Path
>>> from keyscale.checkpoint.jobdir import JobDir
>>> from keyscale.checkpoint.manifest import Manifest, OperatorCheckpoint
>>> from keyscale.checkpoint.files import write_state_file
>>> from keyscale.state.keygroups import KeyGroupRange
>>> from keyscale.state.types import StateDescriptor
>>> root = Path(tempfile.mkdtemp())
>>> jd = JobDir(root / "job"); _ = jd.claim("counts", 8, 8)
>>> rows = pa.table({"key": ["a", "b"], "__kg": pa.array([1, 5], pa.int32()), "n": [3, 4]})
>>> f = write_state_file(jd.path, "state/count/000000000000-s00000-snapshot.arrow", rows,
...                      "snapshot", 0, KeyGroupRange(0, 7))
>>> n = StateDescriptor("n", "value", pa.int64())
>>> op = OperatorCheckpoint("count", 8, 1, (("key", "string"),), (n.to_json(),), (f,))
>>> m = Manifest("counts", 0, 0, {"count": op}); jd.commit(m)
>>> (jd.spark_checkpoint / "commits").mkdir(parents=True)  # Spark's, normally
>>> sp = write_savepoint(jd, m, root / "sp")
>>> info = read_savepoint(sp)
>>> info.batch, info.operators["count"].rows
(0, 2)
>>> new = JobDir(root / "job2"); _ = new.claim("counts", 8, 8)
>>> spec = OperatorSpec((("key", pa.string()),), (n,))
>>> restored = restore_savepoint(sp, new, "counts", {"count": spec})
>>> restored.batch, [x.rows for x in restored.operators["count"].files]
(0, [2])
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from keyscale.checkpoint.drain import add_empty_batch, restored_event_time, spark_log_end
from keyscale.checkpoint.files import _INDEX_KEY, verify_state_file, write_state_file
from keyscale.checkpoint.jobdir import JobDir
from keyscale.checkpoint.lineage import restored_lineage
from keyscale.checkpoint.manifest import (
    Manifest,
    OperatorCheckpoint,
    StateFile,
    files_overlapping,
    latest_snapshot_batches,
)
from keyscale.errors import JobDirError, StateError
from keyscale.state.keygroups import KeyGroupRange, mask_runs
from keyscale.state.table import KG_COLUMN, KeyedStateTable
from keyscale.state.types import StateDescriptor
from keyscale.storage import local_path
from keyscale.storage.local import fsync_dir, fsync_file

__all__ = [
    "DEFAULT_ROWS_PER_FILE",
    "FORMAT",
    "FORMAT_VERSION",
    "KEY_GROUP_COLUMN",
    "METADATA_FILE",
    "OperatorSpec",
    "Progress",
    "SavepointFile",
    "SavepointInfo",
    "SavepointOperator",
    "chunk_ranges",
    "evolution_problem",
    "parse_arrow_type",
    "read_savepoint",
    "restore_savepoint",
    "spark_type_name",
    "text_progress",
    "write_savepoint",
]

FORMAT = "keyscale-savepoint"
FORMAT_VERSION = 1
METADATA_FILE = "_metadata.json"
#: The key group column of savepoint data files (``__kg`` in checkpoint files).
KEY_GROUP_COLUMN = "key_group"
#: Target rows per data file: consecutive key groups are packed until about this many rows.
DEFAULT_ROWS_PER_FILE = 1_000_000
SOURCE_DIR = "source/spark"

# pyarrow's stubs type many constructors narrowly; calls through this alias stay Any.
_PA: Any = pa

#: ``progress(phase, done, total)``: called once before the first file and after each file.
Progress = Callable[[str, int, int], None]


# -- types: Arrow type strings and Spark SQL type names ----------------------------------------

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


def _descriptor_json(d: StateDescriptor) -> dict[str, Any]:
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


def _descriptor_from(name: str, kind: str, column_type: pa.DataType, ttl: float | None = None) -> StateDescriptor:
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


def _evolve(arr: Any, dst: pa.DataType) -> Any:
    """``arr`` (a compatible type, see :func:`evolution_problem`) as type ``dst``."""
    if isinstance(arr, pa.ChunkedArray):
        return _PA.chunked_array([_evolve(c, dst) for c in arr.chunks], type=dst)
    src = arr.type
    if src.equals(dst) or (not pa.types.is_nested(src) and not pa.types.is_nested(dst)):
        return arr.cast(dst)
    mask = arr.is_null() if arr.null_count else None
    if pa.types.is_struct(dst):
        children = {f.name: c for f, c in zip(src, arr.flatten(), strict=True)}
        out = [_evolve(children[f.name], f.type) if f.name in children else _PA.nulls(len(arr), f.type) for f in dst]
        return pa.StructArray.from_arrays(out, fields=list(dst), mask=mask)
    if len(arr) == 0:
        return pa.array([], type=dst)
    if pa.types.is_map(dst):
        return _PA.MapArray.from_arrays(arr.offsets, _evolve(arr.keys, dst.key_type), _evolve(arr.items, dst.item_type), type=dst, mask=mask)
    # lists: offsets index the whole child array, even for a slice
    dst_any: Any = dst
    values = _evolve(arr.values, dst_any.value_type)
    return type(arr).from_arrays(arr.offsets, values, type=dst, mask=mask)


# -- the metadata -----------------------------------------------------------------------------


@dataclass(frozen=True)
class SavepointFile:
    """One data file: the live keys of key groups ``start..end`` (path relative to the savepoint)."""

    path: str
    start: int
    end: int
    rows: int
    bytes: int
    sha256: str

    @property
    def range(self) -> KeyGroupRange:
        return KeyGroupRange(self.start, self.end)

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "start": self.start, "end": self.end, "rows": self.rows, "bytes": self.bytes, "sha256": self.sha256}

    @staticmethod
    def from_json(d: dict[str, Any]) -> SavepointFile:
        return SavepointFile(str(d["path"]), int(d["start"]), int(d["end"]), int(d["rows"]), int(d["bytes"]), str(d["sha256"]))


@dataclass(frozen=True)
class SavepointOperator:
    """The keyed state of one operator (by uid) in a savepoint."""

    uid: str
    max_parallelism: int
    parallelism: int | None  # what it ran at (informational; None for a bootstrap)
    key_columns: tuple[tuple[str, pa.DataType], ...]
    states: tuple[StateDescriptor, ...]
    files: tuple[SavepointFile, ...] = ()
    operator_state: dict[str, Any] = field(default_factory=dict)

    @property
    def key_names(self) -> list[str]:
        return [k for k, _ in self.key_columns]

    @property
    def key_spark_types(self) -> list[str]:
        return [spark_type_name(t) for _, t in self.key_columns]

    @property
    def rows(self) -> int:
        return sum(f.rows for f in self.files)

    @property
    def bytes(self) -> int:
        return sum(f.bytes for f in self.files)

    def schema(self) -> pa.Schema:
        """The schema of the operator's data files: keys, ``key_group`` (int32), states."""
        fields = [pa.field(k, t) for k, t in self.key_columns]
        fields.append(pa.field(KEY_GROUP_COLUMN, pa.int32()))
        fields.extend(pa.field(s.name, s.column_type) for s in self.states)
        return pa.schema(fields)

    def to_json(self) -> dict[str, Any]:
        return {
            "max_parallelism": self.max_parallelism,
            "parallelism": self.parallelism,
            "key_columns": [{"name": k, "type": str(t), "spark_type": spark_type_name(t)} for k, t in self.key_columns],
            "states": [_descriptor_json(s) for s in self.states],
            "rows": self.rows,
            "bytes": self.bytes,
            "files": [f.to_json() for f in self.files],
            "operator_state": self.operator_state,
        }

    @staticmethod
    def from_json(uid: str, d: dict[str, Any]) -> SavepointOperator:
        states = tuple(
            _descriptor_from(str(s["name"]), str(s["kind"]), parse_arrow_type(str(s["type"])), s.get("ttl_seconds"))
            for s in d["states"]
        )
        par = d.get("parallelism")
        return SavepointOperator(
            uid=uid,
            max_parallelism=int(d["max_parallelism"]),
            parallelism=int(par) if par is not None else None,
            key_columns=tuple((str(k["name"]), parse_arrow_type(str(k["type"]))) for k in d["key_columns"]),
            states=states,
            files=tuple(SavepointFile.from_json(f) for f in d["files"]),
            operator_state=dict(d.get("operator_state") or {}),
        )


@dataclass(frozen=True)
class SavepointInfo:
    """A parsed (and, by :func:`read_savepoint`, verified) savepoint."""

    path: Path
    job: str
    batch: int  # -1: "before the first batch" (a bootstrapped savepoint)
    batch_time_ms: int
    watermark_ms: int | None
    created_ms: int
    origin: str  # "checkpoint" | "bootstrap" | "rekey"
    source: str | None  # relative path of Spark's checkpoint, or None
    operators: dict[str, SavepointOperator]
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def max_parallelism(self) -> int | None:
        """The max parallelism of the operators (None without keyed operators)."""
        ms = {op.max_parallelism for op in self.operators.values()}
        return max(ms) if ms else None

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "job": self.job,
            "batch": self.batch,
            "batch_time_ms": self.batch_time_ms,
            "watermark_ms": self.watermark_ms,
            "created_ms": self.created_ms,
            "origin": self.origin,
            "source": self.source,
            "operators": {uid: op.to_json() for uid, op in sorted(self.operators.items())},
            "extra": self.extra,
        }


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _safe_rel(rel: str, where: str) -> str:
    p = Path(rel)
    if p.is_absolute() or ".." in p.parts or not rel:
        raise StateError(f"{where}: path {rel!r} is not relative to the savepoint")
    return rel


def read_savepoint(sp: str | os.PathLike[str], verify: bool = True) -> SavepointInfo:
    """Parse ``sp/_metadata.json`` and check that every data file is there and intact.

    With ``verify`` the sha256 of every data file is checked (a full read); without it only
    that each file exists with its recorded size. Any problem raises :class:`StateError`
    naming the file.

    >>> read_savepoint("/nonexistent/sp")
    Traceback (most recent call last):
    ...
    keyscale.errors.StateError: savepoint /nonexistent/sp does not exist
    """
    root = local_path(sp, "savepoint")
    if not root.is_dir():
        raise StateError(f"savepoint {root} does not exist" if not root.exists() else f"savepoint {root} is not a folder")
    meta_path = root / METADATA_FILE
    try:
        text = meta_path.read_text()
    except FileNotFoundError:
        raise StateError(f"{root} is not a keyscale savepoint: {meta_path} is missing") from None
    except UnicodeDecodeError:
        raise StateError(f"savepoint metadata {meta_path} is damaged (not UTF-8 text)") from None
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise StateError(f"savepoint metadata {meta_path} is not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise StateError(f"{meta_path} is not keyscale savepoint metadata (no \"format\": \"{FORMAT}\")")
    if d.get("format_version") != FORMAT_VERSION:
        raise StateError(f"savepoint {root} has format version {d.get('format_version')}; this keyscale reads {FORMAT_VERSION}")
    try:
        info = SavepointInfo(
            path=root,
            job=str(d["job"]),
            batch=int(d["batch"]),
            batch_time_ms=int(d["batch_time_ms"]),
            watermark_ms=int(d["watermark_ms"]) if d.get("watermark_ms") is not None else None,
            created_ms=int(d.get("created_ms", 0)),
            origin=str(d.get("origin", "checkpoint")),
            source=_safe_rel(str(d["source"]), str(meta_path)) if d.get("source") else None,
            operators={str(uid): SavepointOperator.from_json(str(uid), op) for uid, op in d["operators"].items()},
            extra=dict(d.get("extra") or {}),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise StateError(f"savepoint metadata {meta_path} is missing or has a bad field ({type(e).__name__}: {e})") from None
    if info.source is not None and not (root / info.source).is_dir():
        raise StateError(f"savepoint {root}: the source positions folder {root / info.source} is missing")
    for op in info.operators.values():
        for f in op.files:
            path = root / _safe_rel(f.path, str(meta_path))
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                raise StateError(f"savepoint data file {path} (operator '{op.uid}') is missing") from None
            if size != f.bytes:
                raise StateError(f"savepoint data file {path} (operator '{op.uid}') is damaged: {size} bytes, the metadata says {f.bytes}")
            if verify and sha256_file(path) != f.sha256:
                raise StateError(f"savepoint data file {path} (operator '{op.uid}') is damaged: its sha256 does not match the metadata")
    return info


# -- writing ----------------------------------------------------------------------------------


def chunk_ranges(rows_per_kg: np.ndarray, rows_per_file: int) -> list[KeyGroupRange]:
    """Consecutive key groups packed into files of about ``rows_per_file`` rows.

    Key groups without rows start or end no range; a file never splits a key group.

    >>> [str(r) for r in chunk_ranges(np.array([0, 5, 5, 0, 0, 9, 0, 1]), 10)]
    ['1-2', '5-7']
    >>> [str(r) for r in chunk_ranges(np.array([0, 5, 5, 0, 0, 9, 0, 2]), 10)]
    ['1-2', '5-5', '7-7']
    """
    out: list[KeyGroupRange] = []
    start = last = -1
    acc = 0
    for kg in np.flatnonzero(rows_per_kg > 0).tolist():
        n = int(rows_per_kg[kg])
        if start >= 0 and acc + n > rows_per_file:
            out.append(KeyGroupRange(start, last))
            start = -1
        if start < 0:
            start, acc = kg, 0
        acc += n
        last = kg
    if start >= 0:
        out.append(KeyGroupRange(start, last))
    return out


def data_file_name(uid: str, rng: KeyGroupRange) -> str:
    return f"operators/{uid}/kg-{rng.start}-{rng.end}.parquet"


def write_data_file(root: Path, uid: str, rng: KeyGroupRange, table: pa.Table) -> SavepointFile:
    """Write one canonical data file (``table`` already sorted, canonical columns)."""
    rel = data_file_name(uid, rng)
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    fsync_file(path)
    return SavepointFile(rel, rng.start, rng.end, table.num_rows, path.stat().st_size, sha256_file(path))


def canonical_order(table: pa.Table, key_names: Sequence[str]) -> pa.Table:
    """Sort by key group, then key (the data file order)."""
    if table.num_rows <= 1:
        return table
    return table.sort_by([(KEY_GROUP_COLUMN, "ascending"), *((k, "ascending") for k in key_names)])


def _prepare_dest(dest: Path) -> Path:
    if dest.exists():
        if not dest.is_dir():
            raise StateError(f"savepoint destination {dest} exists and is a file")
        if any(dest.iterdir()):
            raise StateError(f"savepoint destination {dest} exists and is not empty; choose a new folder")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def finish_savepoint(tmp: Path, dest: Path, info: SavepointInfo) -> Path:
    """Write the metadata into ``tmp`` and rename it to ``dest`` (the savepoint appears whole)."""
    meta = tmp / METADATA_FILE
    meta.write_text(json.dumps(info.to_json(), indent=1, sort_keys=True))
    fsync_file(meta)
    for d in sorted({p.parent for p in tmp.rglob("*")} | {tmp}):
        fsync_dir(d)
    if dest.exists():  # an empty folder: replaced
        dest.rmdir()
    os.rename(tmp, dest)
    fsync_dir(dest.parent)
    return dest



@contextmanager
def staging(dest: str | os.PathLike[str]) -> Iterator[tuple[Path, Path]]:
    """``(tmp, dest)``: a hidden folder next to ``dest`` that is removed unless renamed.

    Refuses a ``dest`` that exists and is not an empty folder.
    """
    final = local_path(dest, "savepoint destination")
    tmp = _prepare_dest(final)
    try:
        yield tmp, final
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _report(progress: Progress | None, phase: str, done: int, total: int) -> None:
    if progress is not None:
        progress(phase, done, total)


# -- reading a checkpoint ---------------------------------------------------------------------


def _file_schema(job_path: Path, f: StateFile) -> pa.Schema:
    try:
        with pa.memory_map(str(job_path / f.path)) as source:
            return pa.ipc.open_file(source).schema
    except (pa.ArrowInvalid, OSError) as e:
        raise StateError(f"state file {job_path / f.path} is unreadable ({e})") from None


def checkpoint_types(job_path: Path, op: OperatorCheckpoint) -> tuple[tuple[tuple[str, pa.DataType], ...], tuple[StateDescriptor, ...]]:
    """Key columns and state descriptors of a checkpointed operator.

    Types come from the manifest; one it cannot express is taken from the newest state file.
    """
    cache: list[pa.Schema] = []

    def from_files(name: str) -> pa.DataType:
        if not cache:
            cache.extend(_file_schema(job_path, f) for f in sorted(op.files, key=lambda f: -f.batch))
        for schema in cache:
            if name in schema.names:
                found: pa.DataType = schema.field(name).type
                return found
        raise StateError(f"operator '{op.uid}': cannot tell the type of column '{name}' from the checkpoint")

    def typed(name: str, text: str) -> pa.DataType:
        try:
            return parse_arrow_type(text)
        except StateError:
            return from_files(name)

    keys = tuple((k, typed(k, t)) for k, t in op.key_columns)
    states = tuple(
        _descriptor_from(str(s["name"]), str(s["kind"]), typed(str(s["name"]), str(s["type"])), s.get("ttl_seconds"))
        for s in op.states
    )
    return keys, states


def _file_index(job_path: Path, f: StateFile) -> list[list[int]]:
    meta = _file_schema(job_path, f).metadata or {}
    return list(json.loads(meta.get(_INDEX_KEY, b"[]")))


def checkpoint_rows_per_key_group(job_path: Path, op: OperatorCheckpoint) -> np.ndarray:
    """Per key group, the rows its restore chain holds (an upper bound of its live keys)."""
    m = op.max_parallelism
    snap = latest_snapshot_batches(op.files, m)
    rows = np.zeros(m, dtype=np.int64)
    for f in op.files:
        for kg, _, n in _file_index(job_path, f):
            if 0 <= kg < m and f.batch >= snap[kg]:
                rows[kg] += n
    return rows


def restore_key_groups(
    job_path: Path,
    op: OperatorCheckpoint,
    rng: KeyGroupRange,
    key_columns: Sequence[tuple[str, pa.DataType]],
    states: Sequence[StateDescriptor],
) -> pa.Table:
    """The live keys of key groups ``rng`` at the checkpoint, in savepoint form.

    Each key group is rebuilt from its restore chain (its latest snapshot, then the later
    deltas in batch order, as :func:`keyscale.checkpoint.manifest.restore_chain`); columns
    are the keys, ``key_group`` and the states, sorted by key group then key.
    """
    from keyscale.checkpoint.files import read_state_slice

    names = [k for k, _ in key_columns]
    table = KeyedStateTable(names, [t for _, t in key_columns], states)
    files = files_overlapping(op.files, rng)
    snap = latest_snapshot_batches(files, op.max_parallelism)[rng.start : rng.end + 1]
    for f in sorted(files, key=lambda f: f.batch):
        a, b = max(f.start, rng.start), min(f.end, rng.end)
        need = f.batch >= snap[a - rng.start : b - rng.start + 1]
        for ra, rb in mask_runs(need, a):
            table.apply(read_state_slice(job_path, f, KeyGroupRange(ra, rb)))
    out = table.to_arrow(table.rows_in_range(rng.start, rng.end, live_only=True))
    out = out.rename_columns([KEY_GROUP_COLUMN if c == KG_COLUMN else c for c in out.column_names])
    return canonical_order(out, names)


def _copy_spark_checkpoint(src: Path, dst: Path, batch: int) -> None:
    """Copy Spark's checkpoint without its batch log entries after ``batch``."""
    logs = {src / "offsets", src / "commits"}

    def ignore(folder: str, names: list[str]) -> set[str]:
        skip = set()
        in_log = Path(folder) in logs
        for n in names:
            if n.endswith((".tmp", ".tmp.crc")):
                skip.add(n)  # a write in progress
                continue
            num = n[1:-4] if n.startswith(".") and n.endswith(".crc") else n
            if in_log and num.isdigit() and int(num) > batch:
                skip.add(n)
        return skip

    shutil.copytree(src, dst, ignore=ignore)


def write_savepoint(
    job_dir: JobDir,
    manifest: Manifest,
    dest: str | os.PathLike[str],
    progress: Progress | None = None,
    *,
    rows_per_file: int = DEFAULT_ROWS_PER_FILE,
) -> Path:
    """Write a savepoint of the committed checkpoint ``manifest`` of ``job_dir`` to ``dest``.

    The state of every operator is rebuilt key group by key group from the checkpoint's
    files (verified first: a damaged checkpoint gives no savepoint) and written as Parquet,
    about ``rows_per_file`` rows per file, so memory stays bounded by one file's state.
    Spark's checkpoint is copied to ``source/spark`` without batch log entries after
    ``manifest.batch``. Everything is written into a hidden folder next to ``dest`` that is
    renamed at the end: no half-written savepoint ever exists under ``dest``. Returns the
    absolute path of the savepoint. Never call it on a manifest that retention may delete
    meanwhile (the running job takes it between two batches).
    """
    with staging(dest) as (tmp, final):
        plans = []
        for uid, op in sorted(manifest.operators.items()):
            for f in op.files:
                problem = verify_state_file(job_dir.path, f)
                if problem:
                    raise StateError(f"cannot take a savepoint of checkpoint {manifest.batch}: operator '{uid}': {problem}")
            keys, states = checkpoint_types(job_dir.path, op)
            ranges = chunk_ranges(checkpoint_rows_per_key_group(job_dir.path, op), rows_per_file)
            plans.append((uid, op, keys, states, ranges))
        total = sum(len(p[4]) for p in plans) + 1
        done = 0
        _report(progress, "savepoint", done, total)
        ops: dict[str, SavepointOperator] = {}
        for uid, op, keys, states, ranges in plans:
            files = []
            for rng in ranges:
                table = restore_key_groups(job_dir.path, op, rng, keys, states)
                if table.num_rows:
                    files.append(write_data_file(tmp, uid, rng, table))
                done += 1
                _report(progress, "savepoint", done, total)
            ops[uid] = SavepointOperator(uid, op.max_parallelism, op.parallelism, keys, states, tuple(files), dict(op.operator_state))
        source = None
        if job_dir.spark_checkpoint.is_dir():
            # Spark's log up to the last batch the state consumed; a drain's batch becomes an
            # empty committed one, so a restore never skips input (checkpoint/drain.py).
            consumed = spark_log_end(manifest)
            _copy_spark_checkpoint(job_dir.spark_checkpoint, tmp / SOURCE_DIR, consumed)
            if add_empty_batch(tmp / SOURCE_DIR, consumed, manifest.batch):
                source = SOURCE_DIR
            else:
                shutil.rmtree(tmp / SOURCE_DIR)
        info = SavepointInfo(
            path=final, job=manifest.job, batch=manifest.batch, batch_time_ms=manifest.batch_time_ms,
            watermark_ms=manifest.watermark_ms, created_ms=int(time.time() * 1000), origin="checkpoint",
            source=source, operators=ops, extra={"checkpoint": manifest.extra} if manifest.extra else {},
        )
        finish_savepoint(tmp, final, info)
        _report(progress, "savepoint", total, total)
        return final


# -- restoring --------------------------------------------------------------------------------


@dataclass(frozen=True)
class OperatorSpec:
    """What the new job declares for one keyed operator: its key columns and states."""

    key_columns: tuple[tuple[str, pa.DataType], ...]
    states: tuple[StateDescriptor, ...]


def _describe(t: pa.DataType) -> str:
    spark = spark_type_name(t)
    return str(t) if spark == str(t) else f"{spark} ({t})"


def _keys_text(keys: Sequence[tuple[str, pa.DataType]]) -> str:
    return ", ".join(f"{k} {spark_type_name(t)}" for k, t in keys) or "nothing"


def _check_keys(uid: str, op: SavepointOperator, spec: OperatorSpec) -> None:
    have, want = list(op.key_columns), list(spec.key_columns)
    same = len(have) == len(want) and all(a == c and b.equals(d) for (a, b), (c, d) in zip(have, want, strict=True))
    if same:
        return
    detail = ""
    for i in range(max(len(have), len(want))):
        h = have[i] if i < len(have) else None
        w = want[i] if i < len(want) else None
        if h is None or w is None or h[0] != w[0] or not h[1].equals(w[1]):
            hs = f"'{h[0]}' {spark_type_name(h[1])}" if h else "none"
            ws = f"'{w[0]}' {spark_type_name(w[1])}" if w else "none"
            detail = f" (key column {i + 1}: savepoint {hs}, job {ws})"
            break
    raise StateError(
        f"operator '{uid}': the savepoint's state is keyed by [{_keys_text(have)}], the job keys it by "
        f"[{_keys_text(want)}]{detail}; key columns and their types must match, because a key's key group "
        "depends on both (rewrite the state with the State Processor API to change the key)"
    )


def _check_evolution(uid: str, op: SavepointOperator, spec: OperatorSpec) -> None:
    old = {s.name: s for s in op.states}
    for d in spec.states:
        s = old.get(d.name)
        if s is None:
            continue  # a new state: absent for every key
        if s.kind != d.kind:
            raise StateError(
                f"operator '{uid}', state '{d.name}': the savepoint has a {s.kind} state of {_describe(s.column_type)}, "
                f"the job declares a {d.kind} state of {_describe(d.column_type)}; a state cannot change its kind "
                "(rename it to start it empty)"
            )
        problem = evolution_problem(s.column_type, d.column_type)
        if problem:
            raise StateError(
                f"operator '{uid}', state '{d.name}': saved as {_describe(s.column_type)}, the job declares "
                f"{_describe(d.column_type)}: {problem}; allowed changes are numeric widening (int -> long, "
                "float -> double, int/long -> double) and adding or dropping struct fields (rename the state to start it empty)"
            )


def _to_state_table(uid: str, op: SavepointOperator, spec: OperatorSpec, table: pa.Table, f: SavepointFile, where: Path) -> pa.Table:
    """A savepoint data file as a checkpoint snapshot table of the new job's schema."""
    n = table.num_rows
    missing = [c for c in [*op.key_names, KEY_GROUP_COLUMN] if c not in table.column_names]
    if missing:
        raise StateError(f"savepoint data file {where} (operator '{uid}') has no column '{missing[0]}'")
    arrays: list[Any] = [table.column(k).cast(t) for k, t in spec.key_columns]
    names = [k for k, _ in spec.key_columns]
    kgs = table.column(KEY_GROUP_COLUMN).cast(pa.int32())
    arrays.append(kgs)
    names.append(KG_COLUMN)
    saved = {s.name for s in op.states}
    for d in spec.states:
        if d.name in saved and d.name in table.column_names:
            arrays.append(_evolve(table.column(d.name), d.column_type))
        else:
            arrays.append(_PA.nulls(n, d.column_type))
        names.append(d.name)
    out = pa.Table.from_arrays(arrays, names=names)
    if n:
        kg = kgs.to_numpy()
        if int(kg.min()) < f.start or int(kg.max()) > f.end:
            raise StateError(f"savepoint data file {where} (operator '{uid}') has key groups outside its range {f.start}-{f.end}")
        if np.any(np.diff(kg) < 0):
            out = out.sort_by([(KG_COLUMN, "ascending")])
    if spec.states and n:
        alive = np.zeros(n, dtype=bool)
        for d in spec.states:
            alive |= np.asarray(out.column(d.name).is_valid().to_numpy(zero_copy_only=False), dtype=bool)
        if not alive.all():  # keys whose only state was dropped no longer exist
            out = out.filter(pa.array(alive))
    return out


def _read_data_file(path: Path, uid: str) -> pa.Table:
    try:
        return pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise StateError(f"savepoint data file {path} (operator '{uid}') is unreadable ({e})") from None


def restore_savepoint(
    sp: str | os.PathLike[str],
    job_dir: JobDir,
    job_name: str,
    operators: dict[str, OperatorSpec],
    allow_non_restored_state: bool = False,
    progress: Progress | None = None,
) -> Manifest:
    """Initialise the new job directory ``job_dir`` from savepoint ``sp``; returns its manifest.

    ``job_dir`` must be claimed (:meth:`JobDir.claim`) and have no checkpoint yet. Operators
    are matched by uid: state of a savepoint operator the job does not have is refused
    unless ``allow_non_restored_state``; an operator new in the job starts empty (it is not
    in the manifest). Key columns must match. Per state: a state new in the job is absent
    for every key, a dropped state is dropped (keys left without any state disappear), a
    numeric widening is applied (see :func:`evolution_problem`); anything else raises
    :class:`StateError` naming operator, state and both types, before anything is written.

    Each data file becomes one checkpoint snapshot file; Spark's checkpoint is copied from
    ``source/spark``; the manifest is committed at the savepoint's batch, so Spark resumes
    at the next one. A savepoint without source positions (a bootstrapped one) is committed
    as batch -1, "before the first batch": Spark starts its source from scratch at batch 0.
    Each restored operator's parallelism is the one the savepoint recorded (1 if none):
    the caller sets the one to run at.
    """
    if not job_dir.exists():
        raise JobDirError(f"{job_dir.path} is not a keyscale job directory yet; claim it before restoring a savepoint into it")
    if job_dir.manifest_batches() or any(job_dir.checkpoints.glob("manifest-*.json")):
        raise JobDirError(
            f"job directory {job_dir.path} already has checkpoints; a savepoint is restored into a new job directory"
        )
    if job_dir.spark_checkpoint.exists() and any(job_dir.spark_checkpoint.iterdir()):
        raise JobDirError(f"job directory {job_dir.path} already has a Spark checkpoint; restore a savepoint into a new job directory")
    ident = job_dir.identity()
    info = read_savepoint(sp)
    dropped = sorted(set(info.operators) - set(operators))
    if dropped and not allow_non_restored_state:
        more = f" (and {', '.join(repr(u) for u in dropped[1:])})" if len(dropped) > 1 else ""
        raise StateError(
            f"savepoint {info.path} has state of operator '{dropped[0]}'{more}, which the job does not have; "
            "give the operator its old uid, or pass --allow-non-restored-state to start without that state"
        )
    plans = []
    for uid, spec in sorted(operators.items()):
        op = info.operators.get(uid)
        if op is None:
            continue
        if op.max_parallelism != ident.max_parallelism:
            raise StateError(
                f"operator '{uid}': the savepoint's state has max parallelism {op.max_parallelism} (key groups), the job "
                f"directory {job_dir.path} has {ident.max_parallelism}; the number of key groups never changes on restore: "
                f"create the job directory with --max-parallelism {op.max_parallelism}, or re-key the savepoint first "
                f"(keyscale.state_processor.rekey_savepoint(SP, NEW_SP, {ident.max_parallelism}))"
            )
        _check_keys(uid, op, spec)
        _check_evolution(uid, op, spec)
        plans.append((uid, op, spec))
    # Positions in the savepoint (Spark's checkpoint, or a log's offsets as operator state)
    # continue at the next batch; without any the job starts its input from scratch.
    ck_extra = info.extra.get("checkpoint", {})
    has_positions = info.source is not None or bool(ck_extra.get("source_positions"))
    event_time, resumed_ms = restored_event_time(ck_extra)  # a drained one: the watermark before its drain
    batch = info.batch if has_positions else -1
    total = sum(len(op.files) for _, op, _ in plans) + 1
    done = 0
    _report(progress, "restore", done, total)
    written: list[Path] = []
    copied = False
    try:
        ops: dict[str, OperatorCheckpoint] = {}
        for uid, op, spec in plans:
            files: list[StateFile] = []
            for f in op.files:
                where = info.path / f.path
                table = _to_state_table(uid, op, spec, _read_data_file(where, uid), f, where)
                if table.num_rows:
                    # named by batch >= 0 so retention can parse (and in time delete) it
                    rel = f"state/{uid}/{max(batch, 0):012d}-restore-{len(files):05d}-snapshot.arrow"
                    written.append(job_dir.path / rel)
                    files.append(write_state_file(job_dir.path, rel, table, "snapshot", batch, f.range))
                done += 1
                _report(progress, "restore", done, total)
            par = op.parallelism if op.parallelism is not None and 1 <= op.parallelism <= op.max_parallelism else 1
            ops[uid] = OperatorCheckpoint(
                uid=uid, max_parallelism=op.max_parallelism, parallelism=par,
                key_columns=tuple((k, str(t)) for k, t in spec.key_columns),
                states=tuple(d.to_json() for d in spec.states), files=tuple(files),
                operator_state=dict(op.operator_state),
            )
        if info.source is not None:
            copied = True
            shutil.copytree(info.path / info.source, job_dir.spark_checkpoint, dirs_exist_ok=True)
        manifest = Manifest(
            job=job_name, batch=batch, batch_time_ms=info.batch_time_ms, operators=ops,
            watermark_ms=resumed_ms if ck_extra.get("drained") else info.watermark_ms, created_ms=int(time.time() * 1000),
            extra={
                "restored_from": {"savepoint": str(info.path), "job": info.job, "batch": info.batch, "drained": bool(ck_extra.get("drained"))},
                # event time, source positions and the counts of late or dropped records travel with the savepoint
                **event_time,
                **{k: v for k, v in ck_extra.items() if k in ("source_positions", "counters")},
                # a new lineage, descending from the savepoint's at the restored batch
                "lineage": restored_lineage(ck_extra, batch).to_json(),
            },
        )
        job_dir.commit(manifest)
    except BaseException:
        for p in written:
            p.unlink(missing_ok=True)
        if copied:
            shutil.rmtree(job_dir.spark_checkpoint, ignore_errors=True)
        raise
    _report(progress, "restore", total, total)
    return manifest


# -- progress ---------------------------------------------------------------------------------


def text_progress(label: str, stream: TextIO | None = None, delay: float = 0.5) -> Progress:
    """A progress callback that draws on ``stream`` (default stderr).

    On a terminal: one line redrawn in place (``\\r``); otherwise one line per 10%. Nothing
    is shown for work that finishes within ``delay`` seconds. A phase named like the label
    is not repeated (``text_progress("restore")`` shows ``restore 1/4 (25%)``).

    >>> import io
    >>> out = io.StringIO()
    >>> p = text_progress("restore", out, delay=0)
    >>> for i in range(5):
    ...     p("files", i, 4)
    >>> print(out.getvalue().strip())
    restore: files 1/4 (25%)
    restore: files 2/4 (50%)
    restore: files 3/4 (75%)
    restore: files 4/4 (100%)
    """
    out = stream if stream is not None else sys.stderr
    isatty = getattr(out, "isatty", None)
    tty = bool(isatty()) if callable(isatty) else False
    started: dict[str, float] = {}
    shown: dict[str, int] = {}

    def report(phase: str, done: int, total: int) -> None:
        now = time.monotonic()
        if done <= 0 or phase not in started:
            started[phase] = now
            shown[phase] = 0
        if total <= 0 or done <= 0 or (now - started[phase] < delay and done < total):
            return
        if done >= total and shown[phase] == 0 and now - started[phase] < delay:
            return  # finished before anything was shown
        frac = min(done / total, 1.0)
        title = label if phase == label else f"{label}: {phase}"
        if tty:
            width = 30
            fill = int(width * frac)
            out.write(f"\r{title} [{'#' * fill}{'.' * (width - fill)}] {done}/{total} ({frac:.0%})")
            if done >= total:
                out.write("\n")
            shown[phase] = 10
            out.flush()
            return
        decile = int(frac * 10)
        if decile > shown[phase] or (done >= total and shown[phase] < 10):
            shown[phase] = max(decile, 1)
            out.write(f"{title} {done}/{total} ({frac:.0%})\n")
            out.flush()

    return report
