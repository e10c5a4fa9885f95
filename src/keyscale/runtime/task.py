"""What runs in a Spark task: one subtask of one keyed stage for one micro-batch.

The task owns the key groups of its subtask. It gets their state at the last committed
version, processes the batch's records key by key in arrival order, writes the keys that
changed as one state file (or, when the restore chain got long, a snapshot of its whole
range), reports what it did in a small sidecar file, and emits its output rows.

Warm state: Spark reuses Python worker processes, so each worker keeps, per operator, the
state of the key groups it has served together with the version of each. A task whose key
groups are held at the committed version reads nothing; one a few batches behind applies
only the deltas since; otherwise (first batch, moved key groups, a newer snapshot) it loads
from the checkpoint. A worker marks key groups invalid while it updates them, so a failed
attempt never leaves a copy that claims a version it does not have. A worker keeps the
state of the subtasks it runs only: copies of key groups another worker now advances are
dropped (see ``STALE_COPY_BYTES``), so an executor holds one copy of each key.

With ``state_backend="rocksdb"`` the state is instead in a RocksDB on the executor's disk
(``keyscale.runtime.rocks_task``): the task fetches the batch's keys from it into a small
table, runs the same code on that table, and writes the changed rows back.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time
import uuid
from collections import deque, namedtuple
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from keyscale.checkpoint.files import (
    encode_state_file,
    put_state_file,
    read_state_slice,
    spill_state_file,
)
from keyscale.checkpoint.manifest import FileKind, StateFile, catch_up
from keyscale.errors import InputDataError, JobDefinitionError, KeyscaleError
from keyscale.operators.eventtime import END_OF_TIME, event_time_ms, max_event_within
from keyscale.operators.keyed import (
    TIMER_STATES,
    Context,
    KeyedProcessFunction,
    RuntimeContext,
    rows_to_arrow,
    ttl_column,
)
from keyscale.operators.poison import (
    ErrorCollector,
    bisect_failures,
    null_event_time_mask,
    null_key_mask,
    one_line,
    run_guarded,
)
from keyscale.operators.vectorized import (
    TIMER,
    KeyedBatch,
    VectorizedKeyedFunction,
    masked,
    to_frame,
    unmasked,
)
from keyscale.operators.windows import WindowAggregate, run_windows
from keyscale.runtime.counters import window_counters
from keyscale.runtime.stagetask import (
    COMBINED_AHEAD,
    COMBINED_EVENT_MS,
    COMBINED_RECORDS,
    DEAD,
    KG,
    LATE,
    MAIN,
    SEQ,
    StageTask,
    side_output_schema,
    state_file_name,
    with_side_output,
)
from keyscale.state.keygroups import KeyGroupRange, key_group_range
from keyscale.state.table import KeyedStateTable, factorize_keys, make_index
from keyscale.state.types import StateDescriptor, is_numeric
from keyscale.storage import Store
from keyscale.storage.scratch import remove_scratch

if TYPE_CHECKING:
    from keyscale.runtime.rocks_task import RocksSession

__all__ = ["DEAD", "KG", "LATE", "MAIN", "SEQ", "StageTask", "run_subtask", "side_output_schema", "state_file_name", "with_side_output"]


class _Held:
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
_HELD: dict[tuple[str, str], _Held] = {}


def obtain_state(spec: StageTask, rng: KeyGroupRange) -> tuple[_Held, dict[str, int]]:
    """The worker's state for ``rng`` brought to version ``spec.committed``."""
    key = (spec.store.uri, spec.uid)
    held = _HELD.get(key)
    if held is None or held.run_id != spec.run_id or held.signature != _signature(spec):
        held = _HELD[key] = _Held(spec)
    _evict(held, rng, spec.batch_id, spec.parallelism)  # before loading: one copy at a time, at the peak too
    lo, hi = rng.start, rng.end
    ver = held.version[lo : hi + 1].copy()
    held.version[lo : hi + 1] = -1  # invalid until this task finishes
    full, reads, stats = catch_up(spec.files, rng, ver, spec.committed, spec.max_parallelism)
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
# catches up from the deltas since); but Spark gives a task whichever Python worker is idle,
# so every worker ends up with a copy of every subtask's state (measured: two workers, two
# subtasks, 10M keys: each worker held all 10M; docs/benchmarks.md). So by default a worker
# keeps none: one copy of the state per executor, and a task that lands on another worker
# than last time reloads its range from the checkpoint. KEYSCALE_STALE_STATE_MB (in the
# executors' environment) keeps stale copies, newest first, up to that size per worker and
# operator: memory for fewer reloads (worth it when the state is small or on an object store).
STALE_COPY_BYTES = int(float(os.environ.get("KEYSCALE_STALE_STATE_MB", "0")) * 2**20)


