"""What the Delta Lake and Iceberg sinks share: the write loop (:class:`TableSink`),
argument checks, schema comparison, the last row per key of an upsert batch, and S3
settings from the environment."""

from __future__ import annotations

import logging
import os
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Generic, Literal, TypeVar, cast

from keyscale.errors import OutputError, StorageError
from keyscale.sinks.base import KEPT

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame

    from keyscale.sinks.base import SinkContext

log = logging.getLogger(__name__)
T = TypeVar("T")  # a table handle: deltalake.DeltaTable, pyiceberg Table

Mode = Literal["append", "upsert"]

# Snapshot/commit metadata keys (Iceberg snapshot summary, Delta commit info).
LINEAGE_KEY = "keyscale.lineage"
BATCH_KEY = "keyscale.batch"
JOB_KEY = "keyscale.job"
# How often a sink writes a batch again after losing a commit race to another writer
# (each attempt first checks whether the batch is in the table by then).
COMMIT_ATTEMPTS = 5


def check_mode(sink: str, mode: str, keys: Sequence[str] | str | None) -> tuple[Mode, tuple[str, ...]]:
    """The sink's mode and key columns, or an :class:`OutputError` naming ``sink``."""
    if mode not in ("append", "upsert"):
        raise OutputError(f"{sink}: mode must be 'append' or 'upsert', not {mode!r}")
    if isinstance(keys, str):
        keys = [keys]
    found = tuple(keys or ())
    if mode == "upsert" and not found:
        raise OutputError(f"{sink}: mode='upsert' needs keys=[...], the columns that identify a row")
    if mode == "append" and found:
        raise OutputError(f"{sink}: keys={list(found)} only apply to mode='upsert'")
    if len(set(found)) != len(found):
        raise OutputError(f"{sink}: keys={list(found)} names a column twice")
    return cast(Mode, mode), found


