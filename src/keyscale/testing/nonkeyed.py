"""The non-keyed harness of :mod:`keyscale.testing`: a ``ProcessFunction`` and its list state.

>>> import keyscale as ks
>>> class Seen(ks.ProcessFunction):
...     def open(self, ctx):
...         self.ids = ctx.list_state("ids")            # split/merge on rescale
...     def process(self, records, ctx):
...         self.ids.update([*self.ids.get(), *records["id"].tolist()])
...         return [(ctx.subtask_index, len(self.ids.get()))]
>>> h = OperatorHarness(Seen(), input_schema="id long", output_schema="subtask int, seen long", parallelism=2)
>>> h.process([{"id": i} for i in range(5)])
[{'subtask': 0, 'seen': 3}, {'subtask': 1, 'seen': 2}]
>>> sorted(sum(h.lists()["ids"], []))
[0, 1, 2, 3, 4]
>>> h.snapshot().restore(parallelism=3).lists()["ids"]    # every entry kept, spread over 3 subtasks
[[0, 2], [4, 1], [3]]
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from keyscale.operators.eventtime import Duration, parse_duration_ms
from keyscale.operators.nonkeyed import ProcessFunction, describe_lists, lists_for, lists_state
from keyscale.runtime.task.nonkeyed import NonKeyedTask, run_nonkeyed_subtask
from keyscale.state.types import arrow_schema
from keyscale.testing.keyed import T0_MS, Records, sorted_rows, to_arrow


@dataclass(frozen=True)
class OperatorSnapshot:
    """An operator harness's committed list state, as a checkpoint's manifest has it."""

    harness: OperatorHarness
    operator_state: dict[str, Any]
    committed: int

    def restore(self, parallelism: int | None = None) -> OperatorHarness:
        """A new harness from this state at ``parallelism``: split/merge lists are pooled and
        split evenly, union lists go whole to every subtask, as on a job's rescale."""
        h = self.harness
        fresh = OperatorHarness(h.function, input_schema=h.input_schema, output_schema=h.output_schema,
                                parallelism=parallelism or h.parallelism)
        fresh._state, fresh._committed, fresh.time_ms = json.loads(json.dumps(self.operator_state)), self.committed, h.time_ms
        return fresh


class OperatorHarness:
    """One non-keyed stage, its subtasks run in this process (no Spark); a batch's records
    go round robin to the subtasks, as Spark's ``repartition(p)`` spreads them."""

    def __init__(self, function: ProcessFunction, *, input_schema: str | pa.Schema, output_schema: str | pa.Schema,
                 parallelism: int = 1, broadcast_state: dict[str, Any] | None = None):
        self.function = function
        self.input_schema = arrow_schema(input_schema)
        self.output_schema = arrow_schema(output_schema)
        self.parallelism = parallelism
        self.broadcast_state = broadcast_state
        self.time_ms = T0_MS
        self._modes = describe_lists(function, "harness")
        self._state: dict[str, Any] = {}
        self._committed = -1

    def advance_processing_time(self, by: Duration) -> None:
        """Move the processing-time clock forward."""
        self.time_ms += parse_duration_ms(by, "processing time")

    def process(self, records: Records = ()) -> list[dict[str, Any]]:
        """Run one batch on every subtask, commit its lists, return the rows emitted, sorted."""
        table = to_arrow(records, self.input_schema)
        p, batch = self.parallelism, self._committed + 1
        spec = NonKeyedTask(uid="harness", function=self.function, output_schema=self.output_schema, parallelism=p, batch_id=batch,
                            batch_time_ms=self.time_ms, lists=tuple(lists_for(self._state, self._modes, p, "harness")),
                            broadcast_state=self.broadcast_state, input_schema=self.input_schema)
        rows: list[dict[str, Any]] = []
        reports = []
        for i in range(p):
            mine = table.take(pa.array(range(i, table.num_rows, p), pa.int64()))
            out, report = run_nonkeyed_subtask(spec, iter(mine.to_batches()), i)
            rows += out.to_pylist()
            reports.append(report)
        self._state = json.loads(json.dumps(lists_state(self._modes, [dict(r.lists or {}) for r in reports])))  # as the manifest keeps it
        self._committed = batch
        return sorted_rows(rows)

    def lists(self) -> dict[str, list[list[Any]]]:
        """Each list state's entries per subtask, as the next batch's subtasks get them."""
        shares = lists_for(self._state, self._modes, self.parallelism, "harness")
        return {name: [s[name] for s in shares] for name in self._modes}

    def snapshot(self) -> OperatorSnapshot:
        """The lists as of the last batch: :meth:`OperatorSnapshot.restore` starts a new harness from them."""
        return OperatorSnapshot(self, self._state, self._committed)
