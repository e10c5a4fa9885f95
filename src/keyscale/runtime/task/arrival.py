"""A batch's arrival order that a replay sees again, whatever Spark's split.

A keyed stage's task sorts its records by their arrival sequence, ``monotonically_increasing_id()``
before the shuffle: (Spark partition << 33) + position in the partition. For a file source
the partitions are Spark's file splits, packed largest first into partitions of
``spark.sql.files.maxPartitionBytes``: another number of cores or other ``spark.sql.files.*``
settings give other partitions, so the same files would reach an order-sensitive function in
another order.

For a file source, the query therefore reads more columns from Spark's hidden file
metadata, in the scan itself (exact whatever runs between the scan and keyscale):
:data:`FILE` (``xxhash64`` of the file's path) and :data:`BLOCK` (the split's start offset in
the file); and :data:`APPENDED`, the file's modification time, which is not part of the
order but its records' append time for :mod:`keyscale.latency` (the first keyed stage's
tasks report it). The rows of one split are read in file order into one partition, so their
sequences increase along the file; splits start further into their file the later their
rows are. Sorting by (file, block, sequence) is therefore the order of the batch's files
(by their paths' hash: a fixed order, not their names' order) and of the rows in each file,
whatever the split. The path, not the modification time, names the file: Spark's file
source log fixes a batch's files by path, while a modification time is read again from the
file system at every read (a copy of the input changes it).

The columns ride along only where keyscale knows they survive: the batch's input, its own
``filter`` and ``select``, up to the first keyed stage. A ``transform(fn)`` gets the batch
without them (so user code sees only its own columns), and so do non-keyed stages and the
merge with a log (``connect``); after those, and for sources without file metadata (rate,
memory, Kafka, a union of streams...), the order is Spark's, as before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

if TYPE_CHECKING:
    from pyspark.sql import DataFrame
    from pyspark.sql.types import StructType

FILE = "__ks_file"
BLOCK = "__ks_block"
APPENDED = "__ks_appended"  # the file's modification time (Unix microseconds): its records' append time
ORDER = (FILE, BLOCK, APPENDED)
FILE_CLOCK = "file modification time"  # what a file source's append time is (keyscale.latency)


def with_file_order(df: DataFrame, path: str | None = None) -> tuple[DataFrame, bool]:
    """The streaming DataFrame the job's query runs: ``df`` with :data:`ORDER` from its files'
    metadata when its rows come straight from a file source (through Spark's filters and
    projections), and with each row's file path as column ``path`` if given (for messages
    about malformed records); else ``df`` itself. Says which."""
    from pyspark.errors import AnalysisException
    from pyspark.sql import functions as F

    if "_metadata" in df.columns:  # a column of the data's own hides Spark's metadata
        return df, False
    try:
        with _unlogged_probe():
            ordered = df.select(
                "*", F.xxhash64(F.col("_metadata.file_path")).alias(FILE), F.col("_metadata.file_block_start").alias(BLOCK),
                F.unix_micros(F.col("_metadata.file_modification_time")).alias(APPENDED),
                *([F.col("_metadata.file_path").alias(path)] if path else []),
            )
    except AnalysisException:  # not a file source, or one behind an aggregate, a union, mapInPandas...
        return df, False
    return ordered, True


@contextlib.contextmanager
def _unlogged_probe() -> Iterator[None]:
    """PySpark 4 logs every analysis error of a DataFrame call at ERROR, with its Java stack,
    caught or not: the failed probe for ``_metadata`` is an answer here, not the user's error.
    Off for the one call only, a planning step of milliseconds at the query's start (the
    logger is process-wide: another thread's analysis error in that moment goes unlogged too,
    though it is still raised). The logger is PySpark's own: one made by ``logging`` would
    lack the keywords PySpark logs with."""
    from pyspark.logger import PySparkLogger

    logger = PySparkLogger.getLogger("DataFrameQueryContextLogger")
    was = logger.disabled
    logger.disabled = True
    try:
        yield
    finally:
        logger.disabled = was


def order_probe_schema(schema: StructType) -> StructType:
    """``schema`` with the order columns, as a batch of a file source has them."""
    from pyspark.sql.types import LongType, StructField, StructType

    return StructType([*schema.fields, *(StructField(c, LongType(), False) for c in ORDER)])


def order_columns(df: DataFrame) -> tuple[str, ...]:
    """The arrival-order columns ``df`` carries (all of :data:`ORDER` or none)."""
    cols = set(df.columns)
    return ORDER if all(c in cols for c in ORDER) else ()


def in_arrival_order(table: pa.Table, seq: str) -> pa.Table:
    """A task's records in the order it processes them: by (file, block, sequence) when the
    table carries :data:`ORDER` (dropped then: nothing after the sort reads them, and the
    take copies fewer columns), else by sequence (stable: equal keys keep their place)."""
    s = table.column(seq).to_numpy()
    if FILE not in table.column_names:
        return table.take(np.argsort(s, kind="stable"))
    order = np.lexsort((s, table.column(BLOCK).to_numpy(), table.column(FILE).to_numpy()))
    return table.drop_columns(list(ORDER)).take(order)


def append_times(table: pa.Table) -> np.ndarray[Any, Any] | None:
    """When a task's records were appended to their source, in Unix seconds: their files'
    modification times (None: the table does not carry :data:`APPENDED`)."""
    if APPENDED not in table.column_names:
        return None
    return np.asarray(table.column(APPENDED).to_numpy(zero_copy_only=False), dtype=np.float64) / 1e6


def without(df: DataFrame, cols: Sequence[str]) -> DataFrame:
    """``df`` without the order columns ``cols`` (itself when there are none)."""
    return df.drop(*cols) if cols else df