def _evict(held: _Held, rng: KeyGroupRange, batch: int, parallelism: int, keep_batches: int = 3) -> None:
    """Forget key groups this worker has not served lately (they moved or another worker
    has them), and stale copies beyond ``STALE_COPY_BYTES``: those of key groups not
    served in this batch, once the worker has served its likely share of the batch's
    subtasks (a worker may run several, one after the other): as many as in the batch
    before, scaled by the change of parallelism."""
    held.last_used[rng.start : rng.end + 1] = batch
    held.tasks = {b: t for b, t in held.tasks.items() if b >= batch - 1}
    held.tasks[batch] = (held.tasks.get(batch, (0, parallelism))[0] + 1, parallelism)
    before, of = held.tasks.get(batch - 1, (0, 1))
    done = held.tasks[batch][0] >= before * parallelism / of
    stale = (held.version >= 0) & (held.last_used < batch - keep_batches)
    others = np.flatnonzero((held.version >= 0) & (held.last_used < batch) & ~stale)
    if done and len(others) and len(held.table):
        row_bytes = sum(held.table.memory().values()) / len(held.table)
        rows = np.bincount(held.table.kg, minlength=len(held.version))
        newest_first = others[np.argsort(-held.last_used[others], kind="stable")]
        kept = int(np.searchsorted(np.cumsum(rows[newest_first] * row_bytes), STALE_COPY_BYTES, side="right"))
        stale[newest_first[kept:]] = True
    if stale.any():
        held.table.drop_groups(np.flatnonzero(stale))
        held.version[stale] = -1


def _records(spec: StageTask, table: pa.Table) -> int:
    """The stream's records a batch's rows stand for (a combined row stands for several)."""
    if not spec.combined:
        return table.num_rows
    return int(pc.sum(table.column(COMBINED_RECORDS)).as_py() or 0)


def _max_event(spec: StageTask, table: pa.Table) -> tuple[int | None, int]:
    """The largest event time within the batch's bound, and how many were beyond it."""
    assert spec.event_time is not None
    if not spec.combined:
        return max_event_within(event_time_ms(table, spec.event_time), spec.event_time_limit_ms)
    top = pc.max(table.column(COMBINED_EVENT_MS)).as_py()
    return (int(top) if top is not None else None), int(pc.sum(table.column(COMBINED_AHEAD)).as_py() or 0)


def _null_check(spec: StageTask, table: pa.Table) -> pa.Table:
    """Apply the null-key rule (a NaN key is a null key): stop, naming the column, or drop them."""
    drop = np.zeros(table.num_rows, dtype=bool)
    weight = table.column(COMBINED_RECORDS).to_numpy() if spec.combined else None
    for k in spec.key_names:
        col = table.column(k)
        bad = null_key_mask(col)
        n = int(bad.sum() if weight is None else weight[bad].sum())  # records
        if n and spec.null_keys == "error":
            nan = " (NaN counts as a null key)" if int(bad.sum()) > col.null_count else ""
            raise InputDataError(
                f"null key in column '{k}' of operator '{spec.uid}' (batch {spec.batch_id}, {n} records){nan}; "
                "filter them out before key_by() or use key_by(..., null_keys='drop')"
            )
        drop |= bad
    return table.filter(pa.array(~drop)) if drop.any() else table



@dataclass(frozen=True)
class _Grouped:
    """A batch's records grouped by key: ``order[starts[j]:starts[j+1]]`` are key j's records."""

    codes: np.ndarray  # per record, the index of its key
    index: pd.Index  # the distinct keys, in order of first record
    keys: list[np.ndarray]  # the same, one array per key column
    kgs: np.ndarray  # key group per distinct key
    order: np.ndarray
    starts: np.ndarray
    probe: list[Any]  # the same keys as the state table looks them up (Arrow for a string key: no objects to convert)

    def take(self, idx: np.ndarray) -> list[Any]:
        """The probe columns of keys ``idx``."""
        return [p[idx] if isinstance(p, np.ndarray) else p.take(pa.array(idx, type=pa.int64())) for p in self.probe]


