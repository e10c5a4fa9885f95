"""A job's graph as data: each stage's node, the branches, and the whole job (:class:`JobGraph`).

The fluent API (``keyscale._stream``: streams, keyed streams, windows; ``keyscale._job``) builds these; the
runtime (``keyscale.runtime``) runs them each micro-batch and imports nothing of the API
above this module. Pure data: no Spark session, no I/O; runs wherever the job is built
(the driver) and, inside the stages' functions, on the executors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import pyarrow as pa

from keyscale._keywords import checked_keywords
from keyscale._spark_types import from_arrow_schema
from keyscale.operators.eventtime import WatermarkSpec
from keyscale.operators.keyed import KeyedProcessFunction
from keyscale.operators.nonkeyed import BroadcastStream, ProcessFunction
from keyscale.operators.poison import ErrorPolicy
from keyscale.operators.vectorized import VectorizedKeyedFunction
from keyscale.sources.reader import LogSource
from keyscale.state.types import StateDescriptor

if TYPE_CHECKING:
    from pyspark.sql import DataFrame
    from pyspark.sql.types import StructType

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


def source_schema(source: DataFrame | LogSource) -> StructType:
    """The Spark schema of a source's records."""
    if isinstance(source, LogSource):
        return from_arrow_schema(source.schema)
    return source.schema



@dataclass(frozen=True)
class Branch:
    """One path of a pipeline: the stages a sink's rows go through, from the source on.
    Branches of one pipeline share the stages they have in common (the same objects)."""

    steps: tuple[Step, ...]
    sink: Sink

    @property
    def last_stage(self) -> str | None:
        """The uid of the last stateful stage whose rows the sink gets (None: none)."""
        return next((s.uid for s in reversed(self.steps) if not isinstance(s, TransformStep)), None)


@dataclass(frozen=True)
class JobGraph:
    """A complete job as data: one source, its stages, and one sink per branch. The API
    builds it (:class:`keyscale.Pipeline` is one, with ``start``); the runtime runs it."""

    source: DataFrame | LogSource
    branches: tuple[Branch, ...]
    watermark: WatermarkSpec | None = None
    policies: dict[str, ErrorPolicy] = field(default_factory=dict)  # each keyed stage's poison-record policy
    dead_letter: Sink | None = None
    # The job's own policy (``sink(on_error=)``): for records no operator owns, such as a
    # file source's malformed records (runtime/batch/malformed.py).
    input_policy: ErrorPolicy = field(default_factory=ErrorPolicy)

    def error_policy(self, step: KeyedStep) -> ErrorPolicy:
        """A keyed stage's effective poison-record policy: its own, else its branch's ``sink(on_error=)``."""
        return self.policies.get(step.uid) or ErrorPolicy(step.on_error or "fail")

    @property
    def steps(self) -> tuple[Step, ...]:
        """Every stage once, each after the stages it reads from."""
        seen: dict[int, Step] = {}
        for b in self.branches:
            for s in b.steps:
                seen.setdefault(id(s), s)
        return tuple(seen.values())

    @property
    @checked_keywords
    def sink(self) -> Sink:
        """The first branch's sink."""
        return self.branches[0].sink

    @property
    def output_uids(self) -> list[str]:
        """The last stateful stage of each branch (whose rows its sink gets), once each."""
        return list(dict.fromkeys(b.last_stage for b in self.branches if b.last_stage is not None))

    @property
    def keyed_steps(self) -> list[KeyedStep]:
        return [s for s in self.steps if isinstance(s, KeyedStep)]

    @property
    def nonkeyed_steps(self) -> list[NonKeyedStep]:
        return [s for s in self.steps if isinstance(s, NonKeyedStep)]

    @property
    def broadcasts(self) -> dict[str, BroadcastStream]:
        """The rules streams of the pipeline's stages, by uid."""
        out: dict[str, BroadcastStream] = {}
        for s in self.steps:
            b = getattr(s, "broadcast", None)
            if b is not None:
                out[b.uid] = b
        return out

    @property
    def source_schema(self) -> StructType:
        return source_schema(self.source)

    @property
    def log_source(self) -> LogSource | None:
        """The log whose records drive the batches (the job's source is a log)."""
        return self.source if isinstance(self.source, LogSource) else None

    @property
    def side_log(self) -> LogSource | None:
        """The log read beside a Spark source, each batch (a stage connects the two)."""
        return next((s.log for s in self.steps if isinstance(s, LogInputStep)), None)

    @property
    def logs(self) -> tuple[LogSource, ...]:
        """Every log the job reads, whose offsets its checkpoints keep."""
        return tuple(src for src in (self.log_source, self.side_log) if src is not None)

    @property
    def sinks(self) -> list[Sink]:
        """Each branch's sink and every side-output sink (late records, dead letters)."""
        return [
            *(b.sink for b in self.branches), *(s.late_sink for s in self.keyed_steps if s.late_sink is not None),
            *([self.dead_letter] if self.dead_letter else []),
        ]
