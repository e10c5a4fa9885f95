"""Spark <-> Arrow schemas that mean the same on every PySpark in pyproject.toml's range.

PySpark changed both of its helpers within 4.x: ``to_arrow_schema`` took ``timestamp_utc=``
in 4.0 and a keyword-only ``timezone=`` later, and ``from_arrow_schema``'s
``prefer_timestamp_ntz`` default went from False to True. keyscale's state, task and sink
schemas must not depend on which PySpark is installed, so every conversion goes through
here, with the choices spelled out.
"""

from __future__ import annotations

import inspect
from functools import cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import SparkSession
    from pyspark.sql.types import StructType

__all__ = ["from_arrow_schema", "sent_schema", "to_arrow_schema"]


@cache
def _takes_timezone() -> bool:
    from pyspark.sql.pandas.types import to_arrow_schema as convert

    return "timezone" in inspect.signature(convert).parameters


def to_arrow_schema(schema: StructType, *, utc: bool) -> pa.Schema:
    """``schema`` in Arrow (no large types); ``utc``: a Spark TIMESTAMP becomes an Arrow
    timestamp in UTC (as Spark's Arrow batches carry it), else one without a time zone."""
    from pyspark.sql.pandas.types import to_arrow_schema as convert

    if _takes_timezone():
        return convert(schema, timezone="UTC" if utc else None, prefers_large_types=False)
    return convert(schema, timestamp_utc=utc, prefers_large_types=False)  # type: ignore[call-arg]  # PySpark 4.0


def from_arrow_schema(schema: pa.Schema) -> StructType:
    """``schema`` in Spark; an Arrow timestamp without a time zone is a TIMESTAMP_NTZ."""
    from pyspark.sql.pandas.types import from_arrow_schema as convert

    return convert(schema, prefer_timestamp_ntz=True)


def sent_schema(schema: StructType, spark: SparkSession) -> pa.Schema | None:
    """The Arrow types in which ``spark`` hands rows of ``schema`` to a ``mapInArrow``
    function: timestamps in the session's time zone, strings and binaries large where
    ``spark.sql.execution.arrow.useLargeVarTypes`` says so. None where this PySpark cannot
    name them (4.0 names no zone but UTC).

    >>> sent_schema(StructType([StructField("at", TimestampType())]), spark).field("at").type  # doctest: +SKIP
    TimestampType(timestamp[us, tz=UTC])
    """
    from pyspark.sql.pandas.types import to_arrow_schema as convert

    zone = spark.conf.get("spark.sql.session.timeZone")
    large = spark.conf.get("spark.sql.execution.arrow.useLargeVarTypes", "false") == "true"
    if _takes_timezone():
        return convert(schema, timezone=zone, prefers_large_types=large)
    if zone != "UTC":
        return None
    return convert(schema, timestamp_utc=True, prefers_large_types=large)  # type: ignore[call-arg]  # PySpark 4.0
