"""Where jobs read from: partitioned logs whose offsets keyscale keeps, broadcast rules
streams, and the tools that write logs. (Kafka topics are read by
:mod:`keyscale.kafka`'s ``kafka_source``, which implements this package's interfaces.)

A job's source (give it to ``ks.stream``; a Spark streaming DataFrame works as well):

- :func:`log_source`: a partitioned log (a folder, or Redis streams) as a :class:`LogSource`;
- :func:`broadcast`: a low-volume log of rules applied to every subtask's broadcast state
  (a :class:`BroadcastStream`, given to ``process(..., broadcast=...)``).

Writing logs (tests, benchmarks, demos):

- :func:`open_log` / :func:`create_log`: a :class:`PartitionedLog` in a local folder
  (:class:`LocalLog`) or in Redis streams (:class:`RedisLog`, ``redis://host:port/db?name=NAME``);
  :class:`LogError` when a log is missing, unreachable or asked for what it does not have;
- :class:`LogWriter`: appends tables, splitting rows to partitions by a stable key hash
  (:func:`partition_of`);
- :class:`RateSchedule` (rates over time, a sequence of :class:`Segment`; a
  :class:`ScheduleError` when one does not parse or makes no sense) and :func:`generate`:
  write records at a scheduled rate (a :class:`GenerateResult`), or in a background thread
  (:func:`start_generator`, a :class:`GeneratorThread`); the records themselves are a pure
  function (:func:`generated_records`), in the columns of :data:`GENERATOR_SCHEMA`
  (:data:`GENERATOR_DDL` in Spark DDL).

>>> import tempfile
>>> import keyscale as ks
>>> from keyscale.sources import create_log, generate
>>> log = create_log(tempfile.mkdtemp() + "/events", "key string, value long, ts timestamp", partitions=2)
>>> now = [0.0]
>>> generate(log, "50/s for 2s", keys=10, clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s)).records
100
>>> ks.sources.log_source(log, uid="events").schema.names
['key', 'value', 'ts']
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from keyscale import _lazy
from keyscale.sources.generator import (
    GENERATOR_DDL,
    GENERATOR_SCHEMA,
    GenerateResult,
    GeneratorThread,
    RateSchedule,
    ScheduleError,
    Segment,
    generate,
    generated_records,
    start_generator,
)
from keyscale.sources.local_log import LocalLog
from keyscale.sources.log import LogWriter, create_log, open_log, partition_of
from keyscale.sources.partitioned import LogError, PartitionedLog
from keyscale.sources.redis_log import RedisLog

if TYPE_CHECKING:
    from keyscale.operators.nonkeyed import BroadcastStream
    from keyscale.sources.reader import LogSource, broadcast, log_source

# Imported on first use: the modules that define these import this package's modules.
_EXPORTS = {
    "BroadcastStream": "keyscale.operators.nonkeyed",
    "LogSource": "keyscale.sources.reader",
    "broadcast": "keyscale.sources.reader",
    "log_source": "keyscale.sources.reader",
}

__all__ = [
    "GENERATOR_DDL",
    "GENERATOR_SCHEMA",
    "BroadcastStream",
    "GenerateResult",
    "GeneratorThread",
    "LocalLog",
    "LogError",
    "LogSource",
    "LogWriter",
    "PartitionedLog",
    "RateSchedule",
    "RedisLog",
    "ScheduleError",
    "Segment",
    "broadcast",
    "create_log",
    "generate",
    "generated_records",
    "log_source",
    "open_log",
    "partition_of",
    "start_generator",
]


def __getattr__(name: str) -> Any:
    return _lazy.load(__name__, _EXPORTS, name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
