"""Two inputs into one keyed stage (``Stream.connect``, the joins): how their rows become one
input, in Spark or in a log, and the joins' functions and columns.

Apart from the stream types (:mod:`keyscale._stream`: ``ConnectedStreams`` and
``ConnectedKeyedStreams`` check the inputs and build the stage) because this is plumbing of
its own, on Spark DataFrames, log sources, steps and Arrow schemas, never on a stream type:
so the stream types import it and it imports none of them.

The two inputs become one stream of rows ``(key columns, __side, in1, in2)``, keyed by the
key columns, and the stage runs :class:`keyscale.operators.coprocess.CoProcessAdapter`. Two
Spark streaming DataFrames are unioned in Spark; two log or Kafka sources become one log
source (:class:`keyscale.sources.union.UnionLog`) that keyscale's readers read as any log;
a Spark source and a log are read side by side, Spark's query driving the batches and
each batch reading the log too (:func:`_spark_with_log`).
The stage has one event-time clock: with a Spark input, the watermark trails the largest
event time of either input by the larger of their out-of-orderness bounds; with two logs,
each partition of either log has its own clock and the slowest holds the watermark back.

>>> signed_ms("-5 seconds", "lower"), signed_ms(2, "upper")
(-5000, 2000)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from keyscale._steps import LogInputStep, Step, TransformStep, source_schema
from keyscale.errors import JobDefinitionError
from keyscale.operators.coprocess import EVENT_TIME, INPUTS, SIDE, IntervalJoin, WindowJoin
from keyscale.operators.eventtime import WatermarkSpec, parse_duration_ms
from keyscale.operators.windows import SlidingWindows, TumblingWindows
from keyscale.sources.partitioned import LogError
from keyscale.sources.reader import LogSource
from keyscale.sources.union import UnionLog

if TYPE_CHECKING:
    from pyspark.sql import DataFrame
    from pyspark.sql.types import StructType

Transforms = list[Callable[["DataFrame"], "DataFrame"]]


@dataclass(frozen=True)
class Combined:
    """The stage's one input: a stream of ``source`` with ``steps`` (its rows' ``schema``
    when the steps cannot say it), then ``split`` as a stateless step when there is one."""

    source: DataFrame | LogSource
    steps: tuple[Step, ...] = ()
    schema: StructType | None = None
    split: Callable[[DataFrame], DataFrame] | None = None


def connect_keys(keys1: str | Sequence[str], keys2: str | Sequence[str], schemas: tuple[StructType, StructType]
                 ) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Both inputs' key columns (``connect(...).key_by``), refused unless they are as many,
    in their input, and of the same types pairwise."""
    k1 = (keys1,) if isinstance(keys1, str) else tuple(keys1)
    k2 = (keys2,) if isinstance(keys2, str) else tuple(keys2)
    if not k1 or len(k1) != len(k2):
        raise JobDefinitionError(f"connect().key_by: both inputs need as many key columns (got {list(k1)} and {list(k2)})")
    for which, keys, schema in (("first", k1, schemas[0]), ("second", k2, schemas[1])):
        columns = schema.fieldNames()
        missing = [k for k in keys if k not in columns]
        if missing:
            raise JobDefinitionError(f"connect().key_by: key column '{missing[0]}' is not in the {which} input (columns: {', '.join(columns)})")
    for a, b in zip(k1, k2, strict=True):
        x, y = schemas[0][a].dataType, schemas[1][b].dataType
        if x != y:
            raise JobDefinitionError(f"connect().key_by: key columns '{a}' ({x.simpleString()}) and '{b}' ({y.simpleString()}) differ in type")
    return k1, k2


def transforms(steps: tuple[Step, ...], which: str) -> Transforms:
    """An input's stateless steps (a two-input stage is the first stateful one)."""
    fns = []
    for step in steps:
        if not isinstance(step, TransformStep):
            raise JobDefinitionError(f"connect: the {which} input has a stateful stage ('{step.uid}') before it; connect the streams first")
        fns.append(step.fn)
    return fns


