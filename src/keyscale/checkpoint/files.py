"""State files (Arrow IPC, indexed by key group), written and read through the storage seam.

A state file is an Arrow IPC file sorted by key group. Its schema metadata holds the index
``key group -> (first row, row count)`` so a reader that owns part of the file's range takes
only its slice without scanning (memory-mapped, so untouched pages are never read).
"""

from __future__ import annotations

import json
import os
import zlib

import numpy as np
import pyarrow as pa

from keyscale.checkpoint.manifest import FileKind, StateFile
from keyscale.errors import StateError, StorageError
from keyscale.state.keygroups import KeyGroupRange
from keyscale.state.table import KG_COLUMN
from keyscale.storage import LocalStore, Store, open_store
from keyscale.storage.local import local_write_failure

Location = Store | str | os.PathLike[str]  # a job directory: its store, or where it is

_INDEX_KEY = b"keyscale.kg_index"


def kg_index(kgs: np.ndarray, start: int, end: int) -> list[list[int]]:
    """``[[kg, first_row, rows], ...]`` for a key-group-sorted column."""
    if len(kgs) == 0:
        return []
    bounds = np.searchsorted(kgs, np.arange(start, end + 2))
    return [[start + i, int(bounds[i]), int(bounds[i + 1] - bounds[i])] for i in range(end - start + 1) if bounds[i + 1] > bounds[i]]


def write_state_file(job_dir: Location, rel_path: str, table: pa.Table, kind: FileKind, batch: int, rng: KeyGroupRange) -> StateFile:
    """Write a key-group-sorted state table as one object; returns its manifest entry."""
    store = open_store(job_dir, "job directory")
    kgs = table.column(KG_COLUMN).to_numpy()
    index = kg_index(kgs, rng.start, rng.end)
    meta = {
        _INDEX_KEY: json.dumps(index).encode(),
        b"keyscale.kind": kind.encode(),
        b"keyscale.batch": str(batch).encode(),
        b"keyscale.range": f"{rng.start}-{rng.end}".encode(),
    }
    table = table.replace_schema_metadata(meta)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=1 << 20)
    data = sink.getvalue().to_pybytes()
    try:
        store.put(rel_path, data)
    except OSError as e:  # a local job directory this process cannot write (a task: the driver's disk)
        raise StorageError(f"state file: {local_write_failure(store.url(rel_path), e)}") from None
    return StateFile(
        path=rel_path, batch=batch, kind=kind, start=rng.start, end=rng.end,
        rows=table.num_rows, bytes=len(data), crc32=zlib.crc32(data),
    )


def _open_state_file(store: Store, f: StateFile, verify: bool) -> pa.Table:
    """The whole table of ``f``, checked against its manifest entry (size, and crc with ``verify``)."""
    where = store.url(f.path)
    if isinstance(store, LocalStore):  # memory-mapped: pages outside the slice are never read
        path = store.path(f.path)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise StateError(f"state file {where} is missing") from None
        if size != f.bytes:
            raise StateError(f"state file {where} is damaged (size {size}, checkpoint says {f.bytes})")
        if verify and zlib.crc32(path.read_bytes()) != f.crc32:
            raise StateError(f"state file {where} is damaged (checksum mismatch)")
        source: pa.NativeFile = pa.memory_map(str(path))
    else:
        try:
            data = store.get(f.path)
        except FileNotFoundError:
            raise StateError(f"state file {where} is missing") from None
        if len(data) != f.bytes:
            raise StateError(f"state file {where} is damaged (size {len(data)}, checkpoint says {f.bytes})")
        if verify and zlib.crc32(data) != f.crc32:
            raise StateError(f"state file {where} is damaged (checksum mismatch)")
        source = pa.BufferReader(data)
    try:
        with source:
            return pa.ipc.open_file(source).read_all()
    except (pa.ArrowInvalid, OSError) as e:
        raise StateError(f"state file {where} is unreadable ({e})") from None


def read_state_slice(job_dir: Location, f: StateFile, rng: KeyGroupRange, verify: bool = False) -> pa.Table:
    """The rows of key groups ``rng`` in state file ``f`` (zero-copy where possible)."""
    table = _open_state_file(open_store(job_dir, "job directory"), f, verify)
    meta = table.schema.metadata or {}
    index = json.loads(meta.get(_INDEX_KEY, b"[]"))
    lo, hi = max(rng.start, f.start), min(rng.end, f.end)
    rows = [(first, n) for kg, first, n in index if lo <= kg <= hi]
    if not rows:
        return table.slice(0, 0)
    first = rows[0][0]
    last = rows[-1][0] + rows[-1][1]
    return table.slice(first, last - first)


def verify_state_file(job_dir: Location, f: StateFile) -> str | None:
    """None when the file is intact, else a sentence saying what is wrong."""
    data = open_store(job_dir, "job directory").get_or_none(f.path)
    if data is None:
        return f"state file {f.path} is missing"
    if len(data) != f.bytes:
        return f"state file {f.path} has {len(data)} bytes, expected {f.bytes}"
    if zlib.crc32(data) != f.crc32:
        return f"state file {f.path} fails its checksum"
    return None
