"""The savepoint format: its metadata, data file names and order, and reading a savepoint.

A savepoint is a location (a local folder or an object store prefix) holding::

    _metadata.json                              job, batch, operators, states, files, sha256s
    operators/<uid>/kg-<start>-<end>.parquet    keys, key_group, one column per state
    source/spark/...                            Spark's checkpoint up to the savepoint's batch

It is complete exactly when ``_metadata.json`` exists (written last, create-if-absent);
see ``docs/savepoint-format.md``.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from keyscale.checkpoint.savepoint.schema import (
    descriptor_from,
    descriptor_json,
    parse_arrow_type,
    spark_type_name,
)
from keyscale.errors import StateError, StorageError
from keyscale.state.keygroups import KeyGroupRange
from keyscale.state.types import StateDescriptor
from keyscale.storage import Store, open_store

FORMAT = "keyscale-savepoint"
FORMAT_VERSION = 1
METADATA_FILE = "_metadata.json"
#: The key group column of savepoint data files (``__kg`` in checkpoint files).
KEY_GROUP_COLUMN = "key_group"
#: Target rows per data file: consecutive key groups are packed until about this many rows.
DEFAULT_ROWS_PER_FILE = 1_000_000
OPERATORS_DIR = "operators"
SOURCE_DIR = "source/spark"
#: What a savepoint writes before its metadata: an interrupted one leaves only these.
DATA_PREFIXES = (OPERATORS_DIR + "/", "source/")

#: A savepoint's location: a local path, a ``file://`` or object store URI, or a Store.
Location = str | os.PathLike[str] | Store


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
            "states": [descriptor_json(s) for s in self.states],
            "rows": self.rows,
            "bytes": self.bytes,
            "files": [f.to_json() for f in self.files],
            "operator_state": self.operator_state,
        }

    @staticmethod
    def from_json(uid: str, d: dict[str, Any]) -> SavepointOperator:
        states = tuple(
            descriptor_from(str(s["name"]), str(s["kind"]), parse_arrow_type(str(s["type"])), s.get("ttl_seconds"))
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

    path: str  # where the savepoint is, as a user writes it: a local path or a URI
    job: str
    batch: int  # -1: "before the first batch" (a bootstrapped savepoint)
    batch_time_ms: int
    watermark_ms: int | None
    created_ms: int
    origin: str  # "checkpoint" | "bootstrap" | "rekey"
    source: str | None  # relative path of Spark's checkpoint, or None
    operators: dict[str, SavepointOperator]
    store: Store = field(compare=False, repr=False)  # where its files are read from
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




def sha256_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _safe_rel(rel: str, where: str) -> str:
    p = PurePosixPath(rel)
    if not rel or p.is_absolute() or ".." in p.parts or "\\" in rel:
        raise StateError(f"{where}: path {rel!r} is not relative to the savepoint")
    return rel


def open_savepoint(sp: Location, what: str = "savepoint") -> Store:
    """The store of savepoint location ``sp``."""
    return open_store(sp, what)


def read_savepoint(sp: Location, verify: bool = True) -> SavepointInfo:
    """Parse ``sp/_metadata.json`` and check that every data file is there and intact.

    With ``verify`` the sha256 of every data file is checked (a full read); without it only
    that each file exists with its recorded size. Any problem raises :class:`StateError`
    naming the file. ``sp`` is a local path, a ``file://`` or object store URI, or a Store.

    >>> read_savepoint("/nonexistent/sp")
    Traceback (most recent call last):
    ...
    keyscale.errors.StateError: savepoint /nonexistent/sp does not exist
    """
    store = open_savepoint(sp)
    root = store.url()
    meta_path = store.url(METADATA_FILE)
    if store.is_local and store.size("") is not None:
        raise StateError(f"savepoint {root} is not a folder")
    try:
        text = store.get_text(METADATA_FILE)
    except StorageError:
        raise StateError(f"savepoint metadata {meta_path} is damaged (not UTF-8 text)") from None
    if text is None:
        if not store.list_names(""):
            raise StateError(f"savepoint {root} does not exist")
        raise StateError(f"{root} is not a keyscale savepoint: {meta_path} is missing")
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
            source=_safe_rel(str(d["source"]), meta_path) if d.get("source") else None,
            operators={str(uid): SavepointOperator.from_json(str(uid), op) for uid, op in d["operators"].items()},
            store=store,
            extra=dict(d.get("extra") or {}),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise StateError(f"savepoint metadata {meta_path} is missing or has a bad field ({type(e).__name__}: {e})") from None
    if info.source is not None and not store.list(info.source):
        raise StateError(f"savepoint {root}: the source positions folder {store.url(info.source)} is missing")
    for op in info.operators.values():
        for f in op.files:
            where = store.url(_safe_rel(f.path, meta_path))
            data = store.get_or_none(f.path) if verify else None
            size = (None if data is None else len(data)) if verify else store.size(f.path)
            if size is None:
                raise StateError(f"savepoint data file {where} (operator '{op.uid}') is missing")
            if size != f.bytes:
                raise StateError(f"savepoint data file {where} (operator '{op.uid}') is damaged: {size} bytes, the metadata says {f.bytes}")
            if data is not None and sha256_of(data) != f.sha256:
                raise StateError(f"savepoint data file {where} (operator '{op.uid}') is damaged: its sha256 does not match the metadata")
    return info


def read_data_file(info: SavepointInfo, f: SavepointFile, uid: str, columns: Sequence[str] | None = None) -> pa.Table:
    """One data file of ``info`` as a table, read through the savepoint's store."""
    where = info.store.url(f.path)
    try:
        data = info.store.get(f.path)
    except FileNotFoundError:
        raise StateError(f"savepoint data file {where} (operator '{uid}') is missing") from None
    try:
        return pq.read_table(pa.BufferReader(data), columns=list(columns) if columns is not None else None)
    except (pa.ArrowInvalid, OSError) as e:
        raise StateError(f"savepoint data file {where} (operator '{uid}') is unreadable ({e})") from None


# -- data files -------------------------------------------------------------------------------


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
    return f"{OPERATORS_DIR}/{uid}/kg-{rng.start}-{rng.end}.parquet"


def canonical_order(table: pa.Table, key_names: Sequence[str]) -> pa.Table:
    """Sort by key group, then key (the data file order)."""
    if table.num_rows <= 1:
        return table
    return table.sort_by([(KEY_GROUP_COLUMN, "ascending"), *((k, "ascending") for k in key_names)])


