"""Exactly-once Parquet output on any store (local disk, ``file://``, ``s3://``...): one
folder per batch, complete once its marker ``_keyscale.json`` exists.

The protocol follows object-store rules (immutable objects, create-if-absent), so it is
the same on local disk and on S3, with no rename and no directory fsync:

1. ``write(df, b)`` lists ``PATH/batch=<b>/`` once. A marker there decides as
   :func:`keyscale.checkpoint.lineage.decide` says (keep, supersede, refuse).
2. Otherwise every Spark task writes its partition as one Parquet object
   ``batch=<b>/part-<partition>-<write id>.parquet`` through the (pickled) store and returns
   its name, rows and bytes; the driver collects them (the batch's one Spark action).
   ``<write id>`` is drawn once per ``write`` call: a task retry or a speculative copy
   rewrites the same name, and a concurrent writer of the same batch (another job on
   the same output) never overwrites this one's files.
3. The driver creates the marker, listing the files, with ``store.create`` (conditional):
   that is the commit point of the batch's output. Then it deletes objects of the folder
   that the marker does not list (left by an attempt that crashed before its marker).
   If the create finds a marker, another writer finished the batch first: its marker is
   decided on, and this attempt deletes its own files.
4. Right after the marker, under the same fence check and create-only too, the batch's
   entry in ``PATH/_spark_metadata/`` (Spark's file-sink log, :mod:`keyscale.sinks.spark_log`)
   lists the same files: Spark's readers of ``PATH`` read only what that log lists, so they
   see complete batches only. A replay that keeps a batch's output creates a missing entry.
"""

from __future__ import annotations

import functools
import io
import json
import logging
import os
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from keyscale._keywords import checked_keywords
from keyscale._spark_map import map_in_arrow
from keyscale.checkpoint.lineage import Action, Marker, decide
from keyscale.errors import KeyscaleError, OutputError, StorageError, encode_error
from keyscale.sinks.base import KEPT
from keyscale.sinks.spark_log import LOG, SinkLog, file_status
from keyscale.storage import Store, join, open_store
from keyscale.storage.local import local_write_failure

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame

    from keyscale.sinks.base import SinkContext

log = logging.getLogger(__name__)

MARKER = "_keyscale.json"  # who wrote a batch folder, and its files; Spark and pyarrow skip "_" files
SUPERSEDED = "_superseded"  # folders of an ancestor lineage replaced by a newer run
_BATCH = re.compile(r"^batch=(-?\d+)$")
# The files this protocol writes. A folder without a marker that holds only such files is
# an attempt that did not finish; anything else is another program's output (refused).
_ATTEMPT_FILE = re.compile(r"^part-\d{5}-[0-9a-f]{12}\.parquet$")
_LEGACY_TMP = "_tmp-"  # temporary folders of the rename protocol (keyscale before issue 11)
_RESULT_SCHEMA = "name string, rows long, bytes long"
# Rows a task buffers before it writes them as one Parquet row group: Arrow batches from
# Spark are small (maxRecordsPerBatch), row groups of a few of them would be tiny.
_ROW_GROUP_BYTES = 64 << 20


def batch_folder_name(batch_id: int) -> str:
    return f"batch={batch_id:012d}"


@dataclass(frozen=True)
class OutputFile:
    """One Parquet object of a batch, as its marker lists it."""

    name: str
    rows: int
    bytes: int

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "rows": self.rows, "bytes": self.bytes}


