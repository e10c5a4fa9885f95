"""The RocksDB backend's pure parts: key encoding order, row codec, range deletes, the store."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keyscale.state.rocksdb import RocksState
from keyscale.state.rockskeys import RowCodec, decode_keys, encode_keys
from keyscale.state.types import StateDescriptor

KGS = st.integers(0, 32767)
INT64 = st.integers(-(2**63), 2**63 - 1)
FLOATS = st.floats(allow_nan=False, width=64)
TEXT = st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=0x2FF), max_size=6)


def _col(values: list, t: pa.DataType):  # type: ignore[no-untyped-def]
    return pa.array(values, type=t)


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(st.tuples(KGS, INT64), min_size=1, max_size=30))
def test_int_keys_sort_by_key_group_then_key_and_decode_back(rows: list[tuple[int, int]]) -> None:
    kgs, ks = zip(*rows, strict=True)
    enc = encode_keys(np.array(kgs), [np.array(ks, dtype=np.int64)], [pa.int64()])
    assert sorted(range(len(rows)), key=lambda i: enc[i]) == sorted(range(len(rows)), key=lambda i: rows[i])
    dk, cols = decode_keys(enc, [pa.int64()])
    assert list(zip(dk.tolist(), cols[0].to_pylist(), strict=True)) == rows


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(st.tuples(KGS, TEXT, FLOATS), min_size=1, max_size=30))
def test_string_then_float_keys_sort_by_key_group_then_key_and_decode_back(rows: list[tuple[int, str, float]]) -> None:
    rows = [(g, s, f + 0.0) for g, s, f in rows]  # -0.0 is the key 0.0
    kgs, ss, fs = zip(*rows, strict=True)
    types = [pa.string(), pa.float64()]
    enc = encode_keys(np.array(kgs), [_col(list(ss), pa.string()), np.array(fs)], types)
    by_bytes = sorted(range(len(rows)), key=lambda i: enc[i])
    by_value = sorted(range(len(rows)), key=lambda i: (rows[i][0], rows[i][1].encode(), rows[i][2]))
    assert [rows[i] for i in by_bytes] == [rows[i] for i in by_value]
    dk, cols = decode_keys(enc, types)
    assert list(zip(dk.tolist(), cols[0].to_pylist(), cols[1].to_pylist(), strict=True)) == rows


@given(a=TEXT, b=TEXT, x=INT64, y=INT64)
def test_a_string_key_column_is_prefix_free(a: str, b: str, x: int, y: int) -> None:
    """("a", x) and ("ab", y) never interleave: a routing key's windows share a prefix."""
    types = [pa.string(), pa.int64()]
    ea, eb = encode_keys(np.array([1, 1]), [_col([a, b], pa.string()), np.array([x, y])], types)
    pa_, pb = encode_keys(np.array([1, 1]), [_col([a, b], pa.string())], [pa.string()])
    assert ea.startswith(pa_) and eb.startswith(pb)
    assert (a == b) == (pa_ == pb)
    if a != b:
        assert not ea.startswith(pb) and not eb.startswith(pa_)


def test_row_codec_round_trips_numeric_and_nested_states_with_nulls() -> None:
    states = [StateDescriptor("n", "value", pa.int64()), StateDescriptor("f", "value", pa.float32()),
              StateDescriptor("l", "list", pa.string()), StateDescriptor("m", "map", pa.int64(), pa.string())]
    c = RowCodec(states)
    lists = np.empty(3, dtype=object)
    lists[:] = [["x", "y"], [], None]
    maps = np.empty(3, dtype=object)
    maps[:] = [{"a": 1}, None, {}]
    cols = {"n": (np.array([1, 0, -7]), np.array([True, False, True])), "f": (np.array([0.5, 1, 2], dtype=np.float32), np.array([True, True, False])),
            "l": (lists, np.array([True, True, False])), "m": (maps, np.array([True, False, True]))}
    vals, ok = c.decode(c.encode(cols, 3))
    for name, (v, k) in cols.items():
        assert ok[name].tolist() == k.tolist()
        assert [x for x, keep in zip(vals[name].tolist(), k, strict=True) if keep] == [x for x, keep in zip(v.tolist(), k, strict=True) if keep]
    assert math.isclose(vals["f"][0], 0.5)


COUNT = [StateDescriptor("n", "value", pa.int64())]


def _store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str = "db") -> RocksState:
    monkeypatch.setenv("KEYSCALE_LOCAL_DIR", str(tmp_path))
    from keyscale.storage.scratch import scratch_dir

    return RocksState(scratch_dir(name), ["k"], [pa.int64()], COUNT, 128, indexed=["n"])