def _group_keys(spec: StageTask, table: pa.Table) -> _Grouped:
    """Factorize the key columns: codes per record, unique keys (first-appearance order), etc."""
    if len(spec.key_names) == 1 and not is_numeric(spec.key_types[0]):
        # One string-like key: Arrow's hash encoding (first-appearance order, as pd.factorize)
        # makes Python objects of the distinct keys only, not of every record's.
        enc: Any = pc.dictionary_encode(table.column(spec.key_names[0]).combine_chunks())
        codes = enc.indices.fill_null(-1).to_numpy(zero_copy_only=False)
        uniques = np.empty(len(enc.dictionary), dtype=object)
        uniques[:] = enc.dictionary.to_pylist()
        index = pd.Index(uniques)
        ukeys = [uniques]
        return _finish_grouping(spec, table, codes, index, ukeys, [enc.dictionary])
    key_arrays = []
    for k, t in zip(spec.key_names, spec.key_types, strict=True):
        col = table.column(k)
        key_arrays.append(np.asarray(col.to_numpy()) if is_numeric(t) else np.asarray(col.to_pylist(), dtype=object))
    codes, index, ukeys = factorize_keys(key_arrays)
    return _finish_grouping(spec, table, codes, index, ukeys)


def _finish_grouping(spec: StageTask, table: pa.Table, codes: Any, index: pd.Index, ukeys: list[np.ndarray], probe: list[Any] | None = None) -> _Grouped:
    codes = np.asarray(codes, dtype=np.int64)
    if len(codes) and codes.min() < 0:  # never after _null_check; never a raw numpy error either
        raise InputDataError(f"operator '{spec.uid}' (batch {spec.batch_id}): a key that cannot be grouped (null or NaN) in {', '.join(spec.key_names)}")
    n = len(index)
    _, first = np.unique(codes, return_index=True)
    kgs = table.column(KG).to_numpy().astype(np.int32)[first] if n else np.empty(0, dtype=np.int32)
    order = np.argsort(codes, kind="stable")
    starts = np.concatenate([[0], np.cumsum(np.bincount(codes, minlength=n))]).astype(np.int64)
    return _Grouped(codes, index, ukeys, kgs, order, starts, probe if probe is not None else ukeys)


_TIMER_COLUMNS = frozenset(c for pair in TIMER_STATES.values() for c in pair)  # kept by keyscale, not the function's


def _run_vectorized(fn: VectorizedKeyedFunction, spec: StageTask, held: _Held, g: _Grouped, user: pa.Table,
                    due: np.ndarray | None) -> tuple[pa.Table, np.ndarray]:
    """One call for the whole batch; every key of the batch is written back (their rows are
    returned). ``due``: with event timers, which keys' timers are due (keys after the
    records' own may have no records)."""
    pos = held.table.positions(g.probe)
    # Only the columns the function says it reads become pandas (a string key column is costly).
    reads = user if fn.input_columns is None else user.select(fn.input_columns)
    timer = None if due is None else masked(*held.table.gather(TIMER, pos), pa.int64())
    batch = KeyedBatch(
        records=to_frame(reads) if fn.pandas_records else pd.DataFrame(index=range(reads.num_rows)),
        codes=g.codes,
        keys=pd.DataFrame({k: u for k, u in zip(spec.key_names, g.keys, strict=True)}),
        state=pd.DataFrame({s.name: masked(*held.table.gather(s.name, pos), s.column_type) for s in spec.states if s.name not in _TIMER_COLUMNS}),
        order=g.order,
        starts=g.starts,
        batch_id=spec.batch_id,
        processing_time=spec.batch_time_ms,
        broadcast_state=MappingProxyType(spec.broadcast_state or {}),
        arrow=reads,
        watermark=spec.watermark_ms,
        timer=None if timer is None else pd.Series(timer),
        due=due,
    )
    new_state, result = fn.process_batch(batch)
    updates = {s.name: unmasked(new_state[s.name], s.column_type) for s in spec.states if s.name in new_state and s.name not in _TIMER_COLUMNS}
    for s in spec.states:  # what was written restarts its TTL clock
        if s.ttl_seconds is not None and s.name in updates:
            ok = updates[s.name][1]
            updates[ttl_column(s.name)] = (np.full(len(ok), spec.batch_time_ms, dtype=np.int64), ok.copy())
    if due is not None:  # a due timer is spent unless the function gives the key a new one
        assert timer is not None
        updates[TIMER] = unmasked(new_state[TIMER], pa.int64()) if TIMER in new_state else unmasked(timer, pa.int64())
        if TIMER not in new_state:
            updates[TIMER][1][due] = False
    rows = held.table.upsert(g.probe, g.kgs, updates, pos=pos)
    return _as_output(spec, result), rows


