"""The RocksDB state backend in a task: the subtask's RocksDB brought to the committed
checkpoint, the batch's working set fetched from it, the changed rows written back.

Where the database lives: one per (job directory, operator, run, parallelism, subtask
index) in the executor's scratch space (:mod:`keyscale.storage.scratch`). A task opens it,
and closes it when it ends, so whichever Python worker of the executor runs the subtask
next opens the same files: one copy per executor, never one per worker. When the
parallelism changes, a new subtask starts from a copy (hard links) of the old database
holding most of its range, keeps the key groups of its range that copy holds at the
committed batch, drops the others (DeleteRange) and loads the rest from the checkpoint's
state files; once a batch has committed at the new parallelism the old databases are
deleted, and so are those of earlier runs.

What a database reflects is recorded in it: per key group the checkpoint batch. A task
marks its range unusable (-1) before it changes anything and records the batch it wrote
at the end, so a task killed half-way leaves a database whose range the next attempt
reloads from the files; one at a batch later than the committed one (an attempt whose
batch did not commit) is reloaded too. The state files stay the source of truth: deltas
and snapshots are written exactly as with the in-memory backend.
"""

from __future__ import annotations

import hashlib
import re
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from keyscale.checkpoint.files import read_state_slice
from keyscale.checkpoint.manifest import StateFile, catch_up
from keyscale.errors import KeyscaleError
from keyscale.operators.eventtime import NO_WATERMARK
from keyscale.operators.windows import WINDOW_END, WindowAggregate
from keyscale.runtime.task.spec import StageTask
from keyscale.state.handles import TIMER_STATES, ttl_column
from keyscale.state.keygroups import KeyGroupRange, key_group_range, mask_runs
from keyscale.state.rocksdb import RocksState, Working
from keyscale.state.table import KeyedStateTable
from keyscale.storage.scratch import remove_scratch, scratch_children, scratch_dir

KG = "__kg"
# Rows of state files loaded into RocksDB at once when a key-group range is restored: the
# restore's memory is bounded by this, not by the state's size.
LOAD_CHUNK_ROWS = 500_000
# How long a new subtask waits for another one copying the same database (a copy is hard links:
# well under a second) before it loads its range from the state files instead.
DONOR_WAIT_SECONDS = 30.0


def _db_name(subtask: int, parallelism: int) -> str:
    """The folder of subtask ``subtask``'s database at ``parallelism``: per parallelism, so that
    after a rescale the databases of the old one are there to copy until every new subtask has
    its own."""
    return f"s{subtask}-of-{parallelism}"


def _db_range(name: str, max_parallelism: int) -> KeyGroupRange | None:
    m = re.fullmatch(r"s(\d+)-of-(\d+)", name)
    if m is None or not 0 <= int(m.group(1)) < int(m.group(2)) <= max_parallelism:
        return None
    return key_group_range(int(m.group(1)), max_parallelism, int(m.group(2)))


def _overlap(a: KeyGroupRange, b: KeyGroupRange) -> int:
    return max(0, min(a.end, b.end) - max(a.start, b.start) + 1)


def _plain(name: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:40]
    return f"{safe}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"


def indexed_columns(spec: StageTask) -> list[tuple[str, int]]:
    """The int64 states that make a key due without a record, each with this batch's bound:
    timers (watermark, batch time), TTL clocks (batch time - TTL), window ends (watermark + 1)."""
    cols: list[tuple[str, int]] = []
    if spec.timers:
        cols += [(TIMER_STATES["event_time"][1], spec.watermark_ms), (TIMER_STATES["processing_time"][1], spec.batch_time_ms)]
    cols += [(ttl_column(s.name), spec.batch_time_ms - round(s.ttl_seconds * 1000)) for s in spec.states if s.ttl_seconds is not None]
    if isinstance(spec.function, WindowAggregate):
        cols.append((WINDOW_END, int(min(max(spec.watermark_ms + 1, NO_WATERMARK), 2**63 - 1))))
    return cols


