"""Bootstrapping a savepoint from tables of state (Spark, pandas or Arrow)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from keyscale.checkpoint.savepoint import (
    DEFAULT_ROWS_PER_FILE,
    KEY_GROUP_COLUMN,
    Location,
    Progress,
    SavepointFile,
    SavepointInfo,
    SavepointOperator,
    canonical_order,
    chunk_ranges,
    data_file_name,
    finish_savepoint,
    new_savepoint,
    spark_type_name,
    write_data_file,
)
from keyscale.checkpoint.savepoint.format import sha256_of
from keyscale.errors import InputDataError, KeyscaleError
from keyscale.state.keygroups import KeyGroupRange, check_parallelism
from keyscale.state.spark_hash import key_group_sql, key_groups, routing_values
from keyscale.state.types import StateDescriptor, arrow_type
from keyscale.state.uids import check_uid
from keyscale.state_processor.read import spark_schema
from keyscale.storage import Store

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

_PA: Any = pa


#: Per operator uid: (data, key column names, states by name). Data is a Spark DataFrame,
#: a pandas DataFrame or a pyarrow Table; a state is a Spark SQL type name or a descriptor.
BootstrapOperators = Mapping[str, tuple[Any, Sequence[str], Mapping[str, "str | StateDescriptor"]]]


def _state_descriptor(name: str, spec: str | StateDescriptor) -> StateDescriptor:
    """``"array<T>"`` is a list state of T, ``"map<K,V>"`` a map state, anything else a value."""
    if isinstance(spec, StateDescriptor):
        if spec.name != name:
            raise KeyscaleError(f"state '{name}' is given a descriptor named '{spec.name}'")
        return spec
    t: Any = arrow_type(spec)
    if pa.types.is_list(t):
        return StateDescriptor(name, "list", t.value_type)
    if pa.types.is_map(t):
        return StateDescriptor(name, "map", t.item_type, t.key_type)
    return StateDescriptor(name, "value", t)


def _normal_key_type(t: pa.DataType) -> pa.DataType:
    if pa.types.is_large_string(t):
        return pa.string()
    if pa.types.is_large_binary(t):
        return pa.binary()
    if pa.types.is_timestamp(t) and t.unit != "us":
        ts: pa.DataType = _PA.timestamp("us", tz=t.tz)
        return ts
    return t


def _is_spark_frame(data: Any) -> bool:
    try:
        from pyspark.sql import DataFrame as SparkFrame
    except ImportError:  # pragma: no cover - pyspark is a dependency
        return False
    return isinstance(data, SparkFrame)


def _to_arrow(data: Any, keys: Sequence[str], descs: Sequence[StateDescriptor], uid: str) -> pa.Table:
    if isinstance(data, pa.Table):
        table = data
    elif isinstance(data, pa.RecordBatch):
        table = pa.Table.from_batches([data])
    else:
        import pandas as pd

        if not isinstance(data, pd.DataFrame):
            raise KeyscaleError(f"operator '{uid}': bootstrap data must be a Spark DataFrame, a pandas DataFrame or a pyarrow Table, not {type(data).__name__}")
        _check_columns(list(data.columns), keys, descs, uid)
        key_table = pa.Table.from_pandas(data[list(keys)], preserve_index=False)
        schema = pa.schema([*key_table.schema, *(pa.field(d.name, d.column_type) for d in descs)])
        table = pa.Table.from_pandas(data[[*keys, *(d.name for d in descs)]], schema=schema, preserve_index=False)
    _check_columns(table.column_names, keys, descs, uid)
    return table


def _check_columns(have: Sequence[str], keys: Sequence[str], descs: Sequence[StateDescriptor], uid: str) -> None:
    if not keys:
        raise KeyscaleError(f"operator '{uid}': no key columns given")
    for c in [*keys, *(d.name for d in descs)]:
        if c not in have:
            raise KeyscaleError(f"operator '{uid}': the data has no column '{c}' (columns: {', '.join(map(str, have))})")
    if KEY_GROUP_COLUMN in (*keys, *(d.name for d in descs)):
        raise KeyscaleError(f"operator '{uid}': '{KEY_GROUP_COLUMN}' is reserved for the key group column")


def _alive_mask(table: pa.Table, states: Sequence[str]) -> np.ndarray:
    alive = np.zeros(table.num_rows, dtype=bool) if states else np.ones(table.num_rows, dtype=bool)
    for s in states:
        alive |= np.asarray(table.column(s).is_valid().to_numpy(zero_copy_only=False), dtype=bool)
    return alive


def _duplicate(table: pa.Table, key_names: Sequence[str], last: tuple[Any, ...] | None = None) -> tuple[int, str]:
    """Count of rows repeating the previous row's key (sorted input), and one such key."""
    n = table.num_rows
    if n == 0:
        return 0, ""
    same = np.ones(max(n - 1, 0), dtype=bool)
    for k in key_names:
        col = table.column(k)
        pcs: Any = pc
        eq: Any = pcs.fill_null(pcs.equal(col.slice(1), col.slice(0, n - 1)), False)
        same &= np.asarray(eq.to_numpy(zero_copy_only=False), dtype=bool)
    count = int(same.sum())
    example = ""
    if count:
        i = int(np.flatnonzero(same)[0]) + 1
        example = repr(tuple(table.column(k)[i].as_py() for k in key_names))
    if last is not None and tuple(table.column(k)[0].as_py() for k in key_names) == last:
        count += 1
        example = example or repr(last)
    return count, example


