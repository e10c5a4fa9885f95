"""Two partitioned logs read as one: the input of a two-input stage over logs or Kafka topics.

``a.connect(b)`` over two log sources (:func:`keyscale.sources.log_source`, :func:`keyscale.kafka.kafka_source`)
becomes one job source whose readers, offsets and rescaling are those of any log: partition
``2*i`` of the union is partition ``i`` of the first log, ``2*i + 1`` partition ``i`` of the
second. Interleaving keeps every number stable when either log gets partitions later (the
committed offsets stay where they were), and splits both logs evenly over the readers; a
number whose log has no such partition is an empty partition nobody can append to.

A record comes out as ``(__side, in1, in2[, __event_time])``: ``__side`` 0 or 1, the record
itself as the struct of its side (the other null), and, when the stage runs on event time,
the record's own event-time column copied out so that each partition's clock is its own
log's (the stage's watermark is the slowest partition of either log).

>>> import tempfile, pyarrow as pa
>>> from keyscale.sources.log import create_log
>>> a = create_log(tempfile.mkdtemp() + "/users", "user string, name string", partitions=1)
>>> b = create_log(tempfile.mkdtemp() + "/clicks", "user string, page string", partitions=2)
>>> _ = b.append(1, pa.table({"user": ["u1"], "page": ["/home"]}))
>>> u = UnionLog(a, b)
>>> u.num_partitions(), u.end_offsets()
(4, [0, 0, 0, 1])
>>> u.read(3, 0, 1).to_pylist()
[{'__side': 1, 'in1': None, 'in2': {'user': 'u1', 'page': '/home'}}]
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from keyscale.operators.coprocess import EVENT_TIME, INPUTS, SIDE
from keyscale.sources.partitioned import AppendTimes, LogError, PartitionedLog


class UnionLog(PartitionedLog):
    """Read-only view of two logs as one (see the module doc); ``event_time`` names each
    log's event-time column, or is None when the stage has no event time."""

    def __init__(self, first: PartitionedLog, second: PartitionedLog, event_time: tuple[str, str] | None = None) -> None:
        self.logs = (first, second)
        self.event_time = event_time
        if event_time is not None:
            for log, column in zip(self.logs, event_time, strict=True):
                if column not in log.schema.names:
                    raise LogError(f"log {log.uri} has no column '{column}' for event time (its columns: {', '.join(log.schema.names)})")

    @property
    def schema(self) -> pa.Schema:
        fields: list[pa.Field[Any]] = [pa.field(SIDE, pa.int8(), nullable=False)]
        fields += [pa.field(name, pa.struct(list(log.schema))) for name, log in zip(INPUTS, self.logs, strict=True)]
        if self.event_time is not None:
            fields.append(pa.field(EVENT_TIME, pa.timestamp("us", tz="UTC")))
        return pa.schema(fields)

    @property
    def uri(self) -> str:
        return f"{self.logs[0].uri} + {self.logs[1].uri}"

    def _of(self, partition: int) -> tuple[int, int | None]:
        """The side of a union partition and its partition there (None: that log has none)."""
        side, own = partition % 2, partition // 2
        return side, (own if own < self.logs[side].num_partitions() else None)

    def _both(self, per_log: tuple[list[int], list[int]]) -> list[int]:
        n = max(len(per_log[0]), len(per_log[1]))
        return [per_log[p % 2][p // 2] if p // 2 < len(per_log[p % 2]) else 0 for p in range(2 * n)]

    def num_partitions(self) -> int:
        return 2 * max(log.num_partitions() for log in self.logs)

    def end_offsets(self) -> list[int]:
        return self._both((self.logs[0].end_offsets(), self.logs[1].end_offsets()))

    def first_offsets(self) -> list[int]:
        return self._both((self.logs[0].first_offsets(), self.logs[1].first_offsets()))

    def read(self, partition: int, start: int, end: int) -> pa.Table:
        return self.read_timed(partition, start, end)[0]

    def read_timed(self, partition: int, start: int, end: int) -> tuple[pa.Table, AppendTimes | None]:
        """The records, with the append times their own log keeps (if it keeps any)."""
        self._check_partition(partition)
        self._check_range(partition, start, end)
        side, own = self._of(partition)
        if own is None:
            if end > 0:
                raise self._range_error(partition, start, end, 0)
            return self.schema.empty_table(), None
        records, times = self.logs[side].read_timed(own, start, end)
        return self._as_union(side, records), times

    def _as_union(self, side: int, records: pa.Table) -> pa.Table:
        n = records.num_rows
        target = self.schema
        columns: dict[str, Any] = {SIDE: pa.array([side] * n, pa.int8())}
        for i, name in enumerate(INPUTS):
            columns[name] = records.to_struct_array() if i == side else pa.nulls(n, target.field(name).type)
        if self.event_time is not None:
            t = records.column(self.event_time[side])
            if pa.types.is_integer(t.type):  # epoch milliseconds (with_watermark)
                t = pc.multiply(t.cast(pa.int64()), 1000)
            columns[EVENT_TIME] = t.cast(pa.timestamp("us", tz="UTC"))
        return pa.table(columns, schema=target)

    def append(self, partition: int, table: pa.Table) -> tuple[int, int]:
        raise LogError(f"{self.uri} is two logs read together; append to either log itself")

    def add_partitions(self, n: int) -> int:
        raise LogError(f"{self.uri} is two logs read together; add partitions to either log itself")

    def describe(self) -> str:
        return "\n".join(f"{name} (union partitions {side}, {side + 2}, ...): {log.describe()}"
                         for side, (name, log) in enumerate(zip(INPUTS, self.logs, strict=True)))

    def fingerprints(self) -> bool:
        return all(log.fingerprints() for log in self.logs)

    def positions_committed(self, positions: dict[int, int]) -> None:
        for side, log in enumerate(self.logs):
            log.positions_committed({p // 2: off for p, off in positions.items() if p % 2 == side and p // 2 < log.num_partitions()})

    def take_skipped(self) -> int:
        return sum(log.take_skipped() for log in self.logs)

    def identity(self) -> str | None:
        ids = [log.identity() for log in self.logs]
        return None if ids == [None, None] else f"{ids[0]}+{ids[1]}"
