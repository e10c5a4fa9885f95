"""Print each batch's output: for development, not exactly-once."""

from __future__ import annotations

from typing import TYPE_CHECKING

from keyscale._keywords import checked_keywords

if TYPE_CHECKING:
    from pyspark.sql import DataFrame


class ConsoleSink:
    """Print up to ``rows`` rows of every batch.

    >>> ConsoleSink(rows=5).describe()
    'the console (first 5 rows per batch)'
    """

    exactly_once = False

    @checked_keywords
    def __init__(self, rows: int = 20):
        self.rows = rows

    def describe(self) -> str:
        return f"the console (first {self.rows} rows per batch)"

    def write(self, df: DataFrame, batch_id: int) -> int:
        rows = df.collect()
        print(f"-- batch {batch_id}: {len(rows)} rows")
        for r in rows[: self.rows]:
            print("  ", tuple(r))
        if len(rows) > self.rows:
            print(f"   ... {len(rows) - self.rows} more")
        return len(rows)