def _apply(df: DataFrame, fns: Transforms) -> DataFrame:
    for fn in fns:
        df = fn(df)
    return df


def combine(sources: tuple[DataFrame | LogSource, DataFrame | LogSource], fns: tuple[Transforms, Transforms],
            keys: tuple[tuple[str, ...], tuple[str, ...]], times: tuple[str, str] | None) -> Combined:
    """Both inputs (after their own steps) as rows of ``(key..., __side, in1, in2[, __event_time])``,
    the key columns named as the first input's (``keys[0]``)."""
    from pyspark.sql import DataFrame as SparkDataFrame
    from pyspark.sql import functions as F

    def rows(df1: DataFrame, df2: DataFrame) -> DataFrame:
        dfs = (df1, df2)

        def side(n: int) -> DataFrame:
            df = dfs[n]
            cols = [F.col(k).alias(name) for k, name in zip(keys[n], keys[0], strict=True)]
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

    a, b = sources
    if isinstance(a, SparkDataFrame) and isinstance(b, SparkDataFrame):
        return Combined(rows(_apply(a, fns[0]), _apply(b, fns[1])))
    if isinstance(a, LogSource) and isinstance(b, LogSource):
        # One log source over both logs: keyscale's readers, offsets and rescaling as for one log.
        try:
            union = UnionLog(a.log, b.log, times)
        except LogError as e:
            raise JobDefinitionError(f"connect: {e}; with logs as inputs the watermark is on a column of each log") from None
        caps = [c for c in (a.max_records_per_partition, b.max_records_per_partition) if c is not None]
        pars = [p for p in (a.parallelism, b.parallelism) if p is not None]
        src = LogSource(union, f"{a.uid}-{b.uid}", max(pars) if pars else None, min(caps) if caps else None)

        def split(df: DataFrame) -> DataFrame:
            return rows(*(_apply(df.where(F.col(SIDE) == n).select(f"{INPUTS[n]}.*"), fns[n]) for n in (0, 1)))

        return Combined(src, split=split)
    return _spark_with_log(a, b, fns, rows)


TICK = "__tick"


def _spark_with_log(a: DataFrame | LogSource, b: DataFrame | LogSource, fns: tuple[Transforms, Transforms],
                    rows: Callable[[DataFrame, DataFrame], DataFrame]) -> Combined:
    """A Spark source and a log as one stream: Spark's query drives the batches, and each
    batch also reads the log (its offsets in keyscale's checkpoints, as a log source's).

    Spark runs a batch only when a source of its query has new rows, so the query also
    reads Spark's ``rate-micro-batch`` source, one row per batch (dropped before the stage):
    the log's records and the watermark move at every trigger even while the Spark
    source has nothing new."""
    from pyspark.sql import DataFrame as SparkDataFrame
    from pyspark.sql import functions as F

    spark_first = isinstance(a, SparkDataFrame)
    spark_df, log = (a, b) if spark_first else (b, a)
    assert isinstance(spark_df, SparkDataFrame) and isinstance(log, LogSource)
    session = spark_df.sparkSession
    ticks = session.readStream.format("rate-micro-batch").option("rowsPerBatch", 1).option("numPartitions", 1).load()
    driving = spark_df.withColumn(TICK, F.lit(None).cast("boolean")).unionByName(
        ticks.select(F.lit(True).alias(TICK)), allowMissingColumns=True)

    def merge(spark_rows: DataFrame, log_rows: DataFrame) -> DataFrame:
        kept = spark_rows.where(F.col(TICK).isNull()).drop(TICK)
        first, second = (kept, log_rows) if spark_first else (log_rows, kept)
        return rows(_apply(first, fns[0]), _apply(second, fns[1]))

    def never(df: DataFrame) -> DataFrame:
        raise RuntimeError("the input of a stage connecting a Spark source with a log is built by the runtime")

    probe = merge(session.createDataFrame([], driving.schema), session.createDataFrame([], source_schema(log)))
    return Combined(driving, (LogInputStep(never, log, merge),), probe.schema)


