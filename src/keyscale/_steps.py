"""The nodes of a job's graph: what each stage of a :class:`~keyscale.Pipeline` runs.

The fluent API (``keyscale._pipeline``: streams, keyed streams, windows) builds these; the
runtime (``keyscale.runtime.batch.stages``) runs them each micro-batch. Pure data: no Spark
session, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import pyarrow as pa

from keyscale.operators.keyed import KeyedProcessFunction
from keyscale.operators.nonkeyed import BroadcastStream, ProcessFunction
from keyscale.operators.vectorized import VectorizedKeyedFunction
from keyscale.sources.reader import LogSource
from keyscale.state.types import StateDescriptor

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from keyscale.sinks.base import Sink

NullKeys = Literal["error", "drop"]
OnError = Literal["fail", "skip", "dead_letter"]


@dataclass(frozen=True)
class TransformStep:
    """Ordinary (stateless) Spark transformations applied to each micro-batch."""

    fn: Callable[[DataFrame], DataFrame]
    # The same transformation keeping the given columns (keyscale's own filter and select):
    # the batch's arrival-order columns ride through it (keyscale.runtime.task.arrival). None: the
    # user's function, which gets the batch without them.
    keeping: Callable[[DataFrame, Sequence[str]], DataFrame] | None = field(default=None, kw_only=True)


@dataclass(frozen=True)
class LogInputStep(TransformStep):
    """The input of a stage connecting a Spark source with a log (``a.connect(b)``): each
    batch, Spark's rows and the log's records read for the batch (by reader tasks, offsets
    kept by keyscale as for a log source) become one stream, ``merge(spark_rows, log_rows)``.
    ``fn`` is never called: the batch's log records are read by the runtime."""

    log: LogSource
    merge: Callable[[DataFrame, DataFrame], DataFrame]


@dataclass(frozen=True)
class KeyedStep:
    """One keyed stateful stage."""

    uid: str
    key_names: tuple[str, ...]
    key_types: tuple[pa.DataType, ...]
    input_schema: pa.Schema  # the stage's input columns (user columns only)
    function: KeyedProcessFunction | VectorizedKeyedFunction
    output_schema: pa.Schema
    states: tuple[StateDescriptor, ...]
    null_keys: NullKeys = "error"
    parallelism: int | None = None  # the stage's own default, overriding the job's -p
    event_time: str | None = None  # the stream's event-time column (with_watermark), if it has one
    # State keyed by more than the routing key (windows: + window_start); key groups follow the key alone.
    extra_state_keys: tuple[tuple[str, pa.DataType], ...] = ()
    late_sink: Sink | None = None  # where records too late for a window go
    broadcast: BroadcastStream | None = None  # rules delivered to every subtask as broadcast state
    on_error: OnError | None = None  # poison records; None: the pipeline's default (sink(..., on_error=))
    state_backend: str | None = None  # "memory" | "rocksdb"; None: the job's (start(state_backend=...), default "memory")
    combine: bool = False  # aggregate(combine=True): Spark aggregates each subtask's records per key after the shuffle

    @property
    def vectorized(self) -> bool:
        return isinstance(self.function, VectorizedKeyedFunction)

    @property
    def state_key_columns(self) -> tuple[tuple[str, pa.DataType], ...]:
        return (*zip(self.key_names, self.key_types, strict=True), *self.extra_state_keys)


@dataclass(frozen=True)
class NonKeyedStep:
    """A non-keyed stage: a ProcessFunction per subtask, with operator (list) state."""

    uid: str
    function: ProcessFunction
    input_schema: pa.Schema
    output_schema: pa.Schema
    lists: dict[str, str]  # list state name -> redistribution mode
    parallelism: int | None = None
    broadcast: BroadcastStream | None = None


Step = TransformStep | KeyedStep | NonKeyedStep
