"""Spark sources whose commit discards input keyscale may still need, refused by name.

keyscale replays a batch after Spark committed it to its source: with asynchronous
checkpoints Spark commits batch ``b`` before keyscale's manifest ``b`` exists, and a fallback
to an older checkpoint replays every batch after it. A file source's ``cleanSource``
(``archive`` or ``delete``) moves or removes a batch's files once Spark committed it, so such
a replay would find its input gone. ``ignoreMissingFiles`` turns the failure a missing file
causes into a silent skip: a replay then reads less than the attempt whose output was kept.

The options are read from the streaming DataFrame's analyzed plan (its ``StreamingRelation``
leaves: Spark's V1 sources, the file sources among them), once, when the stream is built.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from keyscale.errors import JobDefinitionError

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

log = logging.getLogger("keyscale")

IGNORE_MISSING_CONF = "spark.sql.files.ignoreMissingFiles"


@dataclass(frozen=True)
class SourceOptions:
    """One Spark source of a streaming DataFrame: its format and its options (keys lower-cased)."""

    format: str
    options: dict[str, str]
    schema_json: str | None = None  # the schema the job gave the source (JSON), if any

    @property
    def path(self) -> str:
        return self.options.get("path", "(no path)")


def spark_sources(df: DataFrame) -> list[SourceOptions]:
    """The V1 streaming sources (file sources among them) ``df`` reads, with their options."""
    plan = df._jdf.queryExecution().analyzed()
    leaves = plan.collectLeaves()
    found = []
    for i in range(leaves.size()):
        leaf = leaves.apply(i)
        if leaf.getClass().getSimpleName() != "StreamingRelation":
            continue  # a V2 source (Kafka, rate...), or a static side of a join
        ds = leaf.dataSource()
        options: dict[str, str] = {}
        it = ds.options().iterator()
        while it.hasNext():
            kv = it.next()
            options[str(kv._1()).lower()] = str(kv._2())
        paths = ds.paths()
        if "path" not in options and paths.size():
            options["path"] = ", ".join(str(paths.apply(j)) for j in range(paths.size()))
        given = ds.userSpecifiedSchema()
        found.append(SourceOptions(str(ds.className()), options, str(given.get().json()) if given.isDefined() else None))
    return found


def check_spark_source(df: DataFrame) -> None:
    """Refuse a source that discards a batch's input when Spark commits it (``cleanSource``);
    warn of ``ignoreMissingFiles``, which would let a replay silently read less."""
    session_ignores = df.sparkSession.conf.get(IGNORE_MISSING_CONF, "false") or "false"
    for src in spark_sources(df):
        clean = src.options.get("cleansource", "off")
        if clean.strip().lower() != "off":
            raise JobDefinitionError(
                f"the {src.format} source reading {src.path} has cleanSource={clean}, which moves or deletes a batch's files once Spark "
                "committed the batch, but keyscale may read a batch again after that (asynchronous checkpoints, a fallback to an older "
                "checkpoint): leave cleanSource off, and archive input yourself once every checkpoint the job keeps is past it"
            )
        ignore = src.options.get("ignoremissingfiles")
        where = "its option" if ignore is not None else IGNORE_MISSING_CONF
        if (ignore if ignore is not None else session_ignores).strip().lower() == "true":
            # A warning, not a refusal: the setting is the user's way past files that vanish
            # before their batch is read, and without it such a batch fails at every start.
            log.warning(
                "the %s source reading %s has ignoreMissingFiles=true (%s): a replay of a batch (after a crash, or a fallback to an "
                "older checkpoint) silently skips its files deleted since, and its state then misses records whose output was kept; "
                "delete input only once every checkpoint the job keeps is past the batch that read it",
                src.format, src.path, where,
            )


def input_file_columns(df: DataFrame) -> list[tuple[str, list[str]]]:
    """Per file source of ``df``, its path and the columns its files have (read without the
    schema the job gives: what Spark infers, as the files' own). Only for an error message:
    it reads the files' schema (all of a JSON or CSV input), so it is never on a batch's path."""
    out = []
    for src in spark_sources(df):
        fmt = src.format.lower().rsplit(".", 1)[-1]
        short = next((f for f in ("parquet", "json", "csv", "orc") if fmt.startswith(f)), None)
        if short is None or "path" not in src.options or ", " in src.options["path"]:
            continue
        options = {k: v for k, v in src.options.items() if k != "path"}
        try:
            columns = df.sparkSession.read.format(short).options(**options).load(src.options["path"]).columns
        except Exception:  # an unreadable input is not what this message is about
            continue
        out.append((f"the {short} source reading {src.path}", list(columns)))
    return out


def explain_missing_key(df: DataFrame, source: DataFrame, message: str) -> str:
    """A null-key error of a subtask that got no key at all (``message``), checked against
    the batch ``df`` (only on the way out: it reads the batch again): when no record of the
    batch has the key either, the column is most likely missing from the input, and the
    message says so, with the input files' own columns for a file source (``source``: the
    job's streaming DataFrame). Otherwise (or when the batch lacks the column: a key
    computed by the pipeline) ``message`` stays as it is."""
    import re

    from pyspark.sql import functions as F

    m = re.match(r"null key in column '([^']+)' of operator '([^']+)' \(batch (\d+), (\d+) records\)", message)
    if m is None or m.group(1) not in df.columns:
        return message
    column, uid, batch, _ = m.groups()
    if df.where(F.col(f"`{column}`").isNotNull()).limit(1).collect():
        return message  # other subtasks got keys: the null keys are records' own
    head = f"key column '{column}' of operator '{uid}' is null in every record of batch {batch}"
    found = input_file_columns(source)
    lacking = [(what, cols) for what, cols in found if column not in cols]
    if lacking:
        what, cols = lacking[0]
        return f"{head}: {what} has no column '{column}' (its files have: {', '.join(cols)}); fix the name in key_by() or in the source's schema"
    if found:
        return message  # the files have the column: their records just have no key
    return (f"{head}: is the column missing from the input, or misspelled? (Spark reads a column that the schema names and the input "
            f"lacks as null) The stream's columns: {', '.join(source.columns)}")