class RocksSession:
    """One task's use of its subtask's RocksDB (open, bring up to date, fetch, write back,
    close): the RocksDB :class:`~keyscale.runtime.task.backend.TaskStateBackend`, whose
    :attr:`table` is the batch's working set."""

    def __init__(self, spec: StageTask, rng: KeyGroupRange, subtask: int):
        self.spec, self.rng = spec, rng
        job = scratch_dir(_plain(spec.store.uri), _plain(spec.uid))
        for old in scratch_children(job):  # earlier runs of this job: their state is in the files
            if old.name != spec.run_id:
                remove_scratch(old)
        run = scratch_dir(_plain(spec.store.uri), _plain(spec.uid), spec.run_id)
        self.columns = indexed_columns(spec)
        names = [*spec.key_names, *(k for k, _ in spec.extra_keys)]
        types = [*spec.key_types, *(t for _, t in spec.extra_keys)]
        self.args = (names, types, spec.states, spec.max_parallelism, [c for c, _ in self.columns])
        own = run / _db_name(subtask, spec.parallelism)
        others = {p: r for p in scratch_children(run) if (r := _db_range(p.name, spec.max_parallelism)) is not None and p != own}
        self.copied_from: str | None = None
        if not own.exists():  # a new subtask (rescale, other executor): copy the database that holds most of its range
            donors = sorted((p for p, r in others.items() if _overlap(r, rng)), key=lambda p: (-_overlap(others[p], rng), others[p].start))
            self.copied_from = self._copy_nearest(own, donors)
        self.private: Path | None = None
        self._working: Working | None = None
        try:
            self.db = RocksState(own, *self.args)
        except Exception as e:  # held by another attempt of this subtask (speculation, a zombie): a private copy
            if "lock" not in str(e).lower():
                raise KeyscaleError(f"operator '{spec.uid}': cannot open its RocksDB state in {own}: {e}") from e
            self.private = run / f"s{subtask}-{uuid.uuid4().hex[:8]}"
            self.db = RocksState(self.private, *self.args)
        if self.copied_from is None and spec.committed >= 0 and (self.db.versions[rng.start : rng.end + 1] == spec.committed).all():
            # The last committed batch ran at this parallelism: every subtask has its own
            # database, so those of other parallelisms (copied from at a rescale) are stale.
            for p in others:
                if not p.name.endswith(f"-of-{spec.parallelism}"):
                    remove_scratch(p)

    def _copy_nearest(self, own: Path, donors: list[Path]) -> str | None:
        """Make ``own`` a copy (hard links) of the first of ``donors`` that can be opened: the
        database of another parallelism holding the most of this range. It is opened only to
        be copied, by whichever new subtask gets its lock first; the others wait their turn."""
        for donor in donors:
            deadline = time.monotonic() + DONOR_WAIT_SECONDS
            while True:
                try:
                    src = RocksState(donor, *self.args)
                    break
                except Exception as e:  # locked by another subtask copying it: wait; gone or damaged: the next one
                    if "lock" not in str(e).lower() or time.monotonic() > deadline:
                        src = None
                        break
                    time.sleep(0.05)
            if src is None:
                continue
            try:
                src.copy_to(own)
                return donor.name
            except Exception:  # a half-made copy is no database: start empty (the files have the state)
                remove_scratch(own)
            finally:
                src.close()
        return None

    def close(self) -> None:
        self.db.close()
        if self.private is not None:
            remove_scratch(self.private)

    # -- bringing the range to the committed checkpoint --------------------------------------

    @property
    def table(self) -> KeyedStateTable:
        """The batch's working set (after :meth:`load`): the stored rows of its keys and of
        the keys due without a record (timers, TTL, windows)."""
        assert self._working is not None, "load() first"
        return self._working.table

    def load(self, records: Callable[[], pa.Table]) -> dict[str, Any]:
        return self.obtain(records())

    def obtain(self, records: pa.Table) -> dict[str, Any]:
        """Load what the range misses from the state files, then fetch the working set of
        the batch's ``records``."""
        started = time.perf_counter()
        spec, db, lo, hi = self.spec, self.db, self.rng.start, self.rng.end
        outside = np.ones(spec.max_parallelism, dtype=bool)
        outside[lo : hi + 1] = False
        gone = np.flatnonzero(outside & ((db.counts != 0) | (db.versions >= 0)))
        ver = db.versions[lo : hi + 1].copy()
        db.set_versions(lo, hi, -1)  # unusable until this task finishes: first, before any change
        if len(gone):
            db.drop_groups(gone)
        full, reads, stats = catch_up(spec.files, self.rng, ver, spec.committed, spec.max_parallelism)
        spec.await_pending(reads)
        db.drop_groups(np.flatnonzero(full) + lo)
        warm = np.zeros(spec.max_parallelism, dtype=bool)
        warm[lo : hi + 1] = ~full
        self._load(reads, warm)
        w = db.working()
        self._fetch(w, records)
        for column, upto in self.columns:
            db.fetch_due(w, column, upto, lo, hi)
        w.freeze()
        self._working = w
        return {**stats, "load_seconds": time.perf_counter() - started, "fetched_keys": len(w.table), "copied_from": self.copied_from}

    def _chunks(self, reads: list[tuple[StateFile, KeyGroupRange]], every_group: bool = False,
                rng: KeyGroupRange | None = None) -> Iterator[KeyGroupRange]:
        """The key groups of ``rng`` (default: the subtask's range) the slices ``reads`` touch
        (``every_group``: all of them), in runs of about ``LOAD_CHUNK_ROWS`` rows by the
        files' sizes, in order."""
        whole = rng or self.rng
        lo, hi = whole.start, whole.end
        est = np.zeros(hi - lo + 1, dtype=np.float64)  # rows per key group, from the files' sizes
        needed = np.full(hi - lo + 1, every_group)
        for f, r in reads:
            est[r.start - lo : r.end - lo + 1] += f.rows / max(1, f.end - f.start + 1)
            needed[r.start - lo : r.end - lo + 1] = True
        for a, b in mask_runs(needed, lo):
            kg = a
            while kg <= b:
                end = kg
                total = est[kg - lo]
                while end < b and total + est[end + 1 - lo] <= LOAD_CHUNK_ROWS:
                    end += 1
                    total += est[end - lo]
                yield KeyGroupRange(kg, end)
                kg = end + 1

    def _slices(self, reads: list[tuple[StateFile, KeyGroupRange]], chunk: KeyGroupRange) -> list[pa.Table]:
        """The rows of key groups ``chunk`` in the slices ``reads``, in their order."""
        parts = []
        for f, r in reads:
            part = r.intersection(chunk)
            if part is not None:
                t = read_state_slice(self.spec.store, f, part)
                if t.num_rows:
                    parts.append(t)
        return parts

    def _load(self, reads: list[tuple[StateFile, KeyGroupRange]], warm: np.ndarray) -> None:
        """Apply the state files' slices, a chunk of key groups at a time (bounded memory)."""
        for chunk in self._chunks(reads):
            self._load_chunk(self._slices(reads, chunk), chunk, warm)

    def _load_chunk(self, parts: list[pa.Table], chunk: KeyGroupRange, warm: np.ndarray) -> None:
        """One chunk of key groups: warm ones (held at an earlier batch) get their stored
        rows updated by the deltas since; the others were dropped and are written anew."""
        if not parts:
            return
        w = self.db.working()
        if warm[chunk.start : chunk.end + 1].any():
            for p in parts:
                kgs = p.column(KG).to_numpy()
                keep = np.flatnonzero(warm[kgs])
                if len(keep):
                    idx: Any = pa.array(keep)
                    self.db.fetch(w, kgs[keep], [p.column(k).take(idx) for k in self.db.key_names])
        w.freeze()
        w.table.apply_all(parts)
        self.db.write_back(w, np.arange(len(w.table)))

    def _fetch(self, w: Working, records: pa.Table) -> None:
        """The stored rows of the batch's keys: multi-gets in key order (windows: every window of each
        key, by prefix)."""
        spec = self.spec
        if not records.num_rows:
            return
        names = [*spec.key_names, KG]
        keys = records.select(names)
        ok = None
        for k in spec.key_names:
            v = pc.is_valid(keys.column(k))
            ok = v if ok is None else pc.and_(ok, v)
        if ok is not None:
            keys = keys.filter(ok)
        distinct = keys.group_by(names, use_threads=False).aggregate([])
        kgs = distinct.column(KG).to_numpy()
        cols = [distinct.column(k).combine_chunks() for k in spec.key_names]
        if spec.extra_keys:
            self.db.fetch_prefixes(w, kgs, cols, list(spec.key_types))
        else:
            self.db.fetch(w, kgs, cols)

    # -- the end of the batch --------------------------------------------------------------------

    def write_back(self, rows: np.ndarray) -> None:
        """The batch's changed rows into the database: the range's whole state is there now."""
        assert self._working is not None
        self.db.write_back(self._working, rows)

    def snapshot(self, changed: np.ndarray, part: KeyGroupRange) -> Iterator[pa.Table]:
        """The state of key groups ``part`` for a snapshot, a chunk of key groups at a time:
        their checkpoint's files (the latest snapshot and the deltas since) with the batch's
        changed rows of ``part`` applied after them (a slice converts only its own). Arrow and
        numpy over the files: walking every row of the database through ``rocksdict`` took 35 s
        for 50M keys (docs/benchmarks.md, "100M keys"). The database holds the same state."""
        kg = self.table.kg[changed]
        spec, changes = self.spec, self.table.to_arrow(changed[(kg >= part.start) & (kg <= part.end)])
        _, reads, _ = catch_up(spec.files, part, np.full(len(part), -1), spec.committed, spec.max_parallelism)
        spec.await_pending(reads)
        kgs = changes.column(KG).to_numpy()
        for chunk in self._chunks(reads, every_group=True, rng=part):
            a, b = np.searchsorted(kgs, [chunk.start, chunk.end + 1])
            table = self.db.working().table
            table.apply_all([*self._slices(reads, chunk), changes.slice(a, b - a)])
            yield table.to_arrow(table.rows_in_range(chunk.start, chunk.end, live_only=True), file_order=True)

    def finish(self, batch: int) -> None:
        """The range now reflects ``batch`` (written back already)."""
        self.db.set_versions(self.rng.start, self.rng.end, batch)
        self.db.flush()

    def state_keys(self) -> int:
        """The range's keys, as the database counts them."""
        return int(self.db.counts[self.rng.start : self.rng.end + 1].sum())