def _as_output(spec: StageTask, result: pd.DataFrame | pa.Table) -> pa.Table:
    """A vectorized function's output rows as the stage's output schema (an Arrow table is
    cast: a column of nothing but nulls comes back typed null)."""
    if not isinstance(result, pa.Table):
        return pa.Table.from_pandas(result, schema=spec.output_schema, preserve_index=False)
    if result.schema == spec.output_schema:
        return result
    try:
        return result.select(spec.output_schema.names).cast(spec.output_schema)
    except (KeyError, pa.ArrowInvalid, pa.ArrowNotImplementedError):
        want = ", ".join(f"{f.name} {f.type}" for f in spec.output_schema)
        got = ", ".join(f"{f.name} {f.type}" for f in result.schema)
        raise JobDefinitionError(f"operator '{spec.uid}' returned rows ({got}) that do not fit its output schema ({want})") from None


def _run_vectorized_guarded(
    fn: VectorizedKeyedFunction, spec: StageTask, held: _Held, g: _Grouped, user: pa.Table, errors: ErrorCollector, due_rows: np.ndarray,
) -> tuple[pa.Table, np.ndarray]:
    """``_run_vectorized``; when it raises under skip/dead_letter, the keys it fails on are
    found by bisection and set aside (all their records of the batch), the others processed.
    In a drain, the timers the calls set fire after them (``_drain_timers``)."""
    due: np.ndarray | None = None
    if fn.event_timers:  # keys whose timers are due join the batch's, once
        g, due = _with_due_keys(g, held, due_rows)
    draining = due is not None and spec.watermark_ms >= END_OF_TIME
    try:
        out, changed = _run_vectorized(fn, spec, held, g, user, due)
    except KeyscaleError:
        raise
    except Exception as e:
        if not errors.policy.isolates or not len(g.index):
            errors.fail_batch(e, "in a vectorized function (it sees the subtask's whole batch)")
            raise
    else:  # the state is written: a failure from here on fails the batch (bisecting would apply it twice)
        return _drain_timers(fn, spec, held, g, user, out, changed, errors) if draining else (out, changed)

    def attempt(idx: np.ndarray) -> tuple[pa.Table, np.ndarray]:
        sub, sub_user = _subset(g, user, idx)
        return _run_vectorized(fn, spec, held, sub, sub_user, None if due is None else due[np.sort(idx)])

    results, failed = bisect_failures(np.arange(len(g.index)), attempt)
    for j, exc in sorted(failed, key=lambda f: f[0]):
        rows = np.sort(g.order[g.starts[j] : g.starts[j + 1]])
        errors.add(one_line(exc), g.index[j], user.take(rows).to_pylist(), exc)
    out = pa.concat_tables([o for o, _ in results]) if results else spec.output_schema.empty_table()
    changed = np.concatenate([c for _, c in results]) if results else np.empty(0, dtype=np.intp)
    if draining:  # the keys that went through: their timers set in the drain fire in it
        ok = np.setdiff1d(np.arange(len(g.index)), np.array([j for j, _ in failed], dtype=np.int64))
        return _drain_timers(fn, spec, held, _subset(g, user, ok)[0], user, out, changed, errors)
    return out, changed


def _drain_timers(fn: VectorizedKeyedFunction, spec: StageTask, held: _Held, g: _Grouped, user: pa.Table, out: pa.Table,
                  changed: np.ndarray, errors: ErrorCollector) -> tuple[pa.Table, np.ndarray]:
    """At the end of time (a drain) no batch follows: timers the function has just set fire
    now, in further calls with those keys due and no records, until none is left."""
    try:
        return _fire_until_none(fn, spec, held, g, user, out, changed)
    except KeyscaleError:
        raise
    except Exception as e:
        errors.fail_batch(e, "in a vectorized function firing the timers it set at the end of time (a drain)")
        raise