def require(sink: str, module: str, extra: str) -> None:
    """The library a sink writes with is installed (an optional dependency of keyscale)."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise OutputError(f"{sink} needs the '{module}' package: pip install 'keyscale[{extra}]'")


def check_key_columns(sink: str, keys: Sequence[str], columns: Sequence[str]) -> None:
    """Every key is an output column (checked before the batch's Spark job runs)."""
    for k in keys:
        if k not in columns:
            raise OutputError(f"{sink}: key column '{k}' is not in the job's output (its columns: {', '.join(columns)})")


def _norm(t: pa.DataType, small_ints_widen: bool) -> str:
    """An Arrow type as a table stores it: string and binary flavours, list flavours and
    timestamp units are one type each, nullability and child field names do not count.
    ``small_ints_widen``: int8/int16 are int32 (Iceberg has no smaller integer)."""
    import pyarrow as pa

    def norm(x: pa.DataType) -> str:
        if pa.types.is_dictionary(x):
            return norm(x.value_type)
        if pa.types.is_string(x) or pa.types.is_large_string(x) or pa.types.is_string_view(x):
            return "string"
        if pa.types.is_binary(x) or pa.types.is_large_binary(x) or pa.types.is_binary_view(x):
            return "binary"
        if pa.types.is_timestamp(x):
            return "timestamp with time zone" if x.tz else "timestamp without time zone"
        if small_ints_widen and (pa.types.is_int8(x) or pa.types.is_int16(x)):
            return "int32"
        if pa.types.is_map(x):
            return f"map<{norm(x.key_type)}, {norm(x.item_type)}>"
        if pa.types.is_list(x) or pa.types.is_large_list(x) or pa.types.is_fixed_size_list(x) or pa.types.is_list_view(x):
            return f"list<{norm(x.value_type)}>"
        if pa.types.is_struct(x):
            return "struct<" + ", ".join(f"{x.field(i).name}: {norm(x.field(i).type)}" for i in range(x.num_fields)) + ">"
        return str(x)

    return norm(t)


def schema_mismatch(table: pa.Schema, output: pa.Schema, small_ints_widen: bool = False) -> str | None:
    """Why the job's ``output`` cannot go into a table of schema ``table`` (None: it can):
    the first column that is missing on either side or has another type."""
    have = {f.name: f.type for f in table}
    new = {f.name: f.type for f in output}
    for name, t in new.items():
        if name not in have:
            return f"the job's output has column '{name}', the table has not (its columns: {', '.join(have)})"
        a, b = _norm(t, small_ints_widen), _norm(have[name], small_ints_widen)
        if a != b:
            return f"column '{name}' is {a} in the job's output, {b} in the table"
    for name in have:
        if name not in new:
            return f"the table has column '{name}', the job's output has not (its columns: {', '.join(new)})"
    return None


def nullable(schema: pa.Schema) -> pa.Schema:
    """``schema`` with every top-level column nullable: a table created from Spark's output
    must not refuse a null that a later plan of the same job may produce (Spark marks
    aggregates and literals not-null, which can change with the plan)."""
    out = schema
    for i, field in enumerate(schema):
        out = out.set(i, field.with_nullable(True))
    return out


def last_per_key(table: pa.Table, keys: Sequence[str]) -> pa.Table:
    """One row per key, the batch's last (in output order) for keys it emits several times:
    a MERGE refuses a source with two rows for one target row, and the last is the newest."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    if table.num_rows < 2:
        return table
    row = "__keyscale_row"
    numbered = table.select(list(keys)).append_column(row, pa.array(np.arange(table.num_rows, dtype=np.int64)))
    last = numbered.group_by(list(keys), use_threads=False).aggregate([(row, "max")])[f"{row}_max"]
    if len(last) == table.num_rows:
        return table
    return table.take(pc.take(last, pc.sort_indices(last)))  # the kept rows, in output order


def one_line(error: BaseException) -> str:
    """A storage library's error as one line: delta-rs reports a chain of causes on
    indented, coloured lines, ending in the server's XML; the S3 message is what counts."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error))
    server = re.search(r"<Message>(.*?)</Message>", text, re.S)
    parts = [line.strip().lstrip("\u21b3").strip() for line in text.splitlines()]
    parts = [p for p in parts if p and not p.startswith("<")]
    if server:
        parts.append(server.group(1).strip())
    return ": ".join(parts) or type(error).__name__


# -- S3 settings from the environment -----------------------------------------------------

# (environment variable(s), what the settings for one key are called): the first set
# variable fills the setting unless the user gave it under any of its names.
_AWS_ENV: tuple[tuple[tuple[str, ...], str], ...] = (
    (("AWS_ENDPOINT_URL",), "endpoint"),
    (("AWS_ACCESS_KEY_ID",), "access_key_id"),
    (("AWS_SECRET_ACCESS_KEY",), "secret_access_key"),
    (("AWS_SESSION_TOKEN",), "session_token"),
    (("AWS_REGION", "AWS_DEFAULT_REGION"), "region"),
    (("AWS_ALLOW_HTTP",), "allow_http"),
)


def aws_env() -> dict[str, str]:
    """The S3 settings of the environment, by setting: endpoint, access_key_id,
    secret_access_key, session_token, region, allow_http (those that are set)."""
    found = {}
    for names, setting in _AWS_ENV:
        value = next((os.environ[n] for n in names if os.environ.get(n)), None)
        if value is not None:
            found[setting] = value
    return found


# delta-rs (object_store) names of each setting, normalised: lower case, no "aws_" prefix.
_DELTA_ALIASES = {
    "endpoint": {"endpoint", "endpoint_url", "endpoint_url_s3"},
    "access_key_id": {"access_key_id"},
    "secret_access_key": {"secret_access_key"},
    "session_token": {"session_token", "token"},
    "region": {"region", "default_region"},
    "allow_http": {"allow_http"},
    "conditional_put": {"conditional_put"},
}
_DELTA_KEY = {
    "endpoint": "AWS_ENDPOINT_URL", "access_key_id": "AWS_ACCESS_KEY_ID", "secret_access_key": "AWS_SECRET_ACCESS_KEY",
    "session_token": "AWS_SESSION_TOKEN", "region": "AWS_REGION", "allow_http": "AWS_ALLOW_HTTP", "conditional_put": "conditional_put",
}


def delta_s3_options(user: Mapping[str, str]) -> dict[str, str]:
    """delta-rs storage options for an ``s3://`` table: the user's, then the environment's
    S3 settings for what the user did not set, passed explicitly (delta-rs does not read
    every one of them from the environment, e.g. ``AWS_ALLOW_HTTP``).

    ``conditional_put="etag"``: commits are created with ``If-None-Match: *`` (put if
    absent), so two writers of one table version cannot both succeed, without a locking
    service (delta-rs 1.x dropped DynamoDB locking; AWS S3, SeaweedFS, MinIO, R2 support
    conditional writes). Never ``AWS_S3_ALLOW_UNSAFE_RENAME``: it lets a commit overwrite
    another's.
    """
    given = {k.lower().removeprefix("aws_") for k in user}
    out = dict(user)
    for setting, value in {**aws_env(), "conditional_put": "etag"}.items():
        if not given & _DELTA_ALIASES[setting]:
            out[_DELTA_KEY[setting]] = value
    return out


_ICEBERG_KEY = {
    "endpoint": "s3.endpoint", "access_key_id": "s3.access-key-id", "secret_access_key": "s3.secret-access-key",
    "session_token": "s3.session-token", "region": "s3.region",
}


def iceberg_s3_properties(user: Mapping[str, str]) -> dict[str, str]:
    """pyiceberg catalog properties: the user's, then the environment's S3 settings as
    FileIO properties (``s3.endpoint``, ``s3.access-key-id``...) for what the user did not
    set (also not as ``client.*``, pyiceberg's setting for every cloud)."""
    out = dict(user)
    for setting, value in aws_env().items():
        key = _ICEBERG_KEY.get(setting)
        if key is None:
            continue  # allow_http: the endpoint's scheme says it
        if key not in out and key.replace("s3.", "client.") not in out:
            out[key] = value
    return out


class TableSink(ABC, Generic[T]):
    """An exactly-once table sink: each batch is one table commit that carries the job's
    lineage and the batch id, so a replayed batch the table already has is a no-op.

    Subclasses say how to load, create, check and commit to their kind of table; the
    write loop, the replay check and the lost-race retries are here."""

    exactly_once = True
    mode: Mode
    keys: tuple[str, ...]
    _ctx: SinkContext | None = None
    # Errors of a commit that lost a race to another writer (checked again, retried) and
    # of storage (reported as one line).
    _conflicts: tuple[type[BaseException], ...] = ()
    _storage_errors: tuple[type[BaseException], ...] = (OSError,)

    @abstractmethod
    def describe(self) -> str: ...

    @abstractmethod
    def _load(self) -> T | None:
        """The table, None if it does not exist yet."""

    @abstractmethod
    def _create(self, schema: pa.Schema) -> T: ...

    @abstractmethod
    def _check_schema(self, table: T, schema: pa.Schema) -> None: ...

    @abstractmethod
    def _newest(self, table: T, lineage: str) -> int | None:
        """The newest batch of ``lineage`` the table has (None: none)."""

    @abstractmethod
    def _commit(self, table: T, data: pa.Table, batch_id: int) -> None: ...

    def _before_commit(self, table: T) -> None:
        """A hook before each commit attempt (Iceberg warns about its retry setting)."""

    def _has(self, table: T, batch_id: int) -> bool:
        newest = self._newest(table, self._ctx.lineage.id if self._ctx else "none")
        return newest is not None and newest >= batch_id

    def open(self, ctx: SinkContext) -> None:
        """Learn the job's lineage; say what the table already holds of it and of the
        lineages this run supersedes (a restore recomputes what they wrote after the fork)."""
        self._ctx = ctx
        table = self._load()
        if table is None:
            return
        self._before_commit(table)
        own = self._newest(table, ctx.lineage.id)
        if own is not None and own > ctx.committed:
            log.info("%s already has batches up to %d of this job (committed: %d): their replay writes nothing",
                     self.describe(), own, ctx.committed)
        for lineage, fork in sorted(ctx.lineage.ancestors.items()):
            theirs = self._newest(table, lineage)
            if theirs is not None and theirs > fork:
                log.warning(
                    "%s has batches %d..%d of an earlier run (lineage %s) that this run recomputes (restored from an "
                    "older savepoint or started over): %s", self.describe(), fork + 1, theirs, lineage[:8],
                    "their rows stay in the table next to the new ones" if self.mode == "append" else "the upserts overwrite them by key",
                )

    def write(self, df: DataFrame, batch_id: int) -> int:
        """Write batch ``batch_id`` in one commit; returns its rows (``KEPT`` if the table has it)."""
        check_key_columns(self.describe(), self.keys, list(df.columns))
        table = self._load()
        if table is not None and self._has(table, batch_id):
            # A replay: the table has the batch. Run the plan (state is rebuilt by it), keep the table.
            df.write.format("noop").mode("overwrite").save()
            return KEPT
        data: pa.Table = df.toArrow()  # the batch's one Spark action
        if data.num_rows == 0:
            return 0  # nothing to commit; a replay of it writes nothing either
        if self.mode == "upsert":
            data = last_per_key(data, self.keys)
        for _attempt in range(COMMIT_ATTEMPTS):
            if table is None:
                table = self._create(data.schema)
            self._check_schema(table, data.schema)
            self._before_commit(table)
            if self._ctx is not None and self._ctx.fence is not None:  # a run a newer one took over commits nothing
                self._ctx.fence.check(f"committing batch {batch_id} to {self.describe()}")
            try:
                self._commit(table, data, batch_id)
                return data.num_rows
            except self._conflicts as e:
                # Another writer committed first (e.g. a zombie of this job): the batch may be in now.
                log.warning("%s: batch %d: %s; checking the table again", self.describe(), batch_id, one_line(e))
            except self._storage_errors as e:
                raise StorageError(f"{self.describe()}: batch {batch_id} could not be written: {one_line(e)}") from None
            table = self._load()
            if table is not None and self._has(table, batch_id):
                return KEPT
        raise StorageError(f"{self.describe()}: batch {batch_id} could not be committed: other writers changed the table "
                           f"under each of {COMMIT_ATTEMPTS} attempts")
