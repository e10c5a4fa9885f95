"""Point reads of state files in one round of requests: footers parsed once, then the record
batches a key needs from every file of its restore chain fetched together.

A lookup of one key reads a few files (its key group's snapshot and the deltas after it),
and a file's record batches can be found only from its footer: two round trips in turn
per file, unless the footer is known. Here a file's footer is read once
(:func:`read_footers`: the files' tails in one round, :class:`Footer` keeps what a read
needs: the key-group index, the fences, each record batch's byte range), and from it
:func:`plan_read` says, without any request, which bytes hold a key group (and, in a file
with fences, the record batch that can hold one key); :func:`read_planned` then fetches
the planned ranges of every file in one :meth:`~keyscale.storage.Store.get_ranges` (at
once on an object store, ``pread`` on local disk: one code path for both) and decodes them;
:class:`SliceCache` keeps footers and slices for the lookups that come back.

The byte ranges come from the Arrow footer's record batch blocks (offset, metadata length,
body length), read from its flatbuffer here: pyarrow does not expose them.

>>> import tempfile, pyarrow as pa
>>> from keyscale.checkpoint.encode import write_state_file
>>> from keyscale.state.keygroups import KeyGroupRange
>>> from keyscale.storage import LocalStore
>>> store = LocalStore(tempfile.mkdtemp())
>>> rows = pa.table({"user": ["ann", "bob", "cy"], "__kg": pa.array([0, 1, 1], pa.int32()), "n": [1, 2, 3]})
>>> f = write_state_file(store, "state/op/000000000003-s00000-delta.arrow", rows, "delta", 3, KeyGroupRange(0, 1))
>>> [footer] = read_footers(store, [f])
>>> plan = plan_read(f, footer, KeyGroupRange(1, 1))
>>> read_planned(store, [plan])[0].column("user").to_pylist()
['bob', 'cy']
>>> plan_read(f, footer, KeyGroupRange(5, 5)) is None  # no rows there: nothing to read
True
"""

from __future__ import annotations

import json
import struct
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from keyscale.checkpoint.files import (
    _CHUNK_KEY,
    _INDEX_KEY,
    fenced_batches,
    file_fences,
    read_key_groups_ranged,
    state_file_tail,
    tail_bytes,
)
from keyscale.checkpoint.manifest import StateFile
from keyscale.errors import StateError
from keyscale.state.keygroups import KeyGroupRange
from keyscale.storage import Store

__all__ = ["DEFAULT_CACHE_BYTES", "WHOLE_DELTA_BYTES", "Footer", "PlannedRead", "SliceCache", "parse_footer", "plan_read", "read_footers",
           "read_planned"]


@dataclass(frozen=True)
class Footer:
    """What a read of part of a state file needs of its footer."""

    schema: pa.Schema
    chunk: int  # rows per record batch; 0: not fixed (a file read whole)
    index: dict[int, tuple[int, int]]  # key group -> (first row, rows)
    blocks: tuple[tuple[int, int], ...]  # per record batch: (byte offset, bytes with its metadata)
    fences: list[int] | None  # each record batch's first sort key (files.file_fences)
    nbytes: int  # about what it holds, for a cache's budget

    def rows_of(self, f: StateFile, rng: KeyGroupRange) -> tuple[int, int]:
        """The rows ``[first, last)`` of key groups ``rng`` (``files._rows_of``, from the parsed index)."""
        lo, hi = max(rng.start, f.start), min(rng.end, f.end)
        found = [self.index[kg] for kg in range(lo, hi + 1) if kg in self.index]
        if not found:
            return 0, 0
        return found[0][0], found[-1][0] + found[-1][1]


# An Arrow footer's Block struct: offset, metadata length, (padding), body length.
_BLOCK = np.dtype([("offset", "<i8"), ("meta", "<i4"), ("pad", "<i4"), ("body", "<i8")])