def _fire_until_none(fn: VectorizedKeyedFunction, spec: StageTask, held: _Held, g: _Grouped, user: pa.Table, out: pa.Table,
                     changed: np.ndarray) -> tuple[pa.Table, np.ndarray]:
    outs = [out]
    while True:
        vals, ok = held.table.gather(TIMER, held.table.positions(g.probe))
        idx = np.flatnonzero(ok & (vals <= spec.watermark_ms))
        if not len(idx):
            return pa.concat_tables(outs), changed
        g = _Grouped(np.empty(0, dtype=np.int64), g.index[idx], [k[idx] for k in g.keys], g.kgs[idx], np.empty(0, dtype=np.int64),
                     np.zeros(len(idx) + 1, dtype=np.int64), g.take(idx))
        more, rows = _run_vectorized(fn, spec, held, g, user.slice(0, 0), np.ones(len(idx), dtype=bool))
        outs.append(more)
        changed = held.table.rows_union(changed, rows)


def _subset(g: _Grouped, user: pa.Table, idx: np.ndarray) -> tuple[_Grouped, pa.Table]:
    """The keys ``idx`` (positions in ``g.index``) of a grouped batch, with their records in arrival order."""
    idx = np.sort(idx)
    rows = np.sort(np.concatenate([g.order[g.starts[j] : g.starts[j + 1]] for j in idx]))
    remap = np.full(len(g.index), -1, dtype=np.int64)
    remap[idx] = np.arange(len(idx))
    codes = remap[g.codes[rows]]
    starts = np.concatenate([[0], np.cumsum(np.bincount(codes, minlength=len(idx)))]).astype(np.int64)
    sub = _Grouped(codes, g.index[idx], [k[idx] for k in g.keys], g.kgs[idx], np.argsort(codes, kind="stable"), starts, g.take(idx))
    return sub, user.take(rows)


def _with_due_keys(g: _Grouped, held: _Held, due_rows: np.ndarray) -> tuple[_Grouped, np.ndarray]:
    """The batch's keys followed by keys that have only due timers; and which keys are due."""
    if not len(due_rows):
        return g, np.zeros(len(g.index), dtype=bool)
    due_keys = held.table.key_values(due_rows)
    due_index = make_index(due_keys)
    extra = ~np.asarray(due_index.isin(g.index), dtype=bool)
    index = g.index.append(due_index[extra])
    keys = [np.concatenate([a, b[extra].astype(a.dtype, copy=False)]) for a, b in zip(g.keys, due_keys, strict=True)]
    kgs = np.concatenate([g.kgs, held.table.kg[due_rows][extra]]).astype(np.int32)
    starts = np.concatenate([g.starts, np.full(int(extra.sum()), g.starts[-1], dtype=np.int64)])
    due = np.asarray(index.isin(due_index), dtype=bool)
    return _Grouped(g.codes, index, keys, kgs, g.order, starts, keys), due


def _run_per_key(
    fn: KeyedProcessFunction, spec: StageTask, held: _Held, g: _Grouped, user: pa.Table, opened: RuntimeContext, ctx: Context,
    due_rows: np.ndarray, errors: ErrorCollector,
) -> tuple[pa.Table, np.ndarray]:
    """Due timers, then ``fn.process``, per key with Python state values; only keys whose
    state changed are written back (their rows are returned)."""
    g, due = _with_due_keys(g, held, due_rows)
    pos = held.table.positions(g.probe)
    columns = _python_columns(held, spec, pos)
    row_type = namedtuple("Row", spec.input_schema.names, rename=True)  # type: ignore[misc]
    rows = [row_type._make(r) for r in zip(*(c.to_pylist() for c in user.columns), strict=True)]
    cursor = opened._cursor
    ttl = [s for s in spec.states if s.ttl_seconds is not None]
    cursor.ttl_written = {s.name: set() for s in ttl}
    cursor.ttl_read_refresh = frozenset(s.name for s in ttl if s.ttl_refresh == "on_read_and_write")
    def record_at(p: int) -> dict[str, Any]:
        return dict(user.slice(p, 1).to_pylist()[0])

    emitted = list(run_guarded(fn, cursor, ctx, g.index.tolist(), g.kgs, g.order, g.starts, rows, columns, due, errors, record_at))
    for s in ttl:  # restart the TTL clock of what was written (or read)
        clock = columns[ttl_column(s.name)]
        for i in cursor.ttl_written[s.name]:
            clock[i] = spec.batch_time_ms if columns[s.name][i] is not None else None
            cursor.dirty[i] = True
    dirty = np.fromiter(cursor.dirty, dtype=bool, count=len(g.index))
    written = np.empty(0, dtype=np.intp)
    if dirty.any():
        sel = np.flatnonzero(dirty)
        updates = {s.name: _from_python([columns[s.name][i] for i in sel], s) for s in spec.states}
        written = held.table.upsert(g.take(sel), g.kgs[sel], updates, pos=pos[sel])
    return rows_to_arrow(emitted, spec.output_schema, spec.uid), written


