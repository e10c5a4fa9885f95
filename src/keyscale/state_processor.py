"""The State Processor API: read, write and re-key keyed state outside a running job.

On Spark DataFrames, in the spirit of Flink's State Processor API:

- :func:`read_keyed_state` reads one operator's keyed state from a savepoint or from a
  job directory's checkpoint, as a DataFrame (list and map states flattened);
- :func:`write_savepoint_from_dataframes` bootstraps a savepoint from DataFrames (or
  pandas / Arrow tables), e.g. to start a job with state computed from a historical table;
- :func:`rekey_savepoint` rewrites a savepoint for another max parallelism (number of key
  groups), the one change Flink cannot make to existing state;
- :func:`inspect_savepoint` summarises a savepoint (``keyscale inspect SP``).

Key groups are Spark's ``pmod(hash(key columns), M)``. :func:`key_groups` computes them
for an Arrow table in numpy, bit for bit as Spark does (checked against Spark in the tests).

>>> import tempfile, pyarrow as pa
>>> from pathlib import Path
>>> root = Path(tempfile.mkdtemp())
>>> table = pa.table({"user": ["ann", "bob"], "clicks": [3, 5]})
>>> sp = write_savepoint_from_dataframes(root / "sp", "clicks",
...                                      {"count": (table, ["user"], {"clicks": "long"})}, 128)
>>> print(inspect_savepoint(sp).splitlines()[2])
operator 'count': max parallelism 128 (bootstrapped)
>>> sp32 = rekey_savepoint(sp, root / "sp32", 32)
>>> import pyarrow.parquet as pq
>>> sorted(pq.read_table(sp32 / "operators" / "count").to_pylist(), key=lambda r: r["user"])
[{'user': 'ann', 'key_group': 18, 'clicks': 3}, {'user': 'bob', 'key_group': 21, 'clicks': 5}]
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from keyscale.checkpoint.jobdir import JobDir
from keyscale.checkpoint.savepoint import (
    DEFAULT_ROWS_PER_FILE,
    KEY_GROUP_COLUMN,
    METADATA_FILE,
    SOURCE_DIR,
    Progress,
    SavepointFile,
    SavepointInfo,
    SavepointOperator,
    canonical_order,
    checkpoint_rows_per_key_group,
    checkpoint_types,
    chunk_ranges,
    data_file_name,
    finish_savepoint,
    read_savepoint,
    restore_key_groups,
    spark_type_name,
    staging,
    write_data_file,
)
from keyscale.errors import InputDataError, KeyscaleError, StateError
from keyscale.state.keygroups import KeyGroupRange, check_parallelism
from keyscale.state.spark_hash import key_group_of, routing_values
from keyscale.state.types import StateDescriptor, arrow_type

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

__all__ = [
    "inspect_savepoint",
    "key_groups",
    "read_keyed_state",
    "rekey_savepoint",
    "write_savepoint_from_dataframes",
]

_PA: Any = pa

# -- Spark's hash(), vectorized ---------------------------------------------------------------

_U32 = np.uint32
_C1 = _U32(0xCC9E2D51)
_C2 = _U32(0x1B873593)


def _rotl(x: np.ndarray, r: int) -> np.ndarray:
    return (x << _U32(r)) | (x >> _U32(32 - r))


def _mix_k1(k: np.ndarray) -> np.ndarray:
    return _rotl(k * _C1, 15) * _C2


def _mix_h1(h: np.ndarray, k: np.ndarray) -> np.ndarray:
    return _rotl(h ^ k, 13) * _U32(5) + _U32(0xE6546B64)


def _fmix(h: np.ndarray, length: np.ndarray | np.uint32) -> np.ndarray:
    h = h ^ length
    h ^= h >> _U32(16)
    h = h * _U32(0x85EBCA6B)
    h ^= h >> _U32(13)
    h = h * _U32(0xC2B2AE35)
    h ^= h >> _U32(16)
    return h


def _hash_int32(h: np.ndarray, v: np.ndarray) -> np.ndarray:
    return _fmix(_mix_h1(h, _mix_k1(v.astype(np.int32).view(_U32))), _U32(4))


def _hash_int64(h: np.ndarray, v: np.ndarray) -> np.ndarray:
    u = v.astype(np.int64).view(np.uint64)
    h = _mix_h1(h, _mix_k1((u & np.uint64(0xFFFFFFFF)).astype(_U32)))
    h = _mix_h1(h, _mix_k1((u >> np.uint64(32)).astype(_U32)))
    return _fmix(h, _U32(8))


def _hash_bytes(h: np.ndarray, arr: Any) -> np.ndarray:
    """``hashUnsafeBytes`` of each value of a (large) string or binary array."""
    n = len(arr)
    large = pa.types.is_large_string(arr.type) or pa.types.is_large_binary(arr.type)
    bufs = arr.buffers()
    offsets = np.frombuffer(bufs[1], dtype=np.int64 if large else np.int32)[arr.offset : arr.offset + n + 1].astype(np.int64)
    data = np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None else np.empty(0, np.uint8)
    starts = offsets[:-1]
    lens = offsets[1:] - starts
    words = lens // 4
    h = h.copy()
    for j in range(int(words.max()) if n else 0):
        idx = np.flatnonzero(words > j)
        p = starts[idx] + 4 * j
        word = data[p].astype(_U32) | (data[p + 1].astype(_U32) << _U32(8)) | (data[p + 2].astype(_U32) << _U32(16)) | (data[p + 3].astype(_U32) << _U32(24))
        h[idx] = _mix_h1(h[idx], _mix_k1(word))
    for t in range(3):  # tail bytes, each sign-extended and mixed on its own
        idx = np.flatnonzero(lens % 4 > t)
        p = starts[idx] + 4 * words[idx] + t
        h[idx] = _mix_h1(h[idx], _mix_k1(data[p].view(np.int8).astype(np.int32).view(_U32)))
    return _fmix(h, lens.astype(_U32))


def _hash_column(h: np.ndarray, col: Any, spark_type: str) -> np.ndarray | None:
    """Spark's hash of one column seeded by ``h`` (None: type not vectorized here)."""
    t = col.type
    if spark_type in ("string", "binary") and (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t)):
        return _hash_bytes(h, col)
    if spark_type in ("int", "integer", "short", "smallint", "byte", "tinyint", "date", "boolean"):
        if pa.types.is_date32(t) or pa.types.is_boolean(t):
            col = col.cast(pa.int32())
        return _hash_int32(h, np.asarray(col.fill_null(0).to_numpy(zero_copy_only=False)))
    if spark_type in ("long", "bigint", "timestamp", "timestamp_ntz"):
        if pa.types.is_timestamp(t):
            col = col.cast(_PA.timestamp("us", tz=t.tz)).cast(pa.int64())
        return _hash_int64(h, np.asarray(col.fill_null(0).to_numpy(zero_copy_only=False)))
    if spark_type == "float":
        v = np.asarray(col.cast(pa.float32()).fill_null(0).to_numpy(zero_copy_only=False), dtype=np.float32)
        bits = np.where(v == 0, _U32(0), np.where(np.isnan(v), _U32(0x7FC00000), v.view(_U32)))
        return _hash_int32(h, bits.astype(_U32).view(np.int32))
    if spark_type == "double":
        d = np.asarray(col.cast(pa.float64()).fill_null(0).to_numpy(zero_copy_only=False), dtype=np.float64)
        bits64 = np.where(d == 0, np.uint64(0), np.where(np.isnan(d), np.uint64(0x7FF8000000000000), d.view(np.uint64)))
        return _hash_int64(h, bits64.astype(np.uint64).view(np.int64))
    return None


