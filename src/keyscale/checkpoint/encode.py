"""State files written: a key-group-sorted state table (or its parts, in order) encoded as a
state file (:mod:`keyscale.checkpoint.files` says what one holds and reads it), with its
manifest entry, and stored.

:func:`encode_state_file` makes the bytes of a table in memory, :func:`spill_state_file` the
same file from parts written to scratch (a snapshot of a range of any size),
:func:`put_state_file` stores either, :func:`write_state_file` does both for a table;
:func:`compressed_on` says whether a store gets LZ4-compressed record batches.

>>> import tempfile, pyarrow as pa
>>> from keyscale.checkpoint.files import read_state_slice
>>> from keyscale.state.keygroups import KeyGroupRange
>>> from keyscale.storage import LocalStore
>>> store = LocalStore(tempfile.mkdtemp())
>>> rows = pa.table({"user": ["ann", "bob"], "__kg": pa.array([0, 1], pa.int32()), "n": [1, 2]})
>>> f = write_state_file(store, "state/op/000000000003-s00000-delta.arrow", rows, "delta", 3, KeyGroupRange(0, 1))
>>> f.rows, read_state_slice(store, f, KeyGroupRange(1, 1)).column("user").to_pylist()
(2, ['bob'])
"""

from __future__ import annotations

import itertools
import json
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa

from keyscale.checkpoint.files import (
    _CHUNK_KEY,
    _FENCE_RULE_KEY,
    _FENCES_KEY,
    _INDEX_KEY,
    Location,
    chunk_rows,
)
from keyscale.checkpoint.manifest import FileKind, StateFile
from keyscale.errors import StateError, StorageError
from keyscale.state.keygroups import KeyGroupRange
from keyscale.state.order import FENCE_RULE, sort_keys
from keyscale.state.table import KG_COLUMN
from keyscale.storage import Store, open_store
from keyscale.storage.local import local_write_failure
from keyscale.storage.scratch import open_scratch_file, remove_scratch, spill_dir


def compressed_on(store: Store) -> bool:
    """Whether state files written to ``store`` compress their record batches (LZ4, Arrow
    IPC's own buffer compression, which any Arrow reader reads back): on an object store
    yes, on local disk no.

    On an object store the bytes cross a network and a store may recompress what it keeps:
    SeaweedFS gzips a compressible chunk and inflates the whole chunk (megabytes) to serve a
    ranged read, ~24 ms of its CPU for a point lookup's 50 KB against 1.5 ms for bytes it
    cannot compress. LZ4 halves string-keyed state for ~0.2 s of CPU a 5M-row write, and the
    upload carries half the bytes (a 2M-key snapshot stored on SeaweedFS in 645 against
    1,320 ms). On local disk a file is memory-mapped and read without a copy, where a
    compressed one must be inflated: a 5M-key snapshot read whole in 0.03-0.05 s against
    0.13-0.19 s.
    (docs/benchmarks.md, "State files on an object store compressed with LZ4".) Files
    written before read as they are, either way: the compression is recorded per buffer.

    >>> from keyscale.storage import LocalStore, open_store
    >>> compressed_on(LocalStore("/tmp")), compressed_on(open_store("s3://bucket/job", "job directory"))
    (False, True)
    """
    return not store.is_local


# On the calling thread, as reads are (files.py's ``_READ_OPTIONS``: a 5M-row snapshot written
# with LZ4 in 0.31-0.38 s on one thread against 0.65-0.80 s on Arrow's pool).
def _write_options(compressed: bool) -> pa.ipc.IpcWriteOptions:
    return pa.ipc.IpcWriteOptions(compression="lz4" if compressed else None, use_threads=False)


def kg_index(kgs: np.ndarray, start: int, end: int) -> list[list[int]]:
    """``[[kg, first_row, rows], ...]`` for a key-group-sorted column."""
    if len(kgs) == 0:
        return []
    bounds = np.searchsorted(kgs, np.arange(start, end + 2))
    return [[start + i, int(bounds[i]), int(bounds[i + 1] - bounds[i])] for i in range(end - start + 1) if bounds[i + 1] > bounds[i]]


def write_state_file(job_dir: Location, rel_path: str, table: pa.Table, kind: FileKind, batch: int, rng: KeyGroupRange) -> StateFile:
    """Write a key-group-sorted state table as one object; returns its manifest entry."""
    store = open_store(job_dir, "job directory")
    entry, data = encode_state_file(rel_path, table, kind, batch, rng, compressed_on(store))
    put_state_file(store, rel_path, data)
    return entry


