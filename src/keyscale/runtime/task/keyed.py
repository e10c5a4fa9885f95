"""What runs in a Spark task: one subtask of one keyed stage for one micro-batch.

The task owns the key groups of its subtask. It gets their state at the last committed
version, processes the batch's records key by key in arrival order, writes the keys that
changed as one state file (or, when the restore chain got long, a snapshot of its whole
range), reports what it did (a :class:`~keyscale.runtime.task.report.TaskReport`, carried to
the driver by Spark with the task's result), and emits its output rows.

Warm state: Spark reuses Python worker processes, so each worker keeps, per operator, the
state of the key groups it has served together with the version of each. A task whose key
groups are held at the committed version reads nothing; one a few batches behind applies
only the deltas since; otherwise (first batch, moved key groups, a newer snapshot) it loads
from the checkpoint. A worker marks key groups invalid while it updates them, so a failed
attempt never leaves a copy that claims a version it does not have. A worker keeps the
state of the subtasks it runs only: copies of key groups another worker now advances are
dropped (see ``STALE_COPY_BYTES``), so an executor holds one copy of each key.

With ``state_backend="rocksdb"`` the state is instead in a RocksDB on the executor's disk
(``keyscale.runtime.task.rocks``): the task fetches the batch's keys from it into a small
table, runs the same code on that table, and writes the changed rows back.

The batch's grouping by key is :mod:`keyscale.runtime.task.grouping`; a vectorized function's
call on it (timers drained, poison keys bisected), :mod:`keyscale.runtime.task.vectorized`.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
import uuid
from collections import deque, namedtuple
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from keyscale._faults import fault_point
from keyscale.checkpoint.files import (
    encode_state_file,
    put_state_file,
    read_state_slice,
    record_upload_failure,
    spill_state_file,
)
from keyscale.checkpoint.manifest import FileKind, StateFile, catch_up
from keyscale.operators.keyed import (
    TIMER_STATES,
    Context,
    KeyedProcessFunction,
    RuntimeContext,
    rows_to_arrow,
    ttl_column,
)
from keyscale.operators.poison import ErrorCollector, null_event_time_mask, run_guarded
from keyscale.operators.vectorized import VectorizedKeyedFunction
from keyscale.operators.windows import WindowAggregate, WindowResult, run_windows
from keyscale.runtime.task import arrival, grouping
from keyscale.runtime.task import vectorized as vectorized_task
from keyscale.runtime.task.counters import window_counters
from keyscale.runtime.task.grouping import Grouped
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
from keyscale.state.keygroups import KeyGroupRange, key_group_range
from keyscale.state.table import KeyedStateTable
from keyscale.state.types import StateDescriptor, is_numeric
from keyscale.storage import Store
from keyscale.storage.scratch import remove_scratch

if TYPE_CHECKING:
    from keyscale.runtime.task.rocks import RocksSession

__all__ = ["DEAD", "KG", "LATE", "MAIN", "SEQ", "StageTask", "run_subtask", "side_output_schema", "state_file_name", "with_side_output"]


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
# catches up from the deltas since); but Spark gives a task whichever Python worker is idle,
# so every worker ends up with a copy of every subtask's state (measured: two workers, two
# subtasks, 10M keys: each worker held all 10M; docs/benchmarks.md). So by default a worker
# keeps none: one copy of the state per executor, and a task that lands on another worker
# than last time reloads its range from the checkpoint. KEYSCALE_STALE_STATE_MB (in the
# executors' environment) keeps stale copies, newest first, up to that size per worker and
# operator: memory for fewer reloads (worth it when the state is small or on an object store).
STALE_COPY_BYTES = int(float(os.environ.get("KEYSCALE_STALE_STATE_MB", "0")) * 2**20)


def _evict(held: Held, rng: KeyGroupRange, batch: int, parallelism: int, keep_batches: int = 3) -> None:
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




def _run_per_key(
    fn: KeyedProcessFunction, spec: StageTask, held: Held, g: Grouped, user: pa.Table, opened: RuntimeContext, ctx: Context,
    due_rows: np.ndarray, errors: ErrorCollector,
) -> tuple[pa.Table, np.ndarray]:
    """Due timers, then ``fn.process``, per key with Python state values; only keys whose
    state changed are written back (their rows are returned)."""
    g, due = vectorized_task.with_due_keys(g, held, due_rows)
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


def _expire(spec: StageTask, held: Held, rng: KeyGroupRange) -> np.ndarray:
    """Expire TTL'd values of the subtask's key groups at the batch time; the rows changed."""
    changed = np.empty(0, dtype=np.intp)
    for s in spec.states:
        if s.ttl_seconds is not None:
            rows = held.table.expire(s.name, ttl_column(s.name), round(s.ttl_seconds * 1000), spec.batch_time_ms, rng.start, rng.end)
            changed = held.table.rows_union(changed, rows)
    return changed


def _due_timers(spec: StageTask, held: Held, rng: KeyGroupRange) -> np.ndarray:
    if not spec.timers:
        return np.empty(0, dtype=np.intp)
    event = held.table.due(TIMER_STATES["event_time"][1], spec.watermark_ms, rng.start, rng.end)
    proc = held.table.due(TIMER_STATES["processing_time"][1], spec.batch_time_ms, rng.start, rng.end)
    return held.table.rows_union(event, proc)


def _python_columns(held: Held, spec: StageTask, pos: np.ndarray) -> dict[str, list[Any]]:
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


def run_subtask(spec: StageTask, batches: Iterator[pa.RecordBatch], subtask: int) -> tuple[pa.Table, TaskReport]:
    """Process one subtask's records; returns (output, report) once its state file is
    stored. Needs no Spark: testable alone."""
    out, report, upload = run_subtask_deferred(spec, batches, subtask)
    if upload is not None:
        upload.wait()
    return out, report


def run_subtask_deferred(spec: StageTask, batches: Iterator[pa.RecordBatch], subtask: int) -> tuple[pa.Table, TaskReport, Upload | None]:
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


def _process(spec: StageTask, batches: Iterator[pa.RecordBatch], subtask: int) -> tuple[pa.Table, TaskReport, Upload | None]:
    if spec.state_backend != "rocksdb":
        return _process_with(spec, batches, subtask, None)
    from keyscale.runtime.task.rocks import RocksSession

    # The batch's records first: its working set is fetched by their keys.
    parts = list(batches)
    session = RocksSession(spec, key_group_range(subtask, spec.max_parallelism, spec.parallelism), subtask)
    try:
        return _process_with(spec, iter(parts), subtask, session)
    finally:
        session.close()


def _process_with(spec: StageTask, batches: Iterator[pa.RecordBatch], subtask: int, rocks: RocksSession | None) -> tuple[pa.Table, TaskReport, Upload | None]:
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
    if spec.fault == "mid-batch":
        fault_point("mid-batch", spec.driver_pid)

    if rocks is None:
        parts = list(batches)
    table = pa.Table.from_batches(parts) if parts else _empty_input(spec)
    records = grouping.records(spec, table)
    out = spec.output_schema.empty_table()
    changed_rows = _expire(spec, held, rng)
    due_rows = _due_timers(spec, held, rng)
    n_keys = 0
    max_event: int | None = None
    late = spec.input_schema.empty_table()
    windows: WindowResult | None = None
    counters: dict[str, int] = {}  # named counts of records not processed normally (keyscale.runtime.task.counters)
    errors = ErrorCollector(spec.on_error, spec.uid, spec.batch_id, subtask)
    # Windows run every batch: without records, some may still be due.
    if table.num_rows or len(due_rows) or isinstance(fn, WindowAggregate):
        table = arrival.in_arrival_order(table, SEQ)
        table = grouping.null_check(spec, table)  # dropped here, not in Spark, so that they are counted
        if (kept := grouping.records(spec, table)) < records:
            counters["dropped_null_keys"] = records - kept
        if isinstance(fn, WindowAggregate):
            table = _without_event_time(spec, fn.event_time, table, errors)
        if spec.event_time and table.num_rows:
            max_event, ahead = grouping.max_event(spec, table)
            if ahead:
                counters["too_far_ahead"] = ahead
        grouped = grouping.group_keys(spec, table)
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
            out, late, windows = res.output, res.late, res
            counters.update(window_counters(res.late_records, res.too_far_ahead, spec.late_output))
            changed_rows = held.table.rows_union(changed_rows, res.changed_rows)
        else:
            if isinstance(fn, VectorizedKeyedFunction):
                out, changed = vectorized_task.run_vectorized_guarded(fn, spec, held, grouped, user, errors, due_rows)
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
        if spec.fault == "in-compaction":
            fault_point("in-compaction", spec.driver_pid)
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
    report = TaskReport(
        subtask=subtask, range=(rng.start, rng.end), records=records, max_event_ms=max_event, timer_keys=len(due_rows), keys=n_keys,
        emitted=out.num_rows, file=written, state_keys=state_keys, busy_seconds=time.perf_counter() - started,
        # How the state was loaded (a RocksDB subtask's own load time and fetch too).
        load_seconds=float(stats.get("load_seconds", load_seconds)), warm_key_groups=int(stats["warm_key_groups"]),
        loaded_key_groups=int(stats["loaded_key_groups"]), files_read=int(stats["files_read"]),
        fetched_keys=stats.get("fetched_keys"), copied_from=stats.get("copied_from"),
        late_records=windows.late_records if windows else None, windows_fired=windows.fired if windows else None,
        windows_purged=windows.purged if windows else None,
        counters={**counters, **errors.counters()},
        store_requests=dict(spec.store.requests),  # this task's copy of the store: its own requests
    )
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
    """A state file's upload in a thread of the task (obstore and file writes release the GIL).

    The task either waits for it (:meth:`wait`: the task reports once the file is stored) or,
    with asynchronous checkpoints (``spec.detach_upload``), leaves it running (:meth:`detach`):
    the worker process outlives the task, and the driver commits the batch's manifest once
    the file exists."""

    def __init__(self, spec: StageTask, rel_path: str, data: bytes | Path):
        self._error: BaseException | None = None
        self._task_over = threading.Event()

        def put() -> None:
            try:
                self._test_fault(spec)
                put_state_file(spec.store, rel_path, data)
            except BaseException as e:  # handed to wait(), in the task's own thread
                self._error = e
            finally:
                if isinstance(data, Path):  # a spilled file: its folder goes with it
                    remove_scratch(data.parent)
                if spec.detach_upload:
                    release_free_memory()
                    if self._error is not None:
                        # The task may be over, and the driver's commit and the next batch's
                        # tasks wait for the file: a failure record beside it ends their wait
                        # at once with this error; the batch is replayed at the next start.
                        recorded = record_upload_failure(spec.store, rel_path, self._error)
                        print(f"keyscale: uploading state file {rel_path} failed: {self._error}"
                              f"{'' if recorded else ' (and so did writing its failure record: the waiters time out)'}",
                              file=sys.stderr, flush=True)

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

    def detach(self) -> None:
        """The task ends; the upload goes on (asynchronous checkpoints). An upload that has
        already failed fails the task instead."""
        self._task_over.set()
        if not self._thread.is_alive() and self._error is not None:
            raise self._error

    def _test_fault(self, spec: StageTask) -> None:
        """Test-only faults (``--fault``, keyscale/_faults.py) in an upload."""
        if spec.fault == "mid-upload" and spec.driver_pid:
            if spec.detach_upload:  # the task has ended: the driver is on to the next batch
                time.sleep(3)
            fault_point("mid-upload", spec.driver_pid)
        if spec.fault in ("worker-dies-mid-upload", "slow-upload", "fail-upload") and spec.detach_upload:
            self._task_over.wait()  # its report on its way to the driver
            time.sleep(2)
            if spec.fault == "worker-dies-mid-upload":
                fault_point("worker-dies-mid-upload")  # this Python worker, its task over
            if spec.fault == "slow-upload":
                fault_point("slow-upload")
            if spec.fault == "fail-upload":
                fault_point("fail-upload")