def _put(db: RocksState, kgs: np.ndarray, keys: np.ndarray, n: np.ndarray) -> None:
    w = db.working()
    rows = w.table.upsert([keys], kgs, {"n": (n, np.ones(len(n), dtype=bool))})
    db.write_back(w, rows)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(keys=st.lists(st.tuples(st.integers(0, 127), st.integers(-50, 50)), unique=True, max_size=60),
       drop=st.sets(st.integers(0, 127), max_size=40))
def test_dropping_key_groups_leaves_exactly_the_other_groups_rows_and_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, keys: list[tuple[int, int]], drop: set[int],
) -> None:
    db = _store(tmp_path, monkeypatch, f"drop-{len(keys)}-{len(drop)}-{hash(tuple(keys)) & 0xFFFF}")
    try:
        db.drop_groups(np.arange(128))
        if keys:
            kg, k = (np.array(x) for x in zip(*keys, strict=True))
            _put(db, kg, k, k * 10)
        db.drop_groups(np.array(sorted(drop), dtype=np.int64))
        left = pa.concat_tables([db.working().table.schema().empty_table(), *db.range_parts(0, 127)]).to_pylist()
        assert sorted((r["__kg"], r["k"]) for r in left) == sorted(x for x in keys if x[0] not in drop)
        assert db.counts.tolist() == np.bincount([g for g, _ in keys if g not in drop], minlength=128).tolist()
        w = db.working()
        db.fetch_due(w, "n", 2**62, 0, 127)  # the index lost the dropped groups' entries too
        assert sorted(zip(w.table.kg.tolist(), w.table.to_arrow()["k"].to_pylist(), strict=True)) == sorted(
            (g, k) for g, k in keys if g not in drop)
    finally:
        db.close()


def test_fetch_due_finds_exactly_the_keys_due_after_updates_moved_their_index_entries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    db = _store(tmp_path, monkeypatch)
    _put(db, np.array([1, 1, 2, 5]), np.array([10, 11, 12, 13]), np.array([100, 200, 300, 400]))
    w = db.working()
    db.fetch(w, np.array([1]), [np.array([10])])
    w.freeze()
    w.table.values["n"][0] = 500  # key 10 moves from time 100 to 500
    db.write_back(w, np.array([0]))
    w = db.working()
    db.fetch_due(w, "n", 300, 0, 3)  # key group 5 is outside the range
    assert sorted(w.table.to_arrow()["k"].to_pylist()) == [11, 12]
    w = db.working()
    db.fetch(w, np.array([2]), [np.array([12])])
    w.freeze()
    w.table.valid["n"][0] = False  # deleted: the row and its index entry go
    db.write_back(w, np.array([0]))
    w = db.working()
    db.fetch_due(w, "n", 10**6, 0, 127)
    assert sorted(w.table.to_arrow()["k"].to_pylist()) == [10, 11, 13]
    assert int(db.counts.sum()) == 3
    db.close()


def test_a_database_remembers_its_versions_and_forgets_them_under_another_layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    db = _store(tmp_path, monkeypatch)
    _put(db, np.array([4]), np.array([1]), np.array([1]))
    db.set_versions(0, 63, 7)
    db.close()
    again = _store(tmp_path, monkeypatch)
    assert again.versions[:64].tolist() == [7] * 64 and again.versions[64:].tolist() == [-1] * 64
    again.close()
    from keyscale.storage.scratch import scratch_dir

    other = RocksState(scratch_dir("db"), ["k"], [pa.int64()], [StateDescriptor("m", "value", pa.int64())], 128)
    assert (other.versions == -1).all() and not list(other.range_parts(0, 127))
    other.close()


@settings(max_examples=100, deadline=None)
@given(rows=st.lists(st.tuples(KGS, INT64), min_size=1, max_size=30), strings=st.lists(TEXT, min_size=30, max_size=30))
def test_sorted_encoding_is_the_encodings_in_byte_order(rows: list[tuple[int, int]], strings: list[str]) -> None:
    kgs = np.array([g for g, _ in rows])
    fixed = [np.array([k for _, k in rows], dtype=np.int64)]
    assert encode_keys(kgs, fixed, [pa.int64()], sort=True) == sorted(encode_keys(kgs, fixed, [pa.int64()]))
    var = [_col(strings[: len(rows)], pa.string())]
    assert encode_keys(kgs, var, [pa.string()], sort=True) == sorted(encode_keys(kgs, var, [pa.string()]))
