"""Reading keyed state as Spark DataFrames, from a savepoint or a job directory's checkpoint."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from keyscale._spark_types import from_arrow_schema
from keyscale.checkpoint.savepoint import (
    DEFAULT_ROWS_PER_FILE,
    KEY_GROUP_COLUMN,
    METADATA_FILE,
    Location,
    SavepointInfo,
    SavepointOperator,
    checkpoint_rows_per_key_group,
    checkpoint_types,
    chunk_ranges,
    read_data_file,
    read_savepoint,
    restore_key_groups,
)
from keyscale.checkpoint.savepoint.write import CheckpointFiles
from keyscale.errors import KeyscaleError, StateError
from keyscale.state.types import StateDescriptor
from keyscale.state_processor.lookup import committed_checkpoint
from keyscale.state_processor.scan import shape_plan
from keyscale.storage import LocalStore, open_store

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession


def _operator(operators: Mapping[str, Any], uid: str, where: object) -> Any:
    if uid not in operators:
        have = ", ".join(repr(u) for u in sorted(operators)) or "none"
        raise StateError(f"{where} has no keyed state of operator '{uid}' (operators: {have})")
    return operators[uid]


def _canonical_schema(keys: Sequence[tuple[str, pa.DataType]], states: Sequence[StateDescriptor]) -> pa.Schema:
    fields = [pa.field(k, t) for k, t in keys]
    fields.append(pa.field(KEY_GROUP_COLUMN, pa.int32()))
    fields.extend(pa.field(s.name, s.column_type) for s in states)
    return pa.schema(fields)


def _shape(df: DataFrame, key_names: Sequence[str], states: Sequence[StateDescriptor], state: str | None, flatten: bool, uid: str) -> DataFrame:
    """``df`` shaped by the rule of :func:`keyscale.state_processor.scan.shape_plan`, in Spark."""
    from pyspark.sql import functions as F

    mode, name = shape_plan(states, state, flatten, uid)
    ids = [*key_names, KEY_GROUP_COLUMN]
    if mode == "all" or name is None:
        return df
    if mode == "select":
        return df.select(*ids, name)
    if mode == "value":
        return df.select(*ids, name).where(F.col(name).isNotNull())
    if mode == "list":
        return df.select(*ids, F.posexplode(name).alias(f"{name}_index", name)).select(*ids, name, f"{name}_index")
    return df.select(*ids, F.explode(name).alias(f"{name}_key", f"{name}_value"))


def read_keyed_state(
    spark: SparkSession,
    path: Location,
    uid: str,
    *,
    state: str | None = None,
    flatten: bool = True,
    checkpoint: int | None = None,
) -> DataFrame:
    """The keyed state of operator ``uid`` as a DataFrame.

    ``path`` (a local path, ``file://`` or object store URI) is a savepoint (its Parquet
    files read in parallel: by Spark from local disk, by tasks through the store from an
    object store) or a job directory: then its latest checkpoint, or checkpoint ``checkpoint``; that state is
    rebuilt key group by key group *in the driver* and handed to Spark as one Arrow table,
    so it suits states that fit in the driver's memory (take a savepoint for bigger ones).

    Columns: the key columns, ``key_group``, then one column per state (null where a key
    does not have that state). With ``flatten`` (the default) a list state becomes one row
    per element (``<state>``, ``<state>_index``) and a map state one row per entry
    (``<state>_key``, ``<state>_value``); keys without it have no row. An operator with a
    list or map state among others needs ``state=`` to pick the state to flatten; a value
    state picked this way gives its keys that have it. ``flatten=False`` keeps the nested
    columns (arrays and maps), of all states or of ``state``.

    Example (a running Spark session ``spark``)::

        df = read_keyed_state(spark, "savepoints/sp-41", "tracker", state="recent")
        df.show()   # key, key_group, recent, recent_index
    """
    store = open_store(path, "savepoint or job directory")
    if store.exists(METADATA_FILE):
        if checkpoint is not None:
            raise KeyscaleError(f"{store.url()} is a savepoint; checkpoint= only applies to a job directory")
        info = read_savepoint(store, verify=False)
        op: SavepointOperator = _operator(info.operators, uid, f"savepoint {info.path}")
        df = _savepoint_frame(spark, info, op)
        return _shape(df, op.key_names, op.states, state, flatten, uid)
    jd, manifest = committed_checkpoint(store, checkpoint)
    cop = _operator(manifest.operators, uid, f"checkpoint {manifest.batch} of {jd.uri}")
    files = CheckpointFiles(jd.store)
    keys, states = checkpoint_types(files, cop)
    schema = _canonical_schema(keys, states)
    ranges = chunk_ranges(checkpoint_rows_per_key_group(files, cop), DEFAULT_ROWS_PER_FILE)
    tables = [restore_key_groups(files, cop, rng, keys, states) for rng in ranges]
    table = pa.concat_tables(tables) if tables else schema.empty_table()
    df = _arrow_frame(spark, table.cast(schema))
    return _shape(df, [k for k, _ in keys], states, state, flatten, uid)


def spark_schema(schema: pa.Schema) -> Any:
    return from_arrow_schema(schema)


def _arrow_frame(spark: SparkSession, table: pa.Table) -> DataFrame:
    if table.num_rows == 0:
        return spark.createDataFrame([], spark_schema(table.schema))
    return spark.createDataFrame(table)


def _savepoint_frame(spark: SparkSession, info: SavepointInfo, op: SavepointOperator) -> DataFrame:
    schema = op.schema()
    if not op.files:
        return spark.createDataFrame([], spark_schema(schema))
    if isinstance(info.store, LocalStore):  # Spark reads local Parquet itself
        return spark.read.schema(spark_schema(schema)).parquet(*(str(info.store.path(f.path)) for f in op.files))
    # This Spark reads no object store: one task per data file reads it through the store.
    reader = _file_reader(info, op)
    ids = spark.range(len(op.files), numPartitions=len(op.files))
    return ids.mapInArrow(reader, spark_schema(schema))


def _file_reader(info: SavepointInfo, op: SavepointOperator) -> Any:
    """The task side of reading a savepoint on an object store: data files by index."""
    files = list(op.files)
    schema = op.schema()
    # the store travels pickled to the executors; the metadata already read goes along
    slim = SavepointInfo(
        path=info.path, job=info.job, batch=info.batch, batch_time_ms=info.batch_time_ms, watermark_ms=info.watermark_ms,
        created_ms=info.created_ms, origin=info.origin, source=None, operators={}, store=info.store,
    )

    def read(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            for i in batch.column(0).to_pylist():
                table = read_data_file(slim, files[int(i or 0)], op.uid).select(schema.names).cast(schema)
                yield from table.to_batches()

    return read
