"""Malformed records of JSON and CSV file sources, handled by the job's ``on_error``.

Spark's JSON and CSV readers run in ``PERMISSIVE`` mode by default: a record they cannot
parse becomes a row of nulls, with its raw text in the corrupt-record column
(``_corrupt_record``, or the source's ``columnNameOfCorruptRecord``) when the schema has
one, and nowhere otherwise. Such a row would reach a keyed stage as a null key (the job
stops blaming the key, or ``null_keys="drop"`` loses it without a sign). So:

- at build time (:func:`check_malformed_modes`): a JSON/CSV source left in the default mode
  without the corrupt-record column in the stream is refused, saying what to choose; a mode
  the user set is respected (``FAILFAST``: Spark stops at the first malformed record, naming
  the file; ``DROPMALFORMED`` or ``PERMISSIVE`` without the column: Spark drops or nulls
  them, which the user chose; a warning says so);
- per batch (:func:`split_malformed`): when the stream carries the corrupt-record column,
  the rows that have it are taken out before any stage and handled by the job's
  ``on_error`` (the policy of ``.sink(..., on_error=)``): ``fail`` stops the batch naming
  the file and the record; ``skip`` counts them; ``dead_letter`` writes them to the
  dead-letter sink (``operator`` is :data:`INPUT`, ``record`` the raw text under the
  column's name, ``error`` names the file), with the batch's output. ``max_errors_per_batch`` bounds them per batch.

A replay reads the same files, so it finds the same malformed records: what is skipped or
dead-lettered is the same on every attempt.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from keyscale.errors import JobDefinitionError, RecordError
from keyscale.operators.poison import DEAD_LETTER_SCHEMA, ErrorPolicy, json_text
from keyscale.runtime.batch.spark_source import SourceOptions, spark_sources

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

log = logging.getLogger("keyscale")

#: The counters' and dead letters' name for the job's input (malformed records have no operator).
INPUT = "input"
#: The batch's column with each row's file path, read from Spark's file metadata while a
#: corrupt-record column is watched (dropped before any stage).
PATH = "__ks_path"
MALFORMED_SKIPPED = "malformed_skipped"
MALFORMED_DEAD_LETTERED = "malformed_dead_lettered"
_PARSED = ("json", "csv")  # the file formats with a parse mode and a corrupt-record column
_CORRUPT_CONF = "spark.sql.columnNameOfCorruptRecord"


def _format(src: SourceOptions) -> str | None:
    """``json`` or ``csv`` for those sources (short name or Spark's class name), else None."""
    name = src.format.lower().rsplit(".", 1)[-1]
    for fmt in _PARSED:
        if name == fmt or name.startswith(fmt):  # "json", "JsonFileFormat", "csv", "CSVFileFormat"
            return fmt
    return None


@dataclass(frozen=True)
class Watched:
    """The corrupt-record column keyscale watches in a stream, and the source it comes from."""

    column: str
    source: str  # "the json source reading PATH", for messages


def check_malformed_modes(df: DataFrame, warn: bool = True) -> Watched | None:
    """Check each JSON/CSV source's parse mode (see the module doc); the corrupt-record
    column to watch, if the stream carries one. ``warn``: log the warnings (once, at build)."""
    session_column = df.sparkSession.conf.get(_CORRUPT_CONF, "_corrupt_record") or "_corrupt_record"
    watched = None
    for src in spark_sources(df):
        fmt = _format(src)
        if fmt is None:
            continue
        column = src.options.get("columnnameofcorruptrecord") or session_column
        mode = src.options.get("mode")
        what = f"the {fmt} source reading {src.path}"
        if mode is not None and mode.strip().upper() == "FAILFAST":
            continue  # Spark stops at a malformed record; keyscale names its file (driver/failures.py translate)
        if mode is not None and mode.strip().upper() == "DROPMALFORMED":
            if warn:
                log.warning("%s has mode=DROPMALFORMED (your setting): Spark drops its malformed records, and nothing counts them", what)
            continue
        if column in df.columns:
            watched = Watched(column, what)
            continue
        if mode is not None:  # PERMISSIVE, said explicitly: the user's choice, kept
            if warn:
                log.warning("%s has mode=%s without a '%s' column in the stream: a malformed record becomes a row of nulls, which "
                            "nothing can tell from data (docs/guides/input-errors.md)", what, mode, column)
            continue
        raise JobDefinitionError(
            f"{what} uses Spark's default mode PERMISSIVE, which turns a malformed record into a row of nulls (a null key) that nothing "
            f"can tell from data: add '{column} string' to the source's schema and keep it in the stream (keyscale then fails, skips or "
            f"dead-letters malformed records by the job's on_error), or set .option(\"mode\", \"FAILFAST\") to stop at the first one "
            "(docs/guides/input-errors.md)"
        )
    return watched


def split_malformed(
    df: DataFrame, watched: Watched, policy: ErrorPolicy, batch_id: int,
) -> tuple[DataFrame, DataFrame | None, dict[str, int]]:
    """The batch without its malformed rows (and without :data:`PATH`), the dead-letter rows
    for them (``dead_letter``), and their count for the counters; raises under ``fail`` or
    beyond the bound. One Spark job reads the malformed rows (few, bounded by the bound)."""
    from pyspark.sql import functions as F

    col = F.col(f"`{watched.column}`")
    bound = policy.max_errors_per_batch
    # Every column, not only the corrupt one: Spark refuses a query of raw JSON/CSV that
    # references only the corrupt-record column.
    bad = df.where(col.isNotNull())
    rows = (bad.limit(bound + 1) if policy.isolates and bound is not None else bad.limit(1) if not policy.isolates else bad).collect()
    clean = df.where(col.isNull()).drop(PATH)
    if not rows:
        return clean, None, {}
    first = rows[0].asDict()
    where = f"{watched.source}: malformed record in file {_local(first.get(PATH))} (batch {batch_id})"
    if not policy.isolates:
        raise RecordError("\n".join([
            where,
            f"  record: {first[watched.column]!r}",
            '  to go on past such records: .sink(..., on_error="skip" or "dead_letter"), or fix the file (docs/guides/input-errors.md)',
            f"malformed record in {_local(first.get(PATH))}",
        ]))
    if bound is not None and len(rows) > bound:
        raise RecordError("\n".join([
            f"{watched.source}: more than max_errors_per_batch={bound} malformed records in batch {batch_id} "
            f"under on_error={policy.on_error!r}; the last one read is in file {_local(rows[-1].asDict().get(PATH))}",
            f"  record: {rows[-1].asDict()[watched.column]!r}",
            "malformed records",
        ]))
    if policy.on_error == "skip":
        return clean, None, {MALFORMED_SKIPPED: len(rows)}
    letters = [
        # record: a JSON object of the row's columns, as for any dead letter; a malformed row has only its raw text
        {"operator": INPUT, "key": None, "batch_id": batch_id, "subtask": None, "record": json_text({watched.column: r[watched.column]}),
         "error": f"malformed record in file {_local(r.asDict().get(PATH))}", "traceback": ""}
        for r in rows
    ]
    dead = df.sparkSession.createDataFrame(pa.Table.from_pylist(letters, schema=DEAD_LETTER_SCHEMA))
    return clean, dead, {MALFORMED_DEAD_LETTERED: len(rows)}


def _local(path: Any) -> str:
    """A file's path as users wrote it (Spark's ``file:`` URI of a local file without the scheme)."""
    if path is None:  # the source is not read straight from files (a union, an aggregate): no file metadata
        return "(unknown: the stream does not come straight from a file source)"
    text = str(path)
    return text[len("file://"):] if text.startswith("file:///") else text[len("file:"):] if text.startswith("file:/") else text



def explain_failfast(df: DataFrame, message: str) -> str:
    """A FAILFAST source's error (``cannot read input file F: <parser's words>``) with the
    malformed record itself: read again from that one file (only on the way out, never on a
    batch's path), in PERMISSIVE mode with a corrupt-record column. Unchanged when the
    error is not about a malformed record of a JSON/CSV source."""
    import re

    from pyspark.sql.types import StringType, StructField, StructType

    m = re.match(r"cannot read input file (.+?): ", message)
    if m is None:
        return message
    path = m.group(1)
    for src in spark_sources(df):
        fmt = _format(src)
        mode = (src.options.get("mode") or "").strip().upper()
        if fmt is None or mode != "FAILFAST" or src.schema_json is None:
            continue
        column = "__ks_corrupt"
        schema = StructType.fromJson(json.loads(src.schema_json)).add(StructField(column, StringType()))
        options = {k: v for k, v in src.options.items() if k not in ("path", "mode", "columnnameofcorruptrecord")}
        try:
            rows = (df.sparkSession.read.format(fmt).options(**options).option("mode", "PERMISSIVE")
                    .option("columnNameOfCorruptRecord", column).schema(schema).load(path)
                    .where(f"{column} is not null").limit(1).collect())
        except Exception:  # not this source's file, or unreadable for another reason: keep Spark's words
            continue
        if rows:
            return f"cannot read input file {path}: malformed record (the {fmt} source has mode=FAILFAST): {rows[0][column]!r}"
    return message
