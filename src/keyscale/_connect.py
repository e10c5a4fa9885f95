"""Two streams into one keyed stage: ``connect`` (co-process functions) and joins.

The two inputs become one stream of rows ``(key columns, __side, in1, in2)``, keyed by the
key columns, and the stage runs :class:`keyscale.operators.coprocess.CoProcessAdapter`. Two
Spark streaming DataFrames are unioned in Spark; two log or Kafka sources become one log
source (:class:`keyscale.sources.union.UnionLog`) that keyscale's readers read as any log;
a Spark source and a log are read side by side, Spark's query driving the batches and
each batch reading the log too (:func:`_spark_with_log`).
The stage has one event-time clock: with a Spark input, the watermark trails the largest
event time of either input by the larger of their out-of-orderness bounds; with two logs,
each partition of either log has its own clock and the slowest holds the watermark back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import pyarrow as pa

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
from keyscale.operators.eventtime import parse_duration_ms
from keyscale.operators.windows import SlidingWindows, TumblingWindows
from keyscale.sources.partitioned import LogError
from keyscale.sources.reader import LogSource
from keyscale.sources.union import UnionLog

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from keyscale._pipeline import Stream
    from keyscale._steps import OnError

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

    from keyscale._pipeline import Stream
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

        from keyscale._pipeline import Stream

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
        from keyscale._pipeline import _to_arrow_schema

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
