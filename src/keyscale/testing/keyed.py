"""The keyed-stage harness of :mod:`keyscale.testing` (see there for an example)."""

from __future__ import annotations

import shutil
import tempfile
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from keyscale.checkpoint.files import read_state_slice
from keyscale.checkpoint.manifest import StateFile, live_files
from keyscale.checkpoint.savepoint.schema import spark_type_name
from keyscale.operators.eventtime import NO_WATERMARK, Duration, parse_duration_ms, watermark_ms_of
from keyscale.operators.keyed import KeyedProcessFunction, describe_states
from keyscale.operators.vectorized import Agg, RunningAggregate, VectorizedKeyedFunction
from keyscale.operators.windows import FIRED, WINDOW_END, WINDOW_START, Assigner, WindowAggregate
from keyscale.runtime.task import memory
from keyscale.runtime.task.keyed import KG, LATE, MAIN, SEQ, StageTask, run_subtask
from keyscale.state.backends import check_rocksdb_keys
from keyscale.state.keygroups import key_group_range
from keyscale.state.spark_hash import key_groups
from keyscale.state.table import KeyedStateTable
from keyscale.state.types import arrow_schema
from keyscale.storage import LocalStore

Records = Iterable[Mapping[str, Any]] | pd.DataFrame | pa.Table
T0_MS = 1_767_225_600_000  # the harness's processing time at start: 2026-01-01 UTC


def to_arrow(records: Records, schema: pa.Schema) -> pa.Table:
    """A batch's records (dicts, pandas or Arrow) as a table of the stage's input columns."""
    if isinstance(records, pa.Table):
        return records.select(schema.names).cast(schema)
    if isinstance(records, pd.DataFrame):
        return pa.Table.from_pandas(records[schema.names], schema=schema, preserve_index=False)
    return pa.Table.from_pylist([dict(r) for r in records], schema=schema)