def _null_key_error(uid: str, column: str, count: int) -> InputDataError:
    return InputDataError(f"operator '{uid}': key column '{column}' has {count} null values; a key cannot be null (filter them out first)")


def _bootstrap_local(
    store: Store, uid: str, table: pa.Table, keys: Sequence[str], descs: Sequence[StateDescriptor],
    m: int, rows_per_file: int, progress: Progress | None,
) -> SavepointOperator:
    key_cols: list[tuple[str, pa.DataType]] = []
    arrays: list[Any] = []
    for k in keys:
        col = table.column(k)
        if col.null_count:
            raise _null_key_error(uid, k, col.null_count)
        t = _normal_key_type(col.type)
        key_cols.append((k, t))
        arrays.append(col.cast(t))
    kt = pa.Table.from_arrays(arrays, names=list(keys))
    kgs = key_groups(kt, list(keys), [spark_type_name(t) for _, t in key_cols], m)
    arrays.append(pa.array(kgs, pa.int32()))
    for d in descs:
        try:
            arrays.append(table.column(d.name).cast(d.column_type))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
            raise KeyscaleError(f"operator '{uid}', state '{d.name}': cannot store column of {table.column(d.name).type} as {d.column_type} ({e})") from None
    full = pa.Table.from_arrays(arrays, names=[*keys, KEY_GROUP_COLUMN, *(d.name for d in descs)])
    full = full.filter(pa.array(_alive_mask(full, [d.name for d in descs])))
    full = canonical_order(full, keys)
    dups, example = _duplicate(full, keys)
    if dups:
        raise InputDataError(f"operator '{uid}': {dups} rows repeat a key (e.g. {example}); keyed state has one row per key")
    kg_sorted = full.column(KEY_GROUP_COLUMN).to_numpy()
    ranges = chunk_ranges(np.bincount(kg_sorted, minlength=m), rows_per_file)
    files = []
    if progress:
        progress(f"bootstrap '{uid}'", 0, len(ranges))
    for i, rng in enumerate(ranges):
        a = int(np.searchsorted(kg_sorted, rng.start, side="left"))
        b = int(np.searchsorted(kg_sorted, rng.end, side="right"))
        files.append(write_data_file(store, uid, rng, full.slice(a, b - a)))
        if progress:
            progress(f"bootstrap '{uid}'", i + 1, len(ranges))
    return SavepointOperator(uid, m, None, tuple(key_cols), tuple(descs), tuple(files))


_RESULT_SCHEMA: pa.Schema = _PA.schema(
    [
        pa.field("path", pa.string()), pa.field("start", pa.int32()), pa.field("end", pa.int32()),
        pa.field("rows", pa.int64()), pa.field("bytes", pa.int64()), pa.field("sha256", pa.string()),
        pa.field("null_keys", pa.int64()), pa.field("null_key_column", pa.string()),
        pa.field("duplicates", pa.int64()), pa.field("example", pa.string()),
    ]
)


