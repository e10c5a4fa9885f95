"""Writing savepoints: the protocol (data files, then the metadata last), and a savepoint of a
job directory's checkpoint.

The protocol works the same on local disk and on object stores, with no rename, no
directory fsync and no staging folder:

1. :func:`begin_savepoint` checks the destination: one that holds ``_metadata.json`` is a
   complete savepoint and is never overwritten; one that holds only savepoint data
   (``operators/``, ``source/``: an interrupted savepoint) is cleaned; anything else there
   is refused.
2. Data files are written whole (``Store.put``) under deterministic names.
3. :func:`finish_savepoint` creates ``_metadata.json`` only if absent: from that moment
   the savepoint exists, and not before. Readers never see a partial savepoint.

One writer per destination at a time: two savepoints written into one destination at
once are not supported (the second to finish fails, and may have replaced files of the first).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from keyscale.checkpoint.drain import add_empty_batch, spark_log_end
from keyscale.checkpoint.files import _INDEX_KEY, read_state_slice, state_bytes_problem
from keyscale.checkpoint.jobdir import JobDir
from keyscale.checkpoint.manifest import (
    Manifest,
    OperatorCheckpoint,
    StateFile,
    chain_files,
    chain_starts,
)
from keyscale.checkpoint.savepoint.format import (
    DATA_PREFIXES,
    DEFAULT_ROWS_PER_FILE,
    KEY_GROUP_COLUMN,
    METADATA_FILE,
    SOURCE_DIR,
    Location,
    SavepointFile,
    SavepointInfo,
    SavepointOperator,
    canonical_order,
    chunk_ranges,
    data_file_name,
    open_savepoint,
    sha256_of,
)
from keyscale.checkpoint.savepoint.progress import Progress, report_progress
from keyscale.checkpoint.savepoint.schema import descriptor_from, parse_arrow_type
from keyscale.checkpoint.sparkmirror import SparkMirror
from keyscale.errors import StateError
from keyscale.state.keygroups import KeyGroupRange
from keyscale.state.table import KG_COLUMN, KeyedStateTable
from keyscale.state.types import StateDescriptor
from keyscale.storage import LocalStore, Store

log = logging.getLogger(__name__)

# -- the protocol -----------------------------------------------------------------------------


def begin_savepoint(dest: Location) -> Store:
    """The store of a new savepoint at ``dest``, ready for its data files.

    Refuses a destination that holds a savepoint (its metadata) or anything that is not
    savepoint data; deletes the data files of an interrupted savepoint (no metadata).
    """
    store = open_savepoint(dest, "savepoint destination")
    where = store.url()
    if store.is_local and store.size("") is not None:
        raise StateError(f"savepoint destination {where} exists and is a file")
    if store.exists(METADATA_FILE):
        raise StateError(
            f"savepoint destination {where} already holds a savepoint ({METADATA_FILE}); "
            "a savepoint is never overwritten: choose a new destination"
        )
    found = store.list()
    foreign = [o.key for o in found if not o.key.startswith(DATA_PREFIXES)]
    if foreign:
        raise StateError(f"savepoint destination {where} exists and is not empty ({store.url(foreign[0])}); choose a new folder")
    if found:
        log.warning("savepoint destination %s holds an interrupted savepoint (%d data files, no %s): writing it again", where, len(found), METADATA_FILE)
        abandon_savepoint(store)
    return store


def abandon_savepoint(store: Store) -> None:
    """Delete a savepoint's data files (never its metadata, never anything else there)."""
    for prefix in DATA_PREFIXES:
        store.delete_prefix(prefix.rstrip("/"))
    if store.is_local and not store.list_names(""):
        store.delete_prefix("")  # the folder itself, left empty (an object store has none)


def write_data_file(store: Store, uid: str, rng: KeyGroupRange, table: pa.Table) -> SavepointFile:
    """Write one canonical data file (``table`` already sorted, canonical columns)."""
    rel = data_file_name(uid, rng)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    data = sink.getvalue().to_pybytes()
    store.put(rel, data)
    return SavepointFile(rel, rng.start, rng.end, table.num_rows, len(data), sha256_of(data))


def finish_savepoint(store: Store, info: SavepointInfo) -> str:
    """Create the metadata, only if absent: the savepoint is complete. Returns its location."""
    data = json.dumps(info.to_json(), indent=1, sort_keys=True).encode()
    if not store.create(METADATA_FILE, data):
        raise StateError(f"savepoint destination {store.url()} was completed by another writer meanwhile; this savepoint is not written")
    return store.url()


@contextmanager
def new_savepoint(dest: Location) -> Iterator[Store]:
    """:func:`begin_savepoint`; if the block fails before :func:`finish_savepoint`, the data
    files written so far are deleted (a crash leaves them: the next writer cleans them)."""
    store = begin_savepoint(dest)
    try:
        yield store
    except BaseException:
        try:
            if not store.exists(METADATA_FILE):
                abandon_savepoint(store)
        except Exception as e:  # cleaning up is best effort: the original error matters
            log.warning("could not delete the partial savepoint in %s: %s", store.url(), e)
        raise