def sorted_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows in a canonical order (a batch's rows come from several subtasks)."""
    return sorted(rows, key=lambda r: tuple((v is None, str(v)) for v in r.values()))


@dataclass(frozen=True)
class Snapshot:
    """A harness's committed state: its state files and the clocks, as a checkpoint has them."""

    harness: KeyedHarness
    files: tuple[StateFile, ...]
    committed: int
    watermark_ms: int
    time_ms: int

    def restore(self, parallelism: int | None = None) -> KeyedHarness:
        """A new harness with this state, at ``parallelism`` (default: the snapshot's), as a
        job restarted from the checkpoint: every subtask loads its key groups from the files."""
        h = self.harness
        fresh = KeyedHarness(h._step, parallelism or h.parallelism, h.max_parallelism, _folder=h._folder, state_backend=h.state_backend)
        fresh.snapshot_every = h.snapshot_every
        fresh._files, fresh._committed = list(self.files), self.committed
        fresh.watermark_ms, fresh.time_ms = self.watermark_ms, self.time_ms
        return fresh


@dataclass(frozen=True)
class _Step:
    """What the harness runs: a keyed stage as the pipeline builder would make it."""

    function: Any
    key_names: tuple[str, ...]
    input_schema: pa.Schema
    output_schema: pa.Schema
    states: tuple[Any, ...]
    event_time: str | None = None
    extra_keys: tuple[tuple[str, pa.DataType], ...] = ()
    late_output: bool = False


class KeyedHarness:
    """One keyed stage, its subtasks run in this process (no Spark)."""

    #: The state backend of harnesses not given one (a test suite may run all its harnesses on both).
    default_state_backend = "memory"

    def __init__(self, step: _Step, parallelism: int = 1, max_parallelism: int = 128, *, _folder: _Folder | None = None,
                 state_backend: str | None = None):
        self._step = step
        self.state_backend = state_backend or KeyedHarness.default_state_backend  # "memory" | "rocksdb": where the subtasks keep their state
        if self.state_backend == "rocksdb":  # refused as a job refuses it
            check_rocksdb_keys("harness", [*((k, step.input_schema.field(k).type) for k in step.key_names), *step.extra_keys])
        self.snapshot_every = 0  # n > 0: every n-th batch writes snapshots instead of deltas
        self.parallelism = parallelism
        self.max_parallelism = max_parallelism
        self.watermark_ms = NO_WATERMARK
        self.time_ms = T0_MS
        self._folder = _folder or _Folder()  # shared with the harnesses restored from this one's snapshots
        self._files: list[StateFile] = []
        self._committed = -1
        self._seq = 0
        self._workers: dict[int, dict[Any, Any]] = {}  # one Python worker's warm state per subtask
        self.late: list[dict[str, Any]] = []  # records too late for their windows, in arrival order

    # -- building ---------------------------------------------------------------------------

    @classmethod
    def of(cls, function: KeyedProcessFunction | VectorizedKeyedFunction, *, key_by: list[str], input_schema: str | pa.Schema,
           output_schema: str | pa.Schema, parallelism: int = 1, max_parallelism: int = 128, event_time: str | None = None,
           state_backend: str | None = None) -> KeyedHarness:
        """A harness for ``key_by(...).process(function, output_schema)``; ``event_time``:
        the column the watermark is on, for event-time timers."""
        schema = arrow_schema(input_schema)
        states = function.state_descriptors() if isinstance(function, RunningAggregate) else describe_states(function, "harness")
        return cls(_Step(function, tuple(key_by), schema, arrow_schema(output_schema), tuple(states), event_time), parallelism, max_parallelism,
                   state_backend=state_backend)

    @classmethod
    def aggregate(cls, *, key_by: list[str], input_schema: str | pa.Schema, parallelism: int = 1, max_parallelism: int = 128,
                  state_backend: str | None = None, **aggs: Agg) -> KeyedHarness:
        """A harness for ``key_by(...).aggregate(**aggs)``."""
        schema = arrow_schema(input_schema)
        fn = RunningAggregate(dict(aggs), list(key_by), {f.name: f.type for f in schema})
        out = pa.schema([*(schema.field(k) for k in key_by), *fn.output_fields()])
        return cls(_Step(fn, tuple(key_by), schema, out, tuple(fn.state_descriptors())), parallelism, max_parallelism, state_backend=state_backend)

    @classmethod
    def window(cls, assigner: Assigner, *, key_by: list[str], input_schema: str | pa.Schema, event_time: str,
               allowed_lateness: Duration = 0, parallelism: int = 1, max_parallelism: int = 128, state_backend: str | None = None,
               **aggs: Agg) -> KeyedHarness:
        """A harness for ``key_by(...).window(assigner, allowed_lateness).aggregate(**aggs)``
        on the event-time column ``event_time``; late records collect in :attr:`late`."""
        schema = arrow_schema(input_schema)
        fn = WindowAggregate(assigner, dict(aggs), list(key_by), {f.name: f.type for f in schema}, event_time,
                             parse_duration_ms(allowed_lateness, "allowed_lateness"))
        out = pa.schema([*(schema.field(k) for k in key_by), *fn.output_fields()])
        return cls(_Step(fn, tuple(key_by), schema, out, tuple(fn.state_descriptors()), event_time, ((WINDOW_START, pa.int64()),), True),
                   parallelism, max_parallelism, state_backend=state_backend)

    # -- running ----------------------------------------------------------------------------

    def advance_watermark(self, to: int | datetime | np.datetime64) -> None:
        """Move the watermark for the next batch (it never goes back): epoch milliseconds,
        as an integer event-time column holds them, or a time as a timestamp column holds
        it (a ``datetime``, ``pandas.Timestamp`` or ``numpy.datetime64``; a naive one is
        UTC, as a naive ``datetime`` in the records is). Finer than a millisecond is
        floored to its millisecond, as event times are. Anything else (a string, a float,
        a ``date``) is refused: a float or a date has no one reading as an event time.
        """
        self.watermark_ms = max(self.watermark_ms, watermark_ms_of(to))

    def advance_processing_time(self, by: Duration) -> None:
        """Move the processing-time clock forward (a duration: ``"30 seconds"``, or ms)."""
        self.time_ms += parse_duration_ms(by, "processing time")

    def process(self, records: Records = ()) -> list[dict[str, Any]]:
        """Run one batch of ``records`` (dicts, pandas or Arrow; none fires due timers and
        windows only) on every subtask, commit it, and return the rows emitted, sorted."""
        table = self._input(records)
        batch = self._committed + 1
        p, m, s = self.parallelism, self.max_parallelism, self._step
        spec = StageTask(
            store=LocalStore(self._folder.path), run_id="harness", uid="harness", function=s.function,
            key_names=s.key_names, key_types=tuple(s.input_schema.field(k).type for k in s.key_names),
            input_schema=s.input_schema, output_schema=s.output_schema, states=s.states, null_keys="error",
            max_parallelism=m, parallelism=p, batch_id=batch, batch_time_ms=self.time_ms, committed=self._committed,
            files=tuple(self._files), snapshot=tuple(key_group_range(i, m, p) if self.snapshot_every and batch % self.snapshot_every == 0 else None for i in range(p)),
            watermark_ms=self.watermark_ms, event_time=s.event_time, extra_keys=s.extra_keys, late_output=s.late_output,
            state_backend=self.state_backend,
        )
        kgs = table.column(KG).to_numpy()
        rows: list[dict[str, Any]] = []
        new: list[StateFile] = []
        for i in range(p):
            rng = key_group_range(i, m, p)
            mine = table.filter(pa.array((kgs >= rng.start) & (kgs <= rng.end)))
            saved = memory._HELD
            memory._HELD = self._workers.setdefault(i, {})
            try:
                out, report = run_subtask(spec, iter(mine.to_batches()), i)
            finally:
                memory._HELD = saved
            new += report.state_files()
            rows += self._unpack(out)
        self._files = live_files([*self._files, *new], m)
        self._committed = batch
        return sorted_rows(rows)

    def _input(self, records: Records) -> pa.Table:
        s = self._step
        table = to_arrow(records, s.input_schema)
        seq = pa.array(range(self._seq, self._seq + table.num_rows), pa.int64())
        self._seq += table.num_rows
        types = [spark_type_name(s.input_schema.field(k).type) for k in s.key_names]
        kg = pa.array(key_groups(table, s.key_names, types, self.max_parallelism), pa.int32())
        return table.append_column(SEQ, seq).append_column(KG, kg)

    def _unpack(self, out: pa.Table) -> list[dict[str, Any]]:
        if not self._step.late_output:
            return list(out.to_pylist())
        rows = []
        for r in out.to_pylist():
            if r.get(MAIN) is not None:
                rows.append(r[MAIN])
            if r.get(LATE) is not None:
                self.late.append(r[LATE])
        return rows

    # -- state ------------------------------------------------------------------------------

    def state(self, *key: Any) -> dict[str, Any] | None:
        """The committed state of ``key`` (its key columns' values), None if it has none; for a
        window operator, a dict of window start -> state."""
        table = self._state_table()
        s = self._step
        rows = [r for r in table.to_arrow().to_pylist() if tuple(r[k] for k in s.key_names) == key]
        hidden = {WINDOW_END, FIRED} if s.extra_keys else set()  # a window's own bookkeeping
        names = [d.name for d in s.states if not d.name.startswith("__") and d.name not in hidden]
        live = [r for r in rows if any(r[n] is not None for n in names)]
        if not live:
            return None
        if s.extra_keys:
            return {r[WINDOW_START]: {n: r[n] for n in names} for r in live}
        return {n: live[0][n] for n in names}

    def _state_table(self) -> KeyedStateTable:
        s = self._step
        table = KeyedStateTable([*s.key_names, *(k for k, _ in s.extra_keys)],
                                [*(s.input_schema.field(k).type for k in s.key_names), *(t for _, t in s.extra_keys)], s.states)
        store = LocalStore(self._folder.path)
        for f in sorted(self._files, key=lambda f: f.batch):
            table.apply(read_state_slice(store, f, f.range))
        table.compact()
        return table

    def snapshot(self) -> Snapshot:
        """The state as of the last batch: :meth:`Snapshot.restore` starts a new harness from it."""
        return Snapshot(self, tuple(self._files), self._committed, self.watermark_ms, self.time_ms)



class _Folder:
    """The harness's temporary job directory: removed once no harness uses it (or at exit)."""

    def __init__(self) -> None:
        self.path = tempfile.mkdtemp(prefix="keyscale-harness-")
        weakref.finalize(self, shutil.rmtree, self.path, True)
