"""Compute each batch and discard the output: for benchmarks and dry runs."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import DataFrame


class NoopSink:
    """Runs the batch to the end (Spark's ``noop`` format) and keeps nothing.

    >>> NoopSink().describe()
    'nowhere (noop sink)'
    """

    exactly_once = False

    def describe(self) -> str:
        return "nowhere (noop sink)"

    def write(self, df: DataFrame, batch_id: int) -> int:
        df.write.format("noop").mode("overwrite").save()
        return 0  # computed, none kept