def _record_batch_blocks(footer: bytes) -> list[tuple[int, int]]:
    """The ``recordBatches`` of an Arrow IPC footer (a flatbuffer ``Footer`` table: fields
    version, schema, dictionaries, recordBatches) as (offset, metadata + body length)."""
    u32 = struct.Struct("<I")
    root = u32.unpack_from(footer, 0)[0]
    vtable = root - struct.unpack_from("<i", footer, root)[0]
    vsize = struct.unpack_from("<H", footer, vtable)[0]
    slot = 4 + 2 * 3  # the vtable entry of field 3, recordBatches
    at = struct.unpack_from("<H", footer, vtable + slot)[0] if slot + 2 <= vsize else 0
    if not at:
        return []
    vec = root + at + u32.unpack_from(footer, root + at)[0]
    blocks = np.frombuffer(footer, dtype=_BLOCK, count=u32.unpack_from(footer, vec)[0], offset=vec + 4)
    return list(zip(blocks["offset"].tolist(), (blocks["meta"] + blocks["body"]).tolist(), strict=True))


def parse_footer(store: Store, f: StateFile, tail: tuple[int, bytes]) -> Footer:
    """The footer of state file ``f`` from its ``tail`` (:func:`~keyscale.checkpoint.files.state_file_tail`)."""
    start, data = tail
    try:
        length = int.from_bytes(data[-10:-6], "little")
        # The tail as a file that ends where the state file ends: Arrow reads the footer from
        # it, and asks for room for the file's leading magic before it (a tail of just the
        # footer, read again for its length, has none: padded).
        pad = b"\0" * max(0, length + 18 - len(data))
        reader = pa.ipc.open_file(pa.BufferReader(pad + data), footer_offset=len(pad) + len(data))
        blocks = _record_batch_blocks(data[len(data) - 10 - length : len(data) - 10])
    except (pa.ArrowInvalid, OSError, struct.error, ValueError) as e:
        raise StateError(f"state file {store.url(f.path)} is unreadable ({e})") from None
    meta = reader.schema.metadata or {}
    chunk = int(meta.get(_CHUNK_KEY, b"0"))
    inside = all(o >= 0 and o + n <= start + len(data) for o, n in blocks[:1] + blocks[-1:])  # in file order: the first and last tell
    if len(blocks) != reader.num_record_batches or not inside:
        chunk = 0  # not a layout this reader knows: read the file whole
    index = {kg: (first, n) for kg, first, n in json.loads(meta.get(_INDEX_KEY, b"[]"))}
    size = len(data) + 48 * len(index) + 16 * len(blocks)
    fences = file_fences(meta)
    return Footer(reader.schema, chunk, index, tuple(blocks), fences, size + 8 * len(fences or ()))


def read_footers(store: Store, files: Sequence[StateFile]) -> list[Footer]:
    """The footers of ``files``: their tails in one :meth:`~keyscale.storage.Store.get_ranges`
    (:func:`~keyscale.checkpoint.files.tail_bytes` each; a longer footer takes a second read of its own)."""
    sizes = [tail_bytes(f) for f in files]
    reads = [(f.path, f.bytes - n, n) for f, n in zip(files, sizes, strict=True)]
    tails = _get_ranges(store, files, reads)
    return [parse_footer(store, f, state_file_tail(store, f, tail)) for f, tail in zip(files, tails, strict=True)]


@dataclass(frozen=True)
class PlannedRead:
    """The bytes of one state file that hold the rows a read wants: record batches
    ``batches`` (``None``: the file is read whole), of which rows ``[first, last)``."""

    file: StateFile
    footer: Footer
    rng: KeyGroupRange
    batches: range | None
    first: int
    last: int

    @property
    def byte_range(self) -> tuple[int, int]:
        """(start, length) of the record batches in the file."""
        assert self.batches is not None
        start = self.footer.blocks[self.batches.start][0]
        end_off, end_len = self.footer.blocks[self.batches.stop - 1]
        return start, end_off + end_len - start