def combined_watermark(wm1: WatermarkSpec, wm2: WatermarkSpec) -> tuple[str, str | None, str | None]:
    """The stage's one clock from both inputs' (``with_watermark``'s out-of-orderness,
    idleness and max_ahead): the looser of each bound, none where either has none.

    >>> combined_watermark(WatermarkSpec("t", 5000, None, 60000), WatermarkSpec("u", 1000, 200, 1000))
    ('5000 ms', None, '60000 ms')
    """
    ahead = None if wm1.max_ahead_ms is None or wm2.max_ahead_ms is None else max(wm1.max_ahead_ms, wm2.max_ahead_ms)
    idle = None if wm1.idleness_ms is None or wm2.idleness_ms is None else max(wm1.idleness_ms, wm2.idleness_ms)
    return (f"{max(wm1.out_of_orderness_ms, wm2.out_of_orderness_ms)} ms", None if idle is None else f"{idle} ms",
            None if ahead is None else f"{ahead} ms")


def interval_join(uid: str, lower: Any, upper: Any, times: tuple[str, str], schemas: tuple[pa.Schema, pa.Schema]) -> tuple[IntervalJoin, pa.Schema]:
    """``interval_join``'s function and output schema, from both inputs' event-time columns
    and Arrow schemas; bounds the wrong way round are refused."""
    lo, hi = signed_ms(lower, "lower"), signed_ms(upper, "upper")
    if lo > hi:
        raise JobDefinitionError(f"interval_join '{uid}': lower ({lo} ms) is after upper ({hi} ms)")
    names1, names2, fields = pair_columns(*schemas)
    return IntervalJoin(*times, lo, hi, pa.struct(list(schemas[0])), pa.struct(list(schemas[1])), names1, names2), pa.schema(fields)


def window_join(uid: str, assigner: Any, times: tuple[str, str], schemas: tuple[pa.Schema, pa.Schema]) -> tuple[WindowJoin, pa.Schema]:
    """``window_join``'s function and output schema (both inputs' columns, then the window's
    bounds); other assigners, and an input column of a bound's name, are refused."""
    if not isinstance(assigner, TumblingWindows | SlidingWindows):
        raise JobDefinitionError(f"window_join '{uid}': windows are TumblingWindows or SlidingWindows, not {type(assigner).__name__}")
    names1, names2, fields = pair_columns(*schemas)
    for name in ("window_start", "window_end"):
        if name in names1 or name in names2:
            raise JobDefinitionError(f"window_join '{uid}': an input has a column '{name}', which the join's output adds; rename it")
    fields += [pa.field("window_start", pa.timestamp("us", tz="UTC")), pa.field("window_end", pa.timestamp("us", tz="UTC"))]
    fn = WindowJoin(assigner, *times, pa.struct(list(schemas[0])), pa.struct(list(schemas[1])), names1, names2)
    return fn, pa.schema(fields)


def pair_columns(a1: pa.Schema, a2: pa.Schema) -> tuple[list[str], list[str], list[pa.Field[Any]]]:
    """A join's output names for either input and the joined row's fields: a name both
    inputs have gets ``_2`` on the second's.

    >>> pair_columns(pa.schema([("k", pa.string()), ("v", pa.int64())]), pa.schema([("k", pa.string())]))[1]
    ['k_2']
    """
    names1 = list(a1.names)
    names2 = [n if n not in names1 else f"{n}_2" for n in a2.names]
    fields: list[pa.Field[Any]] = [*a1, *(f.with_name(n) for f, n in zip(a2, names2, strict=True))]
    return names1, names2, fields


def signed_ms(value: Any, what: str) -> int:
    """A duration that may be negative: ``"-5 seconds"``, or a number of seconds."""
    if isinstance(value, int | float):
        return (-1 if value < 0 else 1) * parse_duration_ms(abs(value), what)
    text = str(value).strip()
    sign = -1 if text.startswith("-") else 1
    return sign * parse_duration_ms(text.lstrip("+-").strip(), what)
