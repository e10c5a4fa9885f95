"""Surgery on Spark's streaming checkpoint (``JOB_DIR/spark``): pure file operations.

Spark keeps two logs there: ``offsets/<b>`` (the input of batch ``b``, written before the
batch runs) and ``commits/<b>`` (written after ``foreachBatch`` returned). On start, Spark
looks only at the newest offsets entry ``N``: if ``commits/N`` is absent it runs batch ``N``
again, with the input from ``offsets/N-1`` to ``offsets/N``, and never looks at the batches
between the newest commit and ``N`` (it logs "Batch completion log latest batch id is ...,
which is not trailing batchid ... by one" and carries on). So after keyscale falls back more
than one checkpoint, removing commit entries alone replays only ``N``; the batches in
between would be skipped. :func:`hide_offsets_after` makes batch ``j`` Spark's newest, so
that a start replays exactly ``j``; :func:`restore_hidden` puts the later entries back.

Each ``<b>`` file may have a checksum sidecar ``.<b>.crc``: it moves with its file.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from keyscale.errors import StateError


def _entries(folder: Path) -> list[int]:
    if not folder.exists():
        return []
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit())


def offset_batches(spark_dir: Path) -> list[int]:
    """The batches Spark has planned (its offsets log)."""
    return _entries(spark_dir / "offsets")


def commit_batches(spark_dir: Path) -> list[int]:
    """The batches Spark has finished (its commit log)."""
    return _entries(spark_dir / "commits")


def _move(src_dir: Path, dst_dir: Path, batch: int) -> None:
    dst_dir.mkdir(parents=True, exist_ok=True)
    for name in (str(batch), f".{batch}.crc"):
        src = src_dir / name
        if src.exists():
            os.replace(src, dst_dir / name)
        else:
            (dst_dir / name).unlink(missing_ok=True)  # no stale checksum next to a moved file


def remove_commits_after(spark_dir: Path, after: int) -> list[int]:
    """Forget that Spark finished the batches after ``after`` (their offsets stay)."""
    commits = spark_dir / "commits"
    removed = [b for b in commit_batches(spark_dir) if b > after]
    for b in removed:
        (commits / str(b)).unlink(missing_ok=True)
        (commits / f".{b}.crc").unlink(missing_ok=True)
    return removed


def hide_offsets_after(spark_dir: Path, hidden: Path, batch: int) -> list[int]:
    """Move Spark's offsets entries newer than ``batch`` to ``hidden``: ``batch`` becomes the
    newest Spark knows, so Spark's next start replays it (and only it)."""
    moved = [b for b in offset_batches(spark_dir) if b > batch]
    for b in moved:
        _move(spark_dir / "offsets", hidden, b)
    return moved


def restore_hidden(spark_dir: Path, hidden: Path, upto: int | None = None) -> list[int]:
    """Put hidden offsets entries back (those up to ``upto``, or all), replacing any entry
    Spark planned anew for the same batch: the original input of a batch is what it replays."""
    back = [b for b in _entries(hidden) if upto is None or b <= upto]
    for b in back:
        _move(hidden, spark_dir / "offsets", b)
    if hidden.exists() and not _entries(hidden):
        shutil.rmtree(hidden, ignore_errors=True)
    return back


def check_replayable(spark_dir: Path, after: int) -> list[int]:
    """The batches Spark has planned after ``after``, checking Spark still has the input of
    each (the offsets of ``after`` and of every later batch). Raises :class:`StateError`
    when one is gone: replaying would skip input."""
    have = offset_batches(spark_dir)
    if not have or have[-1] <= after:
        return []
    need = range(max(after, 0), have[-1] + 1)
    missing = [b for b in need if b not in set(have)]
    if missing:
        raise StateError(
            f"Spark's checkpoint {spark_dir} no longer has the input positions (offsets) of batch {missing[0]}, which the "
            f"fallback to checkpoint {after} must replay (Spark keeps spark.sql.streaming.minBatchesToRetain batches); "
            "refusing to start rather than skip input"
        )
    return [b for b in have if b > after]


def set_aside(spark_dir: Path) -> Path | None:
    """Rename Spark's checkpoint so that the next start reads the input from its beginning
    (kept, not deleted, for inspection). Returns the new name, or None if there was none."""
    if not spark_dir.exists():
        return None
    dest = spark_dir.with_name(f"{spark_dir.name}.set-aside-{int(time.time() * 1000)}")
    os.replace(spark_dir, dest)
    return dest
