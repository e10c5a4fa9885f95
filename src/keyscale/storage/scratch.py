"""Local scratch space on an executor: where the RocksDB state backend keeps its databases.

Scratch is a cache, never the source of truth (the checkpoint's state files are): anything
here may be deleted at any moment between batches and is rebuilt from the job directory.
A *spill* folder holds one large file between its writing and its upload (a snapshot of
a subtask's range, written in parts rather than built in memory). A *turn* is a file lock
that makes the processes of one host take turns at a step (``host_turn``).
It lives under ``KEYSCALE_LOCAL_DIR`` if set, else Spark's first ``SPARK_LOCAL_DIRS``
entry (the executor's local disk), else the system's temporary folder, in
``keyscale-state/``. This module is the storage seam's part for it: it gives out the
folders, opens a RocksDB in one, copies one (hard links) and deletes them.

>>> import os, tempfile
>>> os.environ["KEYSCALE_LOCAL_DIR"] = tempfile.mkdtemp()
>>> p = scratch_dir("job", "op", "s0")
>>> p.is_dir(), p.parts[-4:]
(True, ('keyscale-state', 'job', 'op', 's0'))
>>> remove_scratch(p); p.exists()
False
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

# A spill folder lives for one upload; one older than this was left by a process that died.
SPILL_MAX_AGE_SECONDS = 6 * 3600


def scratch_root() -> Path:
    """The folder under which this executor's scratch lives."""
    base = os.environ.get("KEYSCALE_LOCAL_DIR") or (os.environ.get("SPARK_LOCAL_DIRS") or "").split(",")[0] or tempfile.gettempdir()
    return Path(base) / "keyscale-state"


def _check_scratch(path: Path) -> None:
    """Refuse a path outside scratch space: this module deletes and overwrites what it is given."""
    if scratch_root() not in path.parents:
        raise ValueError(f"{path} is not scratch space")


def _check_names(*parts: str) -> None:
    for p in parts:
        if not p or "/" in p or p in (".", ".."):
            raise ValueError(f"scratch name {p!r} is not a plain name")


def scratch_dir(*parts: str) -> Path:
    """The scratch folder ``parts`` (created if missing); parts are plain names, never paths."""
    _check_names(*parts)
    path = scratch_root().joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path


def scratch_children(path: Path) -> list[Path]:
    """The folders in scratch folder ``path`` (none if it is gone)."""
    try:
        return [c for c in path.iterdir() if c.is_dir()]
    except FileNotFoundError:
        return []


def remove_scratch(path: Path) -> None:
    """Delete a scratch folder and what is in it (gone already is fine)."""
    _check_scratch(path)
    shutil.rmtree(path, ignore_errors=True)


def open_rocksdb(path: Path, options: Any) -> Any:
    """Open (or create) the RocksDB in scratch folder ``path``; RocksDB locks it for this
    process (a second opener gets an error: the caller falls back to a folder of its own)."""
    import rocksdict

    _check_scratch(path)
    path.mkdir(parents=True, exist_ok=True)
    return rocksdict.Rdict(str(path), options)


def copy_rocksdb(db: Any, path: Path) -> None:
    """A copy of open RocksDB ``db`` in new scratch folder ``path``: RocksDB's checkpoint, its
    files hard links (instant, whatever the size; later compactions part the two)."""
    import rocksdict

    _check_scratch(path)
    rocksdict.Checkpoint(db).create_checkpoint(str(path))


def spill_dir() -> Path:
    """A new scratch folder for a file written before its upload; the caller removes it
    (``remove_scratch``) once the upload is done. Spill folders older than
    ``SPILL_MAX_AGE_SECONDS`` (left by a process that died) are removed here."""
    root = scratch_dir("spill")
    for old in scratch_children(root):
        try:
            if time.time() - old.stat().st_mtime > SPILL_MAX_AGE_SECONDS:
                remove_scratch(old)
        except FileNotFoundError:
            continue
    return scratch_dir("spill", uuid.uuid4().hex)


def open_scratch_file(path: Path, mode: Literal["rb", "wb"]) -> Any:
    """A file in scratch space as an Arrow file: ``"wb"`` a new one to write, ``"rb"`` one
    to read."""
    import pyarrow as pa

    _check_scratch(path)
    return pa.OSFile(str(path), mode)


@contextmanager
def host_turn(name: str) -> Iterator[None]:
    """Hold the turn ``name`` (a plain name): processes of this host that share its scratch
    space run the block one at a time (an exclusive ``flock``, released by the kernel if
    the holder dies). Hosts do not wait for each other.

    >>> with host_turn("doc"):
    ...     pass
    """
    _check_names(name)
    path = scratch_dir("turns") / f"{name}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the last descriptor releases the lock