def put_state_file(store: Store, rel_path: str, data: bytes | Path) -> None:
    """Store an encoded state file, its bytes or a spilled file (the upload; its manifest
    entry is already known)."""
    try:
        if isinstance(data, Path):
            store.put_file(rel_path, data)
        else:
            store.put(rel_path, data)
    except OSError as e:  # a local job directory this process cannot write (a task: the driver's disk)
        raise StorageError(f"state file: {local_write_failure(store.url(rel_path), e)}") from None


def _metadata(index: list[list[int]], kind: FileKind, batch: int, rng: KeyGroupRange, fences: list[int] | None = None) -> dict[bytes, bytes]:
    meta = {
        _INDEX_KEY: json.dumps(index).encode(),
        b"keyscale.kind": kind.encode(),
        b"keyscale.batch": str(batch).encode(),
        b"keyscale.range": f"{rng.start}-{rng.end}".encode(),
        _CHUNK_KEY: str(chunk_rows(kind)).encode(),
    }
    if fences is not None:
        meta[_FENCES_KEY] = json.dumps(fences).encode()
        meta[_FENCE_RULE_KEY] = FENCE_RULE.encode()
    return meta


def _first_key(schema: pa.Schema) -> str | None:
    """The column the sub key is read from: the first key column (key columns come before
    the key-group column), None for a file without key columns."""
    return schema.names[0] if schema.names and schema.names[0] != KG_COLUMN else None


def _fences(table: pa.Table, chunk: int) -> list[int] | None:
    """Each record batch's first sort key (``keyscale.state.order.sort_keys``) of a table in
    file order; None if it has no key column, fits one record batch, or is not in that order
    (a delta: its first rows tell, before every row's sub key is computed)."""
    key = _first_key(table.schema)
    if key is None or table.num_rows <= chunk:
        return None  # one record batch: nothing to choose between
    kgs = table.column(KG_COLUMN).to_numpy()
    head = sort_keys(kgs[:1024], table.column(key).slice(0, 1024))
    if (np.diff(head) < 0).any():
        return None
    keys = sort_keys(kgs, table.column(key))
    if (np.diff(keys) < 0).any():
        return None
    return [int(k) for k in keys[::chunk]]


def encode_state_file(
    rel_path: str, table: pa.Table, kind: FileKind, batch: int, rng: KeyGroupRange, compressed: bool = False,
) -> tuple[StateFile, bytes]:
    """A key-group-sorted state table as the bytes of one state file, and its manifest entry
    (with fences when its rows are in file order, key group then sub key: see the module);
    ``compressed``: its record batches LZ4-compressed (:func:`compressed_on` the store it goes to)."""
    kgs = table.column(KG_COLUMN).to_numpy()
    chunk = chunk_rows(kind)
    meta = _metadata(kg_index(kgs, rng.start, rng.end), kind, batch, rng, _fences(table, chunk))
    table = table.replace_schema_metadata(meta).combine_chunks()  # batches of exactly ``chunk`` rows
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema, options=_write_options(compressed)) as writer:
        writer.write_table(table, max_chunksize=chunk)
    data = sink.getvalue().to_pybytes()
    entry = StateFile(
        path=rel_path, batch=batch, kind=kind, start=rng.start, end=rng.end,
        rows=table.num_rows, bytes=len(data), crc32=zlib.crc32(data),
    )
    return entry, data


