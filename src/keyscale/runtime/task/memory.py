"""The memory state backend in a task: the subtask's key groups in the Python worker.

Warm state: Spark reuses Python worker processes, so each worker keeps, per operator, the
state of the key groups it has served together with the version of each. A task whose key
groups are held at the committed version reads nothing; one a few batches behind applies
only the deltas since; otherwise (first batch, moved key groups, a newer snapshot) it loads
from the checkpoint. A worker marks key groups invalid while it updates them, so a failed
attempt never leaves a copy that claims a version it does not have. Copies of key groups
another worker now advances are kept up to a bound (``KEYSCALE_STALE_STATE_MB``) and dropped
beyond it, so a subtask that swaps workers catches up from the deltas instead of reloading,
and an executor holds at most that much more than one copy of each key per worker.

:class:`MemoryBackend` is this as a :class:`~keyscale.runtime.task.backend.TaskStateBackend`:
the batch works on the worker's table itself.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa

from keyscale._env import env_number
from keyscale.checkpoint.files import read_state_slice
from keyscale.checkpoint.manifest import StateFile, catch_up
from keyscale.runtime.task.spec import StageTask
from keyscale.state.keygroups import KeyGroupRange
from keyscale.state.table import KeyedStateTable
from keyscale.storage import Store


class Held:
    """A worker's warm copy of one operator's state: some key groups, each at a version."""

    def __init__(self, spec: StageTask):
        self.run_id = spec.run_id
        self.signature = _signature(spec)
        names = [*spec.key_names, *(k for k, _ in spec.extra_keys)]
        self.table = KeyedStateTable(names, [*spec.key_types, *(t for _, t in spec.extra_keys)], spec.states)
        self.version = np.full(spec.max_parallelism, -1, dtype=np.int64)
        self.last_used = np.full(spec.max_parallelism, -1, dtype=np.int64)
        self.tasks: dict[int, tuple[int, int]] = {}  # per batch (this one, the one before): subtasks served, of how many


def _signature(spec: StageTask) -> tuple[Any, ...]:
    return (spec.key_names, spec.extra_keys, spec.states, spec.max_parallelism)


# Lives as long as the Python worker process: that is what keeps state warm.
_HELD: dict[tuple[str, str], Held] = {}


def obtain_state(spec: StageTask, rng: KeyGroupRange) -> tuple[Held, dict[str, int]]:
    """The worker's state for ``rng`` brought to version ``spec.committed``."""
    key = (spec.store.uri, spec.uid)
    held = _HELD.get(key)
    if held is None or held.run_id != spec.run_id or held.signature != _signature(spec):
        held = _HELD[key] = Held(spec)
    _evict(held, rng, spec.batch_id, spec.parallelism)  # before loading: one copy at a time, at the peak too
    lo, hi = rng.start, rng.end
    ver = held.version[lo : hi + 1].copy()
    held.version[lo : hi + 1] = -1  # invalid until this task finishes
    full, reads, stats = catch_up(spec.files, rng, ver, spec.committed, spec.max_parallelism)
    spec.await_pending(reads)
    held.table.drop_groups(np.flatnonzero(full) + lo)
    # In batch order, a delta over what came before it: applied as one, each key once.
    held.table.apply_all(list(_fetch_in_order(spec.store, reads)))
    if stats["files_read"]:
        held.table.compact()  # deletes replayed from deltas leave all-null rows
    return held, stats


# Slices fetched at once from an object store (obstore releases the GIL): a restore after a
# rescale waits for the slowest request, not for the sum.
_PREFETCH = 8


def _fetch_in_order(store: Store, reads: list[tuple[StateFile, KeyGroupRange]]) -> Iterator[pa.Table]:
    """The slices of ``reads``, in order; from an object store several in flight at once."""
    if store.is_local or len(reads) < 2:
        for f, r in reads:
            yield read_state_slice(store, f, r)
        return
    with ThreadPoolExecutor(max_workers=_PREFETCH, thread_name_prefix="keyscale-restore") as pool:
        pending = deque(pool.submit(read_state_slice, store, f, r) for f, r in reads[:_PREFETCH])
        for f, r in reads[_PREFETCH:]:
            yield pending.popleft().result()
            pending.append(pool.submit(read_state_slice, store, f, r))
        while pending:
            yield pending.popleft().result()


