"""Two streams into one keyed stage: ``connect`` (co-process functions) and joins.

The two inputs become one Spark streaming DataFrame (a union of both queries' rows as
``(key columns, __side, in1, in2)``), keyed by the key columns, and the stage runs
:class:`keyscale.operators.coprocess.CoProcessAdapter`. Both inputs share one event-time
clock: the combined stream's watermark trails the largest event time of either by the
larger of their out-of-orderness bounds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from keyscale.errors import JobDefinitionError
from keyscale.operators.coprocess import INPUTS, SIDE, IntervalJoin, KeyedCoProcessFunction, adapt
from keyscale.operators.eventtime import parse_duration_ms

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from keyscale._pipeline import OnError, Stream

EVENT_TIME = "__event_time"


def _spark_input(stream: Stream, which: str) -> DataFrame:
    """The stream's rows as a streaming DataFrame: its source with its stateless steps."""
    from pyspark.sql import DataFrame as SparkDataFrame

    from keyscale._pipeline import TransformStep

    source = stream._source
    if not isinstance(source, SparkDataFrame):
        raise JobDefinitionError(f"connect: the {which} input reads a log or Kafka source; two-input stages take Spark streaming DataFrames for now")
    df = source
    for step in stream._steps:
        if not isinstance(step, TransformStep):
            raise JobDefinitionError(f"connect: the {which} input has a stateful stage ('{step.uid}') before it; connect the streams first")
        df = step.fn(df)
    return df


class ConnectedStreams:
    """Two streams to key alike (see :meth:`keyscale.Stream.connect`)."""

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
        from pyspark.sql import functions as F

        from keyscale._pipeline import Stream

        df1, df2 = _spark_input(self.first, "first"), _spark_input(self.second, "second")
        s1, s2 = df1.schema, df2.schema
        wm1, wm2 = self.first.watermark, self.second.watermark
        if (wm1 is None) != (wm2 is None):
            raise JobDefinitionError("connect: give both inputs a watermark (with_watermark) or neither")
        keys = list(self.keys1)

        def side(df: DataFrame, n: int, key_cols: tuple[str, ...], time_col: str | None) -> DataFrame:
            other = s2 if n == 0 else s1
            cols = [F.col(k).alias(name) for k, name in zip(key_cols, keys, strict=True)]
            cols.append(F.lit(n).alias(SIDE))
            mine = F.struct(*[F.col(c) for c in df.columns])
            empty = F.lit(None).cast(other)
            cols += [mine.alias(INPUTS[0]), empty.alias(INPUTS[1])] if n == 0 else [empty.alias(INPUTS[0]), mine.alias(INPUTS[1])]
            if time_col is not None:
                cols.append(F.col(time_col).cast("timestamp").alias(EVENT_TIME))
            return df.select(*cols)

        both = side(df1, 0, self.keys1, wm1.column if wm1 else None).unionByName(side(df2, 1, self.keys2, wm2.column if wm2 else None))
        combined = Stream(both)
        if wm1 is not None and wm2 is not None:
            ahead = None if wm1.max_ahead_ms is None or wm2.max_ahead_ms is None else max(wm1.max_ahead_ms, wm2.max_ahead_ms)
            idle = None if wm1.idleness_ms is None or wm2.idleness_ms is None else max(wm1.idleness_ms, wm2.idleness_ms)
            combined = combined.with_watermark(EVENT_TIME, f"{max(wm1.out_of_orderness_ms, wm2.out_of_orderness_ms)} ms",
                                               None if idle is None else f"{idle} ms", None if ahead is None else f"{ahead} ms")
        return combined

    def process(self, function: KeyedCoProcessFunction, schema: str | pa.Schema, uid: str, parallelism: int | None = None,
                on_error: OnError | None = None) -> Stream:
        """Run ``function`` over both inputs: one keyed stage, one state and one set of
        timers per key for both (see :class:`KeyedCoProcessFunction`)."""
        return self._combined().key_by(*self.keys1).process(adapt(function, len(self.keys1)), schema, uid, parallelism, on_error=on_error)

    def interval_join(self, lower: Any, upper: Any, uid: str, parallelism: int | None = None) -> Stream:
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
        from keyscale._pipeline import _to_arrow_schema

        a1, a2 = _to_arrow_schema(self.first.schema), _to_arrow_schema(self.second.schema)
        names1 = list(a1.names)
        names2 = [n if n not in names1 else f"{n}_2" for n in a2.names]
        fields: list[pa.Field[Any]] = [*a1, *(f.with_name(n) for f, n in zip(a2, names2, strict=True))]
        fn = IntervalJoin(wm1.column, wm2.column, lo, hi, pa.struct(list(a1)), pa.struct(list(a2)), names1, names2)
        return self.process(fn, pa.schema(fields), uid, parallelism)


def _signed_ms(value: Any, what: str) -> int:
    """A duration that may be negative: ``"-5 seconds"``, or a number of seconds."""
    if isinstance(value, int | float):
        return (-1 if value < 0 else 1) * parse_duration_ms(abs(value), what)
    text = str(value).strip()
    sign = -1 if text.startswith("-") else 1
    return sign * parse_duration_ms(text.lstrip("+-").strip(), what)