def spill_state_file(
    rel_path: str, parts: Iterable[pa.Table], schema: pa.Schema, kind: FileKind, batch: int, rng: KeyGroupRange,
    ordered: bool = False, compressed: bool = False,
) -> tuple[StateFile, Path]:
    """``encode_state_file`` of the concatenation of ``parts`` (key-group-sorted, in order),
    written to a spill folder in scratch instead of memory, byte for byte the same (given
    ``ordered`` when the rows are in file order, the fences too): a snapshot of a range of
    any size holds at most two parts in memory at a time. Returns the manifest entry and the
    file; upload it with ``put_state_file``, then ``remove_scratch`` its folder.

    ``ordered``: the caller sorted the rows in file order (key group, then sub key:
    :func:`keyscale.state.order.order_rows`, as a snapshot does), so the file gets fences,
    read at each record batch's first row (not checked row by row: that would cost the
    snapshot a second pass over every key).

    The key-group index goes in the file's schema, which comes first, so the rows of several
    parts pass twice: into an Arrow stream in the folder while the index is counted, then into
    the state file. A single part (a slice's snapshot, most ranges) is held instead and
    written once: the stream's pass cost such a snapshot a fifth of its time.
    """
    folder = spill_dir()
    try:
        counts = np.zeros(rng.end - rng.start + 1, dtype=np.int64)
        fences: list[int] = []
        key = _first_key(schema) if ordered else None
        chunk = chunk_rows(kind)
        rows = _checked_parts(rel_path, parts, rng, counts, fences, key, chunk)
        head = list(itertools.islice(rows, 2))
        batches: Iterable[pa.RecordBatch]
        if len(head) < 2:  # one part or none: written once
            batches = head[0].combine_chunks().to_batches(max_chunksize=chunk) if head else []
        else:
            stream = folder / "rows.arrows"
            with open_scratch_file(stream, "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
                for part in itertools.chain(head, rows):
                    writer.write_table(part)
            head = []
            batches = _streamed_batches(stream, chunk)
        first = np.concatenate([[0], np.cumsum(counts)[:-1]])
        index = [[rng.start + int(i), int(first[i]), int(counts[i])] for i in np.flatnonzero(counts)]
        path = folder / "state.arrow"
        meta = _metadata(index, kind, batch, rng, fences if key is not None and int(counts.sum()) > chunk else None)
        with open_scratch_file(path, "wb") as sink, pa.ipc.new_file(sink, schema.with_metadata(meta), options=_write_options(compressed)) as writer:
            for b in batches:
                writer.write_batch(b)
        size, crc = 0, 0
        with open_scratch_file(path, "rb") as f:
            while block := f.read(8 << 20):
                size, crc = size + len(block), zlib.crc32(block, crc)
    except BaseException:
        remove_scratch(folder)
        raise
    entry = StateFile(path=rel_path, batch=batch, kind=kind, start=rng.start, end=rng.end, rows=int(counts.sum()), bytes=size, crc32=crc)
    return entry, path


def _checked_parts(
    rel_path: str, parts: Iterable[pa.Table], rng: KeyGroupRange, counts: np.ndarray, fences: list[int], key: str | None, chunk: int,
) -> Iterator[pa.Table]:
    """``parts`` without the empty ones, each checked to be in key-group order within ``rng``
    as it passes; adds its rows per key group to ``counts`` and, given the ``key`` column,
    the sort key of each of its rows that starts a record batch of ``chunk`` rows to ``fences``."""
    last, seen = rng.start, 0  # seen: rows before this part
    for part in parts:
        if not part.num_rows:
            continue
        kgs = part.column(KG_COLUMN).to_numpy()
        if key is not None:
            at = np.arange(-seen % chunk, part.num_rows, chunk)
            fences.extend(int(k) for k in sort_keys(kgs[at], part.column(key).take(pa.array(at, pa.int64()))))
        seen += part.num_rows
        if kgs[0] < last or kgs[-1] > rng.end or (len(kgs) > 1 and (np.diff(kgs) < 0).any()):
            raise StateError(f"state file {rel_path}: its rows are not in key-group order within {rng.start}-{rng.end}")
        last = int(kgs[-1])
        counts += np.bincount(kgs - rng.start, minlength=len(counts))
        yield part


def _streamed_batches(stream: Path, chunk: int) -> Iterator[pa.RecordBatch]:
    """The rows of an Arrow stream in scratch in record batches of exactly ``chunk`` rows;
    the stream is removed once read."""
    with open_scratch_file(stream, "rb") as source:
        yield from _exact_batches(pa.ipc.open_stream(source), chunk)
    stream.unlink()


def _exact_batches(batches: Iterable[pa.RecordBatch], chunk: int) -> Iterator[pa.RecordBatch]:
    """The rows of ``batches`` again, in record batches of exactly ``chunk`` rows (the last
    one shorter), as ``encode_state_file`` writes them."""
    pending: list[pa.RecordBatch] = []
    held = 0
    for b in batches:
        pending.append(b)
        held += b.num_rows
        while held >= chunk:
            joined = pa.Table.from_batches(pending).combine_chunks()
            yield joined.slice(0, chunk).to_batches()[0]
            rest = joined.slice(chunk)
            pending, held = rest.to_batches(), rest.num_rows
    if held:
        yield pa.Table.from_batches(pending).combine_chunks().to_batches()[0]
