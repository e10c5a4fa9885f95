"""The ``keyscale`` Spark data source: SQL over an operator's keyed state, and its change feed.

Spark 4's Python data source API (``pyspark.sql.datasource``) serves it; :func:`register`
makes it known to a session (keyscale's own sessions register it when they start)::

    df = spark.read.format("keyscale").option("uid", "totals").load("jobs/clicks")
    spark.sql("CREATE TABLE totals USING keyscale OPTIONS (path 'jobs/clicks', uid 'totals')")
    spark.sql("CREATE TEMPORARY VIEW totals_now USING keyscale OPTIONS (path 'jobs/clicks', uid 'totals')")

(Spark hands a Python data source none of a catalog table's options when the table is
read, only its schema: so a table's options are kept in its schema, in the first column's
metadata, when the table is created, and read back from there.)

The path is a job directory (its newest committed checkpoint, or the one the
``checkpoint`` option names) or a savepoint, local or on an object store. The rows are
:func:`~keyscale.state_processor.read_keyed_state`'s (options ``state`` and ``flatten``
as its arguments); one input partition per key-group range (:mod:`.scan`; option
``partitions`` sets how many). A filter ``key = v`` or ``key IN (...)`` on the key columns
plans only the key groups that can hold those keys (from PySpark 4.1, whose readers take
pushed filters; PySpark 4.0 reads every key group and Spark filters the rows).

With ``changes_from`` (and optionally ``changes_to``, default the newest checkpoint) it
reads the change feed instead (:mod:`.changes`): one row per key and batch that changed it.

Options: ``uid`` (required), ``checkpoint`` (or its alias ``batch``), ``state``,
``flatten`` (``true``/``false``), ``partitions``, ``changes_from``, ``changes_to``; any
other is an error naming it.

>>> check_options({"path": "jobs/x", "uid": "totals", "batch": "4"})
{'path': 'jobs/x', 'uid': 'totals', 'checkpoint': 4, 'state': None, 'flatten': True, 'partitions': None, 'changes_from': None, 'changes_to': None}
>>> check_options({"path": "jobs/x", "uid": "totals", "chekpoint": "4"})
Traceback (most recent call last):
...
keyscale.errors.KeyscaleError: keyscale data source: unknown option 'chekpoint' (options: batch, changes_from, changes_to, checkpoint, flatten, partitions, path, state, uid)
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from keyscale._spark_types import from_arrow_schema
from keyscale.errors import KeyscaleError
from keyscale.state.keygroups import KeyGroupRange
from keyscale.state_processor.changes import ChangeFeed, open_changes
from keyscale.state_processor.scan import ScanPart, StateScan, open_scan

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = ["NAME", "PUSHDOWN_CONF", "check_options", "data_source", "register"]

NAME = "keyscale"
#: Spark's setting that lets a Python data source take pushed filters (PySpark 4.1 on).
PUSHDOWN_CONF = "spark.sql.python.filterPushdown.enabled"
_OPTIONS_KEY = "keyscale.options"
_TABLE_PROPERTIES = frozenset({"location", "owner", "provider", "external", "comment", "is_managed_location"})
_OPTIONS = ("batch", "changes_from", "changes_to", "checkpoint", "flatten", "partitions", "path", "state", "uid")


def _int(options: Mapping[str, str], name: str) -> int | None:
    text = options.get(name)
    if text is None or str(text).strip() == "":
        return None
    try:
        return int(str(text).strip())
    except ValueError:
        raise KeyscaleError(f"keyscale data source: option {name} must be an integer (a batch id or a count), not {text!r}") from None


def check_options(options: Mapping[str, str]) -> dict[str, Any]:
    """The data source's options, checked and typed; an unknown or malformed one is an error naming it."""
    # A table's options come with its catalog properties (CREATE TABLE ... USING keyscale).
    given = {str(k).lower(): v for k, v in options.items() if str(k).lower() not in _TABLE_PROPERTIES and not str(k).lower().startswith("option.")}
    for k in sorted(given):
        if k not in _OPTIONS:
            raise KeyscaleError(f"keyscale data source: unknown option '{k}' (options: {', '.join(_OPTIONS)})")
    if not given:
        raise KeyscaleError(
            "keyscale data source: no options reached it (a catalog table created by another keyscale keeps none in its "
            "schema): create the table again, CREATE TABLE name USING keyscale OPTIONS (path '...', uid '...')")
    if not given.get("path"):
        raise KeyscaleError("keyscale data source: no path (a job directory or a savepoint): .load(PATH) or OPTIONS (path '...')")
    if not given.get("uid"):
        raise KeyscaleError("keyscale data source: option uid (the operator whose state to read) is required")
    checkpoint, batch = _int(given, "checkpoint"), _int(given, "batch")
    if checkpoint is not None and batch is not None and checkpoint != batch:
        raise KeyscaleError(f"keyscale data source: options checkpoint ({checkpoint}) and batch ({batch}) name different checkpoints")
    flatten = str(given.get("flatten", "true")).strip().lower()
    if flatten not in ("true", "false"):
        raise KeyscaleError(f"keyscale data source: option flatten must be true or false, not {given['flatten']!r}")
    partitions = _int(given, "partitions")
    if partitions is not None and partitions < 1:
        raise KeyscaleError(f"keyscale data source: option partitions must be at least 1, not {partitions}")
    path = str(given["path"])
    if path.startswith("file:/") and not path.startswith("file://"):  # Spark's qualified form of a table's local path
        path = path[len("file:"):]
    out: dict[str, Any] = {
        "path": path, "uid": str(given["uid"]), "checkpoint": checkpoint if checkpoint is not None else batch,
        "state": given.get("state") or None, "flatten": flatten == "true", "partitions": partitions,
        "changes_from": _int(given, "changes_from"), "changes_to": _int(given, "changes_to"),
    }
    if out["changes_to"] is not None and out["changes_from"] is None:
        raise KeyscaleError("keyscale data source: option changes_to needs changes_from (the feed is of the batches after it)")
    if out["changes_from"] is not None and (out["checkpoint"] is not None or out["state"] is not None or given.get("flatten") is not None):
        raise KeyscaleError("keyscale data source: a change feed (changes_from) takes no checkpoint, batch, state or flatten option")
    return out


