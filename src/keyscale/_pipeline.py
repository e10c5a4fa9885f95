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

This module is the API's face: :func:`stream`, where a pipeline starts, and the names the
package and older imports take from here. The parts live beside it, each for one role:
:mod:`keyscale._stream` (the stream types, which build one another), :mod:`keyscale._connect`
(how two inputs become one keyed stage's input, the joins' columns) and :mod:`keyscale._job` (:class:`Pipeline`, the finished job,
and :func:`pipeline`, which joins branches).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from keyscale._job import Pipeline, pipeline
from keyscale._keywords import checked_keywords
from keyscale._stream import (
    ConnectedKeyedStreams,
    ConnectedStreams,
    KeyedStream,
    Stream,
    WindowedStream,
)
from keyscale.errors import JobDefinitionError
from keyscale.sources.reader import LogSource

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

__all__ = ["ConnectedKeyedStreams", "ConnectedStreams", "KeyedStream", "Pipeline", "Stream", "WindowedStream", "pipeline", "stream"]


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

