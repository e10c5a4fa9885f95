"""keyscale: elastic, stateful stream processing for PySpark.

Keyed state lives in key groups (Flink's model), so a job's parallelism changes by
reassigning key-group ranges, live between two micro-batches or on restart, with
exactly-once checkpoints. See docs/ (the docs site) for the model, the guides and the CLI.

The top level holds what every job file is written with, and nothing else:

- ``stream``, ``pipeline`` and ``Pipeline``: start a pipeline, join its branches, and the
  type ``build`` returns;
- the function base classes a job subclasses: ``KeyedProcessFunction``,
  ``ProcessFunction``, ``VectorizedKeyedFunction``, ``KeyedCoProcessFunction``,
  ``VectorizedKeyedCoProcessFunction``;
- ``JobContext`` (what ``build`` is given), ``main`` (a job file's own entry point),
  ``JobHandle`` (what ``Pipeline.start`` returns) and ``KeyscaleError`` (what to catch).

The rest lives in named modules, read through the module (``ks.aggregates.sum``), so no
name a job uses shadows a builtin (``sum``, ``min``, ``max``) or reads ambiguously
(``Context``): :mod:`keyscale.aggregates`, :mod:`keyscale.windows`,
:mod:`keyscale.sources`, :mod:`keyscale.sinks`, :mod:`keyscale.kafka` (Kafka in and out), :mod:`keyscale.state` (contexts, state,
batches), :mod:`keyscale.streams` (the stream types, for annotations), and
:mod:`keyscale.testing`. The stream types stay off the top level because a job gets them
from ``stream()`` and ``key_by()`` and never makes one.

The names that were at the top level before still work, with a ``DeprecationWarning``
naming their new spelling (``ks.sum`` is ``ks.aggregates.sum``); they go in the next release.

>>> import keyscale as ks
>>> ks.aggregates.count()
Agg(kind='count', column=None, fn=None)
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

# The public modules, bound here so ``ks.aggregates.sum`` works after ``import keyscale as ks``.
from keyscale import aggregates as aggregates
from keyscale import kafka as kafka
from keyscale import sinks as sinks
from keyscale import sources as sources
from keyscale import state as state
from keyscale import streams as streams
from keyscale import windows as windows
from keyscale._jobcontext import JobContext
from keyscale._pipeline import Pipeline, pipeline, stream
from keyscale.errors import KeyscaleError
from keyscale.operators.coprocess import KeyedCoProcessFunction, VectorizedKeyedCoProcessFunction
from keyscale.operators.keyed import KeyedProcessFunction
from keyscale.operators.nonkeyed import ProcessFunction
from keyscale.operators.vectorized import VectorizedKeyedFunction
from keyscale.runtime.control.handle import JobHandle
from keyscale.runtime.control.submit import main

__version__ = "0.1.0"

__all__ = [
    "JobContext",
    "JobHandle",
    "KeyedCoProcessFunction",
    "KeyedProcessFunction",
    "KeyscaleError",
    "Pipeline",
    "ProcessFunction",
    "VectorizedKeyedCoProcessFunction",
    "VectorizedKeyedFunction",
    "main",
    "pipeline",
    "stream",
]

#: The public modules ``dir(keyscale)`` shows beside ``__all__`` (``testing`` and
#: ``state_processor`` are imported when first named: they need more than a job does).
_SUBMODULES = ("aggregates", "kafka", "sinks", "sources", "state", "state_processor", "streams", "testing", "windows")
_ON_FIRST_USE = ("state_processor", "testing")

#: Where each name that left the top level lives now: ``keyscale.NAME`` is ``keyscale.MODULE.NAME``.
_MOVED = {
    **dict.fromkeys(["count", "first", "last", "max", "mean", "min", "reduce", "sum"], "aggregates"),
    **dict.fromkeys(["SessionWindows", "SlidingWindows", "TumblingWindows"], "windows"),
    **dict.fromkeys(["KeyedStream", "Stream", "WindowedStream"], "streams"),
    **dict.fromkeys(["ConsoleSink", "DeltaSink", "IcebergSink", "NoopSink", "ParquetSink"], "sinks"),
    **dict.fromkeys(["KafkaSink", "json_values", "kafka_decoder", "kafka_source"], "kafka"),
    **dict.fromkeys(["BroadcastStream", "LogSource", "broadcast", "log_source"], "sources"),
    **dict.fromkeys(["TIMER", "Context", "KeyedBatch", "KeyedCoBatch", "ListState", "MapState", "OperatorContext",
                     "OperatorListState", "RuntimeContext", "TimerService", "ValueState"], "state"),
}


def __getattr__(name: str) -> Any:
    if name in _ON_FIRST_USE:
        return importlib.import_module(f"{__name__}.{name}")
    module = _MOVED.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"keyscale.{name} is deprecated; use keyscale.{module}.{name}", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __dir__() -> list[str]:
    return sorted({*__all__, *_SUBMODULES, "__version__"})