# A worker's copies of key groups it did not serve in this batch are stale: another worker
# advances them. Kept, such a copy saves a reload when its key groups come back (it then
# catches up from the deltas since). Spark gives a task whichever Python worker is idle
# (its idle workers are a queue: the first to finish the last batch takes the first task
# of the next), so subtasks swap workers in many batches. With no stale copy each swap
# reloads the range from the checkpoint: at 10M string keys on S3 the batches that did took
# 3.4-6.3 s, against 0.3-0.6 s with the copy kept (docs/benchmarks.md, "Worker swaps at 10M keys").
# The price is memory: every worker ends up holding the ranges of the subtasks it swaps with.
# So stale copies are kept newest first up to KEYSCALE_STALE_STATE_MB (in the executors'
# environment; 256 by default) per worker and operator: in that run the other subtask's 5M
# string keys fit (~30 bytes a key in the table, ~150 MB), so each of the two workers held
# all 10M; a larger range is dropped and reloaded when it comes back. 0 keeps none (one
# copy per executor, every swap a reload).
DEFAULT_STALE_STATE_MB = 256.0


def stale_copy_bytes() -> int:
    """The stale copies' budget, ``KEYSCALE_STALE_STATE_MB`` of the executor's environment
    (256 when unset), in bytes; read at each use, so a bad value fails the task that needs it,
    naming the variable."""
    return int(env_number("KEYSCALE_STALE_STATE_MB", DEFAULT_STALE_STATE_MB, "megabytes", from_=0) * 2**20)


def _evict(held: Held, rng: KeyGroupRange, batch: int, parallelism: int, keep_batches: int = 3) -> None:
    """Forget stale copies beyond ``KEYSCALE_STALE_STATE_MB``: those of key groups not served in
    this batch (they moved or another worker has them), newest kept first, once the worker
    has served its likely share of the batch's subtasks (a worker may run several, one after
    the other): as many as in the batch before, scaled by the change of parallelism. With no
    budget, also those not served for ``keep_batches`` batches, at once. With one, the budget
    alone bounds them, whatever their age: a subtask often runs on the same worker for more
    than a few batches, and a copy dropped for its age turned the next swap into a reload
    (docs/benchmarks.md, "Worker swaps at 10M keys"); one older than the newest snapshot is
    reloaded anyway (:func:`~keyscale.checkpoint.manifest.catch_up`)."""
    held.last_used[rng.start : rng.end + 1] = batch
    held.tasks = {b: t for b, t in held.tasks.items() if b >= batch - 1}
    held.tasks[batch] = (held.tasks.get(batch, (0, parallelism))[0] + 1, parallelism)
    before, of = held.tasks.get(batch - 1, (0, 1))
    done = held.tasks[batch][0] >= before * parallelism / of
    budget = stale_copy_bytes()
    stale = (held.version >= 0) & (held.last_used < batch - keep_batches) & (budget == 0)
    others = np.flatnonzero((held.version >= 0) & (held.last_used < batch) & ~stale)
    if done and len(others) and len(held.table):
        row_bytes = sum(held.table.memory().values()) / len(held.table)
        rows = held.table.group_rows()[: len(held.version)]
        newest_first = others[np.argsort(-held.last_used[others], kind="stable")]
        kept = int(np.searchsorted(np.cumsum(rows[newest_first] * row_bytes), budget, side="right"))
        stale[newest_first[kept:]] = True
    if stale.any():
        held.table.drop_groups(np.flatnonzero(stale))
        held.version[stale] = -1


class MemoryBackend:
    """A task's use of the worker's warm state (:func:`obtain_state`): the batch changes the
    worker's table in place, so there is nothing to write back."""

    def __init__(self, spec: StageTask, rng: KeyGroupRange):
        self.spec, self.rng = spec, rng
        self.held: Held | None = None

    @property
    def table(self) -> KeyedStateTable:
        assert self.held is not None, "load() first"
        return self.held.table

    def load(self, records: Callable[[], pa.Table]) -> dict[str, Any]:
        """The worker's copy of the range at the committed version (``records`` unread: the
        whole range is here)."""
        self.held, stats = obtain_state(self.spec, self.rng)
        return dict(stats)

    def write_back(self, rows: np.ndarray) -> None:
        pass  # the batch changed the held table itself

    def snapshot(self, changed: np.ndarray, part: KeyGroupRange) -> Iterator[pa.Table]:
        """The live rows of ``part`` in the held table (deleted keys left out, the table as
        it is: compacting all of it for a slice would cost more than the slice)."""
        return self.table.arrow_parts(self.table.rows_in_range(part.start, part.end, live_only=True))

    def finish(self, batch: int) -> None:
        assert self.held is not None
        self.held.version[self.rng.start : self.rng.end + 1] = batch
        # Purged windows, expired or deleted keys: dropped once written, at 10% of the rows (a
        # compaction of 5M rows takes ~0.2 s: at most ~0.4 us per dead row, at most ~3 B/key kept).
        if self.table.dead_share() > 0.1:
            self.table.compact()

    def state_keys(self) -> int:
        return self.table.count_in_range(self.rng.start, self.rng.end, live_only=True)

    def close(self) -> None:
        pass  # the worker keeps its copy for the next batch