def _partition_writer(
    store: Store, uid: str, ranges: list[tuple[int, int]], key_names: list[str], state_names: list[str], schema: pa.Schema,
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """The executor side of a bootstrap: writes the data files of the chunks it receives.

    Rows arrive sorted by key group and key; chunks are contiguous key-group ranges, so each
    chunk is one run of rows, written as it streams by.
    """
    def write(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        starts = np.array([a for a, _ in ranges], dtype=np.int64)
        results: list[dict[str, Any]] = []
        stats: dict[str, Any] = {"null_keys": 0, "null_key_column": "", "duplicates": 0, "example": ""}
        state: dict[str, Any] = {"chunk": -1, "writer": None, "sink": None, "rows": 0, "last": None}

        def close() -> None:
            w = state["writer"]
            if w is None:
                return
            w.close()
            a, b = ranges[state["chunk"]]
            rel = data_file_name(uid, KeyGroupRange(a, b))
            data = state["sink"].getvalue().to_pybytes()
            store.put(rel, data)
            results.append({"path": rel, "start": a, "end": b, "rows": state["rows"], "bytes": len(data), "sha256": sha256_of(data)})
            state.update(writer=None, rows=0, last=None)

        for batch in batches:
            t = pa.Table.from_batches([batch])
            for k in key_names:
                nulls = t.column(k).null_count
                if nulls:
                    stats["null_keys"] += nulls
                    stats["null_key_column"] = stats["null_key_column"] or k
            keep = _alive_mask(t, state_names)
            for k in key_names:
                keep &= np.asarray(t.column(k).is_valid().to_numpy(zero_copy_only=False), dtype=bool)
            t = t.filter(pa.array(keep)).select(schema.names).cast(schema)
            if t.num_rows == 0:
                continue
            chunk = np.searchsorted(starts, t.column(KEY_GROUP_COLUMN).to_numpy(), side="right") - 1
            bounds = np.flatnonzero(np.diff(chunk)) + 1
            for a, b in zip([0, *bounds.tolist()], [*bounds.tolist(), t.num_rows], strict=True):
                c = int(chunk[a])
                part = t.slice(a, b - a)
                if c != state["chunk"]:
                    close()
                    sink = pa.BufferOutputStream()  # one data file, put whole when complete
                    state.update(chunk=c, sink=sink, writer=pq.ParquetWriter(sink, schema))
                d, ex = _duplicate(part, key_names, state["last"])
                if d:
                    stats["duplicates"] += d
                    stats["example"] = stats["example"] or ex
                state["writer"].write_table(part)
                state["rows"] += part.num_rows
                state["last"] = tuple(part.column(k)[part.num_rows - 1].as_py() for k in key_names)
        close()
        if results or stats["null_keys"] or stats["duplicates"]:
            if not results:
                results.append({"path": "", "start": -1, "end": -1, "rows": 0, "bytes": 0, "sha256": ""})
            for r in results:
                r.update(stats)
                stats = {"null_keys": 0, "null_key_column": "", "duplicates": 0, "example": ""}
            yield pa.RecordBatch.from_pylist(results, schema=_RESULT_SCHEMA)

    return write


def _bootstrap_spark(
    store: Store, uid: str, df: DataFrame, keys: Sequence[str], descs: Sequence[StateDescriptor],
    m: int, rows_per_file: int, progress: Progress | None,
) -> SavepointOperator:
    from pyspark.sql import functions as F

    _check_columns(df.columns, keys, descs, uid)
    fields = {f.name: f.dataType for f in df.schema.fields}
    key_cols: list[tuple[str, pa.DataType]] = []
    for k in keys:
        try:
            key_cols.append((k, _normal_key_type(arrow_type(fields[k].simpleString()))))
        except KeyscaleError:
            raise KeyscaleError(f"operator '{uid}': key column '{k}' has type {fields[k].simpleString()}, which keyscale cannot key by") from None
    sel = df.select(
        *keys,
        F.expr(key_group_sql(keys, m)).alias(KEY_GROUP_COLUMN),
        *[F.col(d.name).cast(spark_type_name(d.column_type)).alias(d.name) for d in descs],
    )
    counts = np.zeros(m, dtype=np.int64)
    for row in sel.groupBy(KEY_GROUP_COLUMN).count().collect():
        counts[int(row[0])] = int(row[1])
    ranges = chunk_ranges(counts, rows_per_file)
    if progress:
        progress(f"bootstrap '{uid}'", 0, len(ranges))
    files: list[SavepointFile] = []
    if ranges:
        chunk_of = np.zeros(m, dtype=np.int64)
        for i, r in enumerate(ranges):
            chunk_of[r.start : r.end + 1] = i
        routes = routing_values(len(ranges))
        chunk = F.element_at(F.lit(chunk_of.tolist()), F.col(KEY_GROUP_COLUMN) + 1)
        route = F.element_at(F.lit(routes), chunk.cast("int") + 1)
        schema = pa.schema([pa.field(k, t) for k, t in key_cols] + [pa.field(KEY_GROUP_COLUMN, pa.int32())] + [pa.field(d.name, d.column_type) for d in descs])
        writer = _partition_writer(store, uid, [(r.start, r.end) for r in ranges], list(keys), [d.name for d in descs], schema)
        parted = sel.repartition(len(ranges), route).sortWithinPartitions(KEY_GROUP_COLUMN, *keys)
        out = parted.mapInArrow(writer, spark_schema(_RESULT_SCHEMA)).collect()
        nulls = sum(int(r["null_keys"]) for r in out)
        if nulls:
            raise _null_key_error(uid, next(r["null_key_column"] for r in out if r["null_keys"]), nulls)
        dups = sum(int(r["duplicates"]) for r in out)
        if dups:
            example = next(r["example"] for r in out if r["duplicates"])
            raise InputDataError(f"operator '{uid}': {dups} rows repeat a key (e.g. {example}); keyed state has one row per key")
        files = sorted(
            (SavepointFile(r["path"], int(r["start"]), int(r["end"]), int(r["rows"]), int(r["bytes"]), r["sha256"]) for r in out if r["path"]),
            key=lambda f: f.start,
        )
    if progress:
        progress(f"bootstrap '{uid}'", len(ranges), len(ranges))
    return SavepointOperator(uid, m, None, tuple(key_cols), tuple(descs), tuple(files))


def write_savepoint_from_dataframes(
    dest: Location,
    job_name: str,
    operators: BootstrapOperators,
    max_parallelism: int,
    *,
    progress: Progress | None = None,
    rows_per_file: int = DEFAULT_ROWS_PER_FILE,
) -> str:
    """Bootstrap a savepoint for job ``job_name`` from tables of state; returns its location.

    ``operators`` maps each operator uid to ``(data, key_columns, states)``: ``data`` is a
    Spark DataFrame, a pandas DataFrame or a pyarrow Table with one row per key;
    ``states`` maps each state name (a column of ``data``) to its Spark SQL type:
    ``"array<T>"`` declares a list state of ``T``, ``"map<K,V>"`` a map state, any other
    type a value state (pass a :class:`~keyscale.state.types.StateDescriptor` for a value
    state that holds an array or a map). These must match what the job declares
    (``ctx.list_state("recent", "long")`` is ``"array<long>"``); the restore checks them.

    Key groups are ``pmod(hash(keys), max_parallelism)`` on the key columns' own types,
    which must be the types the job keys by. A Spark DataFrame is hashed, sorted and written
    by Spark (its executors write the files through the store, so a local ``dest`` must be on
    storage they share, an object store location serves them all; the
    DataFrame is evaluated twice, once to count keys per key group: cache an expensive one);
    pandas and Arrow data are handled in this process. Null keys and repeated keys are
    refused; rows whose states are all null are left out (such keys do not exist).

    The savepoint has no source positions: a job restored from it starts its source from
    scratch (Spark batch 0), with this state as of "before the first batch" (batch -1).

    >>> import tempfile, pandas as pd
    >>> from pathlib import Path
    >>> frame = pd.DataFrame({"user": ["ann", "bob"], "recent": [[1, 2], [7]]})
    >>> sp = write_savepoint_from_dataframes(Path(tempfile.mkdtemp()) / "sp", "clicks",
    ...                                      {"track": (frame, ["user"], {"recent": "array<long>"})}, 16)
    >>> from keyscale.checkpoint.savepoint import read_savepoint
    >>> info = read_savepoint(sp)
    >>> info.batch, info.operators["track"].states[0].kind, info.operators["track"].rows
    (-1, 'list', 2)
    """
    check_parallelism(1, max_parallelism)
    with new_savepoint(dest) as store:
        ops: dict[str, SavepointOperator] = {}
        for uid, (data, keys, states) in operators.items():
            check_uid(uid)  # the pipeline's rule: a savepoint never holds a uid no stage can have
            descs = [_state_descriptor(n, s) for n, s in states.items()]
            keys = list(keys)
            if _is_spark_frame(data):
                ops[uid] = _bootstrap_spark(store, uid, data, keys, descs, max_parallelism, rows_per_file, progress)
            else:
                table = _to_arrow(data, keys, descs, uid)
                ops[uid] = _bootstrap_local(store, uid, table, keys, descs, max_parallelism, rows_per_file, progress)
        info = SavepointInfo(
            path=store.url(), job=job_name, batch=-1, batch_time_ms=0, watermark_ms=None, created_ms=int(time.time() * 1000),
            origin="bootstrap", source=None, operators=ops, store=store,
        )
        return finish_savepoint(store, info)

