"""keyscale: elastic, stateful stream processing for PySpark.

Keyed state lives in key groups (Flink's model), so a job's parallelism changes by
reassigning key-group ranges, live between two micro-batches or on restart, with
exactly-once checkpoints. See docs/ (the docs site) for the model, the guides and the CLI.

>>> import keyscale as ks
>>> ks.count()
Agg(kind='count', column=None, fn=None)
"""

from keyscale._jobcontext import JobContext
from keyscale._pipeline import (
    KeyedStream,
    Pipeline,
    Stream,
    WindowedStream,
    pipeline,
    stream,
)
from keyscale.errors import KeyscaleError
from keyscale.kafka.sink import KafkaSink
from keyscale.kafka.source import json_values, kafka_decoder, kafka_source
from keyscale.operators.coprocess import (
    KeyedCoBatch,
    KeyedCoProcessFunction,
    VectorizedKeyedCoProcessFunction,
)
from keyscale.operators.keyed import (
    Context,
    KeyedProcessFunction,
    ListState,
    MapState,
    RuntimeContext,
    TimerService,
    ValueState,
)
from keyscale.operators.nonkeyed import (
    BroadcastStream,
    OperatorContext,
    OperatorListState,
    ProcessFunction,
    broadcast,
)
from keyscale.operators.vectorized import (
    TIMER,
    KeyedBatch,
    VectorizedKeyedFunction,
    count,
    first,
    last,
    max,
    mean,
    min,
    sum,
)
from keyscale.operators.windows import SessionWindows, SlidingWindows, TumblingWindows, reduce
from keyscale.runtime.control.handle import JobHandle
from keyscale.runtime.control.submit import main
from keyscale.sinks.console import ConsoleSink
from keyscale.sinks.delta import DeltaSink
from keyscale.sinks.iceberg import IcebergSink
from keyscale.sinks.noop import NoopSink
from keyscale.sinks.parquet import ParquetSink
from keyscale.sources.reader import LogSource, log_source

__version__ = "0.1.0"

__all__ = [
    "TIMER",
    "BroadcastStream",
    "ConsoleSink",
    "Context",
    "DeltaSink",
    "IcebergSink",
    "JobContext",
    "JobHandle",
    "KafkaSink",
    "KeyedBatch",
    "KeyedCoBatch",
    "KeyedCoProcessFunction",
    "KeyedProcessFunction",
    "KeyedStream",
    "KeyscaleError",
    "ListState",
    "LogSource",
    "MapState",
    "NoopSink",
    "OperatorContext",
    "OperatorListState",
    "ParquetSink",
    "Pipeline",
    "ProcessFunction",
    "RuntimeContext",
    "SessionWindows",
    "SlidingWindows",
    "Stream",
    "TimerService",
    "TumblingWindows",
    "ValueState",
    "VectorizedKeyedCoProcessFunction",
    "VectorizedKeyedFunction",
    "WindowedStream",
    "broadcast",
    "count",
    "first",
    "json_values",
    "kafka_decoder",
    "kafka_source",
    "last",
    "log_source",
    "main",
    "max",
    "mean",
    "min",
    "pipeline",
    "reduce",
    "stream",
    "sum",
]