def _expire(spec: StageTask, held: _Held, rng: KeyGroupRange) -> np.ndarray:
    """Expire TTL'd values of the subtask's key groups at the batch time; the rows changed."""
    changed = np.empty(0, dtype=np.intp)
    for s in spec.states:
        if s.ttl_seconds is not None:
            rows = held.table.expire(s.name, ttl_column(s.name), round(s.ttl_seconds * 1000), spec.batch_time_ms, rng.start, rng.end)
            changed = held.table.rows_union(changed, rows)
    return changed


def _due_timers(spec: StageTask, held: _Held, rng: KeyGroupRange) -> np.ndarray:
    if not spec.timers:
        return np.empty(0, dtype=np.intp)
    event = held.table.due(TIMER_STATES["event_time"][1], spec.watermark_ms, rng.start, rng.end)
    proc = held.table.due(TIMER_STATES["processing_time"][1], spec.batch_time_ms, rng.start, rng.end)
    return held.table.rows_union(event, proc)


def _python_columns(held: _Held, spec: StageTask, pos: np.ndarray) -> dict[str, list[Any]]:
    out = {}
    for s in spec.states:
        vals, ok = held.table.gather(s.name, pos)
        lst = vals.tolist()
        if not ok.all():
            lst = [v if o else None for v, o in zip(lst, ok, strict=True)]
        out[s.name] = lst
    return out


def _from_python(values: list[Any], desc: StateDescriptor) -> tuple[np.ndarray, np.ndarray]:
    valid = np.fromiter((v is not None for v in values), dtype=bool, count=len(values))
    if is_numeric(desc.column_type):
        zero = False if pa.types.is_boolean(desc.column_type) else 0
        return np.array([v if v is not None else zero for v in values], dtype=desc.column_type.to_pandas_dtype()), valid
    arr = np.empty(len(values), dtype=object)
    arr[:] = values
    return arr, valid


def _empty_input(spec: StageTask) -> pa.Table:
    return spec.input_schema.append(pa.field(SEQ, pa.int64())).append(pa.field(KG, pa.int32())).empty_table()


def run_subtask(spec: StageTask, batches: Iterator[pa.RecordBatch], subtask: int) -> tuple[pa.Table, dict[str, Any]]:
    """Process one subtask's records; returns (output, report) once its state file is
    stored. Needs no Spark: testable alone."""
    out, report, upload = run_subtask_deferred(spec, batches, subtask)
    if upload is not None:
        upload.wait()
    return out, report


def run_subtask_deferred(spec: StageTask, batches: Iterator[pa.RecordBatch], subtask: int) -> tuple[pa.Table, dict[str, Any], Upload | None]:
    """``run_subtask`` with the state file's upload still running (wait for it before the report goes)."""
    result = _process(spec, batches, subtask)
    release_free_memory()  # the batch's temporaries are gone now; what is left is the state
    return result


def _libc() -> Any:
    try:
        lib = ctypes.CDLL(None)
        return lib if hasattr(lib, "malloc_trim") else None  # glibc only
    except OSError:
        return None


_LIBC = _libc()


def release_free_memory() -> None:
    """Hand the memory a batch's temporaries freed back to the system. glibc keeps freed
    heap pages and Arrow's pool its freed segments for reuse; in a worker that idles
    between batches they only inflate its RSS (measured, 1M keys of a running count:
    ~90 bytes per key of state, more than the state itself; docs/benchmarks.md)."""
    pa.default_memory_pool().release_unused()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _process(spec: StageTask, batches: Iterator[pa.RecordBatch], subtask: int) -> tuple[pa.Table, dict[str, Any], Upload | None]:
    if spec.state_backend != "rocksdb":
        return _process_with(spec, batches, subtask, None)
    from keyscale.runtime.rocks_task import RocksSession

    # The batch's records first: its working set is fetched by their keys.
    parts = list(batches)
    session = RocksSession(spec, key_group_range(subtask, spec.max_parallelism, spec.parallelism), subtask)
    try:
        return _process_with(spec, iter(parts), subtask, session)
    finally:
        session.close()


