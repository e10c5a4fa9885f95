"""The stream types a job file builds a pipeline of: :class:`Stream` (stateless steps,
non-keyed stages, event time), :class:`KeyedStream` (keyed stages, aggregates),
:class:`WindowedStream` (window aggregates), and two inputs into one keyed stage
(:class:`ConnectedStreams`, :class:`ConnectedKeyedStreams`: ``connect`` and the joins).

They share one module because they build one another (a stream's ``key_by`` gives a keyed
stream, whose stages give a stream; ``connect`` gives connected streams, whose ``process``
gives a stream), so any two modules of them would import each other; that is why it is
near ~500 lines. What does not name a stream type lives apart: the finished job
(:mod:`keyscale._job`, what ``sink`` returns) and the plumbing that merges two inputs in
Spark or a log (:mod:`keyscale._connect`). The checks a stage meets as it is added (uids,
keys, aggregates, watermarks) are here.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import pyarrow as pa

from keyscale._connect import (
    combine,
    combined_watermark,
    connect_keys,
    interval_join,
    transforms,
    window_join,
)
from keyscale._job import Pipeline, check_sinks
from keyscale._keywords import checked_keywords, unknown_keyword
from keyscale._spark_types import from_arrow_schema, to_arrow_schema
from keyscale._steps import (
    Branch,
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
    KeyedCoProcessFunction,
    VectorizedKeyedCoProcessFunction,
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
from keyscale.sources.reader import LogSource
from keyscale.state.backends import check_rocksdb_keys, check_state_backend
from keyscale.state.types import StateDescriptor, arrow_schema
from keyscale.state.uids import check_uid

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession
    from pyspark.sql.types import StructType

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
        return check_sinks(Pipeline(self._source, (Branch(self._steps, sink),), self._watermark, policies, dead_letter,
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


class ConnectedStreams:
    """Two streams to key alike (see :meth:`keyscale.streams.Stream.connect`)."""

    def __init__(self, first: Stream, second: Stream):
        self.first, self.second = first, second

    def key_by(self, keys1: str | Sequence[str], keys2: str | Sequence[str]) -> ConnectedKeyedStreams:
        """Key the first input by ``keys1`` and the second by ``keys2`` (as many columns,
        of the same types): records with equal keys meet in one key's state."""
        k1, k2 = connect_keys(keys1, keys2, (self.first.schema, self.second.schema))
        return ConnectedKeyedStreams(self.first, self.second, k1, k2)


class ConnectedKeyedStreams:
    """Two inputs keyed alike: ``process`` a :class:`KeyedCoProcessFunction`, or join them."""

    def __init__(self, first: Stream, second: Stream, keys1: tuple[str, ...], keys2: tuple[str, ...]):
        self.first, self.second = first, second
        self.keys1, self.keys2 = keys1, keys2

    def _combined(self) -> Stream:
        """Both inputs as one stream of rows ``(key..., __side, in1, in2[, __event_time])``
        (:func:`keyscale._connect.combine`), with the stage's one clock."""
        wm1, wm2 = self.first.watermark, self.second.watermark
        if (wm1 is None) != (wm2 is None):
            raise JobDefinitionError("connect: give both inputs a watermark (with_watermark) or neither")
        times = (wm1.column, wm2.column) if wm1 is not None and wm2 is not None else None
        fns = (transforms(self.first._steps, "first"), transforms(self.second._steps, "second"))
        c = combine((self.first._source, self.second._source), fns, (self.keys1, self.keys2), times)
        combined = Stream(c.source, c.steps, c.schema)
        if c.split is not None:
            combined = combined.transform(c.split)
        if wm1 is not None and wm2 is not None:
            combined = combined.with_watermark(EVENT_TIME, *combined_watermark(wm1, wm2))
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
        fn, output = interval_join(uid, lower, upper, (wm1.column, wm2.column), self._arrow_schemas())
        return self.process(fn, output, uid, parallelism, state_backend=state_backend)

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
        fn, output = window_join(uid, assigner, (wm1.column, wm2.column), self._arrow_schemas())
        return self.process(fn, output, uid, parallelism, state_backend=state_backend)

    def _arrow_schemas(self) -> tuple[pa.Schema, pa.Schema]:
        return _to_arrow_schema(self.first.schema), _to_arrow_schema(self.second.schema)
