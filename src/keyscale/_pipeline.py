"""The pipeline a job file builds: a Spark streaming DataFrame, keyed stages, a sink.

A job file defines ``build(ctx)`` returning a :class:`Pipeline`::

    import keyscale as ks

    def build(ctx):
        events = ctx.spark.readStream.schema("key string, value long").parquet(ctx.arg("input"))
        return (
            ks.stream(events)
            .key_by("key")
            .aggregate(uid="totals", count=ks.count(), sum=ks.sum("value"))
            .sink(ks.ParquetSink(ctx.arg("output")))
        )
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import pyarrow as pa

from keyscale.errors import JobDefinitionError
from keyscale.operators.keyed import KeyedProcessFunction, describe_states
from keyscale.operators.vectorized import Agg, RunningAggregate, VectorizedKeyedFunction
from keyscale.state.types import StateDescriptor, arrow_schema

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession
    from pyspark.sql.types import StructType

    from keyscale.sinks.base import Sink

NullKeys = Literal["error", "drop"]


@dataclass
class JobContext:
    """What ``build`` gets: the Spark session and the job's ``--set`` arguments."""

    spark: SparkSession
    args: dict[str, str] = field(default_factory=dict)

    def arg(self, name: str, default: str | None = None) -> str:
        """The ``--set NAME=VALUE`` argument ``name`` (or ``default``; missing and no default is an error)."""
        if name in self.args:
            return self.args[name]
        if default is None:
            raise JobDefinitionError(f"the job needs the argument '{name}': pass --set {name}=VALUE")
        return default


@dataclass(frozen=True)
class TransformStep:
    """Ordinary (stateless) Spark transformations applied to each micro-batch."""

    fn: Callable[[DataFrame], DataFrame]


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

    @property
    def vectorized(self) -> bool:
        return isinstance(self.function, VectorizedKeyedFunction)


def _to_arrow_schema(schema: StructType) -> pa.Schema:
    from pyspark.sql.pandas.types import to_arrow_schema

    return to_arrow_schema(schema, timezone="UTC", prefers_large_types=False)


def _to_spark_schema(schema: pa.Schema) -> StructType:
    from pyspark.sql.pandas.types import from_arrow_schema

    return from_arrow_schema(schema)


class Stream:
    """A stream of rows: a Spark streaming DataFrame plus the stages applied per batch."""

    def __init__(self, source: DataFrame, steps: tuple[TransformStep | KeyedStep, ...] = (), schema: StructType | None = None):
        self._source = source
        self._steps = steps
        self._schema: StructType = schema if schema is not None else source.schema

    @property
    def columns(self) -> list[str]:
        return list(self._schema.fieldNames())

    @property
    def schema(self) -> StructType:
        return self._schema

    def transform(self, fn: Callable[[DataFrame], DataFrame]) -> Stream:
        """Apply ordinary PySpark transformations (filter, select, withColumn, joins with static data)."""
        spark = self._source.sparkSession
        probe = fn(spark.createDataFrame([], self._schema))
        return Stream(self._source, (*self._steps, TransformStep(fn)), probe.schema)

    def filter(self, condition: Column | str) -> Stream:
        """Keep rows matching ``condition`` (a Column or a SQL expression)."""
        return self.transform(lambda df: df.filter(condition))

    def select(self, *cols: Column | str) -> Stream:
        """Project columns (Columns or SQL expressions)."""
        exprs = [c for c in cols if isinstance(c, str)]
        if len(exprs) == len(cols):
            return self.transform(lambda df: df.selectExpr(*exprs))
        return self.transform(lambda df: df.select(*cols))

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

    def sink(self, sink: Sink) -> Pipeline:
        """End the pipeline in a sink."""
        return Pipeline(self._source, self._steps, sink, self._schema)

    def _with(self, step: KeyedStep) -> Stream:
        return Stream(self._source, (*self._steps, step), _to_spark_schema(step.output_schema))


class KeyedStream:
    """A stream partitioned by key; ``process``/``aggregate`` add a keyed stateful stage."""

    def __init__(self, stream: Stream, key_names: tuple[str, ...], null_keys: NullKeys):
        self._stream = stream
        self._keys = key_names
        self._null_keys = null_keys
        self._input = _to_arrow_schema(stream.schema)
        self._key_types = tuple(self._input.field(k).type for k in key_names)

    def _step(self, uid: str, fn: Any, output: pa.Schema, states: list[StateDescriptor], parallelism: int | None) -> Stream:
        if not uid or not uid.replace("-", "").replace("_", "").isalnum():
            raise JobDefinitionError(f"uid {uid!r} must be a non-empty name of letters, digits, '-' and '_'")
        used = {s.uid for s in self._stream._steps if isinstance(s, KeyedStep)}
        if uid in used:
            raise JobDefinitionError(f"two stages have the uid '{uid}'; each stateful stage needs its own")
        clash = [s.name for s in states if s.name in self._keys]
        if clash:
            raise JobDefinitionError(f"operator '{uid}': state '{clash[0]}' has the name of a key column")
        step = KeyedStep(uid, self._keys, self._key_types, self._input, fn, output, tuple(states), self._null_keys, parallelism)
        return self._stream._with(step)

    def process(self, function: KeyedProcessFunction | VectorizedKeyedFunction, schema: str | pa.Schema, uid: str, parallelism: int | None = None) -> Stream:
        """Run a keyed process function (per key) or a vectorized one (per batch).

        ``schema`` is the output's Spark DDL, e.g. ``"key string, alert double"``.
        """
        if not isinstance(function, KeyedProcessFunction | VectorizedKeyedFunction):
            raise JobDefinitionError(f"operator '{uid}': {type(function).__name__} is not a KeyedProcessFunction or VectorizedKeyedFunction")
        return self._step(uid, function, arrow_schema(schema), describe_states(function, uid), parallelism)

    def aggregate(self, uid: str, parallelism: int | None = None, **aggs: Agg) -> Stream:
        """Vectorized running aggregates per key; emits (key..., aggregates) for every key updated in a batch.

        ``aggregate(uid="totals", count=keyscale.count(), sum=keyscale.sum("value"))``
        """
        types = {f.name: f.type for f in self._input}
        fn = RunningAggregate(dict(aggs), list(self._keys), types)
        out = pa.schema([*(self._input.field(k) for k in self._keys), *fn.output_fields()])
        return self._step(uid, fn, out, fn.state_descriptors(), parallelism)


@dataclass(frozen=True)
class Pipeline:
    """A complete job: source, stages, sink."""

    source: DataFrame
    steps: tuple[TransformStep | KeyedStep, ...]
    sink: Sink
    schema: StructType

    @property
    def keyed_steps(self) -> list[KeyedStep]:
        return [s for s in self.steps if isinstance(s, KeyedStep)]


def stream(df: DataFrame) -> Stream:
    """Start a pipeline from a Spark streaming DataFrame (``spark.readStream...``)."""
    from pyspark.sql import DataFrame as SparkDataFrame

    if not isinstance(df, SparkDataFrame):
        raise JobDefinitionError(f"keyscale.stream() takes a Spark DataFrame, not {type(df).__name__}")
    if not df.isStreaming:
        raise JobDefinitionError("keyscale.stream() needs a streaming DataFrame (spark.readStream...), not a batch one")
    return Stream(df)