def key_groups(table: pa.Table, key_names: Sequence[str], spark_types: Sequence[str], max_parallelism: int) -> np.ndarray:
    """``pmod(hash(key columns), M)`` of every row, as Spark computes it (int32 array).

    ``spark_types`` name each key column's Spark type (``"string"``, ``"long"``, ...): the
    hash depends on it (``hash(1L) != hash(1)``). Vectorized for the types keys usually
    have; others go row by row through :func:`keyscale.state.spark_hash.key_group_of`.

    >>> t = pa.table({"k": ["a", "bcdef"], "n": [1, None]})
    >>> key_groups(t, ["k", "n"], ["string", "long"], 128).tolist()
    [81, 26]
    >>> [key_group_of(["a", 1], ["string", "long"], 128), key_group_of(["bcdef", None], ["string", "long"], 128)]
    [81, 26]
    """
    check_parallelism(1, max_parallelism)
    n = table.num_rows
    h = np.full(n, 42, dtype=_U32)
    cols = [table.column(k).combine_chunks() if table.column(k).num_chunks != 1 else table.column(k).chunk(0) for k in key_names]
    with np.errstate(over="ignore"):
        for col, st in zip(cols, spark_types, strict=True):
            new = _hash_column(h, col, st)
            if new is None:
                rows = zip(*(c.to_pylist() for c in cols), strict=True)
                return np.fromiter((key_group_of(list(r), list(spark_types), max_parallelism) for r in rows), dtype=np.int32, count=n)
            if col.null_count:
                valid = np.asarray(col.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
                new = np.where(valid, new, h)
            h = new
    return (h.view(np.int32).astype(np.int64) % max_parallelism).astype(np.int32)


# -- reading state as DataFrames --------------------------------------------------------------


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
    from pyspark.sql import functions as F

    ids = [*key_names, KEY_GROUP_COLUMN]
    by_name = {s.name: s for s in states}
    if state is not None and state not in by_name:
        raise StateError(f"operator '{uid}' has no state '{state}' (states: {', '.join(by_name) or 'none'})")
    if not flatten:
        return df.select(*ids, state) if state is not None else df
    if state is None:
        nested = [s.name for s in states if s.kind != "value"]
        if not nested:
            return df
        if len(states) > 1:
            raise KeyscaleError(
                f"operator '{uid}' has list or map state ({', '.join(nested)}) among {len(states)} states; "
                "pass state='NAME' to read one of them flattened, or flatten=False for nested columns"
            )
        state = nested[0]
    s = by_name[state]
    if s.kind == "value":
        return df.select(*ids, state).where(F.col(state).isNotNull())
    if s.kind == "list":
        return df.select(*ids, F.posexplode(state).alias(f"{state}_index", state)).select(*ids, state, f"{state}_index")
    return df.select(*ids, F.explode(state).alias(f"{state}_key", f"{state}_value"))


def read_keyed_state(
    spark: SparkSession,
    path: str | os.PathLike[str],
    uid: str,
    *,
    state: str | None = None,
    flatten: bool = True,
    checkpoint: int | None = None,
) -> DataFrame:
    """The keyed state of operator ``uid`` as a DataFrame.

    ``path`` is a savepoint folder (read by Spark from its Parquet files, in parallel) or a
    job directory: then its latest checkpoint, or checkpoint ``checkpoint``; that state is
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
    root = Path(path)
    if (root / METADATA_FILE).exists():
        if checkpoint is not None:
            raise KeyscaleError(f"{root} is a savepoint; checkpoint= only applies to a job directory")
        info = read_savepoint(root, verify=False)
        op: SavepointOperator = _operator(info.operators, uid, f"savepoint {info.path}")
        df = _savepoint_frame(spark, info, op)
        return _shape(df, op.key_names, op.states, state, flatten, uid)
    jd = JobDir(root)
    if not jd.exists():
        raise StateError(f"{root.absolute()} is neither a savepoint ({METADATA_FILE}) nor a keyscale job directory (job.json)")
    manifest = jd.read_manifest(checkpoint) if checkpoint is not None else jd.latest_manifest()
    if manifest is None:
        raise StateError(f"job directory {jd.path} has no checkpoint yet")
    cop = _operator(manifest.operators, uid, f"checkpoint {manifest.batch} of {jd.path}")
    keys, states = checkpoint_types(jd.path, cop)
    schema = _canonical_schema(keys, states)
    ranges = chunk_ranges(checkpoint_rows_per_key_group(jd.path, cop), DEFAULT_ROWS_PER_FILE)
    tables = [restore_key_groups(jd.path, cop, rng, keys, states) for rng in ranges]
    table = pa.concat_tables(tables) if tables else schema.empty_table()
    df = _arrow_frame(spark, table.cast(schema))
    return _shape(df, [k for k, _ in keys], states, state, flatten, uid)


def _spark_schema(schema: pa.Schema) -> Any:
    from pyspark.sql.pandas.types import from_arrow_schema

    return from_arrow_schema(schema)


def _arrow_frame(spark: SparkSession, table: pa.Table) -> DataFrame:
    if table.num_rows == 0:
        return spark.createDataFrame([], _spark_schema(table.schema))
    return spark.createDataFrame(table)


def _savepoint_frame(spark: SparkSession, info: SavepointInfo, op: SavepointOperator) -> DataFrame:
    schema = op.schema()
    if not op.files:
        return spark.createDataFrame([], _spark_schema(schema))
    return spark.read.schema(_spark_schema(schema)).parquet(*(str(info.path / f.path) for f in op.files))


# -- bootstrapping a savepoint ----------------------------------------------------------------

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


def _check_uid(uid: str) -> None:
    if not uid or "/" in uid or "\\" in uid or uid in (".", "..") or uid.startswith("."):
        raise KeyscaleError(f"operator uid {uid!r} cannot name a folder; use letters, digits, '-', '_'")


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
    tmp: Path, uid: str, table: pa.Table, keys: Sequence[str], descs: Sequence[StateDescriptor],
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
        files.append(write_data_file(tmp, uid, rng, full.slice(a, b - a)))
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
    root: str, uid: str, ranges: list[tuple[int, int]], key_names: list[str], state_names: list[str], schema: pa.Schema,
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """The executor side of a bootstrap: writes the data files of the chunks it receives.

    Rows arrive sorted by key group and key; chunks are contiguous key-group ranges, so each
    chunk is one run of rows, written as it streams by.
    """
    from keyscale.checkpoint.savepoint import sha256_file
    from keyscale.storage.local import fsync_file

    def write(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        starts = np.array([a for a, _ in ranges], dtype=np.int64)
        results: list[dict[str, Any]] = []
        stats: dict[str, Any] = {"null_keys": 0, "null_key_column": "", "duplicates": 0, "example": ""}
        state: dict[str, Any] = {"chunk": -1, "writer": None, "rows": 0, "last": None}

        def close() -> None:
            w = state["writer"]
            if w is None:
                return
            w.close()
            a, b = ranges[state["chunk"]]
            rel = data_file_name(uid, KeyGroupRange(a, b))
            path = Path(root) / rel
            fsync_file(path)
            results.append({"path": rel, "start": a, "end": b, "rows": state["rows"], "bytes": path.stat().st_size, "sha256": sha256_file(path)})
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
                    rel = data_file_name(uid, KeyGroupRange(*ranges[c]))
                    (Path(root) / rel).parent.mkdir(parents=True, exist_ok=True)
                    state.update(chunk=c, writer=pq.ParquetWriter(str(Path(root) / rel), schema))
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
    tmp: Path, uid: str, df: DataFrame, keys: Sequence[str], descs: Sequence[StateDescriptor],
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
        F.pmod(F.hash(*[F.col(k) for k in keys]), F.lit(m)).cast("int").alias(KEY_GROUP_COLUMN),
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
        writer = _partition_writer(str(tmp), uid, [(r.start, r.end) for r in ranges], list(keys), [d.name for d in descs], schema)
        parted = sel.repartition(len(ranges), route).sortWithinPartitions(KEY_GROUP_COLUMN, *keys)
        out = parted.mapInArrow(writer, _spark_schema(_RESULT_SCHEMA)).collect()
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
    dest: str | os.PathLike[str],
    job_name: str,
    operators: BootstrapOperators,
    max_parallelism: int,
    *,
    progress: Progress | None = None,
    rows_per_file: int = DEFAULT_ROWS_PER_FILE,
) -> Path:
    """Bootstrap a savepoint for job ``job_name`` from tables of state; returns its path.

    ``operators`` maps each operator uid to ``(data, key_columns, states)``: ``data`` is a
    Spark DataFrame, a pandas DataFrame or a pyarrow Table with one row per key;
    ``states`` maps each state name (a column of ``data``) to its Spark SQL type:
    ``"array<T>"`` declares a list state of ``T``, ``"map<K,V>"`` a map state, any other
    type a value state (pass a :class:`~keyscale.state.types.StateDescriptor` for a value
    state that holds an array or a map). These must match what the job declares
    (``ctx.list_state("recent", "long")`` is ``"array<long>"``); the restore checks them.

    Key groups are ``pmod(hash(keys), max_parallelism)`` on the key columns' own types,
    which must be the types the job keys by. A Spark DataFrame is hashed, sorted and written
    by Spark (its executors write the files, so ``dest`` must be on storage they share; the
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
    >>> info = read_savepoint(sp)
    >>> info.batch, info.operators["track"].states[0].kind, info.operators["track"].rows
    (-1, 'list', 2)
    """
    check_parallelism(1, max_parallelism)
    with staging(dest) as (tmp, final):
        ops: dict[str, SavepointOperator] = {}
        for uid, (data, keys, states) in operators.items():
            _check_uid(uid)
            descs = [_state_descriptor(n, s) for n, s in states.items()]
            keys = list(keys)
            if _is_spark_frame(data):
                ops[uid] = _bootstrap_spark(tmp, uid, data, keys, descs, max_parallelism, rows_per_file, progress)
            else:
                table = _to_arrow(data, keys, descs, uid)
                ops[uid] = _bootstrap_local(tmp, uid, table, keys, descs, max_parallelism, rows_per_file, progress)
        info = SavepointInfo(
            path=final, job=job_name, batch=-1, batch_time_ms=0, watermark_ms=None, created_ms=int(time.time() * 1000),
            origin="bootstrap", source=None, operators=ops,
        )
        finish_savepoint(tmp, final, info)
        return final


# -- re-keying --------------------------------------------------------------------------------


def _read_canonical(path: Path, op: SavepointOperator, columns: Sequence[str] | None = None) -> pa.Table:
    try:
        table = pq.read_table(path, columns=list(columns) if columns is not None else None)
    except (pa.ArrowInvalid, OSError) as e:
        raise StateError(f"savepoint data file {path} (operator '{op.uid}') is unreadable ({e})") from None
    schema = op.schema()
    if columns is not None:
        schema = pa.schema([schema.field(c) for c in columns])
    return table.select(schema.names).cast(schema)


def rekey_savepoint(
    src: str | os.PathLike[str],
    dest: str | os.PathLike[str],
    new_max_parallelism: int,
    progress: Progress | None = None,
    *,
    rows_per_file: int = DEFAULT_ROWS_PER_FILE,
) -> Path:
    """Write savepoint ``src`` again with ``new_max_parallelism`` key groups; returns ``dest``.

    Every key gets the key group Spark gives it under the new max parallelism
    (``pmod(hash(keys), M')``, on the key columns' types); values, source positions (copied
    as they are) and everything else stay. A job directory created with max parallelism
    ``M'`` restores the result at any parallelism up to ``M'``. Memory stays bounded: keys
    are hashed file by file and spilled per new data file before being sorted and written.
    """
    info = read_savepoint(src)
    check_parallelism(1, new_max_parallelism)
    m2 = new_max_parallelism
    with staging(dest) as (tmp, final):
        spill = tmp / ".spill"
        spill.mkdir()
        total = sum(2 * len(op.files) for op in info.operators.values())
        done = 0
        if progress:
            progress("rekey", 0, total)
        ops: dict[str, SavepointOperator] = {}
        for uid, op in sorted(info.operators.items()):
            names, types = op.key_names, op.key_spark_types
            counts = np.zeros(m2, dtype=np.int64)
            for i, f in enumerate(op.files):
                kgs = key_groups(_read_canonical(info.path / f.path, op, names), names, types, m2)
                np.save(spill / f"{i}.npy", kgs)
                counts += np.bincount(kgs, minlength=m2)
                done += 1
                if progress:
                    progress("rekey", done, total)
            ranges = chunk_ranges(counts, rows_per_file)
            starts = np.array([r.start for r in ranges], dtype=np.int64)
            writers: dict[int, Any] = {}
            schema = op.schema()
            try:
                for i, f in enumerate(op.files):
                    table = _read_canonical(info.path / f.path, op)
                    kgs = np.load(spill / f"{i}.npy")
                    (spill / f"{i}.npy").unlink()
                    table = table.set_column(table.schema.get_field_index(KEY_GROUP_COLUMN), KEY_GROUP_COLUMN, pa.array(kgs, pa.int32()))
                    chunk = np.searchsorted(starts, kgs, side="right") - 1
                    order = np.argsort(chunk, kind="stable")
                    table, chunk = table.take(order), chunk[order]
                    bounds = np.flatnonzero(np.diff(chunk)) + 1
                    for a, b in zip([0, *bounds.tolist()], [*bounds.tolist(), table.num_rows], strict=True):
                        if b <= a:
                            continue
                        c = int(chunk[a])
                        if c not in writers:
                            writers[c] = pa.ipc.new_file(str(spill / f"chunk-{c}.arrow"), schema)
                        writers[c].write_table(table.slice(a, b - a))
                    done += 1
                    if progress:
                        progress("rekey", done, total)
            finally:
                for w in writers.values():
                    w.close()
            files = []
            for c, rng in enumerate(ranges):
                part = spill / f"chunk-{c}.arrow"
                with pa.memory_map(str(part)) as source:
                    table = pa.ipc.open_file(source).read_all()
                files.append(write_data_file(tmp, uid, rng, canonical_order(table, names)))
                del table
                part.unlink()
            par = min(op.parallelism, m2) if op.parallelism is not None else None
            ops[uid] = SavepointOperator(uid, m2, par, op.key_columns, op.states, tuple(files), dict(op.operator_state))
        shutil.rmtree(spill)
        if info.source is not None:
            shutil.copytree(info.path / info.source, tmp / SOURCE_DIR)
        old_m = {uid: op.max_parallelism for uid, op in info.operators.items()}
        new = SavepointInfo(
            path=final, job=info.job, batch=info.batch, batch_time_ms=info.batch_time_ms, watermark_ms=info.watermark_ms,
            created_ms=int(time.time() * 1000), origin="rekey", source=SOURCE_DIR if info.source is not None else None,
            operators=ops, extra={**info.extra, "rekeyed_from": {"origin": info.origin, "created_ms": info.created_ms, "max_parallelism": old_m}},
        )
        finish_savepoint(tmp, final, new)
        return final


# -- inspecting -------------------------------------------------------------------------------


def _size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"  # pragma: no cover


def _time(ms: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ms / 1000)) if ms > 0 else "-"


def inspect_savepoint(sp: str | os.PathLike[str], verify: bool = False) -> str:
    """A readable summary: job, batch, source, and per operator its keys, states, key
    count and bytes per key-group range (one line per data file).

    The files are checked to exist with their recorded sizes; with ``verify`` also their
    sha256. See the module example for the output.
    """
    info = read_savepoint(sp, verify=verify)
    batch = "before the first batch (bootstrapped)" if info.batch < 0 else f"{info.batch} (batch time {_time(info.batch_time_ms)})"
    lines = [
        f"savepoint {info.path}",
        f"job '{info.job}', batch {batch}, created {_time(info.created_ms)}, origin {info.origin}",
    ]
    if not info.operators:
        lines.append("no keyed operators")
    for uid, op in sorted(info.operators.items()):
        ran = f"ran at parallelism {op.parallelism}" if op.parallelism is not None else "bootstrapped"
        lines.append(f"operator '{uid}': max parallelism {op.max_parallelism} ({ran})")
        lines.append("  keys: " + ", ".join(f"{k} {spark_type_name(t)}" for k, t in op.key_columns))
        for s in op.states:
            shown = spark_type_name(s.value_type) if s.kind != "map" else f"{spark_type_name(s.map_key_type or pa.null())} -> {spark_type_name(s.value_type)}"
            lines.append(f"  state {s.name}: {s.kind} of {shown}")
        if op.operator_state:
            lines.append(f"  operator state: {', '.join(sorted(op.operator_state))}")
        lines.append(f"  {op.rows:,} keys, {_size(op.bytes)} in {len(op.files)} files")
        if op.files:
            lines.append(f"  {'key groups':>13}  {'keys':>12}  {'bytes':>10}")
            lines.extend(f"  {f.range!s:>13}  {f.rows:>12,}  {_size(f.bytes):>10}" for f in op.files)
    if info.source is not None:
        lines.append(f"source positions: {info.source} (Spark checkpoint up to batch {info.batch})")
    else:
        lines.append("source positions: none (a restored job starts its source from the beginning)")
    return "\n".join(lines)
