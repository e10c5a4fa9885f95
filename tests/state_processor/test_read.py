"""State Processor API: vectorized key groups, bootstrap, read, re-key, inspect.

Tests marked ``spark`` use the session-wide local Spark (tests/conftest.py); the others
run without a JVM.
"""

from __future__ import annotations

import datetime as dt
import math
import random
import shutil
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from keyscale.checkpoint.encode import write_state_file
from keyscale.checkpoint.files import read_state_slice
from keyscale.checkpoint.jobdir import JobDir
from keyscale.checkpoint.manifest import Manifest, OperatorCheckpoint
from keyscale.checkpoint.savepoint import (
    METADATA_FILE,
    OperatorSpec,
    read_savepoint,
    restore_savepoint,
    write_savepoint,
)
from keyscale.errors import InputDataError, KeyscaleError, StateError
from keyscale.state.keygroups import key_group_ranges
from keyscale.state.spark_hash import key_group_of
from keyscale.state.table import KG_COLUMN, KeyedStateTable
from keyscale.state.types import StateDescriptor
from keyscale.state_processor import (
    inspect_savepoint,
    key_groups,
    read_keyed_state,
    rekey_savepoint,
    write_savepoint_from_dataframes,
)

TOTAL = StateDescriptor("total", "value", pa.int64())
RECENT = StateDescriptor("recent", "list", pa.int64())
PARITY = StateDescriptor("parity", "map", pa.int64(), pa.string())
STATES = (TOTAL, RECENT, PARITY)
STATE_TYPES = {"total": "long", "recent": "array<long>", "parity": "map<string,long>"}


def _schema(two_keys: bool) -> pa.Schema:
    fields: list[pa.Field[Any]] = [pa.field("user", pa.string())]
    if two_keys:
        fields.append(pa.field("shard", pa.int64()))
    fields += [pa.field(d.name, d.column_type) for d in STATES]
    return pa.schema(fields)


# -- key groups, vectorized -------------------------------------------------------------------

TYPES: list[tuple[str, pa.DataType]] = [
    ("int", pa.int32()), ("long", pa.int64()), ("short", pa.int16()), ("byte", pa.int8()),
    ("boolean", pa.bool_()), ("double", pa.float64()), ("float", pa.float32()), ("string", pa.string()),
    ("binary", pa.binary()), ("date", pa.date32()), ("timestamp", pa.timestamp("us", tz="UTC")),
]
ALPHABET = ["a", "Z", "0", " ", "\x00", "é", "ÿ", "€", "ключ", "😀", "中"]


def _value(rng: random.Random, t: str) -> Any:
    if t in ("int", "date"):
        return rng.choice([0, 1, -1, -(2**31), 2**31 - 1, rng.randint(-(2**31), 2**31 - 1)])
    if t in ("long", "timestamp"):
        return rng.choice([0, -1, 2**32, -(2**63), 2**63 - 1, rng.randint(-(2**63), 2**63 - 1)])
    if t == "short":
        return rng.randint(-(2**15), 2**15 - 1)
    if t == "byte":
        return rng.randint(-128, 127)
    if t == "boolean":
        return rng.random() < 0.5
    if t == "double":
        return rng.choice([0.0, -0.0, math.nan, math.inf, 1.5, rng.uniform(-1e9, 1e9), struct.unpack("<d", struct.pack("<Q", rng.getrandbits(64)))[0]])
    if t == "float":
        return rng.choice([0.0, -0.0, math.nan, -math.inf, 0.1, rng.uniform(-1e6, 1e6)])
    if t == "string":
        return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 11)))
    if t == "binary":
        return bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 13)))
    raise AssertionError(t)


def _column(values: list[Any], t: pa.DataType) -> Any:
    if pa.types.is_date32(t):
        return pa.array(values, pa.int32()).cast(t)
    if pa.types.is_timestamp(t):
        return pa.array(values, pa.int64()).cast(t)
    return pa.array(values, t)


