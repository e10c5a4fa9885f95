"""State files (Arrow IPC, indexed by key group), written and read through the storage seam.

A state file is an Arrow IPC file sorted by key group, in record batches of ``CHUNK_ROWS``
rows (a delta's of ``DELTA_CHUNK_ROWS``). Its schema metadata holds the index
``key group -> (first row, row count)`` so a reader that owns part of the file's range
takes only its slice without scanning (memory-mapped, so untouched pages are never read;
on an object store, by byte range).

Snapshots also order the rows of each key group by an 8-bit sub key of the key
(:mod:`keyscale.state.order`) and keep *fences* in the schema metadata: each record batch's
first ``key group << 8 | sub key``. A point lookup then fetches the footer (cached) and
the one record batch (1,024 rows, ~50 KB) that can hold its key, not every
batch of its key group (a key group of a 10M-key snapshot at M=128 holds ~78,000 rows,
~4 MB). Why a sub key: it is read from a few of the key's bytes and sorted by radix passes,
where sorting by the key itself (or by Spark's hash of it) cost about as much as the
snapshot's write again. The order still costs: the rows are reordered (an Arrow ``take``
after the conversion), 1.5x a snapshot's write of string keys with a list state
(docs/benchmarks.md, "State lookups with fences"; docs/design.md, "Record batches and
fences"). Only snapshots pay it: deltas, written every batch, keep key-group order, and
their record batches are small instead. A file without fences (deltas, files written
before fences, writers that do not order rows) is read by key group as before; fences are
written only by a writer that says its rows are in that order
(:func:`keyscale.checkpoint.encode.encode_state_file` checks it; ``spill_state_file`` is
told, by the snapshot path that sorted them).

This module is the format and its reads; :mod:`keyscale.checkpoint.encode` writes the files.
"""

from __future__ import annotations

import bisect
import io
import json
import os
import zlib
from typing import Any

import pyarrow as pa

from keyscale.checkpoint.manifest import FileKind, StateFile
from keyscale.errors import StateError
from keyscale.state.keygroups import KeyGroupRange
from keyscale.state.order import FENCE_RULE
from keyscale.storage import LocalStore, Store, open_store

Location = Store | str | os.PathLike[str]  # a job directory: its store, or where it is

_INDEX_KEY = b"keyscale.kg_index"
_CHUNK_KEY = b"keyscale.chunk_rows"
_FENCES_KEY = b"keyscale.fences"  # each record batch's first key group << 8 | sub key (keyscale.state.order)
_FENCE_RULE_KEY = b"keyscale.fence_rule"
# Record batches of this many rows (the last one shorter): a reader that needs a few key
# groups of a file on an object store fetches only the batches holding them, by byte range,
# and a point lookup in a fenced file the one batch of its key (~50 KB at 10M string keys).
# 1,024 since 2026-12-01 (8,192, then 2,048 the same day): each step shortened a lookup's GET
# on S3 beside a running job (p99 ~170 -> ~110 -> ~97 ms) for a snapshot write within a few %
# and the same scan speed (docs/benchmarks.md, "Snapshot record batches of 2,048 rows" and
# "... of 1,024 rows"). Files record their own size (``keyscale.chunk_rows``): files written
# with 2,048, 8,192 or 65,536 read as before.
CHUNK_ROWS = 1 << 10
# A delta's record batches are never larger (the same size today): its rows of one key group
# are few (the keys one batch changed) and in no order a fence can use, so a point lookup
# reads the batches holding them whole; at 1,024 rows a batch is tens of KB. (A delta is
# written every batch: more, smaller record batches cost its write a few microseconds each.)
DELTA_CHUNK_ROWS = 1 << 10


def chunk_rows(kind: FileKind) -> int:
    """Rows per record batch of a state file of ``kind``."""
    return CHUNK_ROWS if kind == "snapshot" else min(CHUNK_ROWS, DELTA_CHUNK_ROWS)


