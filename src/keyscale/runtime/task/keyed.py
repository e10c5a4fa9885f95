"""What runs in a Spark task: one subtask of one keyed stage for one micro-batch.

The task owns the key groups of its subtask. It gets their state at the last committed
version, processes the batch's records key by key in arrival order, writes the keys that
changed as one state file (and, when the restore chain got long, a snapshot of its whole
range beside it), emits its output rows, and reports what it did (a
:class:`~keyscale.runtime.task.report.TaskReport`, carried to the driver by Spark with the
task's result).

Where the state is between batches is the state backend's (one interface,
:class:`~keyscale.runtime.task.backend.TaskStateBackend`): with ``state_backend="memory"``
a warm copy in the Python worker (:mod:`keyscale.runtime.task.memory`), with ``"rocksdb"``
a RocksDB on the executor's disk from which the task fetches the batch's keys into a small
table (:mod:`keyscale.runtime.task.rocks`). The task runs the same code on either table.

The batch's grouping by key is :mod:`keyscale.runtime.task.grouping`; a vectorized function's
call on it (timers drained, poison keys bisected), :mod:`keyscale.runtime.task.vectorized`;
the state file's upload, :mod:`keyscale.runtime.task.upload`.
"""

from __future__ import annotations

import time
import uuid
from collections import namedtuple
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import pyarrow as pa

