"""Re-keying a savepoint for another max parallelism, and summarising one (``keyscale inspect``)."""

from __future__ import annotations

import io
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from keyscale.checkpoint.savepoint import (
    DEFAULT_ROWS_PER_FILE,
    KEY_GROUP_COLUMN,
    SOURCE_DIR,
    Location,
    Progress,
    SavepointFile,
    SavepointInfo,
    SavepointOperator,
    canonical_order,
    chunk_ranges,
    finish_savepoint,
    new_savepoint,
    read_data_file,
    read_savepoint,
    spark_type_name,
    write_data_file,
)
from keyscale.state.keygroups import check_parallelism
from keyscale.state.spark_hash import key_groups
from keyscale.storage import LocalStore, Store


def _read_canonical(info: SavepointInfo, f: SavepointFile, op: SavepointOperator, columns: Sequence[str] | None = None) -> pa.Table:
    table = read_data_file(info, f, op.uid, columns)
    schema = op.schema()
    if columns is not None:
        schema = pa.schema([schema.field(c) for c in columns])
    return table.select(schema.names).cast(schema)


def _npy(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def _ipc(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    return bytes(sink.getvalue().to_pybytes())


def _rekey_operator(
    info: SavepointInfo, op: SavepointOperator, m2: int, spill: Store, store: Store, rows_per_file: int, tick: Any,
) -> SavepointOperator:
    """One operator's keys under ``m2`` key groups, spilled per new data file, then written."""
    names, types = op.key_names, op.key_spark_types
    counts = np.zeros(m2, dtype=np.int64)
    for i, f in enumerate(op.files):
        kgs = key_groups(_read_canonical(info, f, op, names), names, types, m2)
        spill.put(f"kgs/{i}.npy", _npy(kgs), durable=False)
        counts += np.bincount(kgs, minlength=m2)
        tick()
    ranges = chunk_ranges(counts, rows_per_file)
    starts = np.array([r.start for r in ranges], dtype=np.int64)
    for i, f in enumerate(op.files):
        table = _read_canonical(info, f, op)
        kgs = np.load(io.BytesIO(spill.get(f"kgs/{i}.npy")))
        spill.delete(f"kgs/{i}.npy")
        table = table.set_column(table.schema.get_field_index(KEY_GROUP_COLUMN), KEY_GROUP_COLUMN, pa.array(kgs, pa.int32()))
        chunk = np.searchsorted(starts, kgs, side="right") - 1
        order = np.argsort(chunk, kind="stable")
        table, chunk = table.take(order), chunk[order]
        bounds = np.flatnonzero(np.diff(chunk)) + 1
        for a, b in zip([0, *bounds.tolist()], [*bounds.tolist(), table.num_rows], strict=True):
            if b > a:
                spill.put(f"chunk-{int(chunk[a]):08d}/{i:08d}.arrow", _ipc(table.slice(a, b - a)), durable=False)
        tick()
    files = []
    for c, rng in enumerate(ranges):
        parts = []
        for o in spill.list(f"chunk-{c:08d}"):
            parts.append(pa.ipc.open_file(pa.BufferReader(spill.get(o.key))).read_all())
        table = pa.concat_tables(parts) if parts else op.schema().empty_table()
        files.append(write_data_file(store, op.uid, rng, canonical_order(table, names)))
        del table, parts
        spill.delete_prefix(f"chunk-{c:08d}")
    par = min(op.parallelism, m2) if op.parallelism is not None else None
    return SavepointOperator(op.uid, m2, par, op.key_columns, op.states, tuple(files), dict(op.operator_state))


def rekey_savepoint(
    src: Location,
    dest: Location,
    new_max_parallelism: int,
    progress: Progress | None = None,
    *,
    rows_per_file: int = DEFAULT_ROWS_PER_FILE,
) -> str:
    """Write savepoint ``src`` again with ``new_max_parallelism`` key groups at ``dest``;
    returns the new savepoint's location. ``src`` and ``dest`` may be on different stores.

    Every key gets the key group Spark gives it under the new max parallelism
    (``pmod(hash(keys), M')``, on the key columns' types); values, source positions (copied
    as they are) and everything else stay. A job directory created with max parallelism
    ``M'`` restores the result at any parallelism up to ``M'``. Memory stays bounded: keys
    are hashed file by file and spilled (to a local temporary folder) per new data file
    before being sorted and written.
    """
    info = read_savepoint(src)
    check_parallelism(1, new_max_parallelism)
    m2 = new_max_parallelism
    total = sum(2 * len(op.files) for op in info.operators.values())
    done = 0

    def tick() -> None:
        nonlocal done
        done += 1
        if progress:
            progress("rekey", done, total)

    with new_savepoint(dest) as store, tempfile.TemporaryDirectory(prefix="keyscale-rekey-") as scratch:
        spill = LocalStore(scratch)  # scratch space of this process, gone when done
        if progress:
            progress("rekey", 0, total)
        ops = {uid: _rekey_operator(info, op, m2, spill, store, rows_per_file, tick) for uid, op in sorted(info.operators.items())}
        if info.source is not None:
            prefix = info.source.rstrip("/") + "/"
            for o in info.store.list(info.source):
                store.put(f"{SOURCE_DIR}/{o.key[len(prefix):]}", info.store.get(o.key))
        old_m = {uid: op.max_parallelism for uid, op in info.operators.items()}
        new = SavepointInfo(
            path=store.url(), job=info.job, batch=info.batch, batch_time_ms=info.batch_time_ms, watermark_ms=info.watermark_ms,
            created_ms=int(time.time() * 1000), origin="rekey", source=SOURCE_DIR if info.source is not None else None,
            operators=ops, store=store,
            extra={**info.extra, "rekeyed_from": {"origin": info.origin, "created_ms": info.created_ms, "max_parallelism": old_m}},
        )
        return finish_savepoint(store, new)


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


def inspect_savepoint(sp: Location, verify: bool = False) -> str:
    """A readable summary: job, batch, source, and per operator its keys, states, key
    count and bytes per key-group range (one line per data file).

    The files are checked to exist with their recorded sizes; with ``verify`` also their
    sha256. ``sp`` is a local path, a ``file://`` or object store URI. See the package
    example for the output.
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
