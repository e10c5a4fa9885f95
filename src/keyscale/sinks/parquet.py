"""Exactly-once Parquet output: one folder per batch that appears whole, by one rename."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from keyscale.checkpoint.lineage import Action, Marker, decide
from keyscale.errors import OutputError
from keyscale.storage import local_path
from keyscale.storage.local import fsync_dir, fsync_file

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from keyscale.sinks.base import SinkContext

log = logging.getLogger(__name__)

MARKER = "_keyscale.json"  # who wrote a batch folder; Spark and pyarrow skip "_" files
SUPERSEDED = "_superseded"  # folders of an ancestor lineage replaced by a newer run
_BATCH = re.compile(r"^batch=(-?\d+)$")


def batch_folder_name(batch_id: int) -> str:
    return f"batch={batch_id:012d}"


def read_marker(folder: Path) -> Marker | None:
    """The marker of a batch folder (None: no marker, or one that cannot be read)."""
    try:
        return Marker.from_json(json.loads((folder / MARKER).read_text()))
    except (OSError, ValueError):
        return None


def _fsync_tree(folder: Path) -> None:
    """fsync every file in ``folder`` (one level: a Spark output folder), then the folder."""
    for p in folder.iterdir():
        if p.is_file():
            fsync_file(p)
    fsync_dir(folder)


class ParquetSink:
    """Write each batch to ``PATH/batch=<id>/`` (Parquet), atomically and at most once.

    Readers see a batch's files all at once or not at all (the folder is renamed into
    place); a batch replayed after a crash finds its folder and writes nothing again.
    Spark and pyarrow read ``PATH`` as one dataset with a ``batch`` column. Each folder
    holds ``_keyscale.json``, naming the job lineage, job, job directory and attempt that
    wrote it; output of another lineage is refused (see :mod:`keyscale.checkpoint.lineage`),
    output of an ancestor lineage that this run recomputes is moved to
    ``PATH/_superseded/<lineage>/``. Files and folders are fsynced before ``write``
    returns, so the output is durable before the job commits the batch.

    >>> ParquetSink("/tmp/out").describe()
    'parquet files in /tmp/out'
    """

    exactly_once = True

    def __init__(self, path: str | os.PathLike[str]):
        self.path = local_path(path, "Parquet sink path")
        self._ctx: SinkContext | None = None

    def describe(self) -> str:
        return f"parquet files in {self.path}"

    # -- lineage -----------------------------------------------------------------------------
    def open(self, ctx: SinkContext) -> None:
        """Check the whole output path against the job's lineage before the first batch:
        refuse another lineage's batches, move aside an ancestor's superseded ones."""
        self._ctx = ctx
        self.cleanup()
        if not self.path.is_dir():
            return
        folders = sorted((int(m.group(1)), p) for p in self.path.iterdir() if (m := _BATCH.match(p.name)) and p.is_dir())
        superseded = []
        for batch, folder in folders:
            if batch <= ctx.committed:
                # Committed history (the job's own, or shared with the savepoint it was
                # restored from): a resumed job reads only the markers of batches it may write.
                continue
            marker = read_marker(folder)
            action = decide(True, marker, batch, ctx.lineage, ctx.committed)
            if action is Action.REFUSE:
                raise self._conflict(batch, marker)
            if action is Action.SUPERSEDE:
                superseded.append((batch, folder, marker))
        for batch, folder, marker in superseded:
            self._supersede(batch, folder, marker)

    def _conflict(self, batch: int, marker: Marker | None) -> OutputError:
        assert self._ctx is not None
        if marker is None or marker.lineage is None:
            who = "output without a keyscale lineage marker (written by an older keyscale or another program)"
        else:
            who = f"output of job '{marker.job}' (job directory {marker.job_dir}, lineage {marker.lineage[:8]})"
        return OutputError(
            f"output path {self.path} already has batch {batch} from {who}; job '{self._ctx.job}' "
            f"(job directory {self._ctx.job_dir}, lineage {self._ctx.lineage.id[:8]}) would write that batch too; "
            "give this job another output path (or move the old output away)"
        )

    def _supersede(self, batch: int, folder: Path, marker: Marker | None) -> None:
        lid = marker.lineage if marker is not None and marker.lineage else "unknown"
        dest_dir = self.path / SUPERSEDED / lid
        dest_dir.mkdir(parents=True, exist_ok=True)
        dest = dest_dir / folder.name
        if dest.exists():
            dest = dest_dir / f"{folder.name}-{uuid.uuid4().hex[:8]}"
        os.rename(folder, dest)
        fsync_dir(dest_dir)
        fsync_dir(self.path)
        log.warning(
            "output of batch %d from an earlier run (lineage %s, job directory %s) is superseded by this run, which "
            "recomputes it (restored from an older savepoint or started over); the old folder is kept in %s",
            batch, lid[:8], marker.job_dir if marker else "?", dest,
        )

    # -- one batch ---------------------------------------------------------------------------
    def write(self, df: DataFrame, batch_id: int) -> int:
        final = self.path / batch_folder_name(batch_id)
        if final.exists():
            ctx = self._ctx
            marker = read_marker(final)
            action = Action.KEEP if ctx is None else decide(True, marker, batch_id, ctx.lineage, ctx.committed)
            if action is Action.REFUSE:
                raise self._conflict(batch_id, marker)
            if action is Action.KEEP:
                # Replay of a batch whose output is complete: run the stages (state must be
                # rebuilt) but keep the first output; it is identical by determinism.
                df.write.format("noop").mode("overwrite").save()
                return -1
            self._supersede(batch_id, final, marker)
        created = not self.path.exists()
        self.path.mkdir(parents=True, exist_ok=True)
        if created:
            fsync_dir(self.path.parent)
        tmp = self.path / f"_tmp-{batch_id}-{uuid.uuid4().hex[:8]}"
        df.write.mode("overwrite").parquet(str(tmp))
        for p in list(tmp.iterdir()):
            if p.name.startswith("_") or p.name.startswith("."):
                p.unlink()
        ctx = self._ctx
        marker = Marker(
            ctx.lineage.id if ctx else None, ctx.job if ctx else "", ctx.job_dir if ctx else "",
            ctx.attempt if ctx else "", batch_id,
        )
        (tmp / MARKER).write_text(json.dumps(marker.to_json(), sort_keys=True))
        # Durable before the rename makes the folder visible, and the rename durable before
        # the job commits the batch (its manifest is fsynced; its output must be too).
        _fsync_tree(tmp)
        os.rename(tmp, final)
        fsync_dir(self.path)
        return -1

    def cleanup(self) -> None:
        """Remove half-written temporary folders left by a crash."""
        if self.path.exists():
            for p in self.path.glob("_tmp-*"):
                shutil.rmtree(p, ignore_errors=True)