# On the calling thread: a state file's buffers are small (a record batch of 1,024 rows),
# and handing each to Arrow's thread pool to (de)compress cost more than it saved: a
# 5M-row snapshot written with LZ4 in 0.31-0.38 s on one thread against 0.65-0.80 s on the
# pool, read back in 0.13-0.19 s against 0.63-1.15 s (uncompressed files: the same either way).
_READ_OPTIONS = pa.ipc.IpcReadOptions(use_threads=False)


# Below this size a file is fetched whole (one request beats a few ranged ones).
RANGED_MIN_BYTES = 4 << 20


def _open_state_file(store: Store, f: StateFile, verify: bool) -> pa.Table:
    """The whole table of ``f``, checked against its manifest entry: size, and crc (on local disk
    with ``verify`` only; from an object store always, the bytes being in memory)."""
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
        # Always checked here, whatever ``verify`` says: the whole object is in memory already
        # (a checksum pass is cheap next to the request), and on an object store recovery checks
        # sizes only, so this read is where a file damaged in place is found.
        if zlib.crc32(data) != f.crc32:
            raise StateError(f"state file {where} is damaged (checksum mismatch)")
        source = pa.BufferReader(data)
    try:
        with source:
            return pa.ipc.open_file(source, options=_READ_OPTIONS).read_all()
    except (pa.ArrowInvalid, OSError) as e:
        raise StateError(f"state file {where} is unreadable ({e})") from None


def _rows_of(meta: dict[bytes, bytes] | None, f: StateFile, rng: KeyGroupRange) -> tuple[int, int]:
    """The rows ``[first, last)`` of key groups ``rng`` in a file with schema metadata ``meta``."""
    index = json.loads((meta or {}).get(_INDEX_KEY, b"[]"))
    lo, hi = max(rng.start, f.start), min(rng.end, f.end)
    rows = [(first, n) for kg, first, n in index if lo <= kg <= hi]
    if not rows:
        return 0, 0
    return rows[0][0], rows[-1][0] + rows[-1][1]


class _Ranged(io.RawIOBase):
    """One object of a store as a read-only, seekable file, fetched by byte ranges with a
    read-ahead window: Arrow reads the footer, then only the record batches it is asked for."""

    def __init__(self, store: Store, key: str, size: int, window: int = 1 << 20, tail: tuple[int, bytes] | None = None):
        self._store, self._key, self._size, self.window = store, key, size, window
        self._pos = 0
        # ``tail``: bytes already fetched from some offset (the footer), read from memory
        self._buf_start, self._buf = tail if tail is not None else (0, b"")

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def read(self, n: int | None = -1) -> bytes:
        n = self._size - self._pos if n is None or n < 0 else min(n, self._size - self._pos)
        if n <= 0:
            return b""
        if not (self._buf_start <= self._pos and self._pos + n <= self._buf_start + len(self._buf)):
            self._buf = self._store.get_range(self._key, self._pos, min(max(n, self.window), self._size - self._pos))
            self._buf_start = self._pos
        off = self._pos - self._buf_start
        self._pos += n
        return self._buf[off : off + n]

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)


# A point lookup's first read of a state file: its last bytes, which hold the footer (the
# schema with the key-group index and fences, the record batches' offsets), at least
# TAIL_BYTES and more by the file's record batches and key groups (tail_bytes).
TAIL_BYTES = 16 << 10
# A footer's bytes a record batch and a key group, with room: a snapshot with fences holds
# ~31 a record batch (its block, 24, and its fence), its index ~20 a key group (measured on
# 10M-key snapshots, docs/benchmarks.md "A footer in one read").
_FOOTER_PER_BATCH = 40
_FOOTER_PER_KEY_GROUP = 24


