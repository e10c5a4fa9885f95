"""A non-keyed stage's subtask: a ProcessFunction over its share of the batch, with its
operator list state restored from, and reported back to, the manifest."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pandas as pd
import pyarrow as pa

from keyscale.errors import JobDefinitionError
from keyscale.operators.keyed import rows_to_arrow
from keyscale.operators.nonkeyed import ProcessFunction
from keyscale.operators.vectorized import to_frame
from keyscale.runtime.task.gcpauses import GcPauses, gc_pauses
from keyscale.runtime.task.report import TaskReport
from keyscale.runtime.task.spark import as_spark_task
from keyscale.runtime.task.spec import TASK_VERSION
from keyscale.state.contexts import OperatorContext


@dataclass(frozen=True)
class NonKeyedTask:
    """What a task of a non-keyed stage needs: its function and each subtask's list state."""

    uid: str
    function: ProcessFunction
    output_schema: pa.Schema
    parallelism: int
    batch_id: int
    batch_time_ms: int
    lists: tuple[dict[str, list[Any]], ...]  # per subtask: list name -> entries
    broadcast_state: dict[str, Any] | None = None
    report_to: Any = None  # where the report goes (keyscale.runtime.task.report)
    input_schema: pa.Schema | None = None  # a subtask without records still gets these columns
    version: int = TASK_VERSION  # the form it was shipped in (runtime/task/spec.py: check_shipped)


def run_nonkeyed_subtask(spec: NonKeyedTask, batches: Iterator[pa.RecordBatch], subtask: int) -> tuple[pa.Table, TaskReport]:
    """One subtask of a non-keyed stage: restore its lists, process, report the lists back
    (and its busy time, with the garbage collector's pauses in it: runtime/task/gcpauses.py)."""
    with gc_pauses() as pauses:
        return _run(spec, batches, subtask, pauses)


def _run(spec: NonKeyedTask, batches: Iterator[pa.RecordBatch], subtask: int, pauses: GcPauses) -> tuple[pa.Table, TaskReport]:
    started = time.perf_counter()
    fn = spec.function
    ctx = OperatorContext(spec.uid, subtask, spec.parallelism, spec.batch_id, spec.batch_time_ms, spec.broadcast_state)
    fn.open(ctx)
    for name, entries in spec.lists[subtask].items():
        if name in ctx.lists:
            ctx.lists[name].update(entries)
    parts = list(batches)
    if parts:
        records = to_frame(pa.Table.from_batches(parts))
    else:  # no records this batch: the same columns, no rows
        records = to_frame(spec.input_schema.empty_table()) if spec.input_schema is not None else pd.DataFrame()
    result = fn.process(records, ctx)
    if isinstance(result, pd.DataFrame):
        out = pa.Table.from_pandas(result, schema=spec.output_schema, preserve_index=False)
    elif isinstance(result, pa.Table):
        out = result
    else:
        out = rows_to_arrow(list(result or []), spec.output_schema, spec.uid)
    lists = {name: s.get() for name, s in ctx.lists.items()}
    try:
        json.dumps(lists)
    except (TypeError, ValueError) as e:
        raise JobDefinitionError(f"operator '{spec.uid}': list state entries must be JSON values ({e})") from None
    busy = time.perf_counter() - started
    report = TaskReport(subtask=subtask, records=len(records), emitted=out.num_rows, lists=lists, busy_seconds=busy,
                        gc_seconds=min(pauses.seconds, busy))
    return out, report


def make_nonkeyed_function(spec: NonKeyedTask) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """The function given to ``DataFrame.mapInArrow`` for this non-keyed stage and batch."""
    return as_spark_task(lambda s, b, i: (*run_nonkeyed_subtask(s, b, i), None), spec)
