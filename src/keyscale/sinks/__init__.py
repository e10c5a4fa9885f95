"""Where a pipeline's rows go: ``.sink(...)`` takes one of these.

- :class:`ParquetSink`: Parquet files in a folder (local or object storage), exactly once;
- :class:`DeltaSink` and :class:`IcebergSink`: a lakehouse table, appended or upserted;
- :class:`ConsoleSink`: rows printed on the driver, to look at; :class:`NoopSink`: none.

Kafka's sink is the Kafka connector's: :class:`keyscale.kafka.KafkaSink`.

Each is imported on first use (the lakehouse libraries only when asked for).

>>> import keyscale as ks
>>> ks.sinks.DeltaSink("s3://lake/counts", mode="upsert", keys=["key"]).describe()
'Delta table s3://lake/counts'
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from keyscale import _lazy

if TYPE_CHECKING:
    from keyscale.sinks.console import ConsoleSink
    from keyscale.sinks.delta import DeltaSink
    from keyscale.sinks.iceberg import IcebergSink
    from keyscale.sinks.noop import NoopSink
    from keyscale.sinks.parquet import ParquetSink

_EXPORTS = {
    "ConsoleSink": "keyscale.sinks.console",
    "DeltaSink": "keyscale.sinks.delta",
    "IcebergSink": "keyscale.sinks.iceberg",
    "NoopSink": "keyscale.sinks.noop",
    "ParquetSink": "keyscale.sinks.parquet",
}

__all__ = ["ConsoleSink", "DeltaSink", "IcebergSink", "NoopSink", "ParquetSink"]


def __getattr__(name: str) -> Any:
    return _lazy.load(__name__, _EXPORTS, name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
