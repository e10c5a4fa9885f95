"""What a keyed stage's task is given and what it gives back: its spec (shipped from the
driver, pickled), the columns it adds to its input rows, the name of the state file an
attempt writes, and the layout of an output with side outputs (late records, dead letters).
The task itself is :mod:`keyscale.runtime.task.keyed`; its report,
:class:`~keyscale.runtime.task.report.TaskReport`.

A spec crosses a process boundary: the driver's keyscale pickles it, the executors'
keyscale (installed there, maybe another version) unpickles it. It carries the version of
its form (:data:`TASK_VERSION`), and a task refuses a spec of another version by name
(:func:`check_shipped`) rather than run on fields it does not know."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from keyscale.checkpoint.manifest import StateFile
from keyscale.checkpoint.uploads import wait_stored
from keyscale.errors import KeyscaleError
from keyscale.operators.eventtime import NO_WATERMARK
from keyscale.operators.poison import FAIL, ErrorPolicy
from keyscale.state.handles import TIMER_STATES
from keyscale.state.keygroups import KeyGroupRange
from keyscale.state.types import StateDescriptor
from keyscale.storage import Store

SEQ = "__seq"
KG = "__kg"

#: The version of what tasks are shipped (:class:`StageTask`, ``NonKeyedTask``): a field
#: added, removed or changed in meaning is a new version.
TASK_VERSION = 2


def check_shipped(spec: Any) -> None:
    """Refuse a task spec the driver's keyscale shipped in another form than this one reads.

    >>> from types import SimpleNamespace
    >>> check_shipped(SimpleNamespace(uid="count", batch_id=3, version=TASK_VERSION))
    >>> check_shipped(SimpleNamespace(uid="count", batch_id=3))
    Traceback (most recent call last):
    ...
    keyscale.errors.KeyscaleError: operator 'count', batch 3: the driver shipped this task in form 0, the executors' keyscale reads form 2: install the driver's keyscale version on the workers
    """
    shipped = vars(spec).get("version", 0)  # the instance's own: a spec from before versions has none
    if shipped != TASK_VERSION:
        raise KeyscaleError(f"operator '{spec.uid}', batch {spec.batch_id}: the driver shipped this task in form {shipped}, the "
                            f"executors' keyscale reads form {TASK_VERSION}: install the driver's keyscale version on the workers")


@dataclass(frozen=True)
class StageTask:
    """Everything a task of a keyed stage needs, shipped from the driver (pickled)."""

    store: Store  # the job directory's: state files are read and written through it
    run_id: str
    uid: str
    function: Any
    key_names: tuple[str, ...]
    key_types: tuple[pa.DataType, ...]
    input_schema: pa.Schema
    output_schema: pa.Schema
    states: tuple[StateDescriptor, ...]
    null_keys: str
    max_parallelism: int
    parallelism: int
    batch_id: int
    batch_time_ms: int
    committed: int  # batch whose manifest the state comes from (-1: none yet)
    files: tuple[StateFile, ...]  # the operator's live files at ``committed``
    snapshot: tuple[KeyGroupRange | None, ...]  # per subtask: the key groups it snapshots this batch (retention.snapshot_range)
    fault: str | None = None  # test-only: the fault point armed for this task, by its name in keyscale/_faults.py
    driver_pid: int = 0
    watermark_ms: int = NO_WATERMARK  # the watermark this batch runs with
    event_time: str | None = None  # the event-time column whose maximum the task reports
    extra_keys: tuple[tuple[str, pa.DataType], ...] = ()  # state key columns after the routing key
    late_output: bool = False  # the stage also returns records too late for its windows
    broadcast_state: dict[str, Any] | None = None  # the rules stream's state as of this batch
    event_time_limit_ms: int | None = None  # later event times are not believed (with_watermark's max_ahead)
    on_error: ErrorPolicy = FAIL  # poison records: fail, skip or dead-letter (operators/poison.py)
    report_to: Any = None  # where the report goes (keyscale.runtime.task.report): a Spark accumulator
    state_backend: str = "memory"  # "memory" | "rocksdb": the task's TaskStateBackend (runtime/task/backend.py)
    combined: bool = False  # the records are Spark's partial aggregates per key (aggregate(combine=True)): see COMBINED_*
    # Asynchronous checkpoints: the task ends without waiting for its state file's upload,
    # and the files of batch ``pending`` (its manifest not yet committed) may still be uploading.
    detach_upload: bool = False
    pending: int = -1
    upload_timeout: float = 600.0
    version: int = TASK_VERSION  # the form it was shipped in (check_shipped)

    def await_pending(self, reads: Iterable[tuple[StateFile, Any]]) -> None:
        """Wait for the files of ``reads`` that the pending batch's tasks may still be uploading."""
        pending = [f for f, _ in reads if f.batch == self.pending]
        if pending:
            wait_stored(self.store, pending, self.upload_timeout, f"read by a subtask of '{self.uid}' in batch {self.batch_id}")

    @property
    def timers(self) -> bool:
        return any(s.name == TIMER_STATES["event_time"][1] for s in self.states)


def state_file_name(uid: str, batch: int, subtask: int, kind: str, attempt: str) -> str:
    """A name unique to one attempt: two attempts of a subtask (speculation, a zombie task
    set) never overwrite each other's file, so the report that survives names the file its
    attempt wrote, with that file's size and crc (the report travels in the task's result,
which Spark carries with a task's success only: ``report.py``).
    Retention removes the files no manifest took."""
    return f"state/{uid}/{batch:012d}-s{subtask:05d}-{kind}-{attempt}.arrow"


MAIN, LATE, DEAD = "__main", "__late", "__dead"
# A combined batch's columns beside the aggregates' partials: the records each row stands
# for, their largest event time within the batch's bound (ms), and how many were beyond it.
COMBINED_RECORDS, COMBINED_EVENT_MS, COMBINED_AHEAD = "__partial_records", "__partial_event_ms", "__partial_ahead"
ROUTE, MARKER = "__route", "__marker"  # a combined stage's grouping columns beside its keys (runtime/batch/stages.py)


def side_output_schema(main: pa.Schema, late: pa.Schema | None = None, dead: pa.Schema | None = None) -> pa.Schema:
    """A stage's output when it has side outputs (late records, dead letters): one struct
    column for each, one set per row."""
    fields = [pa.field(MAIN, pa.struct(list(main)))]
    if late is not None:
        fields.append(pa.field(LATE, pa.struct(list(late))))
    if dead is not None:
        fields.append(pa.field(DEAD, pa.struct(list(dead))))
    return pa.schema(fields)


def with_side_output(main: pa.Table, late: pa.Table | None = None, dead: pa.Table | None = None) -> pa.Table:
    def packed(t: pa.Table) -> pa.Array[Any]:
        return t.to_struct_array().combine_chunks()

    parts = {MAIN: main, **({LATE: late} if late is not None else {}), **({DEAD: dead} if dead is not None else {})}
    packs = {name: packed(t) for name, t in parts.items()}
    total = sum(t.num_rows for t in parts.values())
    cols, at = {}, 0
    for name, t in parts.items():
        arr = packs[name]
        cols[name] = pa.concat_arrays([pa.nulls(at, arr.type), arr, pa.nulls(total - at - t.num_rows, arr.type)])
        at += t.num_rows
    return pa.table(cols)