@dataclass(frozen=True)
class BatchMarker:
    """A batch folder's ``_keyscale.json``: who wrote it, and which files are the batch.

    ``files`` is None for markers of the rename protocol (keyscale before issue 11), whose
    folders appeared whole: every Parquet file in them is the batch.
    """

    marker: Marker
    files: tuple[OutputFile, ...] | None

    def to_json(self) -> dict[str, Any]:
        d = self.marker.to_json()
        if self.files is not None:
            d["files"] = [f.to_json() for f in self.files]
            d["rows"] = sum(f.rows for f in self.files)
        return d

    @staticmethod
    def parse(data: bytes) -> BatchMarker | None:
        """The marker in ``data``, None if it cannot be read (damaged)."""
        try:
            d = json.loads(data)
            files = d.get("files") if isinstance(d, dict) else None
            listed = None if files is None else tuple(OutputFile(str(f["name"]), int(f["rows"]), int(f["bytes"])) for f in files)
            return BatchMarker(Marker.from_json(d), listed)
        except (ValueError, TypeError, KeyError, AttributeError):
            return None


def read_marker(store: Store, folder: str) -> BatchMarker | None:
    """The marker of batch folder ``folder`` (None: no marker, or one that cannot be read)."""
    data = store.get_or_none(join(folder, MARKER))
    return None if data is None else BatchMarker.parse(data)


# -- the tasks ------------------------------------------------------------------------------


