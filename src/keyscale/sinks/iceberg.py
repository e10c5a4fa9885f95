"""Exactly-once output to an Apache Iceberg table (pyiceberg): one catalog commit per
batch, whose snapshots carry the job lineage and the batch id in their summaries.

An Iceberg snapshot summary holds any string properties, and a table's snapshots form a
chain (the current snapshot's ancestry). Each batch commits its snapshot(s) with
``keyscale.lineage`` and ``keyscale.batch``; before writing, the sink walks the ancestry
back to the newest snapshot of its lineage, and a batch at or below that one's is in the
table already (keyscale writes a lineage's batches in order): the write is skipped.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

from keyscale._keywords import checked_keywords
from keyscale.errors import OutputError, StorageError
from keyscale.sinks._lakehouse import (
    BATCH_KEY,
    JOB_KEY,
    LINEAGE_KEY,
    Mode,
    TableSink,
    check_mode,
    iceberg_s3_properties,
    nullable,
    one_line,
    require,
    schema_mismatch,
)

if TYPE_CHECKING:
    import pyarrow as pa
    from pyiceberg.catalog import Catalog
    from pyiceberg.table import Table


log = logging.getLogger(__name__)

RETRIES = "commit.retry.num-retries"
# pyiceberg retries a commit that lost a race by re-applying it on the new table state:
# for an append that is a second copy of rows another writer (a zombie of this job) has
# already committed for the same batch. The sink retries itself, after checking the table.
_TABLE_PROPERTIES = {RETRIES: "0"}


class IcebergSink(TableSink["Table"]):
    """Write each batch to an Iceberg table exactly once, in one catalog commit.

    ``catalog``: a pyiceberg ``Catalog``, or the properties to load one with
    (``pyiceberg.catalog.load_catalog``), e.g. a SQL catalog on SQLite::

        {"type": "sql", "uri": "sqlite:////data/catalog.db", "warehouse": "s3://lake/warehouse"}

    (``"name"`` names the catalog, ``"default"`` if absent). With properties, the S3
    settings of the environment (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``,
    ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_REGION``) become the FileIO
    properties ``s3.endpoint``, ``s3.access-key-id``... that the properties do not set. A
    ``Catalog`` object is used as it is configured (it may not pickle: the sink runs on the
    driver only).

    ``table``: ``"namespace.table"`` (or a tuple). The namespace and the table are created
    on the first batch, from the output's schema (every column optional), with
    ``commit.retry.num-retries=0``; an existing table must have the output's columns and
    types, and should have that property too (pyiceberg's own retry would re-apply an
    append that lost a race to a writer of the same batch; the log warns).

    ``mode="append"`` appends the batch's rows (one snapshot). ``mode="upsert"`` merges
    them by ``keys`` (pyiceberg's ``upsert`` in one transaction: an overwrite of the
    changed rows and an append of the new ones, committed together): one row per key with
    its latest values; of several rows of one key in a batch the last is merged.

    Exactly once: every snapshot of a batch's commit has ``keyscale.lineage`` (the job
    lineage) and ``keyscale.batch`` in its summary (and ``keyscale.job``). The table commit
    comes before keyscale's checkpoint commit; a batch written again after a crash between
    the two finds its snapshot in the table's history, runs the batch's Spark job (keyed
    state is rebuilt by it) and writes nothing. Readers see a batch when its commit is
    done. A batch with no rows, or an upsert that changes no row, commits nothing (its
    replay writes nothing either). Keep at least the newest snapshot of the running job
    when expiring snapshots: it is how a replay knows its batch. A job restored from an older savepoint recomputes the
    batches after it under a new lineage: in append mode their earlier rows stay (the log
    warns, naming them); upsert mode overwrites them by key.

    The batch's rows are collected on the driver (``DataFrame.toArrow``) and written from
    there: for batches that fit the driver's memory.

    In a job file::

        def build(ctx):
            events = ctx.spark.readStream.schema("key string, value long").parquet(ctx.arg("input"))
            catalog = {"type": "sql", "uri": ctx.arg("catalog"), "warehouse": ctx.arg("warehouse")}
            return (ks.stream(events).key_by("key").aggregate(uid="totals", count=ks.aggregates.count())
                    .sink(ks.sinks.IcebergSink(catalog, "analytics.counts", mode="upsert", keys=["key"])))

    >>> import keyscale as ks
    >>> catalog = {"type": "sql", "uri": "sqlite:////tmp/catalog.db", "warehouse": "file:///tmp/warehouse"}
    >>> ks.sinks.IcebergSink(catalog, "analytics.counts").describe()
    "Iceberg table analytics.counts (catalog 'default' at sqlite:////tmp/catalog.db)"
    >>> ks.sinks.IcebergSink(catalog, "analytics.counts", mode="upsert")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    keyscale.errors.OutputError: Iceberg sink for analytics.counts: mode='upsert' needs keys=[...], ...
    """

    @checked_keywords
    def __init__(
        self,
        catalog: Catalog | Mapping[str, str],
        table: str | Sequence[str],
        mode: Mode = "append",
        keys: Sequence[str] | None = None,
    ):
        require("Iceberg sink", "pyiceberg", "iceberg")
        from pyiceberg.exceptions import CommitFailedException

        self._conflicts = (CommitFailedException,)  # another writer committed first
        parts = tuple(table.split(".")) if isinstance(table, str) else tuple(table)
        if len(parts) < 2 or not all(parts):
            raise OutputError(f"Iceberg sink: table {table!r} needs a namespace: give it as 'namespace.table'")
        self.identifier = parts
        self.mode, self.keys = check_mode(f"Iceberg sink for {self.name}", mode, keys)
        self._catalog: Catalog | None = None
        self._properties: dict[str, str] | None = None
        if isinstance(catalog, Mapping):
            self._properties = {str(k): str(v) for k, v in catalog.items()}
            self.catalog_name = self._properties.pop("name", "default")
            _check_warehouse(self._properties.get("warehouse"), self.name)
            where = self._properties.get("uri", "")
        else:
            self._catalog = catalog
            self.catalog_name = catalog.name
            where = str(catalog.properties.get("uri", ""))
        self._where = _without_password(where)
        self._warned_retries = False

    @property
    def name(self) -> str:
        """The table's name, ``namespace.table``."""
        return ".".join(self.identifier)

    def describe(self) -> str:
        # The table alone (not the mode): two outputs of one job into one table would
        # take each other's snapshots for their own, so the pipeline check must see one place.
        at = f" at {self._where}" if self._where else ""
        return f"Iceberg table {self.name} (catalog '{self.catalog_name}'{at})"

    @property
    def lineage(self) -> str:
        """The lineage id the snapshots carry (empty when the sink writes outside a job)."""
        return self._ctx.lineage.id if self._ctx is not None else ""

    def catalog(self) -> Catalog:
        """The catalog, loaded on first use from the properties (and the environment)."""
        if self._catalog is None:
            from pyiceberg.catalog import load_catalog

            assert self._properties is not None
            try:
                self._catalog = load_catalog(self.catalog_name, **iceberg_s3_properties(self._properties))
            except Exception as e:  # bad properties or an unreachable catalog (SQL, REST...): one line, no traceback
                raise OutputError(f"{self.describe()}: cannot load the catalog: {type(e).__name__}: {one_line(e)}") from None
        return self._catalog

    def _newest(self, table: Table, lineage: str) -> int | None:
        return _newest_batch(table, lineage)

    def _commit(self, table: Table, data: pa.Table, batch_id: int) -> None:
        ctx = self._ctx
        props = {LINEAGE_KEY: self.lineage, BATCH_KEY: str(batch_id), JOB_KEY: ctx.job if ctx else ""}
        if self.mode == "append":
            table.append(data, snapshot_properties=props)
            return
        # One transaction, one catalog commit: the overwrite of changed rows and the append
        # of new ones become visible together, each snapshot with the batch's properties.
        with table.transaction() as tx:
            tx.upsert(data, join_cols=list(self.keys), snapshot_properties=props)

    # -- the table ------------------------------------------------------------------------
    def _load(self) -> Table | None:
        from pyiceberg.exceptions import NoSuchNamespaceError, NoSuchTableError

        try:
            return self.catalog().load_table(self.identifier)
        except (NoSuchTableError, NoSuchNamespaceError):
            return None
        except OSError as e:
            raise StorageError(f"{self.describe()}: cannot read the table: {one_line(e)}") from None

    def _create(self, schema: pa.Schema) -> Table:
        """Create the namespace and the table from the output's schema; a table that another
        writer created in the meantime is used as it is, if its schema fits."""
        catalog = self.catalog()
        try:
            catalog.create_namespace_if_not_exists(self.identifier[:-1])
            table = catalog.create_table_if_not_exists(self.identifier, nullable(schema), properties=_TABLE_PROPERTIES)
        except OSError as e:
            raise StorageError(f"{self.describe()}: cannot create the table: {one_line(e)}") from None
        log.info("created %s", self.describe())
        return table

    def _check_schema(self, table: Table, schema: pa.Schema) -> None:
        # Iceberg has no 8 or 16 bit integers: Spark's byte and short columns are int there.
        why = schema_mismatch(table.schema().as_arrow(), schema, small_ints_widen=True)
        if why is not None:
            raise OutputError(f"{self.describe()}: the job's output no longer fits the table: {why}; "
                              "write to a new table, or change this one to the new schema")

    def _before_commit(self, table: Table) -> None:
        if self._warned_retries or table.properties.get(RETRIES) == "0":
            return
        self._warned_retries = True
        log.warning("%s: the table property %s is not 0: a commit that pyiceberg retries after losing a race may add "
                    "a batch twice if another writer (a zombie of this job) wrote it meanwhile; set it to 0",
                    self.describe(), RETRIES)