def tail_bytes(f: StateFile) -> int:
    """How many of ``f``'s last bytes a first read of its footer takes: enough for the
    footer of a file of its rows and key groups, so that one read holds it (a footer
    longer still takes a second); at most the whole file.

    >>> tail_bytes(StateFile("s", 8, "snapshot", 0, 31, 625_000, 30_000_000, 1))  # 611 record batches, 32 key groups
    41592
    >>> tail_bytes(StateFile("d", 9, "delta", 0, 31, 200, 9_000, 1))
    9000
    """
    batches = -(-f.rows // CHUNK_ROWS)
    return min(f.bytes, TAIL_BYTES + _FOOTER_PER_BATCH * batches + _FOOTER_PER_KEY_GROUP * (f.end - f.start + 1))


def state_file_tail(store: Store, f: StateFile, first: bytes | None = None) -> tuple[int, bytes]:
    """The end of state file ``f`` that holds its Arrow footer, as ``(offset, bytes)``: one
    ranged read of :func:`tail_bytes` (two when the footer is longer; ``first``: the first
    read's bytes, fetched already). Kept by a reader that comes back to the file
    (:mod:`keyscale.checkpoint.ranged`), so that each later read of a key group fetches only
    the record batches holding it."""
    n = tail_bytes(f)
    try:
        tail = store.get_range(f.path, f.bytes - n, n) if first is None else first
        if len(tail) == n and n >= 10 and tail[-6:] == b"ARROW1":
            need = int.from_bytes(tail[-10:-6], "little") + 10
            if n < need <= f.bytes:
                n, tail = need, store.get_range(f.path, f.bytes - need, need)
    except FileNotFoundError:
        raise StateError(f"state file {store.url(f.path)} is missing") from None
    if len(tail) != n or tail[-6:] != b"ARROW1":
        raise StateError(f"state file {store.url(f.path)} is damaged (size or footer differs from its checkpoint's entry)")
    return f.bytes - n, tail


def read_key_groups_ranged(
    store: Store, f: StateFile, rng: KeyGroupRange, tail: tuple[int, bytes] | None = None, probe: int | None = None,
) -> pa.Table:
    """The rows of key groups ``rng`` in state file ``f``, by byte ranges: the footer (or
    ``tail``, from :func:`state_file_tail`), then only the record batches (``CHUNK_ROWS``
    rows each) that hold those key groups, fetched by ranged reads from an object store and
    memory-mapped on local disk (where only those pages are read, without a copy). Nothing
    is checksummed: the bytes of the whole file are never read.

    ``probe``: a point lookup's sort key (``keyscale.state.order.sort_keys`` of its key group
    and key). In a file with fences only the record batches whose fences can hold it are
    read, so the rows returned are those of the key group in those batches: every row of
    that key, not every row of its key group."""
    table = _read_ranged(store, f, rng, window=tail_bytes(f), tail=tail, probe=probe)
    if table is None:  # a file without fixed batch sizes: read whole
        table = _open_state_file(store, f, verify=False)
        first, last = _rows_of(table.schema.metadata, f, rng)
        table = table.slice(first, max(0, last - first))
    return table


def _fenced(meta: dict[bytes, bytes], batches: range, probe: int) -> range:
    """Of ``batches`` (those holding a key group), the ones whose fences can hold sort key
    ``probe``: batch ``i`` holds sort keys from its fence to the next batch's fence (both
    included: equal sort keys may straddle a boundary). All of ``batches`` when the file
    has no fences of the rule this code reads."""
    return fenced_batches(file_fences(meta), batches, probe)


def file_fences(meta: dict[bytes, bytes]) -> list[int] | None:
    """The fences in a state file's schema metadata, None when it has none of the rule this
    code reads."""
    raw = meta.get(_FENCES_KEY)
    if raw is None or meta.get(_FENCE_RULE_KEY) != FENCE_RULE.encode():
        return None
    return list(json.loads(raw))


def fenced_batches(fences: list[int] | None, batches: range, probe: int) -> range:
    """:func:`_fenced` with the file's fences parsed (:func:`file_fences`)."""
    if fences is None or not batches:
        return batches
    lo = bisect.bisect_left(fences, probe)  # batches before lo - 1 end before probe
    hi = bisect.bisect_right(fences, probe)  # batches from hi on start after probe
    first, last = max(batches.start, lo - 1), min(batches.stop, hi)
    return range(first, last) if last > first else range(batches.start, batches.start)


def _read_ranged(
    store: Store, f: StateFile, rng: KeyGroupRange, window: int = 1 << 20, tail: tuple[int, bytes] | None = None,
    probe: int | None = None,
) -> pa.Table | None:
    """Only the record batches of ``f`` that hold key groups ``rng`` (and can hold sort key
    ``probe``, if given, in a file with fences); None: the file has no fixed batch size,
    read it whole."""
    raw: _Ranged | None = None
    try:
        if isinstance(store, LocalStore):  # memory-mapped: only the pages of the footer and those batches are read
            reader = pa.ipc.open_file(pa.memory_map(str(store.path(f.path))), options=_READ_OPTIONS)
        else:
            raw = _Ranged(store, f.path, f.bytes, window, tail)
            reader = pa.ipc.open_file(pa.PythonFile(raw, mode="r"), options=_READ_OPTIONS)
    except FileNotFoundError:
        raise StateError(f"state file {store.url(f.path)} is missing") from None
    except (pa.ArrowInvalid, OSError) as e:
        raise StateError(f"state file {store.url(f.path)} is unreadable ({e})") from None
    meta = reader.schema.metadata or {}
    chunk = int(meta.get(_CHUNK_KEY, b"0"))
    if chunk <= 0:
        return None
    first, last = _rows_of(meta, f, rng)
    if last <= first:
        return reader.schema.empty_table()
    todo = range(first // chunk, (last - 1) // chunk + 1)
    if probe is not None:
        todo = _fenced(meta, todo, probe)
        if not todo:
            return reader.schema.empty_table()
    if raw is not None and reader.num_record_batches:
        # A batch's message in one request: its metadata and body together, about the
        # file's size over its batches (a read of just the first bytes would take a second).
        raw.window = max(window, min(8 << 20, f.bytes // reader.num_record_batches * 5 // 4))
    try:
        table = pa.Table.from_batches([reader.get_batch(i) for i in todo], schema=reader.schema)
    except FileNotFoundError:  # deleted since its footer was read
        raise StateError(f"state file {store.url(f.path)} is missing") from None
    except (pa.ArrowInvalid, OSError) as e:
        raise StateError(f"state file {store.url(f.path)} is unreadable ({e})") from None
    lo, hi = max(first, todo.start * chunk), min(last, todo.stop * chunk)
    return table.slice(lo - todo.start * chunk, hi - lo)


def read_state_slice(job_dir: Location, f: StateFile, rng: KeyGroupRange, verify: bool = False) -> pa.Table:
    """The rows of key groups ``rng`` in state file ``f``: memory-mapped on local disk (pages
    outside the slice are never read); on an object store, a large file of which only part
    is needed is read by byte ranges (a key group that moved reads its rows, not the file)."""
    store = open_store(job_dir, "job directory")
    partial = rng.start > f.start or rng.end < f.end
    if partial and not verify and not isinstance(store, LocalStore) and f.bytes >= RANGED_MIN_BYTES:
        ranged = _read_ranged(store, f, rng)
        if ranged is not None:
            return ranged
    table = _open_state_file(store, f, verify)
    first, last = _rows_of(table.schema.metadata, f, rng)
    return table.slice(first, max(0, last - first))


def verify_state_file(job_dir: Location, f: StateFile) -> str | None:
    """None when the file is intact, else a sentence saying what is wrong."""
    return state_bytes_problem(f, open_store(job_dir, "job directory").get_or_none(f.path))


def state_size_problem(f: StateFile, size: int | None) -> str | None:
    """What is wrong with state file ``f`` found with ``size`` bytes (None: absent)."""
    if size is None:
        return f"state file {f.path} is missing"
    if size != f.bytes:
        return f"state file {f.path} has {size} bytes, expected {f.bytes}"
    return None


def state_bytes_problem(f: StateFile, data: bytes | None) -> str | None:
    """What is wrong with ``data`` read as state file ``f`` (None: intact, by size and crc32)."""
    problem = state_size_problem(f, None if data is None else len(data))
    if problem is not None or data is None:
        return problem
    if zlib.crc32(data) != f.crc32:
        return f"state file {f.path} fails its checksum"
    return None