def _random_table(rng: random.Random, n: int, nulls: bool) -> tuple[pa.Table, list[dict[str, Any]]]:
    """A table with a column per Spark type, and its rows as plain values (days, micros)."""
    raw = {name: [None if nulls and rng.random() < 0.15 else _value(rng, name) for _ in range(n)] for name, _ in TYPES}
    table = pa.table({name: _column(raw[name], t) for name, t in TYPES})
    return table, [{name: raw[name][i] for name, _ in TYPES} for i in range(n)]


@pytest.mark.parametrize("m", [1, 7, 16, 128, 32768])
def test_key_groups_match_key_group_of(m: int) -> None:
    rng = random.Random(m)
    table, rows = _random_table(rng, 300, nulls=True)
    for name, _ in TYPES:  # one column at a time
        got = key_groups(table, [name], [name], m).tolist()
        want = [key_group_of([r[name]], [name], m) for r in rows]
        assert got == want, name
    for combo in (["string", "long"], ["int", "binary", "boolean"], ["double", "float", "date", "timestamp", "short", "byte"]):
        got = key_groups(table, combo, combo, m).tolist()
        want = [key_group_of([r[c] for c in combo], combo, m) for r in rows]
        assert got == want, combo


def test_key_groups_of_timestamps_in_other_units() -> None:
    micros = [0, 1_500_000, -86_400_000_000, 1_700_000_000_123_000]
    want = [key_group_of([v], ["timestamp"], 64) for v in micros]
    for unit, div in (("ms", 1000), ("s", 1_000_000)):
        col = pa.array([v // div for v in micros], pa.int64()).cast(pa.timestamp(unit, tz="UTC"))
        exact = [v % div == 0 for v in micros]
        got = key_groups(pa.table({"t": col}), ["t"], ["timestamp"], 64).tolist()
        assert [g for g, e in zip(got, exact, strict=True) if e] == [w for w, e in zip(want, exact, strict=True) if e]
    days = [dt.date(2024, 2, 29), dt.date(1969, 12, 31)]
    assert key_groups(pa.table({"d": pa.array(days)}), ["d"], ["date"], 64).tolist() == [key_group_of([d], ["date"], 64) for d in days]


def test_key_groups_of_slices_chunks_and_large_types() -> None:
    rng = random.Random(5)
    keys = ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 40))) for _ in range(200)]
    want = [key_group_of([k], ["string"], 64) for k in keys]
    parts: Any = pa.chunked_array([pa.array(keys[:70]), pa.array(keys[70:])])
    chunked = pa.table({"k": parts})
    assert key_groups(chunked, ["k"], ["string"], 64).tolist() == want
    sliced = pa.table({"k": pa.array(["pad", *keys]).slice(1)})
    assert key_groups(sliced, ["k"], ["string"], 64).tolist() == want
    large = pa.table({"k": pa.array(keys, pa.large_string())})
    assert key_groups(large, ["k"], ["string"], 64).tolist() == want
    empty = pa.table({"k": pa.array([], pa.string())})
    assert key_groups(empty, ["k"], ["string"], 64).tolist() == []
    # types without a vectorized path (decimals) fall back to the row-by-row hash
    assert key_groups(pa.table({"d": pa.array([1, 2], pa.decimal128(5, 0))}), ["d"], ["decimal(5,0)"], 8).tolist() == [
        key_group_of([d], ["decimal(5,0)"], 8) for d in (1, 2)]