# -- reading a checkpoint ---------------------------------------------------------------------


def _state_file_schema(store: Store, f: StateFile, data: bytes | None = None) -> pa.Schema:
    where = store.url(f.path)
    try:
        if data is None and isinstance(store, LocalStore):  # only the footer is read
            with pa.memory_map(str(store.path(f.path))) as source:
                return pa.ipc.open_file(source).schema
        if data is None:
            data = store.get(f.path)
        return pa.ipc.open_file(pa.BufferReader(data)).schema
    except FileNotFoundError:
        raise StateError(f"state file {where} is missing") from None
    except (pa.ArrowInvalid, OSError) as e:
        raise StateError(f"state file {where} is unreadable ({e})") from None


class CheckpointFiles:
    """The state files of a checkpoint in a job directory's store, with their schemas kept
    once read (on an object store a file's bytes are fetched once for its check and schema)."""

    def __init__(self, store: Store):
        self.store = store
        self._schemas: dict[str, pa.Schema] = {}

    def verify(self, f: StateFile) -> str | None:
        """None when ``f`` is intact (size, crc32), else what is wrong."""
        data = self.store.get_or_none(f.path)
        problem = state_bytes_problem(f, data)
        if problem is not None or data is None:
            return problem
        if not self.store.is_local:
            self._schemas[f.path] = _state_file_schema(self.store, f, data)
        return None

    def schema(self, f: StateFile) -> pa.Schema:
        if f.path not in self._schemas:
            self._schemas[f.path] = _state_file_schema(self.store, f)
        return self._schemas[f.path]

    def index(self, f: StateFile) -> list[list[int]]:
        meta = self.schema(f).metadata or {}
        return list(json.loads(meta.get(_INDEX_KEY, b"[]")))


def _files(files: Store | CheckpointFiles) -> CheckpointFiles:
    return files if isinstance(files, CheckpointFiles) else CheckpointFiles(files)


def checkpoint_types(
    store: Store | CheckpointFiles, op: OperatorCheckpoint
) -> tuple[tuple[tuple[str, pa.DataType], ...], tuple[StateDescriptor, ...]]:
    """Key columns and state descriptors of a checkpointed operator.

    Types come from the manifest; one it cannot express is taken from the newest state file.
    """
    files = _files(store)

    def from_files(name: str) -> pa.DataType:
        for f in sorted(op.files, key=lambda f: -f.batch):
            schema = files.schema(f)
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
        descriptor_from(str(s["name"]), str(s["kind"]), typed(str(s["name"]), str(s["type"])), s.get("ttl_seconds"))
        for s in op.states
    )
    return keys, states


def checkpoint_rows_per_key_group(store: Store | CheckpointFiles, op: OperatorCheckpoint) -> np.ndarray:
    """Per key group, the rows its restore chain holds (an upper bound of its live keys)."""
    files = _files(store)
    m = op.max_parallelism
    everything = KeyGroupRange(0, m - 1)
    rows = np.zeros(m, dtype=np.int64)
    for f, runs in chain_files(op.files, everything, *chain_starts(op.files, everything)):
        for kg, _, n in files.index(f):
            if any(r.start <= kg <= r.end for r in runs):  # f is in kg's restore chain
                rows[kg] += n
    return rows


def restore_key_groups(
    store: Store | CheckpointFiles,
    op: OperatorCheckpoint,
    rng: KeyGroupRange,
    key_columns: Sequence[tuple[str, pa.DataType]],
    states: Sequence[StateDescriptor],
) -> pa.Table:
    """The live keys of key groups ``rng`` at the checkpoint, in savepoint form.

    Each key group is rebuilt from its restore chain (its latest snapshot, then the later
    deltas in batch order: :func:`keyscale.checkpoint.manifest.chain_files`); columns
    are the keys, ``key_group`` and the states, sorted by key group then key. Each state
    file is read once per call (one GET on an object store).
    """
    js = _files(store).store
    names = [k for k, _ in key_columns]
    table = KeyedStateTable(names, [t for _, t in key_columns], states)
    for f, runs in chain_files(op.files, rng, *chain_starts(op.files, rng)):
        part = read_state_slice(js, f, KeyGroupRange(runs[0].start, runs[-1].end))
        if len(runs) == 1:
            table.apply(part)
            continue
        kgs = part.column(KG_COLUMN).to_numpy()
        for ra, rb in ((r.start, r.end) for r in runs):
            lo, hi = np.searchsorted(kgs, ra, side="left"), np.searchsorted(kgs, rb, side="right")
            table.apply(part.slice(int(lo), int(hi - lo)))
    out = table.to_arrow(table.rows_in_range(rng.start, rng.end, live_only=True))
    out = out.rename_columns([KEY_GROUP_COLUMN if c == KG_COLUMN else c for c in out.column_names])
    return canonical_order(out, names)