def plan_read(f: StateFile, footer: Footer, rng: KeyGroupRange, probe: int | None = None) -> PlannedRead | None:
    """What to read of ``f`` for key groups ``rng`` (and, in a file with fences, for the key
    of sort key ``probe``): None when the file holds none of their rows."""
    first, last = footer.rows_of(f, rng)
    if last <= first:
        return None
    if footer.chunk <= 0:
        return PlannedRead(f, footer, rng, None, first, last)
    todo = range(first // footer.chunk, (last - 1) // footer.chunk + 1)
    if probe is not None:
        todo = fenced_batches(footer.fences, todo, probe)
        if not todo:
            return None
    lo, hi = max(first, todo.start * footer.chunk), min(last, todo.stop * footer.chunk)
    return PlannedRead(f, footer, rng, todo, lo, hi)


def read_planned(store: Store, plans: Sequence[PlannedRead]) -> list[pa.Table]:
    """The rows each plan wants, its record batches of every file fetched in one
    :meth:`~keyscale.storage.Store.get_ranges` (a file without fixed batches: read whole)."""
    ranged = [p for p in plans if p.batches is not None]
    data = _get_ranges(store, [p.file for p in ranged], [(p.file.path, *p.byte_range) for p in ranged])
    fetched = dict(zip((id(p) for p in ranged), data, strict=True))
    out = []
    for p in plans:
        if p.batches is None:
            out.append(read_key_groups_ranged(store, p.file, p.rng))
            continue
        buf, base = pa.py_buffer(fetched[id(p)]), p.byte_range[0]
        batches = []
        try:
            for i in p.batches:
                off, n = p.footer.blocks[i]
                batches.append(pa.ipc.read_record_batch(pa.ipc.read_message(buf.slice(off - base, n)), p.footer.schema))
        except (pa.ArrowInvalid, OSError, EOFError) as e:
            raise StateError(f"state file {store.url(p.file.path)} is unreadable ({e})") from None
        table = pa.Table.from_batches(batches, schema=p.footer.schema)
        out.append(table.slice(p.first - p.batches.start * p.footer.chunk, p.last - p.first))
    return out


def _get_ranges(store: Store, files: Sequence[StateFile], reads: list[tuple[str, int, int]]) -> list[bytes]:
    """``store.get_ranges(reads)`` of ``files``' bytes; a missing file or a short read is a
    StateError naming the file."""
    if not reads:
        return []
    try:
        got = store.get_ranges(reads)
    except FileNotFoundError as e:
        where = e.filename or (e.args[0] if e.args else "")
        raise StateError(f"state file {where} is missing") from None
    for f, (_, _, length), data in zip(files, reads, got, strict=True):
        if len(data) != length:
            raise StateError(f"state file {store.url(f.path)} is damaged (shorter than its checkpoint's entry says)")
    return got


# -- the cache ------------------------------------------------------------------------------------

#: Bytes of footers and key-group slices a :class:`~keyscale.state_processor.StateLookup` keeps (64 MiB).
DEFAULT_CACHE_BYTES = 64 << 20

#: A delta of at most this many bytes (and at most 1/16 of the cache) is read whole the first
#: time a lookup needs it, and kept.
WHOLE_DELTA_BYTES = 4 << 20


class SliceCache:
    """A least-recently-used cache of what lookups read of state files: parsed footers and
    key-group slices (by the record batches read), bounded by their bytes, safe to share
    between threads.

    Entries are keyed by the file's path *and* checksum (a state file never changes once
    written; a path is never reused for other bytes), so no entry is ever stale; a file
    retention deleted just stops being asked for and ages out.
    """

    def __init__(self, max_bytes: int = DEFAULT_CACHE_BYTES):
        self.max_bytes = max_bytes
        self._items: OrderedDict[tuple[Any, ...], tuple[Any, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes = 0
        self.hits = 0
        self.misses = 0

    def _get(self, key: tuple[Any, ...]) -> Any:
        with self._lock:
            found = self._items.get(key)
            if found is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return found[0]

    def _put(self, key: tuple[Any, ...], value: Any, size: int) -> None:
        if size > self.max_bytes:
            return
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.bytes -= old[1]
            self._items[key] = (value, size)
            self.bytes += size
            while self.bytes > self.max_bytes:
                _, (_, dropped) = self._items.popitem(last=False)
                self.bytes -= dropped

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self.bytes = 0

    def footers(self, store: Store, files: Sequence[StateFile]) -> list[Footer]:
        """The parsed footers of ``files``: from the cache, those missing read in one round."""
        idents = [("footer", store.uri, f.path, f.crc32, f.bytes) for f in files]
        found = [self._get(i) for i in idents]
        missing = [k for k, ft in enumerate(found) if ft is None]
        if missing:
            for k, ft in zip(missing, read_footers(store, [files[k] for k in missing]), strict=True):
                found[k] = ft
                self._put(idents[k], ft, ft.nbytes)
        return found

    def slices(self, store: Store, files: Sequence[StateFile], rng: KeyGroupRange, probe: int | None = None) -> list[pa.Table]:
        """The rows of key groups ``rng`` in each of ``files``: from the cache, else fetched by
        byte range, every file's at once (:func:`read_planned`),
        their footers first if not cached. ``probe``: a key's sort key
        (:func:`keyscale.state.order.sort_keys`): in a file with fences, only the rows of
        ``rng`` in the record batch(es) that can hold that key.

        A slice is cached by the record batches it was read from, not by the key: another key
        of the same record batch (of a delta: of the key group) takes it from the cache. A
        small delta (``WHOLE_DELTA_BYTES``) is read and kept whole instead: every key group's
        lookup reads the deltas of its chain, and, held whole, the newest deltas serve every
        key after the first lookup, so a lookup's round of reads is its snapshot's record
        batch alone (one request, where a chain of 8 files made 8, the slowest setting
        the lookup's time on a busy object store)."""
        out: list[pa.Table] = []
        todo: list[tuple[int, PlannedRead, tuple[Any, ...], tuple[int, int] | None]] = []
        for f, footer in zip(files, self.footers(store, files), strict=True):
            plan = plan_read(f, footer, rng, probe)
            if plan is None:  # the file holds no row of the key group (or of the key's batch)
                out.append(footer.schema.empty_table())
                continue
            if f.kind == "delta" and footer.chunk > 0 and f.bytes <= min(WHOLE_DELTA_BYTES, self.max_bytes // 16):
                key: tuple[Any, ...] = ("whole", store.uri, f.path, f.crc32, f.bytes)
                first, last = footer.rows_of(f, rng)
                whole = self._get(key)
                if whole is None:  # its place in ``out`` is filled once fetched
                    todo.append((len(out), PlannedRead(f, footer, f.range, range(len(footer.blocks)), 0, f.rows), key, (first, last)))
                out.append(footer.schema.empty_table() if whole is None else whole.slice(first, last - first))
                continue
            read = None if plan.batches is None else (plan.batches.start, plan.batches.stop)
            key = (store.uri, f.path, f.crc32, f.bytes, rng.start, rng.end, read)
            cached = self._get(key)
            if cached is None:
                todo.append((len(out), plan, key, None))
            out.append(cached)
        for (i, _, key, wanted), table in zip(todo, read_planned(store, [plan for _, plan, _, _ in todo]), strict=True):
            if wanted is not None:  # a whole delta: kept whole, its rows of ``rng`` handed out
                self._put(key, table, max(1, table.get_total_buffer_size()))
                out[i] = table.slice(wanted[0], wanted[1] - wanted[0])
                continue
            if self.max_bytes and table.num_rows and table.get_total_buffer_size() > 2 * table.nbytes:
                # A view of fetched record batches much larger than the key group's rows
                # (batches holding other key groups too): kept, it would hold them all; a
                # copy of its own rows lets the cache hold many more slices.
                table = table.take(np.arange(table.num_rows))
            self._put(key, table, max(1, table.get_total_buffer_size()))
            out[i] = table
        return out

    def slice(self, store: Store, f: StateFile, rng: KeyGroupRange, probe: int | None = None) -> pa.Table:
        """:meth:`slices` of one file."""
        return self.slices(store, [f], rng, probe)[0]