def _process_with(spec: StageTask, batches: Iterator[pa.RecordBatch], subtask: int, rocks: RocksSession | None) -> tuple[pa.Table, dict[str, Any], Upload | None]:
    started = time.perf_counter()
    fn = spec.function
    opened = RuntimeContext(spec.uid, subtask, spec.parallelism, spec.max_parallelism)
    fn.open(opened)
    rng = key_group_range(subtask, spec.max_parallelism, spec.parallelism)
    parts = list(batches) if rocks is not None else []
    held: Any
    if rocks is not None:
        held, stats = rocks.obtain(pa.Table.from_batches(parts) if parts else _empty_input(spec))
    else:
        held, stats = obtain_state(spec, rng)
    load_seconds = time.perf_counter() - started
    if spec.fault == "kill-driver-mid-batch" and spec.driver_pid:
        os.kill(spec.driver_pid, signal.SIGKILL)
        time.sleep(30)

    if rocks is None:
        parts = list(batches)
    table = pa.Table.from_batches(parts) if parts else _empty_input(spec)
    records = _records(spec, table)
    out = spec.output_schema.empty_table()
    changed_rows = _expire(spec, held, rng)
    due_rows = _due_timers(spec, held, rng)
    n_keys = 0
    max_event: int | None = None
    late = spec.input_schema.empty_table()
    window_stats: dict[str, int] = {}
    counters: dict[str, int] = {}  # named counts of records not processed normally (keyscale.runtime.counters)
    errors = ErrorCollector(spec.on_error, spec.uid, spec.batch_id, subtask)
    # Windows run every batch: without records, some may still be due.
    if table.num_rows or len(due_rows) or isinstance(fn, WindowAggregate):
        table = table.take(np.argsort(table.column(SEQ).to_numpy(), kind="stable"))
        table = _null_check(spec, table)  # dropped here, not in Spark, so that they are counted
        if (kept := _records(spec, table)) < records:
            counters["dropped_null_keys"] = records - kept
        if isinstance(fn, WindowAggregate):
            table = _without_event_time(spec, fn.event_time, table, errors)
        if spec.event_time and table.num_rows:
            max_event, ahead = _max_event(spec, table)
            if ahead:
                counters["too_far_ahead"] = ahead
        grouped = _group_keys(spec, table)
        n_keys = len(grouped.index)
        user = table.select(list(spec.input_schema.names))
        if isinstance(fn, WindowAggregate):
            try:
                res = run_windows(
                    fn, held.table, rng.start, rng.end, user, [k[grouped.codes] for k in grouped.keys], grouped.kgs[grouped.codes],
                    spec.watermark_ms, spec.output_schema, spec.event_time_limit_ms,
                )
            except Exception as e:  # a reduce() function of the user's: it sees the whole batch
                errors.fail_batch(e, "in a window aggregate (it sees the subtask's whole batch: no single record to set aside)")
                raise
            out, late, window_stats = res.output, res.late, {"late_records": res.late_records, "windows_fired": res.fired, "windows_purged": res.purged}
            counters.update(window_counters(res.late_records, res.too_far_ahead, spec.late_output))
            changed_rows = held.table.rows_union(changed_rows, res.changed_rows)
        else:
            if isinstance(fn, VectorizedKeyedFunction):
                out, changed = _run_vectorized_guarded(fn, spec, held, grouped, user, errors, due_rows)
            else:
                ctx = Context(spec.batch_id, spec.batch_time_ms, subtask, spec.watermark_ms)
                ctx.broadcast_state = MappingProxyType(spec.broadcast_state or {})
                out, changed = _run_per_key(fn, spec, held, grouped, user, opened, ctx, due_rows, errors)
            changed_rows = held.table.rows_union(changed_rows, changed)

    compact = spec.compact[subtask]
    attempt = uuid.uuid4().hex[:12]
    written: StateFile | None = None
    upload: Upload | None = None
    if rocks is not None:
        rocks.write_back(changed_rows)  # the range's whole state is in RocksDB now (a snapshot reads it)
    if compact:
        if spec.fault == "kill-driver-in-compaction" and spec.driver_pid:
            os.kill(spec.driver_pid, signal.SIGKILL)
            time.sleep(30)
        kind: FileKind = "snapshot"
        if rocks is None:
            held.table.compact()
            rows = held.table.rows_in_range(rng.start, rng.end)
    else:
        kind, rows = "delta", changed_rows
    if compact or len(changed_rows):
        name = state_file_name(spec.uid, spec.batch_id, subtask, kind, attempt)
        if compact:  # the whole range: written in parts to a spill file, never whole in memory
            snapshot = rocks.snapshot_parts(held.table.to_arrow(changed_rows)) if rocks is not None else held.table.arrow_parts(rows)
            written, spilled = spill_state_file(name, snapshot, held.table.schema(), kind, spec.batch_id, rng)
            upload = Upload(spec, name, spilled)
        else:
            written, data = encode_state_file(name, held.table.to_arrow(rows), kind, spec.batch_id, rng)
            upload = Upload(spec, name, data)
    if rocks is not None:
        rocks.finish(spec.batch_id)
        state_keys = rocks.state_keys()
    else:
        held.version[rng.start : rng.end + 1] = spec.batch_id
        # Purged windows, expired or deleted keys: dropped once written, at 10% of the rows (a
        # compaction of 5M rows takes ~0.2 s: at most ~0.4 us per dead row, at most ~3 B/key kept).
        if held.table.dead_share() > 0.1:
            held.table.compact()
        state_keys = len(held.table.rows_in_range(rng.start, rng.end, live_only=True))
    report = {
        "subtask": subtask,
        "range": [rng.start, rng.end],
        "records": records,
        "max_event_ms": max_event,
        "timer_keys": len(due_rows),
        "keys": n_keys,
        "emitted": out.num_rows,
        "file": written.to_json() if written else None,
        "state_keys": state_keys,
        "busy_seconds": time.perf_counter() - started,
        "load_seconds": load_seconds,
        **stats,
        **window_stats,
        "counters": {**counters, **errors.counters()},
        "store_requests": dict(spec.store.requests),  # this task's copy of the store: its own requests
    }
    dead = errors.dead_letters() if spec.on_error.on_error == "dead_letter" else None
    if spec.late_output or dead is not None:
        out = with_side_output(out, late if spec.late_output else None, dead)
    return out, report, upload