def test_key_groups_match_spark(spark: Any) -> None:
    from pyspark.sql import functions as F

    rng = random.Random(11)
    table, _ = _random_table(rng, 300, nulls=True)
    # Python's datetime cannot hold every date or timestamp: keep those in its range
    table = table.set_column(9, "date", pa.array([rng.randint(-700_000, 2_000_000) for _ in range(300)], pa.int32()).cast(pa.date32()))
    table = table.set_column(10, "timestamp", pa.array([rng.randint(-(2**60), 2**60) // 1000 for _ in range(300)], pa.int64()).cast(pa.timestamp("us", tz="UTC")))
    df = spark.createDataFrame(table)
    combos = [[n] for n, _ in TYPES] + [["string", "long"], ["int", "binary", "boolean", "date", "timestamp"], ["double", "float", "short", "byte"]]
    got = df.select(*[F.pmod(F.hash(*c), F.lit(128)).alias(f"c{i}") for i, c in enumerate(combos)]).toArrow()
    for i, c in enumerate(combos):
        assert key_groups(table, c, c, 128).tolist() == got.column(f"c{i}").to_pylist(), c


# -- bootstrapping ----------------------------------------------------------------------------


def _reference(n: int, seed: int = 0, two_keys: bool = False) -> pd.DataFrame:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        row: dict[str, Any] = {"user": f"u{i % 37}" if two_keys else f"u{i}"}
        if two_keys:
            row["shard"] = i // 37
        row["total"] = rng.choice([None, rng.randint(-(10**9), 10**9)])
        row["recent"] = rng.choice([None, [], [rng.randint(0, 9) for _ in range(rng.randint(1, 4))]])
        row["parity"] = rng.choice([None, [("even", rng.randint(0, 9)), ("odd", rng.randint(0, 9))]])
        rows.append(row)
    rows.append({"user": "ghost", **({"shard": 0} if two_keys else {}), "total": None, "recent": None, "parity": None})
    return pd.DataFrame(rows)


def _expected(frame: pd.DataFrame, keys: list[str]) -> dict[tuple[Any, ...], dict[str, Any]]:
    out = {}
    for r in frame.to_dict("records"):
        v = {"total": None if pd.isna(r["total"]) else int(r["total"]), "recent": r["recent"], "parity": dict(r["parity"]) if r["parity"] is not None else None}
        if any(x is not None for x in v.values()):
            out[tuple(r[k] for k in keys)] = v
    return out


def _restored(sp: Path | str, path: Path | str, keys: tuple[tuple[str, pa.DataType], ...], m: int) -> dict[tuple[Any, ...], dict[str, Any]]:
    jd = JobDir(path)
    jd.claim("job", m, m)
    man = restore_savepoint(sp, jd, "job", {"op": OperatorSpec(keys, STATES)})
    op = man.operators["op"]
    t = KeyedStateTable([k for k, _ in keys], [t for _, t in keys], STATES)
    for f in op.files:
        t.apply(read_state_slice(jd.store, f, f.range, verify=True))
    out = {}
    types = [spark for spark in ("string", "long")][: len(keys)]
    for r in t.to_arrow().to_pylist():
        key = tuple(r[k] for k, _ in keys)
        assert r[KG_COLUMN] == key_group_of(list(key), types, m)
        out[key] = {"total": r["total"], "recent": r["recent"], "parity": dict(r["parity"]) if r["parity"] is not None else None}
    return out


@pytest.mark.parametrize("two_keys", [False, True])
@pytest.mark.parametrize("kind", ["pandas", "arrow"])
def test_bootstrap_local_then_restore(tmp_path: Path, kind: str, two_keys: bool) -> None:
    frame = _reference(200, two_keys=two_keys)
    keys = ["user", "shard"] if two_keys else ["user"]
    data: Any = frame
    if kind == "arrow":
        data = pa.Table.from_pandas(frame, preserve_index=False, schema=_schema(two_keys))
    calls: list[tuple[str, int, int]] = []
    sp = Path(write_savepoint_from_dataframes(tmp_path / "sp", "job", {"op": (data, keys, STATE_TYPES)}, 16, rows_per_file=30, progress=lambda *a: calls.append(a)))
    info = read_savepoint(sp)
    assert (info.batch, info.source, info.origin) == (-1, None, "bootstrap")
    op = info.operators["op"]
    assert op.states == STATES and op.max_parallelism == 16 and op.parallelism is None and len(op.files) > 2
    assert calls[-1][1] == calls[-1][2] == len(op.files)
    key_cols = (("user", pa.string()), ("shard", pa.int64()))[: len(keys)]
    assert op.key_columns == key_cols
    assert not (sp / "source").exists()
    assert _restored(sp, tmp_path / "job", key_cols, 16) == _expected(frame, keys)


def test_bootstrap_refuses_bad_input(tmp_path: Path) -> None:
    frame = pd.DataFrame({"user": ["a", "b", "a"], "total": [1, 2, 3]})
    with pytest.raises(InputDataError, match=r"operator 'op': 1 rows repeat a key \(e.g. \('a',\)\)"):
        write_savepoint_from_dataframes(tmp_path / "sp", "job", {"op": (frame, ["user"], {"total": "long"})}, 16)
    frame = pd.DataFrame({"user": ["a", None], "total": [1, 2]})
    with pytest.raises(InputDataError, match="key column 'user' has 1 null values"):
        write_savepoint_from_dataframes(tmp_path / "sp", "job", {"op": (frame, ["user"], {"total": "long"})}, 16)
    with pytest.raises(KeyscaleError, match="has no column 'count'"):
        write_savepoint_from_dataframes(tmp_path / "sp", "job", {"op": (frame, ["user"], {"count": "long"})}, 16)
    with pytest.raises(KeyscaleError, match=r"uid '\.\./x' must be a non-empty name of letters, digits, '-' and '_'"):
        write_savepoint_from_dataframes(tmp_path / "sp", "job", {"../x": (frame, ["user"], {"total": "long"})}, 16)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing left behind


def test_bootstrap_value_state_holding_an_array(tmp_path: Path) -> None:
    frame = pd.DataFrame({"k": [1, 2], "v": [[1, 2], [3]]})
    desc = StateDescriptor("v", "value", pa.list_(pa.int64()))
    sp = Path(write_savepoint_from_dataframes(tmp_path / "sp", "job", {"op": (frame, ["k"], {"v": desc})}, 8))
    assert read_savepoint(sp).operators["op"].states == (desc,)
    implied = Path(write_savepoint_from_dataframes(tmp_path / "sp2", "job", {"op": (frame, ["k"], {"v": "array<long>"})}, 8))
    assert read_savepoint(implied).operators["op"].states[0].kind == "list"


def _spark_frame(spark: Any, frame: pd.DataFrame, two_keys: bool) -> Any:
    schema = "user string, " + ("shard long, " if two_keys else "") + "total long, recent array<long>, parity map<string,long>"
    def cell(c: Any, v: Any) -> Any:
        if c == "parity" and v is not None:
            return dict(v)
        if c == "total":
            return None if pd.isna(v) else int(v)
        return v

    rows = [tuple(cell(c, v) for c, v in r.items()) for r in frame.to_dict("records")]
    return spark.createDataFrame(rows, schema)


@pytest.mark.parametrize("two_keys", [False, True])
def test_bootstrap_from_spark_then_read_back(spark: Any, tmp_path: Path, two_keys: bool) -> None:
    frame = _reference(300, seed=4, two_keys=two_keys)
    keys = ["user", "shard"] if two_keys else ["user"]
    df = _spark_frame(spark, frame, two_keys).repartition(3)
    sp = Path(write_savepoint_from_dataframes(tmp_path / "sp", "job", {"op": (df, keys, STATE_TYPES)}, 16, rows_per_file=40))
    info = read_savepoint(sp)
    op = info.operators["op"]
    assert len(op.files) > 3 and op.rows == len(_expected(frame, keys))
    for f in op.files:  # canonical files: sorted, within range, key groups as key_group_of
        t = pq.read_table(sp / f.path)
        rows = t.to_pylist()
        order = [(r["key_group"], *(r[k] for k in keys)) for r in rows]
        assert order == sorted(order) and len(rows) == f.rows
        types = ["string", "long"][: len(keys)]
        assert all(r["key_group"] == key_group_of([r[k] for k in keys], types, 16) for r in rows)
        assert all(f.start <= r["key_group"] <= f.end for r in rows)

    nested = read_keyed_state(spark, sp, "op", flatten=False)
    assert nested.columns == [*keys, "key_group", "total", "recent", "parity"]
    got = {tuple(r[k] for k in keys): {"total": r["total"], "recent": r["recent"], "parity": r["parity"]} for r in nested.collect()}
    assert got == _expected(frame, keys)
    key_cols = (("user", pa.string()), ("shard", pa.int64()))[: len(keys)]
    assert _restored(sp, tmp_path / "job", key_cols, 16) == _expected(frame, keys)

    want = _expected(frame, keys)
    recent = read_keyed_state(spark, sp, "op", state="recent")
    assert recent.columns == [*keys, "key_group", "recent", "recent_index"]
    got_elems = sorted((tuple(r[k] for k in keys), r["recent_index"], r["recent"]) for r in recent.collect())
    want_elems = sorted((k, i, x) for k, v in want.items() for i, x in enumerate(v["recent"] or []))
    assert got_elems == want_elems
    parity = read_keyed_state(spark, sp, "op", state="parity")
    assert parity.columns == [*keys, "key_group", "parity_key", "parity_value"]
    got_entries = sorted((tuple(r[k] for k in keys), r["parity_key"], r["parity_value"]) for r in parity.collect())
    assert got_entries == sorted((k, a, b) for k, v in want.items() for a, b in (v["parity"] or {}).items())
    total = read_keyed_state(spark, sp, "op", state="total")
    assert total.columns == [*keys, "key_group", "total"]
    assert total.count() == sum(1 for v in want.values() if v["total"] is not None)
    with pytest.raises(KeyscaleError, match="pass state='NAME'"):
        read_keyed_state(spark, sp, "op")
    with pytest.raises(StateError, match="no keyed state of operator 'nope'"):
        read_keyed_state(spark, sp, "nope")
    with pytest.raises(StateError, match="has no state 'x'"):
        read_keyed_state(spark, sp, "op", state="x")


def test_spark_bootstrap_refuses_duplicates_and_null_keys(spark: Any, tmp_path: Path) -> None:
    df = spark.createDataFrame([("a", 1), ("b", 2), ("a", 3)], "user string, total long")
    with pytest.raises(InputDataError, match=r"1 rows repeat a key \(e.g. \('a',\)\)"):
        write_savepoint_from_dataframes(tmp_path / "sp", "job", {"op": (df, ["user"], {"total": "long"})}, 16)
    df = spark.createDataFrame([("a", 1), (None, 2)], "user string, total long")
    with pytest.raises(InputDataError, match="key column 'user' has 1 null values"):
        write_savepoint_from_dataframes(tmp_path / "sp", "job", {"op": (df, ["user"], {"total": "long"})}, 16)
    assert list(tmp_path.iterdir()) == []
    # int state column cast to the declared long; an empty frame gives an empty operator
    df = spark.createDataFrame([(1, 5)], "k int, n int")
    sp = Path(write_savepoint_from_dataframes(tmp_path / "sp", "job", {"op": (df, ["k"], {"n": "long"}), "empty": (df.limit(0), ["k"], {"n": "long"})}, 8))
    info = read_savepoint(sp)
    assert info.operators["op"].key_columns == (("k", pa.int32()),)
    assert pq.read_table(sp / info.operators["op"].files[0].path).to_pylist() == [{"k": 1, "key_group": key_group_of([1], ["int"], 8), "n": 5}]
    assert info.operators["empty"].files == ()
    assert read_keyed_state(spark, sp, "empty").count() == 0


# -- reading a checkpoint ---------------------------------------------------------------------


def _checkpoint(path: Path | str, frame: pd.DataFrame, m: int, p: int) -> JobDir:
    """Batch 0 of a job: a snapshot per subtask of ``frame`` (one row per key)."""
    jd = JobDir(path)
    jd.claim("job", m, m)
    table = pa.Table.from_pandas(frame, preserve_index=False, schema=_schema(False))
    kgs = key_groups(table, ["user"], ["string"], m)
    table = table.add_column(1, KG_COLUMN, pa.array(kgs, pa.int32()))
    files = []
    for s, rng in enumerate(key_group_ranges(m, p)):
        part = table.filter(pa.array((kgs >= rng.start) & (kgs <= rng.end))).sort_by(KG_COLUMN)
        files.append(write_state_file(jd.store, f"state/op/000000000000-s{s:05d}-snapshot.arrow", part, "snapshot", 0, rng))
    op = OperatorCheckpoint("op", m, p, (("user", "string"),), tuple(d.to_json() for d in STATES), tuple(files))
    jd.commit(Manifest("job", 0, 1000, {"op": op}))
    (jd.spark_checkpoint / "commits").mkdir(parents=True)
    (jd.spark_checkpoint / "commits" / "0").write_text("v1")
    return jd


def test_read_keyed_state_of_a_checkpoint(spark: Any, tmp_path: Path) -> None:
    frame = _reference(150, seed=9)
    jd = _checkpoint(tmp_path / "job", frame, 16, 3)
    got = {(r["user"],): {"total": r["total"], "recent": r["recent"], "parity": r["parity"]} for r in read_keyed_state(spark, jd.path, "op", flatten=False).collect()}
    assert got == _expected(frame, ["user"])
    assert read_keyed_state(spark, jd.path, "op", state="recent", checkpoint=0).count() == sum(len(v["recent"] or []) for v in got.values())
    with pytest.raises(StateError, match="checkpoint 3 does not exist"):
        read_keyed_state(spark, jd.path, "op", checkpoint=3)
    with pytest.raises(StateError, match="neither a savepoint"):
        read_keyed_state(spark, tmp_path, "op")


# -- re-keying --------------------------------------------------------------------------------


def test_rekey_keeps_every_key_and_value(tmp_path: Path) -> None:
    frame = _reference(400, seed=2)
    jd = _checkpoint(tmp_path / "job", frame, 16, 4)
    man = jd.latest_manifest()
    assert man is not None
    sp = Path(write_savepoint(jd, man, tmp_path / "sp16", rows_per_file=50))
    calls: list[tuple[str, int, int]] = []
    sp32 = Path(rekey_savepoint(sp, tmp_path / "sp32", 32, progress=lambda *a: calls.append(a), rows_per_file=50))
    assert calls[-1][1] == calls[-1][2]
    info = read_savepoint(sp32)
    op = info.operators["op"]
    assert (op.max_parallelism, op.parallelism, info.batch, info.origin) == (32, 4, 0, "rekey")
    assert info.extra["rekeyed_from"]["max_parallelism"] == {"op": 16}
    assert (sp32 / "source" / "spark" / "commits" / "0").read_text() == "v1"
    rows = []
    for f in op.files:
        t = pq.read_table(sp32 / f.path).to_pylist()
        order = [(r["key_group"], r["user"]) for r in t]
        assert order == sorted(order) and all(f.start <= r["key_group"] <= f.end for r in t)
        rows.extend(t)
    assert all(r["key_group"] == key_group_of([r["user"]], ["string"], 32) for r in rows)
    got = {(r["user"],): {"total": r["total"], "recent": r["recent"], "parity": dict(r["parity"]) if r["parity"] is not None else None} for r in rows}
    assert got == _expected(frame, ["user"])
    # restores into a job directory of 32 key groups, not into one of 16
    assert _restored(sp32, tmp_path / "job32", (("user", pa.string()),), 32) == _expected(frame, ["user"])
    with pytest.raises(StateError, match="max parallelism 32"):
        _restored(sp32, tmp_path / "job16", (("user", pa.string()),), 16)
    # and back down again: same content as the original
    sp16 = Path(rekey_savepoint(sp32, tmp_path / "back16", 16))
    a = pa.concat_tables([pq.read_table(sp / f.path) for f in read_savepoint(sp).operators["op"].files])
    b = pa.concat_tables([pq.read_table(sp16 / f.path) for f in read_savepoint(sp16).operators["op"].files])
    assert a.equals(b)


def test_rekey_refuses_an_existing_destination_and_damaged_source(tmp_path: Path) -> None:
    frame = _reference(50)
    sp = Path(write_savepoint_from_dataframes(tmp_path / "sp", "job", {"op": (frame, ["user"], STATE_TYPES)}, 16))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(StateError, match="not empty"):
        rekey_savepoint(sp, tmp_path / "full", 32)
    f = read_savepoint(sp).operators["op"].files[0]
    (sp / f.path).write_bytes(b"x" * f.bytes)
    with pytest.raises(StateError, match=f"{f.path}.*sha256"):
        rekey_savepoint(sp, tmp_path / "sp32", 32)
    assert not (tmp_path / "sp32").exists()


def test_rekey_matches_spark_key_groups(spark: Any, tmp_path: Path) -> None:
    from pyspark.sql import functions as F

    frame = _reference(500, seed=8, two_keys=True)
    df = _spark_frame(spark, frame, True)
    sp = Path(write_savepoint_from_dataframes(tmp_path / "sp", "job", {"op": (df, ["user", "shard"], STATE_TYPES)}, 16))
    sp32 = Path(rekey_savepoint(sp, tmp_path / "sp32", 32))
    state = read_keyed_state(spark, sp32, "op", flatten=False)
    check = state.select("user", "shard", "key_group", "total", F.pmod(F.hash("user", "shard"), F.lit(32)).alias("spark_kg"))
    rows = check.collect()
    assert len(rows) == len(_expected(frame, ["user", "shard"]))
    assert all(r["key_group"] == r["spark_kg"] for r in rows)
    want = _expected(frame, ["user", "shard"])
    assert {(r["user"], r["shard"]): r["total"] for r in rows} == {k: v["total"] for k, v in want.items()}


# -- inspect ----------------------------------------------------------------------------------


def test_inspect_savepoint(tmp_path: Path) -> None:
    frame = _reference(100)
    jd = _checkpoint(tmp_path / "job", frame, 16, 2)
    man = jd.latest_manifest()
    assert man is not None
    sp = Path(write_savepoint(jd, man, tmp_path / "sp", rows_per_file=40))
    text = inspect_savepoint(sp)
    info = read_savepoint(sp)
    op = info.operators["op"]
    lines = text.splitlines()
    assert lines[0] == f"savepoint {sp}"
    assert lines[1].startswith("job 'job', batch 0 (batch time 1970-01-01 00:00:01 UTC), created ")
    assert "operator 'op': max parallelism 16 (ran at parallelism 2)" in lines
    assert "  keys: user string" in lines
    assert "  state total: value of long" in lines
    assert "  state recent: list of long" in lines
    assert "  state parity: map of string -> long" in lines
    assert f"  {op.rows:,} keys, " in text and f" in {len(op.files)} files" in text
    for f in op.files:
        assert any(line.split()[:2] == [f"{f.start}-{f.end}", f"{f.rows:,}"] for line in lines)
    assert lines[-1] == "source positions: source/spark (Spark checkpoint up to batch 0)"
    shutil.rmtree(sp / "source")
    (sp / METADATA_FILE).write_text((sp / METADATA_FILE).read_text().replace('"source": "source/spark"', '"source": null'))
    assert inspect_savepoint(sp).splitlines()[-1].startswith("source positions: none")
    np.testing.assert_equal(len(inspect_savepoint(sp, verify=True)) > 0, True)


# -- on object stores -------------------------------------------------------------------------
#
# Savepoints and job directories on S3 (SeaweedFS, the ``s3_bucket`` fixture), mixed with
# local ones (marked ``s3``).


@pytest.fixture
def bucket(s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("KEYSCALE_SPARK_CACHE", str(tmp_path / "spark-cache"))
    return str(s3_bucket)


def test_bootstrap_and_rekey_on_s3(bucket: str, tmp_path: Path) -> None:
    frame = _reference(120, seed=4)
    sp = write_savepoint_from_dataframes(f"{bucket}/sp16", "job", {"op": (frame, ["user"], STATE_TYPES)}, 16, rows_per_file=30)
    assert sp == f"{bucket}/sp16" and read_savepoint(sp).operators["op"].rows == len(_expected(frame, ["user"]))
    to_local = rekey_savepoint(sp, tmp_path / "sp32", 32, rows_per_file=30)  # S3 -> local
    to_s3 = rekey_savepoint(to_local, f"{bucket}/sp32", 32, rows_per_file=30)  # local -> S3
    a = pa.concat_tables([pq.read_table(Path(to_local) / f.path) for f in read_savepoint(to_local).operators["op"].files])
    info = read_savepoint(to_s3)
    b = pa.concat_tables([pq.read_table(pa.BufferReader(info.store.get(f.path))) for f in info.operators["op"].files])
    assert a.equals(b)
    for where in (f"{bucket}/job32", tmp_path / "job32"):
        assert _restored(to_s3, where, (("user", pa.string()),), 32) == _expected(frame, ["user"])
    with pytest.raises(StateError, match="already holds a savepoint"):
        rekey_savepoint(sp, f"{bucket}/sp32", 32)
    assert inspect_savepoint(to_s3).splitlines()[0] == f"savepoint {bucket}/sp32"


def test_state_processor_on_s3(spark: Any, bucket: str, tmp_path: Path) -> None:
    """A job directory on S3: its checkpoint read as a DataFrame, a savepoint of it on S3 read
    by tasks through the store, restored into job directories on S3 and on local disk at
    another parallelism and read back; a bootstrap from a Spark DataFrame written to S3 by
    Spark's tasks."""
    frame = _reference(150, seed=11)
    want = _expected(frame, ["user"])

    def state(location: str | Path, **kw: Any) -> dict[tuple[Any, ...], dict[str, Any]]:
        rows = read_keyed_state(spark, location, "op", flatten=False, **kw).collect()
        return {(r["user"],): {"total": r["total"], "recent": r["recent"], "parity": r["parity"]} for r in rows}

    jd = _checkpoint(f"{bucket}/job", frame, 16, 3)
    assert state(f"{bucket}/job") == want
    man = jd.latest_manifest()
    assert man is not None
    sp = write_savepoint(jd, man, f"{bucket}/sp", rows_per_file=40)
    assert len(read_savepoint(sp).operators["op"].files) > 1
    assert state(sp) == want
    assert read_keyed_state(spark, sp, "op", state="recent").count() == sum(len(v["recent"] or []) for v in want.values())
    for where in (f"{bucket}/restored", str(tmp_path / "restored")):
        new = JobDir(where)
        new.claim("job", 16, 16)
        m = restore_savepoint(sp, new, "job", {"op": OperatorSpec((("user", pa.string()),), STATES)})
        assert m.batch == 0
        assert state(where) == want
    df = _spark_frame(spark, frame, False)
    boot = write_savepoint_from_dataframes(f"{bucket}/boot", "job", {"op": (df, ["user"], STATE_TYPES)}, 16, rows_per_file=40)
    assert state(boot) == want