def _newest_batch(table: Table, lineage: str) -> int | None:
    """The newest batch of ``lineage`` in the table's current history (None: none)."""
    from pyiceberg.table.snapshots import ancestors_of

    for snapshot in ancestors_of(table.current_snapshot(), table.metadata):
        summary = snapshot.summary
        if summary is not None and summary[LINEAGE_KEY] == lineage:
            return _batch(summary[BATCH_KEY])
    return None


def _batch(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _check_warehouse(warehouse: str | None, table: str) -> None:
    """A warehouse pyiceberg can write: a local path or a URI of a FileIO it has."""
    from pyiceberg.io import SCHEMA_TO_FILE_IO

    if not warehouse:
        return
    scheme = urlsplit(warehouse).scheme.lower()
    if (len(scheme) > 1 or "://" in warehouse) and scheme not in SCHEMA_TO_FILE_IO:
        raise OutputError(
            f"Iceberg sink for {table}: cannot write to warehouse {warehouse}: pyiceberg has no file system for "
            f"'{scheme}:' (a local path, or {', '.join(s + '://' for s in sorted(SCHEMA_TO_FILE_IO))})"
        )


def _without_password(uri: str) -> str:
    """A catalog URI for messages: without a password (``postgresql://user:secret@host/db``)."""
    try:
        parts = urlsplit(uri)
        if parts.password is None:
            return uri
        host = parts.hostname or ""
        netloc = f"{parts.username}@{host}" + (f":{parts.port}" if parts.port else "")
        return urlunsplit(parts._replace(netloc=netloc))
    except ValueError:
        return uri


def table_rows(catalog: Catalog | Mapping[str, str], table: str) -> pa.Table:
    """Every row of an Iceberg table (for tests and for looking at what a job wrote)."""
    sink = IcebergSink(catalog, table)
    loaded = sink._load()
    if loaded is None:
        raise OutputError(f"{sink.describe()} does not exist")
    return loaded.scan().to_arrow()

