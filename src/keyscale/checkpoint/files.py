"""Durable files: atomic writes by rename, and state files (Arrow IPC, indexed by key group).

A state file is an Arrow IPC file sorted by key group. Its schema metadata holds the index
``key group -> (first row, row count)`` so a reader that owns part of the file's range takes
only its slice without scanning (memory-mapped, so untouched pages are never read).
"""

from __future__ import annotations

import fcntl
import json
import os
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from keyscale.checkpoint.manifest import FileKind, StateFile
from keyscale.errors import KeyscaleError, StateError
from keyscale.state.keygroups import KeyGroupRange
from keyscale.state.table import KG_COLUMN

_INDEX_KEY = b"keyscale.kg_index"


def fsync_file(path: Path) -> None:
    """Make a file's written bytes durable (it was written and closed elsewhere, e.g. by Spark)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes, durable: bool = True) -> None:
    """Write ``path`` so that readers see the old file or the whole new one, never a part."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


def atomic_write_text(path: Path, text: str, durable: bool = True) -> None:
    atomic_write_bytes(path, text.encode(), durable)


def atomic_write_json(path: Path, obj: object, durable: bool = True) -> None:
    atomic_write_text(path, json.dumps(obj, indent=1, sort_keys=True), durable)


def report_path(job_dir: Path, uid: str, batch: int, subtask: int) -> Path:
    """Where subtask ``subtask`` of operator ``uid`` reports on ``batch`` (a small JSON sidecar)."""
    return job_dir / "state" / uid / f"{batch:012d}-s{subtask:05d}.json"


def write_report(job_dir: Path, uid: str, batch: int, subtask: int, report: dict[str, Any]) -> None:
    path = report_path(job_dir, uid, batch, subtask)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, report, durable=False)


def read_reports(job_dir: Path, uid: str, batch: int, parallelism: int) -> list[dict[str, Any]]:
    """The report of every subtask of an operator for a batch (a missing one is an error)."""
    out = []
    for s in range(parallelism):
        try:
            out.append(json.loads(report_path(job_dir, uid, batch, s).read_text()))
        except FileNotFoundError:
            raise KeyscaleError(f"subtask {s} of operator '{uid}' did not report for batch {batch}") from None
    return out


def is_locked(path: Path) -> bool:
    """True while some process holds an exclusive ``flock`` on ``path`` (it dies with its holder)."""
    if not path.exists():
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def file_crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def kg_index(kgs: np.ndarray, start: int, end: int) -> list[list[int]]:
    """``[[kg, first_row, rows], ...]`` for a key-group-sorted column."""
    if len(kgs) == 0:
        return []
    bounds = np.searchsorted(kgs, np.arange(start, end + 2))
    return [[start + i, int(bounds[i]), int(bounds[i + 1] - bounds[i])] for i in range(end - start + 1) if bounds[i + 1] > bounds[i]]


def write_state_file(job_dir: Path, rel_path: str, table: pa.Table, kind: FileKind, batch: int, rng: KeyGroupRange) -> StateFile:
    """Write a key-group-sorted state table, atomically; returns its manifest entry."""
    kgs = table.column(KG_COLUMN).to_numpy()
    index = kg_index(kgs, rng.start, rng.end)
    meta = {
        _INDEX_KEY: json.dumps(index).encode(),
        b"keyscale.kind": kind.encode(),
        b"keyscale.batch": str(batch).encode(),
        b"keyscale.range": f"{rng.start}-{rng.end}".encode(),
    }
    table = table.replace_schema_metadata(meta)
    path = job_dir / rel_path
    path.parent.mkdir(parents=True, exist_ok=True)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=1 << 20)
    data = sink.getvalue().to_pybytes()
    atomic_write_bytes(path, data, durable=True)
    return StateFile(
        path=rel_path, batch=batch, kind=kind, start=rng.start, end=rng.end,
        rows=table.num_rows, bytes=len(data), crc32=zlib.crc32(data),
    )


def read_state_slice(job_dir: Path, f: StateFile, rng: KeyGroupRange, verify: bool = False) -> pa.Table:
    """The rows of key groups ``rng`` in state file ``f`` (zero-copy where possible)."""
    path = job_dir / f.path
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise StateError(f"state file {path} is missing") from None
    if size != f.bytes:
        raise StateError(f"state file {path} is damaged (size {size}, checkpoint says {f.bytes})")
    if verify and file_crc32(path) != f.crc32:
        raise StateError(f"state file {path} is damaged (checksum mismatch)")
    try:
        with pa.memory_map(str(path)) as source:
            reader = pa.ipc.open_file(source)
            table = reader.read_all()
    except (pa.ArrowInvalid, OSError) as e:
        raise StateError(f"state file {path} is unreadable ({e})") from None
    meta = table.schema.metadata or {}
    index = json.loads(meta.get(_INDEX_KEY, b"[]"))
    lo, hi = max(rng.start, f.start), min(rng.end, f.end)
    rows = [(first, n) for kg, first, n in index if lo <= kg <= hi]
    if not rows:
        return table.slice(0, 0)
    first = rows[0][0]
    last = rows[-1][0] + rows[-1][1]
    return table.slice(first, last - first)


def verify_state_file(job_dir: Path, f: StateFile) -> str | None:
    """None when the file is intact, else a sentence saying what is wrong."""
    path = job_dir / f.path
    if not path.exists():
        return f"state file {f.path} is missing"
    size = path.stat().st_size
    if size != f.bytes:
        return f"state file {f.path} has {size} bytes, expected {f.bytes}"
    if file_crc32(path) != f.crc32:
        return f"state file {f.path} fails its checksum"
    return None
