"""Where jobs read from: partitioned append-only logs and a rate-scheduled load generator.

- :func:`open_log` / :func:`create_log`: a :class:`PartitionedLog` in a local folder
  (:class:`LocalLog`) or in Redis streams (:class:`RedisLog`, ``redis://host:port/db?name=NAME``);
- :class:`LogWriter`: appends tables, splitting rows to partitions by a stable key hash;
- :class:`RateSchedule` and :func:`generate`: write records at a scheduled rate.

>>> import tempfile
>>> from keyscale.sources import create_log, generate
>>> log = create_log(tempfile.mkdtemp() + "/events", "key string, value long, ts timestamp", partitions=2)
>>> now = [0.0]
>>> generate(log, "50/s for 2s", keys=10, clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s)).records
100
"""

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

__all__ = [
    "GENERATOR_DDL",
    "GENERATOR_SCHEMA",
    "GenerateResult",
    "GeneratorThread",
    "LocalLog",
    "LogError",
    "LogWriter",
    "PartitionedLog",
    "RateSchedule",
    "RedisLog",
    "ScheduleError",
    "Segment",
    "create_log",
    "generate",
    "generated_records",
    "open_log",
    "partition_of",
    "start_generator",
]