def _write_partition(store: Store, folder: str, write_id: str, batch_id: int, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """One Spark task: its partition as one Parquet object (none if it has no rows);
    yields (name, rows, bytes) for the driver."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from pyspark import TaskContext

    ctx = TaskContext.get()
    partition = ctx.partitionId() if ctx is not None else 0
    name = f"part-{partition:05d}-{write_id}.parquet"
    buf = io.BytesIO()
    writer: pq.ParquetWriter | None = None
    pending: list[pa.RecordBatch] = []
    pending_bytes = rows = 0

    def flush() -> None:
        nonlocal writer, pending, pending_bytes
        table = pa.Table.from_batches(pending)
        if writer is None:
            writer = pq.ParquetWriter(buf, table.schema)
        writer.write_table(table, row_group_size=max(table.num_rows, 1))
        pending, pending_bytes = [], 0

    for b in batches:
        if b.num_rows == 0:
            continue
        pending.append(b)
        pending_bytes += b.nbytes
        rows += b.num_rows
        if pending_bytes >= _ROW_GROUP_BYTES:
            flush()
    if pending:
        flush()
    if writer is None:
        return  # an empty partition writes no file
    writer.close()
    data = buf.getvalue()
    try:
        # A retry or a speculative copy of this task writes the same name (whole objects:
        # a reader sees one copy or the other, identical by determinism).
        store.put(join(folder, name), data)
    except KeyscaleError as e:
        raise RuntimeError(encode_error(StorageError(f"Parquet sink, batch {batch_id}, partition {partition}: {e}"))) from None
    except OSError as e:
        # A local folder this executor cannot write: on a cluster, typically one on the
        # driver's disk that the executor (another host or user) does not share.
        raise RuntimeError(encode_error(StorageError(
            f"Parquet sink, batch {batch_id}, partition {partition}: {local_write_failure(store.url(join(folder, name)), e)}"
        ))) from None
    yield pa.RecordBatch.from_pydict({"name": [name], "rows": [rows], "bytes": [len(data)]})  # string, int64, int64


# -- the sink -------------------------------------------------------------------------------


class ParquetSink:
    """Write each batch to ``PATH/batch=<id>/`` (Parquet) exactly once, on local disk, a
    ``file://`` URI or an object store (``s3://``; settings as for job directories).

    ``_keyscale.json`` in a batch folder is its completion mark, as ``_SUCCESS`` is for
    Hadoop's committers: it is written last, atomically (create-if-absent), and lists the
    batch's files with their rows and sizes. A folder without a marker is an attempt that
    did not finish (the job crashed while writing it): keyscale completes it on replay,
    writing the batch anew and deleting the unfinished attempt's files once the new marker
    exists. Readers see complete batches only through :func:`read_output` (markers) or
    through Spark: right after each marker the sink adds the batch's files to
    ``PATH/_spark_metadata/``, the commit log of Spark's own file sink, and
    ``spark.read.parquet(PATH)`` then reads only the files that log lists (with a ``batch``
    column from the folder names). pyarrow's ``pq.read_table(PATH)`` reads every file of the
    folder, a batch being written included. On an object store the log names files by the
    store's URIs (``s3://...``): Spark needs a file system for that scheme.

    The marker names the job lineage, job, job directory and attempt that wrote it; output
    of another lineage is refused (see :mod:`keyscale.checkpoint.lineage`), output of an
    ancestor lineage that this run recomputes is moved to ``PATH/_superseded/<lineage>/``.
    Every file, the marker last, is durable before ``write`` returns (the store's ``put``
    and ``create``), so the output is durable before the job commits the batch. Each task
    writes its partition through the store (executors need no disk shared with the
    driver); it holds the partition's Parquet bytes in memory while it writes them.

    >>> ParquetSink("/tmp/out").describe()
    'parquet files in /tmp/out'
    """

    exactly_once = True

    @checked_keywords
    def __init__(self, path: str | os.PathLike[str] | Store):
        self.store = open_store(path, "Parquet sink path")
        self.path = self.store.url()
        self._ctx: SinkContext | None = None
        self._log = SinkLog(self.store)
        self._log_loaded = False
        self._folders: set[int] | None = None  # batches with a folder, from open()'s LIST

    def describe(self) -> str:
        return f"parquet files in {self.path}"

    # -- lineage -----------------------------------------------------------------------------
    def open(self, ctx: SinkContext) -> None:
        """Check the whole output path against the job's lineage before the first batch:
        refuse another lineage's batches, move aside an ancestor's superseded ones.

        One LIST of the output path; a marker is read only for batches the job may still
        write (after ``ctx.committed``), so a long history costs no request per folder."""
        self._ctx = ctx
        names = self.store.list_names("")
        for name in names:
            if name.startswith(_LEGACY_TMP):
                self.store.delete_prefix(name)  # half-written by the rename protocol of an older keyscale
        folders = sorted((int(m.group(1)), n) for n in names if (m := _BATCH.match(n)))
        self._folders = {b for b, _ in folders}
        self._log_loaded = LOG not in names  # else listed at the first write (open lists nothing more)
        superseded = []
        for batch, folder in folders:
            if batch <= ctx.committed:
                # Committed history (the job's own, or shared with the savepoint it was
                # restored from): a resumed job reads only the markers of batches it may write.
                continue
            found = self._inspect(folder)
            if found is None:
                continue  # an unfinished attempt: write() replaces it
            action = decide(True, found.marker, batch, ctx.lineage, ctx.committed)
            if action is Action.REFUSE:
                raise self._conflict(batch, found.marker)
            if action is Action.SUPERSEDE:
                superseded.append((batch, folder, found))
        if superseded:
            # Out of Spark's log first (newest first), then moved aside: a reader never gets a listed file that is gone.
            self._truncate_log(superseded[0][0] - 1)
        for batch, folder, found in superseded:
            self._supersede(batch, folder, found.marker)

    def _inspect(self, folder: str) -> BatchMarker | None:
        """What a batch folder holds, for a lineage decision: its marker; a marker of
        "no lineage" for a folder that is not keyscale's (no marker, other files) or whose
        marker is damaged; None for an unfinished attempt (no marker, only its files)."""
        data = self.store.get_or_none(join(folder, MARKER))
        if data is not None:
            return BatchMarker.parse(data) or BatchMarker(Marker(None), None)
        if all(_ATTEMPT_FILE.match(o.key.rsplit("/", 1)[-1]) for o in self.store.list(folder)):
            return None
        return BatchMarker(Marker(None), None)

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

    def _supersede(self, batch: int, folder: str, marker: Marker | None) -> None:
        """Move a batch folder to ``_superseded/<lineage>/`` (copy, then delete: objects
        cannot be renamed). The copy's marker is written last and the original's marker is
        deleted first, so a crash at any point leaves a marked folder in one place or the
        other, and at worst an unmarked remainder that the next write of the batch replaces."""
        lid = marker.lineage if marker is not None and marker.lineage else "unknown"
        objects = [o.key for o in self.store.list(folder)]
        prefix = len(folder) + 1
        own = self.store.get_or_none(join(folder, MARKER))
        dest = join(SUPERSEDED, lid, folder)
        theirs = self.store.get_or_none(join(dest, MARKER))
        if theirs is not None and theirs != own:
            # the same lineage's batch set aside before, with other output: keep both
            dest = f"{dest}-{uuid.uuid4().hex[:8]}"
        data = [k for k in objects if k[prefix:] != MARKER]
        for key in data:
            self.store.copy(key, join(dest, key[prefix:]))
        if own is not None:
            self.store.copy(join(folder, MARKER), join(dest, MARKER))
            self.store.delete(join(folder, MARKER))
        self.store.delete_prefix(folder)
        log.warning(
            "output of batch %d from an earlier run (lineage %s, job directory %s) is superseded by this run, which "
            "recomputes it (restored from an older savepoint or started over); the old folder is kept in %s",
            batch, lid[:8], marker.job_dir if marker else "?", self.store.url(dest),
        )

    # -- one batch ---------------------------------------------------------------------------
    def write(self, df: DataFrame, batch_id: int) -> int:
        """Write batch ``batch_id`` once; returns its rows (``KEPT`` if an earlier write is kept)."""
        folder = batch_folder_name(batch_id)
        leftovers = [o.key[len(folder) + 1:] for o in self.store.list(folder)]
        if MARKER in leftovers or any(not _ATTEMPT_FILE.match(n) for n in leftovers):
            found = self._inspect(folder)
            if found is not None:
                if self._keep_or_refuse(found.marker, batch_id, folder):
                    df.write.format("noop").mode("overwrite").save()
                    self._add_to_log(batch_id, folder, found.files)  # a crash may have come between the marker and its entry
                    return KEPT
                leftovers = []  # superseded: moved aside
        write_id = uuid.uuid4().hex[:12]  # this call's file names (a concurrent writer's differ)
        task = functools.partial(_write_partition, self.store, folder, write_id, batch_id)
        files = tuple(sorted(
            (OutputFile(r["name"], int(r["rows"]), int(r["bytes"])) for r in map_in_arrow(df, task, _RESULT_SCHEMA).collect()),
            key=lambda f: f.name,
        ))
        ctx = self._ctx
        marker = BatchMarker(
            Marker(ctx.lineage.id if ctx else None, ctx.job if ctx else "", ctx.job_dir if ctx else "", ctx.attempt if ctx else "", batch_id),
            files,
        )
        # The commit point of the batch's output: the files are in place (each task's put
        # returned), the marker makes them the batch. Never by a run a newer one took over:
        # its files stay an unfinished attempt, which the newer run's write of the batch replaces.
        if ctx is not None and ctx.fence is not None:
            ctx.fence.check(f"marking batch {batch_id}'s output in {self.path} complete")
        if not self.store.create(join(folder, MARKER), json.dumps(marker.to_json(), sort_keys=True).encode()):
            # Another writer finished this batch first: its files are the batch, not ours.
            self.store.delete_many([join(folder, f.name) for f in files])
            found = self._inspect(folder)
            if found is not None and self._keep_or_refuse(found.marker, batch_id, folder):
                self._add_to_log(batch_id, folder, found.files)
                return KEPT
            return self.write(df, batch_id)  # its output was moved aside (superseded): write ours
        listed = {f.name for f in files}
        stale = [join(folder, n) for n in leftovers if n not in listed]
        if stale:
            # An unfinished attempt's files: not part of the batch (the marker says which are).
            self.store.delete_many(stale)
        # Under the fence check made for the marker: the log follows the marker, never leads it.
        self._add_to_log(batch_id, folder, files)
        return sum(f.rows for f in files)

    # -- Spark's commit log ------------------------------------------------------------------
    def _add_to_log(self, batch_id: int, folder: str, files: tuple[OutputFile, ...] | None) -> None:
        """Batch ``batch_id``'s entry in ``_spark_metadata`` (create-only), after entries for
        the batches before it that the log lacks (Spark's reader needs every one)."""
        if not self._log_loaded:
            self._log.load()
            self._log_loaded = True
        if batch_id <= self._log.latest:
            return  # logged already: entries are created in order, and only once a batch is complete
        for gap in range(self._log.latest + 1, batch_id):
            self._log.add(gap, self._logged_files(gap, batch_folder_name(gap), None))
        self._log.add(batch_id, self._logged_files(batch_id, folder, files))

    def _truncate_log(self, keep_up_to: int) -> None:
        self._log.truncate(keep_up_to)
        self._log_loaded = True

    def _logged_files(self, batch: int, folder: str, files: tuple[OutputFile, ...] | None) -> list[dict[str, Any]]:
        """The log's lines for a batch folder: its marker's files (``files``, else read from
        its marker); none for a batch this sink never wrote, or whose folder is unfinished."""
        if files is None:
            if self._folders is not None and batch not in self._folders:
                return []
            found = read_marker(self.store, folder)
            if found is None:
                return []
            files = found.files if found.files is not None else tuple(
                OutputFile(o.key[len(folder) + 1:], 0, o.size) for o in self.store.list(folder) if o.key.endswith(".parquet"))
        now = int(time.time() * 1000)
        return [file_status(self._spark_uri(join(folder, f.name)), f.bytes, now) for f in files]

    def _spark_uri(self, key: str) -> str:
        """A file as Spark names it: a ``file:`` URI on local disk, the store's URI elsewhere."""
        url = self.store.url(key)
        # "=" unescaped, as Hadoop's Path writes it (Spark's own sink log has batch=.../ verbatim)
        return "file://" + quote(str(Path(url).resolve()), safe="/=") if self.store.is_local else url

    def _keep_or_refuse(self, marker: Marker, batch_id: int, folder: str) -> bool:
        """True if the batch's existing output stays (a replay); raises if it is another
        lineage's; False once an ancestor's output has been moved aside."""
        ctx = self._ctx
        action = Action.KEEP if ctx is None else decide(True, marker, batch_id, ctx.lineage, ctx.committed)
        if action is Action.REFUSE:
            raise self._conflict(batch_id, marker)
        if action is Action.KEEP:
            # Replay of a batch whose output is complete: the caller runs the stages (state
            # must be rebuilt) but keeps the first output; it is identical by determinism.
            return True
        self._truncate_log(batch_id - 1)
        self._supersede(batch_id, folder, marker)
        return False


# -- reading the output back ----------------------------------------------------------------


def read_output(path: str | os.PathLike[str] | Store) -> pa.Table:
    """The complete batches of a Parquet sink's output as one table with a ``batch`` column
    (int64), ordered by batch: only folders with a marker, only the files it lists
    (output of the rename protocol: every Parquet file of a marked folder). Works on every
    store; for local output, ``spark.read.parquet(PATH)`` works too.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    store = open_store(path, "Parquet sink path")
    tables = []
    for batch, folder in sorted((int(m.group(1)), n) for n in store.list_names("") if (m := _BATCH.match(n))):
        found = read_marker(store, folder)
        if found is None:
            continue  # unfinished (or unreadable): not a complete batch
        if found.files is not None:
            names = [f.name for f in found.files]
        else:
            names = sorted(o.key[len(folder) + 1:] for o in store.list(folder) if o.key.endswith(".parquet"))
        for name in names:
            try:
                table = pq.read_table(pa.BufferReader(store.get(join(folder, name))))
            except FileNotFoundError:
                raise StorageError(f"{store.url(join(folder, name))} is missing: its batch's marker lists it") from None
            tables.append(table.append_column("batch", pa.array([batch] * table.num_rows, pa.int64())))
    if not tables:
        return pa.table({"batch": pa.array([], pa.int64())})
    return pa.concat_tables(tables, promote_options="default")
