"""Exactly-once output to a Delta Lake table (delta-rs): one table commit per batch, which
carries the job lineage's application transaction ``keyscale-<lineage id>`` at version
``batch id``.

Delta's application transactions (``txn`` actions, "SetTransaction") exist for exactly
this: a streaming writer records its progress in the same atomic commit as the data, and
asks the table for it after a restart. keyscale commits the table first and its own
checkpoint second, so after a crash between the two it writes the batch again; the table
says it has it (``transaction_version(app id) >= batch id``) and the write is skipped.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from keyscale._keywords import checked_keywords
from keyscale.errors import OutputError, StorageError
from keyscale.sinks._lakehouse import (
    BATCH_KEY,
    JOB_KEY,
    LINEAGE_KEY,
    Mode,
    TableSink,
    check_mode,
    delta_s3_options,
    nullable,
    one_line,
    require,
    schema_mismatch,
)

if TYPE_CHECKING:
    import pyarrow as pa
    from deltalake import CommitProperties, DeltaTable


log = logging.getLogger(__name__)

# The stores delta-rs serves (object_store): anything else with a scheme is refused rather
# than taken for a local folder name.
_SCHEMES = frozenset({"file", "s3", "s3a", "gs", "az", "azure", "abfs", "abfss"})


def table_uri(uri: str | os.PathLike[str]) -> str:
    """The table's location as delta-rs takes it: a URI of a store it serves, or an
    absolute local path. Any other scheme is an :class:`OutputError`."""
    text = os.fspath(uri)
    scheme = urlsplit(text).scheme.lower()
    if len(scheme) > 1 or "://" in text:  # one letter: a Windows drive, not a scheme
        if scheme not in _SCHEMES or "://" not in text:
            raise OutputError(
                f"Delta sink: cannot write a table at {text}: the URI scheme '{scheme}:' is not one delta-rs serves "
                f"(a local path, or {', '.join(s + '://' for s in sorted(_SCHEMES))})"
            )
        return text
    return os.path.abspath(text)


class DeltaSink(TableSink["DeltaTable"]):
    """Write each batch to a Delta Lake table exactly once, in one table commit.

    ``uri``: a local path, ``file://``, ``s3://`` (AWS or any S3-compatible server),
    ``gs://`` or ``az://``/``abfss://``. The table is created on the first batch, from the
    output's schema (every column nullable); an existing table must have the output's
    columns and types.

    ``mode="append"`` appends the batch's rows. ``mode="upsert"`` merges them by ``keys``
    (``MERGE ... WHEN MATCHED UPDATE * WHEN NOT MATCHED INSERT *``): the table holds one
    row per key with its latest values; of several rows of one key in a batch the last
    is merged.

    Exactly once: each batch is one commit that carries the application transaction
    ``(keyscale-<lineage id>, batch id)``, the job and the batch (``keyscale.job``,
    ``keyscale.batch``, ``keyscale.lineage`` in the commit info: see
    ``DeltaTable(uri).history()``). The table commit comes before keyscale's checkpoint
    commit; a batch written again after a crash between the two finds its transaction
    version in the table, runs the batch's Spark job (keyed state is rebuilt by it) and
    writes nothing. Readers see a batch when its table commit is done. A batch with no
    rows makes no commit (an idle stream does not add table versions): its replay writes
    nothing either. A job restored from an older savepoint recomputes the batches after
    it under a new lineage: in append mode their earlier rows stay in the table (the
    log warns, naming them); upsert mode overwrites them by key.

    ``storage_options``: delta-rs settings. For ``s3://`` the environment fills in what
    they do not set: ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
    ``AWS_SESSION_TOKEN``, ``AWS_REGION``, ``AWS_ALLOW_HTTP``, and ``conditional_put="etag"``
    (commits are put-if-absent, so concurrent writers are safe with no locking service).

    The batch's rows are collected on the driver (``DataFrame.toArrow``) and written from
    there: for batches that fit the driver's memory.

    In a job file::

        def build(ctx):
            events = ctx.spark.readStream.schema("key string, value long").parquet(ctx.arg("input"))
            return (ks.stream(events).key_by("key").aggregate(uid="totals", count=ks.aggregates.count())
                    .sink(ks.sinks.DeltaSink(ctx.arg("output"), mode="upsert", keys=["key"])))

    >>> import keyscale as ks
    >>> ks.sinks.DeltaSink("s3://lake/counts", mode="upsert", keys=["key"]).describe()
    'Delta table s3://lake/counts'
    >>> ks.sinks.DeltaSink("hdfs://lake/counts")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    keyscale.errors.OutputError: Delta sink: cannot write a table at hdfs://lake/counts: ...
    """

    @checked_keywords
    def __init__(
        self,
        uri: str | os.PathLike[str],
        mode: Mode = "append",
        keys: Sequence[str] | None = None,
        storage_options: Mapping[str, str] | None = None,
    ):
        require("Delta sink", "deltalake", "delta")
        from deltalake.exceptions import CommitFailedError, DeltaError

        # CommitFailedError: another writer committed first and delta-rs could not rebase
        # this commit on it (the same transaction: a zombie of this job).
        self._conflicts = (CommitFailedError,)
        self._storage_errors = (OSError, DeltaError)
        self.uri = table_uri(uri)
        self.mode, self.keys = check_mode(f"Delta sink for {self.uri}", mode, keys)
        self.storage_options = dict(storage_options or {})

    def describe(self) -> str:
        # The table alone (not the mode): two outputs of one job into one table share the
        # application id, so the pipeline check must see them as one place.
        return f"Delta table {self.uri}"

    @property
    def app_id(self) -> str:
        """The application id of this job lineage's transactions (``keyscale`` when the
        sink writes outside a job)."""
        return f"keyscale-{self._ctx.lineage.id}" if self._ctx is not None else "keyscale"

    def options(self) -> dict[str, str]:
        """The delta-rs storage options: the user's; for S3, the environment's settings too."""
        if urlsplit(self.uri).scheme.lower() in ("s3", "s3a"):
            return delta_s3_options(self.storage_options)
        return dict(self.storage_options)

    def _newest(self, table: DeltaTable, lineage: str) -> int | None:
        return table.transaction_version(f"keyscale-{lineage}")

    def _commit_properties(self, batch_id: int) -> CommitProperties:
        from deltalake import CommitProperties, Transaction

        ctx = self._ctx
        info = {BATCH_KEY: str(batch_id), LINEAGE_KEY: ctx.lineage.id if ctx else "", JOB_KEY: ctx.job if ctx else ""}
        # The transaction and the data are one atomic commit: the table has both or neither.
        return CommitProperties(app_transactions=[Transaction(self.app_id, batch_id)], custom_metadata=info)

    def _commit(self, table: DeltaTable, data: pa.Table, batch_id: int) -> None:
        from deltalake import write_deltalake

        props = self._commit_properties(batch_id)
        if self.mode == "append":
            write_deltalake(table, data, mode="append", commit_properties=props)
            return
        on = " AND ".join(f"s.{_quote(k)} = t.{_quote(k)}" for k in self.keys)
        (table.merge(data, on, source_alias="s", target_alias="t", commit_properties=props)
           .when_matched_update_all().when_not_matched_insert_all().execute())

    # -- the table ------------------------------------------------------------------------
    def _load(self) -> DeltaTable | None:
        """The table at its newest version, None if there is none yet."""
        from deltalake import DeltaTable
        from deltalake.exceptions import DeltaError, TableNotFoundError

        try:
            return DeltaTable(self.uri, storage_options=self.options())
        except TableNotFoundError:
            return None
        except (OSError, DeltaError) as e:
            raise StorageError(f"{self.describe()}: cannot read the table: {one_line(e)}") from None

    def _create(self, schema: pa.Schema) -> DeltaTable:
        """Create the table from the output's schema (``mode="ignore"``: a table that another
        writer created in the meantime is used as it is, if its schema fits)."""
        from deltalake import CommitProperties, DeltaTable
        from deltalake.exceptions import DeltaError

        ctx = self._ctx
        try:
            DeltaTable.create(
                self.uri, nullable(schema), mode="ignore", storage_options=self.options(),
                commit_properties=CommitProperties(custom_metadata={JOB_KEY: ctx.job if ctx else ""}),
            )
        except (OSError, DeltaError) as e:
            raise StorageError(f"{self.describe()}: cannot create the table: {one_line(e)}") from None
        dt = self._load()
        assert dt is not None
        log.info("created %s", self.describe())
        return dt

    def _check_schema(self, dt: DeltaTable, schema: pa.Schema) -> None:
        import pyarrow as pa

        arrow: Any = dt.schema().to_arrow()  # an arro3 schema: pyarrow takes it (Arrow C data interface)
        why = schema_mismatch(pa.schema(arrow), schema)
        if why is not None:
            raise OutputError(f"{self.describe()}: the job's output no longer fits the table: {why}; "
                              "write to a new table, or change this one to the new schema")


def _quote(column: str) -> str:
    """A column name in a delta-rs (DataFusion) SQL predicate: quoted, as written (unquoted
    names would be lower-cased)."""
    return '"' + column.replace('"', '""') + '"'


def delta_history(uri: str, storage_options: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """The table's commits, newest first, with each one's ``keyscale.batch`` (for tests and
    for looking at what a job wrote)."""
    from deltalake import DeltaTable

    sink = DeltaSink(uri, storage_options=storage_options)
    return DeltaTable(sink.uri, storage_options=sink.options()).history()
