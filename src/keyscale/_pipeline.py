"""The pipeline a job file builds: a Spark streaming DataFrame, keyed stages, a sink.

A job file defines ``build(ctx)`` returning a :class:`Pipeline`::

    import keyscale as ks

    def build(ctx):
        events = ctx.spark.readStream.schema("key string, value long").parquet(ctx.arg("input"))
        return (
            ks.stream(events)
            .key_by("key")
            .aggregate(uid="totals", count=ks.aggregates.count(), sum=ks.aggregates.sum("value"))
            .sink(ks.sinks.ParquetSink(ctx.arg("output")))
        )

Two streams into one keyed stage (``Stream.connect``, the joins) are here too, at the end:
the stream types build one another (a stream's ``connect`` gives connected streams, whose
``process`` gives a stream), so they share one module; that is why it is longer than ~500 lines.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, NoReturn

import pyarrow as pa

from keyscale._keywords import checked_keywords, unknown_keyword
from keyscale._spark_types import from_arrow_schema, to_arrow_schema
from keyscale._steps import (
    Branch,
    JobGraph,
    KeyedStep,
    NonKeyedStep,
    NullKeys,
    OnError,
    Step,
    TransformStep,
    source_schema,
)
from keyscale.errors import JobDefinitionError
from keyscale.operators.coprocess import (
    EVENT_TIME,
    INPUTS,
    SIDE,
    IntervalJoin,
    KeyedCoProcessFunction,
    VectorizedKeyedCoProcessFunction,
    WindowJoin,
    adapt,
)
from keyscale.operators.eventtime import Duration, WatermarkSpec, parse_duration_ms
from keyscale.operators.keyed import KeyedProcessFunction, describe_states, uses_timers
from keyscale.operators.nonkeyed import BroadcastStream, ProcessFunction, describe_lists
from keyscale.operators.poison import DEFAULT_MAX_ERRORS, ErrorPolicy, check_bound, check_on_error
from keyscale.operators.vectorized import Agg, RunningAggregate, VectorizedKeyedFunction
from keyscale.operators.windows import (
    WINDOW_END,
    WINDOW_START,
    Assigner,
    SessionWindows,
    SlidingWindows,
    TumblingWindows,
    WindowAggregate,
)
from keyscale.sources.partitioned import LogError
from keyscale.sources.reader import LogSource
from keyscale.sources.union import UnionLog
from keyscale.state.backends import check_rocksdb_keys, check_state_backend
from keyscale.state.types import StateDescriptor, arrow_schema
from keyscale.state.uids import check_uid

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession
    from pyspark.sql.types import StructType

    from keyscale._steps import OnError
    from keyscale.runtime.control.handle import JobHandle
    from keyscale.sinks.base import Sink

log = logging.getLogger("keyscale")


def _to_arrow_schema(schema: StructType) -> pa.Schema:
    return to_arrow_schema(schema, utc=True)


def _to_spark_schema(schema: pa.Schema) -> StructType:
    return from_arrow_schema(schema)


class Stream:
    """A stream of rows: a Spark streaming DataFrame plus the stages applied per batch."""

    def __init__(
        self, source: DataFrame | LogSource, steps: tuple[Step, ...] = (), schema: StructType | None = None,
        watermark: WatermarkSpec | None = None,
    ):
        self._source = source
        self._steps = steps
        self._schema: StructType = schema if schema is not None else source_schema(source)
        self._watermark = watermark

    @property
    def watermark(self) -> WatermarkSpec | None:
        return self._watermark

    @checked_keywords
    def with_watermark(
        self, column: str, max_out_of_orderness: Duration = 0, idleness: Duration | None = None, max_ahead: Duration | None = "1 hour",
    ) -> Stream:
        """Event time: ``column`` (a timestamp, or epoch milliseconds) with a bounded out-of-orderness.

        The watermark trails the largest event time seen by ``max_out_of_orderness``; with
        ``idleness``, an input that has had no records for that long no longer holds it
        back, and when all are idle it follows the clock (``idleness`` behind). It advances
        between batches, is checkpointed, and never goes back. An event time more than
        ``max_ahead`` after the batch's processing time (None: no bound) never moves it:
        such records are counted, and windows send them to their late output or drop them.
        See :mod:`keyscale.operators.eventtime`.

        ``ks.stream(df).with_watermark("ts", "10 seconds")``
        """
        if self._watermark is not None:
            raise JobDefinitionError(f"the stream already has a watermark on '{self._watermark.column}'")
        if column not in self.columns:
            raise JobDefinitionError(f"event-time column '{column}' is not in the stream (columns: {', '.join(self.columns)})")
        t = _to_arrow_schema(self._schema).field(column).type
        if not (pa.types.is_timestamp(t) or pa.types.is_integer(t)):
            raise JobDefinitionError(f"event-time column '{column}' has type {t}; it must be a timestamp or epoch milliseconds (long)")
        spec = WatermarkSpec(
            column,
            parse_duration_ms(max_out_of_orderness, "max_out_of_orderness"),
            None if idleness is None else parse_duration_ms(idleness, "idleness"),
            None if max_ahead is None else parse_duration_ms(max_ahead, "max_ahead"),
        )
        return Stream(self._source, self._steps, self._schema, spec)

    @property
    def columns(self) -> list[str]:
        return list(self._schema.fieldNames())

    @property
    def schema(self) -> StructType:
        return self._schema

    @checked_keywords
    def transform(self, fn: Callable[[DataFrame], DataFrame]) -> Stream:
        """Apply ordinary PySpark transformations (filter, select, withColumn, joins with static data).

        ``fn`` gets the batch's columns only; the keyed stages after it get their records in
        Spark's order within a batch (``filter`` and ``select`` keep a file source's file
        order: docs/guides/job.md, "Arrival order")."""
        return self._transform(TransformStep(fn))

    def _transform(self, step: TransformStep) -> Stream:
        from keyscale.runtime.task.arrival import ORDER, order_probe_schema

        session = _session(self._source)
        probe = step.fn(session.createDataFrame([], self._schema))
        if step.keeping is not None:
            # It keeps the order columns only if they come out once each, after its own (a
            # select of "*" would bring them twice).
            kept = step.keeping(session.createDataFrame([], order_probe_schema(self._schema)), ORDER).columns
            if kept != [*probe.columns, *ORDER]:
                step = TransformStep(step.fn)
        return Stream(self._source, (*self._steps, step), probe.schema, self._watermark)

    @checked_keywords
    def filter(self, condition: Column | str) -> Stream:
        """Keep rows matching ``condition`` (a Column or a SQL expression)."""
        return self._transform(TransformStep(lambda df: df.filter(condition), keeping=lambda df, _: df.filter(condition)))

    @checked_keywords
    def select(self, *cols: Column | str) -> Stream:
        """Project columns (Columns or SQL expressions)."""
        exprs = [c for c in cols if isinstance(c, str)]
        if len(exprs) == len(cols):
            return self._transform(TransformStep(lambda df: df.selectExpr(*exprs), keeping=lambda df, keep: df.selectExpr(*exprs, *keep)))
        return self._transform(TransformStep(lambda df: df.select(*cols), keeping=lambda df, keep: df.select(*cols, *keep)))

    @checked_keywords
    def process(self, function: ProcessFunction, schema: str | pa.Schema, uid: str, parallelism: int | None = None,
                broadcast: BroadcastStream | None = None) -> Stream:
        """A non-keyed stage: ``function.process(records, ctx)`` once per subtask and batch,
        with operator list state that is split/merged or unioned on rescale, and, with
        ``broadcast``, the rules stream's state in ``ctx.broadcast_state``."""
        if not isinstance(function, ProcessFunction):
            raise JobDefinitionError(f"operator '{uid}': {type(function).__name__} is not a ProcessFunction (for keyed state use key_by(...).process)")
        _check_uid(uid, self._steps)
        step = NonKeyedStep(uid, function, _to_arrow_schema(self._schema), arrow_schema(schema), describe_lists(function, uid), parallelism, broadcast)
        return Stream(self._source, (*self._steps, step), _to_spark_schema(step.output_schema), self._watermark)

    @checked_keywords
    def connect(self, other: Stream) -> ConnectedStreams:
        """This stream and ``other`` into one keyed stage: ``.key_by(keys, other_keys)``
        then ``.process(KeyedCoProcessFunction, schema, uid)`` or ``.interval_join(lower,
        upper, uid)`` (see the connected streams below). Either input may be a Spark streaming
        DataFrame or a log/Kafka source.

        ``users.connect(clicks).key_by("id", "user").process(Enrich(), "user string, name string, page string", uid="enrich")``
        """

        return ConnectedStreams(self, other)

    @checked_keywords
    def key_by(self, *columns: str, null_keys: NullKeys = "error") -> KeyedStream:
        """Partition the stream by key columns: the next stage's state is per key.

        ``null_keys="error"`` (default) stops the job at a record whose key has a null,
        naming the column; ``"drop"`` discards such records.
        """
        if not columns:
            raise JobDefinitionError("key_by() needs at least one column")
        missing = [c for c in columns if c not in self.columns]
        if missing:
            raise JobDefinitionError(f"key column '{missing[0]}' is not in the stream (columns: {', '.join(self.columns)})")
        if null_keys not in ("error", "drop"):
            raise JobDefinitionError(f"null_keys must be 'error' or 'drop', not {null_keys!r}")
        return KeyedStream(self, tuple(columns), null_keys)

    @checked_keywords
    def sink(
        self, sink: Sink, on_error: OnError = "fail", dead_letter: Sink | None = None, max_errors_per_batch: int | None = DEFAULT_MAX_ERRORS,
    ) -> Pipeline:
        """End the pipeline (or one branch of it: :func:`keyscale.pipeline`) in a sink.

        ``on_error`` is the default poison-record policy of every keyed stage (a stage's own
        ``on_error=`` overrides it): ``"fail"`` stops the job at the record, naming it;
        ``"skip"`` drops and counts it; ``"dead_letter"`` writes it to ``dead_letter`` (a
        sink, exactly-once with the batch). Under skip and dead_letter, more than
        ``max_errors_per_batch`` poison records in one subtask and batch fail the batch
        (None: no bound). See :mod:`keyscale.operators.poison`.
        """
        check_on_error(on_error, "sink()")
        check_bound(max_errors_per_batch)
        policies = {s.uid: ErrorPolicy(s.on_error or on_error, max_errors_per_batch) for s in self._steps if isinstance(s, KeyedStep)}
        for uid, policy in policies.items():
            if policy.on_error == "dead_letter" and dead_letter is None:
                raise JobDefinitionError(
                    f"operator '{uid}' has on_error='dead_letter' but the pipeline has no dead-letter sink: "
                    "end it with .sink(main_sink, dead_letter=ks.sinks.ParquetSink(path))"
                )
        if on_error == "dead_letter" and dead_letter is None:
            raise JobDefinitionError("sink(on_error='dead_letter') needs a dead-letter sink: .sink(main_sink, on_error='dead_letter', dead_letter=ks.sinks.ParquetSink(path))")
        return _check_sinks(Pipeline(self._source, (Branch(self._steps, sink),), self._watermark, policies, dead_letter,
                                     ErrorPolicy(on_error, max_errors_per_batch)))

    def start(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Refused: a stream starts once it ends in a sink (``.sink(...).start(...)``)."""
        last = next((s.uid for s in reversed(self._steps) if not isinstance(s, TransformStep)), None)
        what = f"the stream after stage '{last}'" if last else "the stream"
        raise JobDefinitionError(f"{what} has no sink, so it cannot start: end it with .sink(ks.sinks.ParquetSink(path)) "
                                 "(or another sink), then call .start(...) on what .sink() returns")

    def _with(self, step: KeyedStep) -> Stream:
        return Stream(self._source, (*self._steps, step), _to_spark_schema(step.output_schema), self._watermark)


def _check_uid(uid: str, steps: tuple[Step, ...]) -> None:
    check_uid(uid)
    if uid in {s.uid for s in steps if not isinstance(s, TransformStep)}:
        raise JobDefinitionError(f"two stages have the uid '{uid}'; each stateful stage needs its own")


class KeyedStream:
    """A stream partitioned by key; ``process``/``aggregate`` add a keyed stateful stage."""

    def __init__(self, stream: Stream, key_names: tuple[str, ...], null_keys: NullKeys):
        self._stream = stream
        self._keys = key_names
        self._null_keys = null_keys
        self._input = _to_arrow_schema(stream.schema)
        self._key_types = tuple(self._input.field(k).type for k in key_names)

    def start(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Refused: a keyed stream needs a stage and a sink before it starts."""
        keys = ", ".join(f"'{k}'" for k in self._keys)
        raise JobDefinitionError(f"the stream keyed by {keys} has no stage and no sink, so it cannot start: add a stage "
                                 "(.aggregate(...) or .process(...)), end it with .sink(...), then call .start(...)")

    def _step(
        self, uid: str, fn: Any, output: pa.Schema, states: list[StateDescriptor], parallelism: int | None,
        extra_keys: tuple[tuple[str, pa.DataType], ...] = (), late_sink: Sink | None = None, broadcast: BroadcastStream | None = None,
        on_error: OnError | None = None, state_backend: str | None = None, combine: bool = False,
    ) -> Stream:
        _check_uid(uid, self._stream._steps)
        check_on_error(on_error, f"operator '{uid}'")
        if state_backend is not None:
            check_state_backend(state_backend, f"operator '{uid}'")
        clash = [s.name for s in states if s.name in self._keys]
        if clash:
            raise JobDefinitionError(f"operator '{uid}': state '{clash[0]}' has the name of a key column")
        wm = self._stream.watermark
        event_time = wm.column if wm is not None and wm.column in self._input.names else None
        step = KeyedStep(
            uid, self._keys, self._key_types, self._input, fn, output, tuple(states), self._null_keys, parallelism, event_time,
            extra_keys, late_sink, broadcast, on_error, state_backend, combine,
        )
        if state_backend == "rocksdb":
            check_rocksdb_keys(uid, step.state_key_columns)
        return self._stream._with(step)

    @checked_keywords
    def process(
        self, function: KeyedProcessFunction | VectorizedKeyedFunction, schema: str | pa.Schema, uid: str, parallelism: int | None = None,
        broadcast: BroadcastStream | None = None, on_error: OnError | None = None, state_backend: str | None = None,
    ) -> Stream:
        """Run a keyed process function (per key) or a vectorized one (per batch).

        ``schema`` is the output's Spark DDL, e.g. ``"key string, alert double"``. With
        ``broadcast`` (:func:`keyscale.sources.broadcast`), every subtask reads the rules stream's
        state as ``ctx.broadcast_state``; a batch's rules apply before its records.
        ``on_error`` ("fail", "skip", "dead_letter") overrides the pipeline's poison-record
        policy for this stage. ``state_backend`` ("memory" or "rocksdb") overrides the job's
        (``start(state_backend=...)``, default "memory") for this stage: docs/guides/state-backends.md.
        """
        if not isinstance(function, KeyedProcessFunction | VectorizedKeyedFunction):
            raise JobDefinitionError(f"operator '{uid}': {type(function).__name__} is not a KeyedProcessFunction or VectorizedKeyedFunction")
        if isinstance(function, VectorizedKeyedFunction) and function.event_timers and self._stream.watermark is None:
            raise JobDefinitionError(f"operator '{uid}': {type(function).__name__} has event_timers, which fire as the watermark passes "
                                     "them: call with_watermark(column, ...) on the stream first")
        if uses_timers(function) and self._stream.watermark is None:
            log.info("operator '%s' has on_timer but the stream has no watermark: only processing-time timers will fire", uid)
        return self._step(uid, function, arrow_schema(schema), describe_states(function, uid), parallelism, broadcast=broadcast, on_error=on_error,
                          state_backend=state_backend)

    @checked_keywords
    def window(self, assigner: Assigner, allowed_lateness: Duration = 0, late_output: Sink | None = None) -> WindowedStream:
        """Event-time windows per key: ``TumblingWindows``, ``SlidingWindows`` or ``SessionWindows``.

        A window emits its result once the watermark passes its end, and again whenever
        records within ``allowed_lateness`` update it; records later than that go to
        ``late_output`` (a sink, written exactly-once with the batch) or are dropped.

        ``.key_by("user").window(ks.windows.TumblingWindows("1 minute")).aggregate(uid="per_minute", n=ks.aggregates.count())``
        """
        if self._stream.watermark is None:
            raise JobDefinitionError("window() needs event time: call with_watermark(column, ...) on the stream first")
        if self._stream.watermark.column not in self._input.names:
            raise JobDefinitionError(f"window(): the event-time column '{self._stream.watermark.column}' is not in the stream any more")
        clash = [k for k in self._keys if k in (WINDOW_START, WINDOW_END)]
        if clash:
            raise JobDefinitionError(f"window(): key column '{clash[0]}' has the name of a window column; rename it before key_by()")
        if not isinstance(assigner, TumblingWindows | SlidingWindows | SessionWindows):
            raise JobDefinitionError(f"window() takes TumblingWindows, SlidingWindows or SessionWindows, not {type(assigner).__name__}")
        return WindowedStream(self, assigner, parse_duration_ms(allowed_lateness, "allowed_lateness"), late_output)

    def aggregate(self, uid: str, parallelism: int | None = None, on_error: OnError | None = None, state_backend: str | None = None,
                  combine: bool = False, **aggs: Agg) -> Stream:
        """Vectorized running aggregates per key; emits (key..., aggregates) for every key updated in a batch.

        ``aggregate(uid="totals", count=keyscale.aggregates.count(), sum=keyscale.aggregates.sum("value"))``;
        ``state_backend="rocksdb"`` keeps this stage's state on local disk (default: the job's).

        ``combine=True``: Spark aggregates each subtask's records per key in the JVM (after
        the shuffle, with no other exchange), so one row per key, not every record, crosses
        to Python. It pays only with many records per key in a batch (measured: docs/benchmarks.md, "combine=True").
        State, output, checkpoints and rescaling are the same either way (a job can turn it
        on or off between runs). Sums and means of floating-point columns are refused: the
        order of Spark's partial additions is not fixed, so a replay could differ.
        """
        _check_aggs("aggregate()", aggs, ("uid", "parallelism", "on_error", "state_backend", "combine"))
        types = {f.name: f.type for f in self._input}
        fn = RunningAggregate(dict(aggs), list(self._keys), types)
        if combine:
            fn.check_combinable(uid)
        out = pa.schema([*(self._input.field(k) for k in self._keys), *fn.output_fields()])
        return self._step(uid, fn, out, fn.state_descriptors(), parallelism, on_error=on_error, state_backend=state_backend, combine=combine)


class WindowedStream:
    """A keyed stream cut into windows; ``aggregate`` adds the window operator."""

    def start(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Refused: windows need their aggregate and a sink before the job starts."""
        raise JobDefinitionError("the windowed stream has no aggregate and no sink, so it cannot start: add "
                                 ".aggregate(uid=..., ...), end it with .sink(...), then call .start(...)")

    def __init__(self, keyed: KeyedStream, assigner: Assigner, lateness_ms: int, late_output: Sink | None):
        self._keyed = keyed
        self._assigner = assigner
        self._lateness_ms = lateness_ms
        self._late = late_output

    def aggregate(self, uid: str, parallelism: int | None = None, on_error: OnError | None = None, state_backend: str | None = None,
                  **aggs: Agg) -> Stream:
        """Incremental aggregates per key and window: ``count()``, ``sum``, ``min``, ``max``,
        ``mean`` (vectorized) and ``reduce(column, fn)``. Emits (key..., window_start, window_end, aggregates).

        Records without an event time (null) follow ``on_error`` (or the pipeline's default);
        ``state_backend`` ("memory" or "rocksdb") overrides the job's for this stage."""
        _check_aggs("window(...).aggregate()", aggs, ("uid", "parallelism", "on_error", "state_backend"))
        k = self._keyed
        wm = k._stream.watermark
        assert wm is not None
        types = {f.name: f.type for f in k._input}
        fn = WindowAggregate(self._assigner, dict(aggs), list(k._keys), types, wm.column, self._lateness_ms)
        out = pa.schema([*(k._input.field(c) for c in k._keys), *fn.output_fields()])
        return k._step(uid, fn, out, fn.state_descriptors(), parallelism, ((WINDOW_START, pa.int64()),), self._late, on_error=on_error,
                       state_backend=state_backend)


def _check_aggs(where: str, aggs: dict[str, Any], options: tuple[str, ...]) -> None:
    """Each keyword beyond ``options`` names an output column and must be an aggregate: a
    misspelt option (``paralelism=2``) is not one, and says which option it was meant as."""
    for name, agg in aggs.items():
        if not isinstance(agg, Agg):
            if difflib.get_close_matches(name, options, n=1):
                raise unknown_keyword(where, name, options)
            raise JobDefinitionError(f"{where}: {name}={agg!r} is not an aggregate: give ks.aggregates.count(), ks.aggregates.sum(column), ks.aggregates.min(column), "
                                     "ks.aggregates.max(column), ks.aggregates.mean(column) or ks.aggregates.reduce(column, fn)")


def _session(source: DataFrame | LogSource) -> SparkSession:
    if isinstance(source, LogSource):
        from pyspark.sql import SparkSession

        active = SparkSession.getActiveSession()
        if active is None:
            raise JobDefinitionError("a pipeline on a log source needs the job's Spark session: build it in build(ctx)")
        return active
    return source.sparkSession


@dataclass(frozen=True)
class Pipeline(JobGraph):
    """A complete job: one source, its stages, and one sink per branch (the job graph,
    :class:`keyscale._steps.JobGraph`, which the runtime runs), and :meth:`start`."""

    def start(self, job_dir: str, parallelism: int | None = None, *, name: str | None = None, **options: Any) -> JobHandle:
        """Run this pipeline on the SparkSession it was built on, in a background thread of
        this process, with its state in ``job_dir``; returns a :class:`keyscale.JobHandle`
        (``status()``, ``rescale(n)``, ``savepoint()``, ``stop(savepoint=True)``,
        ``await_termination()``) once the job is set up.

        ``name`` is the job's name (default: the job directory's last part); a job
        directory remembers it, so a later start in the same directory resumes from its
        checkpoint. ``options`` are :class:`~keyscale.runtime.batch.jobstate.RunOptions` fields:
        ``until_idle=True`` (end when the input is read), ``trigger_interval="1 second"`` (a log
        source's batches run back to back while records wait, and at least once an interval;
        ``wait_for_trigger=True``: one per interval at most), ``latency_target="1s"`` (a log
        source's batches sized for that end-to-end latency, never below what keeps up with
        the input nor above the source's own ``max_records_per_batch``; the status's ``batch_size``),
        ``max_parallelism``, ``from_savepoint``, ``scaling="fixed"|"reactive"|"auto"`` (with ``"auto"``:
        ``autoscaler_mode="recommend"|"active"``, ``slo="latency=5s"`` or ``"lag=30s"``, the target it sizes for),
        ``retain``, ``drain_at_end``, ``state_backend="memory"|"rocksdb"`` (the keyed stages'
        default; a stage's own ``state_backend=`` wins), ``control_host="0.0.0.0"`` and
        ``control_port=9464`` (where the control API listens; default 127.0.0.1, any port),
        ``metrics_token_file=`` or ``metrics_unauthenticated=True`` (who may read ``/metrics``;
        default: the per-run secret)... keyscale changes none of the session's settings.
        """
        from keyscale.runtime.control.handle import start_job

        return start_job(self, job_dir, parallelism, name, **options)


@checked_keywords
def stream(df: DataFrame | LogSource) -> Stream:
    """Start a pipeline from a Spark streaming DataFrame (``spark.readStream...``) or a
    partitioned log (:func:`keyscale.sources.log_source`), whose offsets keyscale keeps itself."""
    from pyspark.sql import DataFrame as SparkDataFrame

    if isinstance(df, LogSource):
        return Stream(df)
    if not isinstance(df, SparkDataFrame):
        raise JobDefinitionError(f"keyscale.stream() takes a Spark DataFrame or a log_source(), not {type(df).__name__}")
    from keyscale.runtime.driver.session import check_classic

    check_classic(df)
    if not df.isStreaming:
        raise JobDefinitionError("keyscale.stream() needs a streaming DataFrame (spark.readStream...), not a batch one")
    from keyscale.runtime.batch.malformed import check_malformed_modes
    from keyscale.runtime.batch.spark_source import check_spark_source

    check_spark_source(df)
    check_malformed_modes(df)
    return Stream(df)


@checked_keywords
def pipeline(*branches: Pipeline) -> Pipeline:
    """One job with several sinks: each argument ends one branch (``stream.sink(...)``), and
    all start from the same ``ks.stream(...)``. A batch runs each stage once, however many
    branches read it, and each sink gets the batch exactly once.

    Branch after any stage: ``events.key_by("user").window(...).aggregate(...)`` and
    ``events.key_by("page").aggregate(...)`` read the same ``events``; or send one stage's
    rows to two sinks::

        events = ks.stream(df).with_watermark("ts", "10 seconds")
        sessions = events.key_by("user").window(ks.windows.SessionWindows("30 minutes")).aggregate(uid="sessions", clicks=ks.aggregates.count())
        pages = events.key_by("page").aggregate(uid="page_counts", views=ks.aggregates.count())
        return ks.pipeline(sessions.sink(ks.sinks.ParquetSink(a)), pages.sink(ks.sinks.ParquetSink(b)), pages.sink(ks.sinks.ConsoleSink()))
    """
    if not branches:
        raise JobDefinitionError("keyscale.pipeline() needs at least one branch: stream.sink(...)")
    wrong = next((b for b in branches if not isinstance(b, Pipeline)), None)
    if wrong is not None:
        raise JobDefinitionError(f"keyscale.pipeline() takes branches ending in .sink(...), not {type(wrong).__name__}")
    first = branches[0]
    if any(b.source is not first.source for b in branches):
        raise JobDefinitionError("the branches of keyscale.pipeline() start from different streams: branch one ks.stream(...) instead")
    if any(b.watermark != first.watermark for b in branches):
        raise JobDefinitionError("the branches of keyscale.pipeline() have different watermarks: call with_watermark() once, before branching")
    merged = Pipeline(first.source, tuple(br for b in branches for br in b.branches), first.watermark)
    by_uid: dict[str, Step] = {}
    for s in merged.steps:
        if not isinstance(s, TransformStep) and by_uid.setdefault(s.uid, s) is not s:
            raise JobDefinitionError(f"two stages have the uid '{s.uid}'; each stateful stage needs its own")
    policies: dict[str, ErrorPolicy] = {}
    for b in branches:
        for uid, p in b.policies.items():
            if policies.setdefault(uid, p) != p:
                raise JobDefinitionError(f"operator '{uid}' is in two branches whose sink(on_error=..., max_errors_per_batch=...) differ: give them the same")
    dead = {id(b.dead_letter): b.dead_letter for b in branches if b.dead_letter is not None}
    if len(dead) > 1:
        raise JobDefinitionError("the branches of keyscale.pipeline() have different dead-letter sinks: a job has one; give it on one branch")
    # The job's own policy (malformed input): the strictest of the branches' (fail, then dead_letter).
    inputs = sorted((b.input_policy for b in branches), key=lambda p: ("fail", "dead_letter", "skip").index(p.on_error))
    return _check_sinks(replace(merged, policies=policies, dead_letter=next(iter(dead.values()), None), input_policy=inputs[0]))


def _check_sinks(p: Pipeline) -> Pipeline:
    """Two outputs into one exactly-once sink would lose rows: a batch's second write finds
    the first one's output and, as a replay does, keeps it."""
    seen: set[str] = set()
    for sink in p.sinks:
        where = sink.describe()
        if sink.exactly_once and where in seen:
            raise JobDefinitionError(f"two outputs of the pipeline write to {where}: each needs a sink of its own")
        seen.add(where)
    return p


# Two streams into one keyed stage (connect and joins).
#
# Two streams into one keyed stage: ``connect`` (co-process functions) and joins.
#
# The two inputs become one stream of rows ``(key columns, __side, in1, in2)``, keyed by the
# key columns, and the stage runs :class:`keyscale.operators.coprocess.CoProcessAdapter`. Two
# Spark streaming DataFrames are unioned in Spark; two log or Kafka sources become one log
# source (:class:`keyscale.sources.union.UnionLog`) that keyscale's readers read as any log;
# a Spark source and a log are read side by side, Spark's query driving the batches and
# each batch reading the log too (:func:`_spark_with_log`).
# The stage has one event-time clock: with a Spark input, the watermark trails the largest
# event time of either input by the larger of their out-of-orderness bounds; with two logs,
# each partition of either log has its own clock and the slowest holds the watermark back.


def _transforms(stream: Stream, which: str) -> list[Callable[[DataFrame], DataFrame]]:
    """The stream's stateless steps (a two-input stage is the first stateful one)."""
    from keyscale._steps import TransformStep

    fns = []
    for step in stream._steps:
        if not isinstance(step, TransformStep):
            raise JobDefinitionError(f"connect: the {which} input has a stateful stage ('{step.uid}') before it; connect the streams first")
        fns.append(step.fn)
    return fns


def _apply(df: DataFrame, fns: list[Callable[[DataFrame], DataFrame]]) -> DataFrame:
    for fn in fns:
        df = fn(df)
    return df


TICK = "__tick"


def _spark_with_log(a: DataFrame | LogSource, b: DataFrame | LogSource, fns: tuple[list[Callable[[DataFrame], DataFrame]], ...],
                    combine: Callable[[DataFrame, DataFrame], DataFrame]) -> Stream:
    """A Spark source and a log as one stream: Spark's query drives the batches, and each
    batch also reads the log (its offsets in keyscale's checkpoints, as a log source's).

    Spark runs a batch only when a source of its query has new rows, so the query also
    reads Spark's ``rate-micro-batch`` source, one row per batch (dropped before the stage):
    the log's records and the watermark move at every trigger even while the Spark
    source has nothing new."""
    from pyspark.sql import DataFrame as SparkDataFrame
    from pyspark.sql import functions as F

    from keyscale._steps import LogInputStep, source_schema

    spark_first = isinstance(a, SparkDataFrame)
    spark_df, log = (a, b) if spark_first else (b, a)
    assert isinstance(spark_df, SparkDataFrame) and isinstance(log, LogSource)
    session = spark_df.sparkSession
    ticks = session.readStream.format("rate-micro-batch").option("rowsPerBatch", 1).option("numPartitions", 1).load()
    driving = spark_df.withColumn(TICK, F.lit(None).cast("boolean")).unionByName(
        ticks.select(F.lit(True).alias(TICK)), allowMissingColumns=True)

    def merge(spark_rows: DataFrame, log_rows: DataFrame) -> DataFrame:
        rows = spark_rows.where(F.col(TICK).isNull()).drop(TICK)
        first, second = (rows, log_rows) if spark_first else (log_rows, rows)
        return combine(_apply(first, fns[0]), _apply(second, fns[1]))

    def never(df: DataFrame) -> DataFrame:
        raise RuntimeError("the input of a stage connecting a Spark source with a log is built by the runtime")

    probe = merge(session.createDataFrame([], driving.schema), session.createDataFrame([], source_schema(log)))
    return Stream(driving, (LogInputStep(never, log, merge),), probe.schema)


class ConnectedStreams:
    """Two streams to key alike (see :meth:`keyscale.streams.Stream.connect`)."""

    def __init__(self, first: Stream, second: Stream):
        self.first, self.second = first, second

    def key_by(self, keys1: str | Sequence[str], keys2: str | Sequence[str]) -> ConnectedKeyedStreams:
        """Key the first input by ``keys1`` and the second by ``keys2`` (as many columns,
        of the same types): records with equal keys meet in one key's state."""
        k1 = (keys1,) if isinstance(keys1, str) else tuple(keys1)
        k2 = (keys2,) if isinstance(keys2, str) else tuple(keys2)
        if not k1 or len(k1) != len(k2):
            raise JobDefinitionError(f"connect().key_by: both inputs need as many key columns (got {list(k1)} and {list(k2)})")
        for which, keys, stream in (("first", k1, self.first), ("second", k2, self.second)):
            missing = [k for k in keys if k not in stream.columns]
            if missing:
                raise JobDefinitionError(f"connect().key_by: key column '{missing[0]}' is not in the {which} input (columns: {', '.join(stream.columns)})")
        t1 = [self.first.schema[k].dataType for k in k1]
        t2 = [self.second.schema[k].dataType for k in k2]
        for a, b, x, y in zip(k1, k2, t1, t2, strict=True):
            if x != y:
                raise JobDefinitionError(f"connect().key_by: key columns '{a}' ({x.simpleString()}) and '{b}' ({y.simpleString()}) differ in type")
        return ConnectedKeyedStreams(self.first, self.second, k1, k2)


class ConnectedKeyedStreams:
    """Two inputs keyed alike: ``process`` a :class:`KeyedCoProcessFunction`, or join them."""

    def __init__(self, first: Stream, second: Stream, keys1: tuple[str, ...], keys2: tuple[str, ...]):
        self.first, self.second = first, second
        self.keys1, self.keys2 = keys1, keys2

    def _combined(self) -> Stream:
        from pyspark.sql import DataFrame as SparkDataFrame
        from pyspark.sql import functions as F

        wm1, wm2 = self.first.watermark, self.second.watermark
        if (wm1 is None) != (wm2 is None):
            raise JobDefinitionError("connect: give both inputs a watermark (with_watermark) or neither")
        times = (wm1.column, wm2.column) if wm1 is not None and wm2 is not None else None
        keys = list(self.keys1)
        key_cols = (self.keys1, self.keys2)
        fns = (_transforms(self.first, "first"), _transforms(self.second, "second"))

        def combine(df1: DataFrame, df2: DataFrame) -> DataFrame:
            """Both inputs (after their own steps) as rows of ``(key..., __side, in1, in2[, __event_time])``."""
            dfs = (df1, df2)

            def side(n: int) -> DataFrame:
                df = dfs[n]
                cols = [F.col(k).alias(name) for k, name in zip(key_cols[n], keys, strict=True)]
                cols.append(F.lit(n).cast("byte").alias(SIDE))
                structs = [F.lit(None).cast(d.schema) for d in dfs]
                structs[n] = F.struct(*[F.col(c) for c in df.columns])
                cols += [c.alias(name) for c, name in zip(structs, INPUTS, strict=True)]
                if times is not None:  # a long event time is epoch milliseconds (with_watermark)
                    t = F.col(times[n])
                    is_long = df.schema[times[n]].dataType.typeName() in ("byte", "short", "integer", "long")
                    cols.append((F.timestamp_millis(t) if is_long else t.cast("timestamp")).alias(EVENT_TIME))
                return df.select(*cols)

            return side(0).unionByName(side(1))

        a, b = self.first._source, self.second._source
        if isinstance(a, SparkDataFrame) and isinstance(b, SparkDataFrame):
            combined = Stream(combine(_apply(a, fns[0]), _apply(b, fns[1])))
        elif isinstance(a, LogSource) and isinstance(b, LogSource):
            # One log source over both logs: keyscale's readers, offsets and rescaling as for one log.
            try:
                union = UnionLog(a.log, b.log, times)
            except LogError as e:
                raise JobDefinitionError(f"connect: {e}; with logs as inputs the watermark is on a column of each log") from None
            caps = [c for c in (a.max_records_per_partition, b.max_records_per_partition) if c is not None]
            pars = [p for p in (a.parallelism, b.parallelism) if p is not None]
            src = LogSource(union, f"{a.uid}-{b.uid}", max(pars) if pars else None, min(caps) if caps else None)

            def split(df: DataFrame) -> DataFrame:
                return combine(*(_apply(df.where(F.col(SIDE) == n).select(f"{INPUTS[n]}.*"), fns[n]) for n in (0, 1)))

            combined = Stream(src).transform(split)
        else:
            combined = _spark_with_log(a, b, fns, combine)
        if wm1 is not None and wm2 is not None:
            ahead = None if wm1.max_ahead_ms is None or wm2.max_ahead_ms is None else max(wm1.max_ahead_ms, wm2.max_ahead_ms)
            idle = None if wm1.idleness_ms is None or wm2.idleness_ms is None else max(wm1.idleness_ms, wm2.idleness_ms)
            combined = combined.with_watermark(EVENT_TIME, f"{max(wm1.out_of_orderness_ms, wm2.out_of_orderness_ms)} ms",
                                               None if idle is None else f"{idle} ms", None if ahead is None else f"{ahead} ms")
        return combined

    def process(self, function: KeyedCoProcessFunction | VectorizedKeyedCoProcessFunction, schema: str | pa.Schema, uid: str,
                parallelism: int | None = None, on_error: OnError | None = None, state_backend: str | None = None) -> Stream:
        """Run ``function`` over both inputs: one keyed stage, one state and one set of
        timers per key for both (see :class:`KeyedCoProcessFunction`), or a batch of both
        at a time (:class:`VectorizedKeyedCoProcessFunction`); ``state_backend`` as for a
        one-input stage."""
        if isinstance(function, VectorizedKeyedCoProcessFunction):
            for which, stream, columns in (("1", self.first, function.input_columns1), ("2", self.second, function.input_columns2)):
                missing = [c for c in columns or () if c not in stream.columns]
                if missing:
                    raise JobDefinitionError(f"operator '{uid}': input_columns{which} names '{missing[0]}', which is not a column of "
                                             f"the {'first' if which == '1' else 'second'} input (columns: {', '.join(stream.columns)})")
        return self._combined().key_by(*self.keys1).process(adapt(function, len(self.keys1)), schema, uid, parallelism, on_error=on_error,
                                                             state_backend=state_backend)

    def interval_join(self, lower: Any, upper: Any, uid: str, parallelism: int | None = None, state_backend: str | None = None) -> Stream:
        """Pairs of rows with equal keys whose event times satisfy
        ``t1 + lower <= t2 <= t1 + upper`` (durations such as ``"-5 seconds"``, ``"10 seconds"``,
        or seconds), each pair once, as one row of the first input's columns and the
        second's (a name both have gets the suffix ``_2`` on the second's). Needs a watermark
        on both inputs: it drops rows that can no longer join, so state stays bounded.
        """
        wm1, wm2 = self.first.watermark, self.second.watermark
        if wm1 is None or wm2 is None:
            raise JobDefinitionError(f"interval_join '{uid}': both inputs need a watermark (with_watermark) on their event time")
        lo, hi = _signed_ms(lower, "lower"), _signed_ms(upper, "upper")
        if lo > hi:
            raise JobDefinitionError(f"interval_join '{uid}': lower ({lo} ms) is after upper ({hi} ms)")
        a1, a2, names1, names2, fields = self._pair_columns()
        fn = IntervalJoin(wm1.column, wm2.column, lo, hi, pa.struct(list(a1)), pa.struct(list(a2)), names1, names2)
        return self.process(fn, pa.schema(fields), uid, parallelism, state_backend=state_backend)

    def window_join(self, assigner: TumblingWindows | SlidingWindows, uid: str, parallelism: int | None = None,
                    state_backend: str | None = None) -> Stream:
        """Pairs of rows with equal keys in the same event-time window (``ks.windows.TumblingWindows``
        or ``ks.windows.SlidingWindows``; each pair once per window both rows fall in), as one row of
        both inputs' columns (a name both have gets ``_2`` on the second's) and the window's
        ``window_start`` and ``window_end``. Needs a watermark on both inputs: a row leaves the
        state once its last window has fired, and a row whose windows have all fired is late
        and joins nothing.
        """
        wm1, wm2 = self.first.watermark, self.second.watermark
        if wm1 is None or wm2 is None:
            raise JobDefinitionError(f"window_join '{uid}': both inputs need a watermark (with_watermark) on their event time")
        if not isinstance(assigner, TumblingWindows | SlidingWindows):
            raise JobDefinitionError(f"window_join '{uid}': windows are TumblingWindows or SlidingWindows, not {type(assigner).__name__}")
        a1, a2, names1, names2, fields = self._pair_columns()
        for name in ("window_start", "window_end"):
            if name in names1 or name in names2:
                raise JobDefinitionError(f"window_join '{uid}': an input has a column '{name}', which the join's output adds; rename it")
        fields += [pa.field("window_start", pa.timestamp("us", tz="UTC")), pa.field("window_end", pa.timestamp("us", tz="UTC"))]
        fn = WindowJoin(assigner, wm1.column, wm2.column, pa.struct(list(a1)), pa.struct(list(a2)), names1, names2)
        return self.process(fn, pa.schema(fields), uid, parallelism, state_backend=state_backend)

    def _pair_columns(self) -> tuple[pa.Schema, pa.Schema, list[str], list[str], list[pa.Field[Any]]]:
        """Both inputs' Arrow schemas, their output column names and the joined row's fields."""

        a1, a2 = _to_arrow_schema(self.first.schema), _to_arrow_schema(self.second.schema)
        names1 = list(a1.names)
        names2 = [n if n not in names1 else f"{n}_2" for n in a2.names]
        fields: list[pa.Field[Any]] = [*a1, *(f.with_name(n) for f, n in zip(a2, names2, strict=True))]
        return a1, a2, names1, names2, fields


def _signed_ms(value: Any, what: str) -> int:
    """A duration that may be negative: ``"-5 seconds"``, or a number of seconds."""
    if isinstance(value, int | float):
        return (-1 if value < 0 else 1) * parse_duration_ms(abs(value), what)
    text = str(value).strip()
    sign = -1 if text.startswith("-") else 1
    return sign * parse_duration_ms(text.lstrip("+-").strip(), what)
