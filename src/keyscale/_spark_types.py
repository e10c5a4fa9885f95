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
    from pyspark.sql.types import StructType

__all__ = ["from_arrow_schema", "to_arrow_schema"]


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