def plan(options: Mapping[str, str]) -> StateScan | ChangeFeed:
    """What the options ask to read: a scan or a change feed."""
    o = check_options(options)
    if o["changes_from"] is not None:
        return open_changes(o["path"], o["uid"], o["changes_from"], o["changes_to"])
    return open_scan(o["path"], o["uid"], checkpoint=o["checkpoint"], state=o["state"], flatten=o["flatten"])


def _key_values(filters: Iterable[Any], columns: Iterable[str]) -> tuple[dict[str, list[Any]], list[Any]]:
    """The values ``EqualTo``/``In`` filters give the key columns (their intersection when
    several filter one column), and the filters that said it."""
    from pyspark.sql.datasource import EqualTo, In

    wanted = set(columns)
    values: dict[str, list[Any]] = {}
    used = []
    for f in filters:
        attr: tuple[str, ...] = tuple(getattr(f, "attribute", ()))
        if not isinstance(f, EqualTo | In) or len(attr) != 1 or attr[0] not in wanted:
            continue
        got = [f.value] if isinstance(f, EqualTo) else list(f.value)
        values[attr[0]] = [v for v in values[attr[0]] if v in got] if attr[0] in values else got
        used.append(f)
    return values, used


def _with_options(schema: Any, options: Mapping[str, str]) -> Any:
    """``schema`` with the data source's options in its first field's metadata: a catalog
    table keeps its schema (metadata too) but Spark hands its reader none of its options."""
    from pyspark.sql.types import StructField, StructType

    kept = {k: str(v) for k, v in options.items() if str(k).lower() not in _TABLE_PROPERTIES and not str(k).lower().startswith("option.")}
    first = schema.fields[0]
    meta = {**(first.metadata or {}), _OPTIONS_KEY: json.dumps(kept, sort_keys=True)}
    return StructType([StructField(first.name, first.dataType, first.nullable, meta), *schema.fields[1:]])