from keyscale._faults import fault_point
from keyscale.checkpoint.encode import compressed_on, encode_state_file, spill_state_file
from keyscale.checkpoint.manifest import StateFile, deltas_since
from keyscale.latency import ages
from keyscale.operators.keyed import KeyedProcessFunction, rows_to_arrow
from keyscale.operators.poison import ErrorCollector, null_event_time_mask, run_guarded
from keyscale.operators.vectorized import VectorizedKeyedFunction
from keyscale.operators.windows import WindowAggregate, WindowResult, run_windows
from keyscale.runtime.task import arrival, grouping
from keyscale.runtime.task import vectorized as vectorized_task
from keyscale.runtime.task.backend import TaskStateBackend
from keyscale.runtime.task.counters import window_counters
from keyscale.runtime.task.gcpauses import GcPauses, gc_pauses
from keyscale.runtime.task.grouping import Grouped
from keyscale.runtime.task.memory import MemoryBackend
from keyscale.runtime.task.report import TaskReport
from keyscale.runtime.task.spec import (
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
from keyscale.runtime.task.upload import Upload, release_free_memory
from keyscale.state.contexts import Context, RuntimeContext
from keyscale.state.handles import TIMER_STATES, ttl_column
from keyscale.state.keygroups import KeyGroupRange, key_group_range
from keyscale.state.table import KeyedStateTable
from keyscale.state.types import StateDescriptor, is_numeric

__all__ = ["DEAD", "KG", "LATE", "MAIN", "SEQ", "StageTask", "run_subtask", "side_output_schema", "state_file_name", "with_side_output"]


def _run_per_key(
    fn: KeyedProcessFunction, spec: StageTask, state: KeyedStateTable, g: Grouped, user: pa.Table, opened: RuntimeContext, ctx: Context,
    due_rows: np.ndarray, errors: ErrorCollector,
) -> tuple[pa.Table, np.ndarray]:
    """Due timers, then ``fn.process``, per key with Python state values; only keys whose
    state changed are written back (their rows are returned)."""
    g, due = vectorized_task.with_due_keys(g, state, due_rows)
    pos = state.positions(g.probe)
    columns = _python_columns(state, spec, pos)
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
        written = state.upsert(g.take(sel), g.kgs[sel], updates, pos=pos[sel])
    return rows_to_arrow(emitted, spec.output_schema, spec.uid), written


def _expire(spec: StageTask, state: KeyedStateTable, rng: KeyGroupRange) -> np.ndarray:
    """Expire TTL'd values of the subtask's key groups at the batch time; the rows changed."""
    changed = np.empty(0, dtype=np.intp)
    for s in spec.states:
        if s.ttl_seconds is not None:
            rows = state.expire(s.name, ttl_column(s.name), round(s.ttl_seconds * 1000), spec.batch_time_ms, rng.start, rng.end)
            changed = state.rows_union(changed, rows)
    return changed


def _due_timers(spec: StageTask, state: KeyedStateTable, rng: KeyGroupRange) -> np.ndarray:
    if not spec.timers:
        return np.empty(0, dtype=np.intp)
    event = state.due(TIMER_STATES["event_time"][1], spec.watermark_ms, rng.start, rng.end)
    proc = state.due(TIMER_STATES["processing_time"][1], spec.batch_time_ms, rng.start, rng.end)
    return state.rows_union(event, proc)


def _python_columns(state: KeyedStateTable, spec: StageTask, pos: np.ndarray) -> dict[str, list[Any]]:
    out = {}
    for s in spec.states:
        vals, ok = state.gather(s.name, pos)
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


def run_subtask(spec: StageTask, batches: Iterator[pa.RecordBatch], subtask: int) -> tuple[pa.Table, TaskReport]:
    """Process one subtask's records; returns (output, report) once its state file is
    stored. Needs no Spark: testable alone."""
    out, report, upload = run_subtask_deferred(spec, batches, subtask)
    if upload is not None:
        upload.wait()
    return out, report


def run_subtask_deferred(spec: StageTask, batches: Iterator[pa.RecordBatch], subtask: int) -> tuple[pa.Table, TaskReport, Upload | None]:
    """``run_subtask`` with the state file's upload still running (wait for it before the report goes)."""
    rng = key_group_range(subtask, spec.max_parallelism, spec.parallelism)
    records = _Records(spec, batches)
    backend = open_backend(spec, rng, subtask, records)
    try:
        with gc_pauses() as pauses:
            result = _process(spec, records, subtask, rng, backend, pauses)
    finally:
        backend.close()
    release_free_memory()  # the batch's temporaries are gone now; what is left is the state
    return result


class _Records:
    """The batch's records as one table, read from Spark's iterator at the first call."""

    def __init__(self, spec: StageTask, batches: Iterator[pa.RecordBatch]):
        self._spec, self._batches = spec, batches
        self._table: pa.Table | None = None

    def __call__(self) -> pa.Table:
        if self._table is None:
            parts = list(self._batches)
            self._table = pa.Table.from_batches(parts) if parts else _empty_input(self._spec)
        return self._table


def open_backend(spec: StageTask, rng: KeyGroupRange, subtask: int, records: Callable[[], pa.Table]) -> TaskStateBackend:
    """The subtask's state backend (``spec.state_backend``), open for this task (``records``: the
    batch's records, read on the first call)."""
    if spec.state_backend != "rocksdb":
        return MemoryBackend(spec, rng)  # loads, then the task reads the records
    from keyscale.runtime.task.rocks import RocksSession

    records()  # the batch's records first: its working set is fetched by their keys
    return RocksSession(spec, rng, subtask)


@dataclass
class _Processed:
    """What the batch's records and due timers did (before the state file)."""

    out: pa.Table
    changed: np.ndarray  # rows of the backend's table the batch changed
    late: pa.Table | None = None  # records too late for their windows
    keys: int = 0
    max_event: int | None = None
    windows: WindowResult | None = None  # a window aggregate's result (late, fired, purged)
    counters: dict[str, int] = field(default_factory=dict)  # named counts of records not processed normally (keyscale.runtime.task.counters)
    appended: np.ndarray | None = None  # a file source's records' append times (Unix seconds; arrival.APPENDED)


def _process(
    spec: StageTask, records_of: _Records, subtask: int, rng: KeyGroupRange, backend: TaskStateBackend, pauses: GcPauses,
) -> tuple[pa.Table, TaskReport, Upload | None]:
    started, paused = time.perf_counter(), pauses.seconds
    fn = spec.function
    opened = RuntimeContext(spec.uid, subtask, spec.parallelism, spec.max_parallelism)
    fn.open(opened)
    stats = backend.load(records_of)
    load_seconds = time.perf_counter() - started
    if spec.fault == "mid-batch":
        fault_point("mid-batch", spec.driver_pid)

    table = records_of()
    records = grouping.records(spec, table)
    state = backend.table
    changed_rows = _expire(spec, state, rng)
    due_rows = _due_timers(spec, state, rng)
    errors = ErrorCollector(spec.on_error, spec.uid, spec.batch_id, subtask)
    done = _Processed(spec.output_schema.empty_table(), np.empty(0, dtype=np.intp), spec.input_schema.empty_table())
    # Windows run every batch: without records, some may still be due.
    if table.num_rows or len(due_rows) or isinstance(fn, WindowAggregate):
        done = _run_function(fn, spec, subtask, rng, opened, state, table, records, due_rows, errors)
        changed_rows = state.rows_union(changed_rows, done.changed)
    out, late, max_event, n_keys, windows, counters = done.out, done.late, done.max_event, done.keys, done.windows, done.counters

    written, companion, upload = _write_state_file(spec, subtask, rng, backend, changed_rows)
    backend.finish(spec.batch_id)
    state_keys = backend.state_keys()
    busy, gc_seconds = time.perf_counter() - started, pauses.seconds - paused
    report = TaskReport(
        subtask=subtask, range=(rng.start, rng.end), records=records, max_event_ms=max_event, timer_keys=len(due_rows), keys=n_keys,
        emitted=out.num_rows, file=written, companion=companion, state_keys=state_keys, busy_seconds=busy,
        gc_seconds=min(gc_seconds, busy),  # the collector's pauses within the busy time (runtime/task/gcpauses.py)
        # How the state was loaded (a RocksDB subtask's own load time and fetch too).
        load_seconds=float(stats.get("load_seconds", load_seconds)), warm_key_groups=int(stats["warm_key_groups"]),
        loaded_key_groups=int(stats["loaded_key_groups"]), files_read=int(stats["files_read"]),
        fetched_keys=stats.get("fetched_keys"), copied_from=stats.get("copied_from"),
        late_records=windows.late_records if windows else None, windows_fired=windows.fired if windows else None,
        windows_purged=windows.purged if windows else None,
        counters={**counters, **errors.counters()},
        store_requests=dict(spec.store.requests),  # this task's copy of the store: its own requests
        # A file source's first keyed stage: its records' ages now (the driver adds the time to the commit).
        ages=ages(done.appended, time.time(), arrival.FILE_CLOCK) if done.appended is not None else None,
    )
    dead = errors.dead_letters() if spec.on_error.on_error == "dead_letter" else None
    if spec.late_output or dead is not None:
        out = with_side_output(out, late if spec.late_output else None, dead)
    return out, report, upload


def _run_function(
    fn: Any, spec: StageTask, subtask: int, rng: KeyGroupRange, opened: RuntimeContext, state: KeyedStateTable, table: pa.Table,
    records: int, due_rows: np.ndarray, errors: ErrorCollector,
) -> _Processed:
    """The batch's records (``records`` of them before the null-key check) and due timers
    through the stage's function: a window aggregate, a vectorized function or one per key."""
    done = _Processed(spec.output_schema.empty_table(), np.empty(0, dtype=np.intp), spec.input_schema.empty_table())
    done.appended = arrival.append_times(table)
    table = arrival.in_arrival_order(table, SEQ)
    table = grouping.null_check(spec, table)  # dropped here, not in Spark, so that they are counted
    if (kept := grouping.records(spec, table)) < records:
        done.counters["dropped_null_keys"] = records - kept
    if isinstance(fn, WindowAggregate):
        table = _without_event_time(spec, fn.event_time, table, errors)
    if spec.event_time and table.num_rows:
        done.max_event, ahead = grouping.max_event(spec, table)
        if ahead:
            done.counters["too_far_ahead"] = ahead
    grouped = grouping.group_keys(spec, table)
    done.keys = len(grouped.index)
    user = table.select(list(spec.input_schema.names))
    if isinstance(fn, WindowAggregate):
        try:
            res = run_windows(
                fn, state, rng.start, rng.end, user, [k[grouped.codes] for k in grouped.keys], grouped.kgs[grouped.codes],
                spec.watermark_ms, spec.output_schema, spec.event_time_limit_ms,
            )
        except Exception as e:  # a reduce() function of the user's: it sees the whole batch
            errors.fail_batch(e, "in a window aggregate (it sees the subtask's whole batch: no single record to set aside)")
            raise
        done.out, done.late, done.changed = res.output, res.late, res.changed_rows
        done.windows = res
        done.counters.update(window_counters(res.late_records, res.too_far_ahead, spec.late_output))
    elif isinstance(fn, VectorizedKeyedFunction):
        done.out, done.changed = vectorized_task.run_vectorized_guarded(fn, spec, state, grouped, user, errors, due_rows)
    else:
        ctx = Context(spec.batch_id, spec.batch_time_ms, subtask, spec.watermark_ms)
        ctx.broadcast_state = MappingProxyType(spec.broadcast_state or {})
        done.out, done.changed = _run_per_key(fn, spec, state, grouped, user, opened, ctx, due_rows, errors)
    return done


def _write_state_file(
    spec: StageTask, subtask: int, rng: KeyGroupRange, backend: TaskStateBackend, changed_rows: np.ndarray,
) -> tuple[StateFile | None, StateFile | None, Upload | None]:
    """The batch's state files, their upload started: a delta of the changed rows (none if
    no row changed) and, for the key groups the driver asks it to (``spec.snapshot``), a
    snapshot. Beside a snapshot the delta is kept as its companion, so that a copy of the
    range held on another worker catches up across the snapshot instead of reloading it
    (``StateFile.deltas_since``), and the key groups not snapshotted have the batch's
    changes. Returns the main file (the snapshot, else the delta), the companion (None when
    none was written) and the upload. The backend keeps the changed rows first (a snapshot
    reads them)."""
    part = spec.snapshot[subtask]
    attempt = uuid.uuid4().hex[:12]
    backend.write_back(changed_rows)
    if part is None and not len(changed_rows):
        return None, None, None
    delta_name = state_file_name(spec.uid, spec.batch_id, subtask, "delta", attempt)
    compressed = compressed_on(spec.store)
    if part is None:
        written, data = encode_state_file(delta_name, backend.table.to_arrow(changed_rows), "delta", spec.batch_id, rng, compressed)
        return written, None, Upload(spec, [(delta_name, data)])
    if spec.fault == "in-compaction":
        fault_point("in-compaction", spec.driver_pid)
    since = deltas_since(spec.files, part)
    uploads: list[tuple[str, bytes | Path]] = []
    companion = None
    # Before the snapshot: it reads the rows too. Not needed when the snapshot is the whole
    # range and no copy can cross it (its key groups had no snapshot before this batch's).
    if len(changed_rows) and (since < spec.batch_id or part != rng):
        companion, data = encode_state_file(delta_name, backend.table.to_arrow(changed_rows), "delta", spec.batch_id, rng, compressed)
        uploads.append((delta_name, data))
    name = state_file_name(spec.uid, spec.batch_id, subtask, "snapshot", attempt)
    # Written in parts to a spill file, never whole in memory. backend.snapshot yields rows
    # in file order (key group, then sub key): the file gets fences.
    written, spilled = spill_state_file(name, backend.snapshot(changed_rows, part), backend.table.schema(), "snapshot", spec.batch_id, part,
                                       ordered=True, compressed=compressed)
    if since < spec.batch_id:
        written = replace(written, deltas_since=since)
    return written, companion, Upload(spec, [(name, spilled), *uploads])


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