# -- Spark's checkpoint -----------------------------------------------------------------------


def spark_checkpoint_files(folder: LocalStore, batch: int) -> dict[str, bytes]:
    """Spark's checkpoint (a local folder) as ``{relative path: bytes}``, without its batch
    log entries after ``batch`` and without writes in progress."""
    out: dict[str, bytes] = {}
    for o in folder.list():
        parts = o.key.split("/")
        name = parts[-1]
        if name.endswith((".tmp", ".tmp.crc")):
            continue  # a write in progress
        num = name[1:-4] if name.startswith(".") and name.endswith(".crc") else name
        if len(parts) == 2 and parts[0] in ("offsets", "commits") and num.isdigit() and int(num) > batch:
            continue
        data = folder.get_or_none(o.key)
        if data is not None:  # else deleted by Spark meanwhile
            out[o.key] = data
    return out


def _copy_spark_checkpoint(job_dir: JobDir, manifest: Manifest, dest: Store) -> str | None:
    """Spark's checkpoint up to the last batch the state consumed, into ``dest/source/spark``;
    a drain's batch becomes an empty committed one, so a restore never skips input
    (checkpoint/drain.py). Returns the source path for the metadata (None: no positions).

    A job directory on an object store keeps Spark's checkpoint in its mirror, and a local
    folder only in the process that runs the job: any other process (``keyscale
    savepoint`` of a stopped job, a deployment's supervisor, a user's script) finds its own
    folder empty and rebuilds it from the mirror first, or the savepoint would carry no
    source positions and a job restored from it would read its input again."""
    folder = LocalStore(job_dir.spark_checkpoint)
    if not job_dir.is_local and not folder.list_names(""):
        SparkMirror(job_dir.store, job_dir.spark_checkpoint).pull()
    if not folder.list_names(""):
        return None
    consumed = spark_log_end(manifest)
    files = spark_checkpoint_files(folder, consumed)
    if not files or not add_empty_batch(files, consumed, manifest.batch):
        return None
    for rel, data in sorted(files.items()):
        dest.put(f"{SOURCE_DIR}/{rel}", data)
    return SOURCE_DIR


# -- a savepoint of a checkpoint --------------------------------------------------------------


def write_savepoint(
    job_dir: JobDir,
    manifest: Manifest,
    dest: Location,
    progress: Progress | None = None,
    *,
    rows_per_file: int = DEFAULT_ROWS_PER_FILE,
) -> str:
    """Write a savepoint of the committed checkpoint ``manifest`` of ``job_dir`` to ``dest``.

    The state of every operator is rebuilt key group by key group from the checkpoint's
    files (verified first: a damaged checkpoint gives no savepoint) and written as Parquet,
    about ``rows_per_file`` rows per file, so memory stays bounded by one file's state.
    Spark's checkpoint is copied to ``source/spark`` without batch log entries after
    ``manifest.batch``. The metadata is written last, only if absent: a savepoint without
    it is not one (see :func:`begin_savepoint`). ``dest`` is a local path, a ``file://`` or
    object store URI, or a Store; returns the savepoint's location (a plain path on local
    disk). Never call it on a manifest that retention may delete meanwhile (the running job
    takes it between two batches).
    """
    files = CheckpointFiles(job_dir.store)
    plans = []
    for uid, op in sorted(manifest.operators.items()):
        for f in op.files:
            problem = files.verify(f)
            if problem:
                raise StateError(f"cannot take a savepoint of checkpoint {manifest.batch}: operator '{uid}': {problem}")
        keys, states = checkpoint_types(files, op)
        ranges = chunk_ranges(checkpoint_rows_per_key_group(files, op), rows_per_file)
        plans.append((uid, op, keys, states, ranges))
    with new_savepoint(dest) as store:
        total = sum(len(p[4]) for p in plans) + 1
        done = 0
        report_progress(progress, "savepoint", done, total)
        ops: dict[str, SavepointOperator] = {}
        for uid, op, keys, states, ranges in plans:
            written = []
            for rng in ranges:
                table = restore_key_groups(files, op, rng, keys, states)
                if table.num_rows:
                    written.append(write_data_file(store, uid, rng, table))
                done += 1
                report_progress(progress, "savepoint", done, total)
            ops[uid] = SavepointOperator(uid, op.max_parallelism, op.parallelism, keys, states, tuple(written), dict(op.operator_state))
        source = _copy_spark_checkpoint(job_dir, manifest, store)
        extra: dict[str, Any] = {"checkpoint": manifest.extra} if manifest.extra else {}
        info = SavepointInfo(
            path=store.url(), job=manifest.job, batch=manifest.batch, batch_time_ms=manifest.batch_time_ms,
            watermark_ms=manifest.watermark_ms, created_ms=int(time.time() * 1000), origin="checkpoint",
            source=source, operators=ops, store=store, extra=extra,
        )
        location = finish_savepoint(store, info)
    report_progress(progress, "savepoint", total, total)
    return location