def _options_in(schema: Any) -> dict[str, str]:
    """The options :func:`_with_options` kept in a table's schema (none: an empty dict)."""
    fields = getattr(schema, "fields", None) or []
    text = (fields[0].metadata or {}).get(_OPTIONS_KEY) if fields else None
    return dict(json.loads(text)) if text else {}


def data_source(pushdown: bool = True) -> type:
    """The data source class (built on first use: importing this module needs no PySpark).
    Without ``pushdown`` its reader takes no pushed filters (Spark refuses a reader that
    would while ``spark.sql.python.filterPushdown.enabled`` is off)."""
    from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

    class KeyscalePartition(InputPartition):  # type: ignore[misc]
        def __init__(self, part: ScanPart | KeyGroupRange):
            super().__init__(part)
            self.part = part

    class KeyscaleReader(DataSourceReader):  # type: ignore[misc]
        def __init__(self, source: StateScan | ChangeFeed, partitions: int | None):
            self.source = source
            self.count = partitions
            self.key_groups: set[int] | None = None

        def partitions(self) -> list[Any]:
            if isinstance(self.source, ChangeFeed):
                return [KeyscalePartition(r) for r in self.source.ranges(self.count, self.key_groups)]
            return [KeyscalePartition(p) for p in self.source.parts(self.count, self.key_groups)]

        def read(self, partition: Any) -> Iterator[pa.RecordBatch]:
            part = partition.part
            table = self.source.read(part)
            yield from table.combine_chunks().to_batches(max_chunksize=1 << 18)

    class PushdownReader(KeyscaleReader):
        def pushFilters(self, filters: list[Any]) -> Iterable[Any]:
            values, _ = _key_values(filters, [n for n, _ in self.source.routing])
            source = self.source
            if isinstance(source, ChangeFeed):
                scan = StateScan(source.store, source.uid, source.end, source.max_parallelism, source.parallelism, source.keys,
                                 source.routing, source.states)
                self.key_groups = scan.key_groups_of(values)
            else:
                self.key_groups = source.key_groups_of(values)
            return filters  # pruning only: Spark still checks every row against them

    reader_class = PushdownReader if pushdown else KeyscaleReader

    class KeyscaleDataSource(DataSource):  # type: ignore[misc]
        """keyscale's keyed state as a Spark data source (``keyscale.state_processor.datasource``)."""

        @classmethod
        def name(cls) -> str:
            return NAME

        def _source(self) -> StateScan | ChangeFeed:
            if getattr(self, "_planned", None) is None:
                self._planned = plan(self.options)
            return self._planned

        def schema(self) -> Any:
            schema = from_arrow_schema(self._source().schema())
            if _TABLE_PROPERTIES & {str(k).lower() for k in self.options}:  # CREATE TABLE: the options kept in the table's schema
                schema = _with_options(schema, self.options)
            return schema

        def reader(self, schema: Any) -> Any:
            if not self.options:  # a catalog table read: Spark passes none of its options, its schema holds them
                self.options = _options_in(schema)
            return reader_class(self._source(), check_options(self.options)["partitions"])

    return KeyscaleDataSource


def register(spark: SparkSession) -> None:
    """Make the ``keyscale`` data source known to ``spark``: ``spark.read.format("keyscale")``,
    ``CREATE TABLE`` and ``CREATE TEMPORARY VIEW ... USING keyscale OPTIONS (...)``, in any
    session, a job's own included (no session gets it unasked). Key filters are pushed down
    where Spark allows it: the session's ``spark.sql.python.filterPushdown.enabled`` is
    turned on when unset (a value the user set is kept; with it off, every key group is read
    and Spark filters the rows).

    Example (a running Spark session ``spark``)::

        register(spark)
        spark.read.format("keyscale").option("uid", "totals").load("jobs/clicks").where("user = 'ann'").show()
    """
    conf = spark.conf
    setting = conf.get(PUSHDOWN_CONF, None)
    if setting is None:
        try:
            conf.set(PUSHDOWN_CONF, "true")
            setting = "true"
        except Exception:  # a PySpark without the setting (4.0): no pushdown there
            setting = "false"
    spark.dataSource.register(data_source(pushdown=str(setting).lower() == "true"))