def _without_event_time(spec: StageTask, column: str, table: pa.Table, errors: ErrorCollector) -> pa.Table:
    """A window operator's records without an event time (null) are poison: handled by on_error."""
    bad = null_event_time_mask(table.column(column))
    if not bad.any():
        return table
    rows = table.filter(pa.array(bad))
    user = rows.select(list(spec.input_schema.names)).to_pylist()
    keys = rows.select(list(spec.key_names)).to_pylist()
    reason = f"null event time in column '{column}'"
    if spec.on_error.on_error == "fail":
        errors.add(f"{reason} ({int(bad.sum())} records)", _key_of(keys[0]), user[:1], what="a window needs every record's event time; "
                   "filter them out before the window, or set on_error")
    for r, k in zip(user, keys, strict=True):
        errors.add(reason, _key_of(k), [r])
    return table.filter(pa.array(~bad))


def _key_of(row: dict[str, Any]) -> Any:
    vals = list(row.values())
    return vals[0] if len(vals) == 1 else vals


class Upload:
    """A state file's upload in a thread of the task (obstore and file writes release the GIL)."""

    def __init__(self, spec: StageTask, rel_path: str, data: bytes | Path):
        self._error: BaseException | None = None

        def put() -> None:
            try:
                if spec.fault == "kill-driver-mid-upload" and spec.driver_pid:
                    os.kill(spec.driver_pid, signal.SIGKILL)
                    time.sleep(30)
                put_state_file(spec.store, rel_path, data)
            except BaseException as e:  # handed to wait(), in the task's own thread
                self._error = e
            finally:
                if isinstance(data, Path):  # a spilled file: its folder goes with it
                    remove_scratch(data.parent)

        self._thread = threading.Thread(target=put, name="keyscale-upload", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        self._thread.join()
        # The output has streamed on by now (its buffers and the file's bytes are free):
        # from this thread, the one that freed them (Arrow's pool returns a thread's pages
        # only when that thread asks).
        release_free_memory()
        if self._error is not None:
            raise self._error
