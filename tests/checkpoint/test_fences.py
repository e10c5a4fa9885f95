"""Fences in snapshots (keyscale.state.order, keyscale.checkpoint.files): a point lookup that
reads only the record batch its key's fences select finds exactly what a read of the key's
whole key group finds, for keys present, absent, repeated (a window operator's rows of one
key, several rows of one key in a file) and straddling record batch boundaries; files
without fences (deltas, files written before fences) read as before."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import keyscale.checkpoint.files as files
from keyscale.checkpoint.encode import (
    encode_state_file,
    put_state_file,
    spill_state_file,
    write_state_file,
)
from keyscale.checkpoint.files import read_key_groups_ranged
from keyscale.state.keygroups import KeyGroupRange
from keyscale.state.order import order_rows, sort_keys
from keyscale.state.table import KG_COLUMN, KeyedStateTable
from keyscale.state.types import StateDescriptor
from keyscale.storage import LocalStore
from keyscale.storage.scratch import remove_scratch

REL = "state/op/000000000003-s00000-snapshot.arrow"
M = 8

# Keys that stress the sub key: short (fewer than 8 bytes), empty, equal last bytes, non-ASCII.
_text = st.one_of(st.text(max_size=3), st.sampled_from(["", "a", "ab", "x-00000001", "y-00000001", "é", "é-00000001"]),
                  st.integers(0, 10**6).map(lambda i: f"user-{i:09d}"))


def _probe(kg: int, key: object, t: pa.DataType) -> int:
    return int(sort_keys(np.array([kg]), pa.array([key], type=t))[0])


def _file_table(keys: list[object], t: pa.DataType, kgs: list[int]) -> pa.Table:
    """Rows (key, kg, n) in file order: key group, then sub key; n numbers the rows."""
    table = pa.table({"key": pa.array(keys, t), KG_COLUMN: pa.array(kgs, pa.int32()), "n": pa.array(range(len(keys)), pa.int64())})
    return table.take(pa.array(order_rows(np.array(kgs), table.column("key"))))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    data=st.data(),
    strings=st.booleans(),
    chunk=st.integers(2, 9),
    spill=st.booleans(),
)
def test_a_lookup_through_fences_finds_what_its_whole_key_group_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, data: st.DataObject, strings: bool, chunk: int, spill: bool,
) -> None:
    monkeypatch.setattr(files, "CHUNK_ROWS", chunk)  # many record batches, keys across their boundaries
    t = pa.string() if strings else pa.int64()
    values = st.one_of(_text, st.none()) if strings else st.one_of(st.integers(-5, 5), st.integers(-(2**63), 2**63 - 1), st.none())
    distinct = data.draw(st.lists(values, min_size=1, max_size=25, unique=True))
    repeats = data.draw(st.lists(st.integers(1, 4), min_size=len(distinct), max_size=len(distinct)))  # a key's rows: windows
    groups = data.draw(st.lists(st.integers(0, M - 1), min_size=len(distinct), max_size=len(distinct)))
    keys = [k for k, r in zip(distinct, repeats, strict=True) for _ in range(r)]
    kgs = [g for g, r in zip(groups, repeats, strict=True) for _ in range(r)]
    table = _file_table(keys, t, kgs)
    rng = KeyGroupRange(0, M - 1)
    store = LocalStore(tmp_path / str(data.draw(st.integers(0, 10**9))))
    if spill:
        cuts = sorted(set(data.draw(st.lists(st.integers(0, table.num_rows), max_size=4))) | {0, table.num_rows})
        parts = [table.slice(a, b - a) for a, b in itertools.pairwise(cuts)]
        f, path = spill_state_file(REL, parts, table.schema, "snapshot", 3, rng, ordered=True)
        put_state_file(store, REL, path)
        remove_scratch(path.parent)
    else:
        f = write_state_file(store, REL, table, "snapshot", 3, rng)
    meta = pa.ipc.open_file(pa.memory_map(str(store.path(REL)))).schema.metadata
    assert (b"keyscale.fences" in meta) == (table.num_rows > chunk)  # in file order: fenced
    absent = data.draw(values)
    for key, kg in [*zip(distinct, groups, strict=True), (absent, data.draw(st.integers(0, M - 1)))]:
        whole = read_key_groups_ranged(store, f, KeyGroupRange(kg, kg))
        fenced = read_key_groups_ranged(store, f, KeyGroupRange(kg, kg), probe=_probe(kg, key, t))
        assert fenced.num_rows <= whole.num_rows
        assert set(fenced.column(KG_COLUMN).to_pylist()) <= {kg}
        want = [r for r in whole.to_pylist() if r["key"] == key]  # (a null key: its rows too)
        assert [r for r in fenced.to_pylist() if r["key"] == key] == want


def test_fences_select_one_small_record_batch_of_a_large_key_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(files, "CHUNK_ROWS", 100)
    keys = [f"user-{i:09d}" for i in range(5000)]
    table = _file_table(keys, pa.string(), [i % 2 for i in range(5000)])
    store = LocalStore(tmp_path)
    f = write_state_file(store, REL, table, "snapshot", 3, KeyGroupRange(0, 1))
    for key in keys[:50]:
        kg = int(keys.index(key) % 2)
        got = read_key_groups_ranged(store, f, KeyGroupRange(kg, kg), probe=_probe(kg, key, pa.string()))
        assert key in got.column("key").to_pylist() and got.num_rows <= 200  # one batch, two at a tie on its edge
        assert read_key_groups_ranged(store, f, KeyGroupRange(kg, kg)).num_rows == 2500


def test_rows_out_of_file_order_and_old_files_have_no_fences_and_read_whole_key_groups(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A delta (key-group order only) gets no fences, and neither does a file of a rule this
    code does not know: a lookup with a probe reads their key group whole."""
    monkeypatch.setattr(files, "CHUNK_ROWS", 10)
    keys = [f"k{i}" for i in range(200)]
    table = pa.table({"key": keys, KG_COLUMN: pa.array([0] * 200, pa.int32())})  # by name, not by sub key
    assert (np.diff(sort_keys(np.zeros(200), table.column("key"))) < 0).any()
    store = LocalStore(tmp_path)
    f = write_state_file(store, REL, table, "delta", 3, KeyGroupRange(0, 0))
    assert b"keyscale.fences" not in pa.ipc.open_file(pa.memory_map(str(store.path(REL)))).schema.metadata
    assert read_key_groups_ranged(store, f, KeyGroupRange(0, 0), probe=_probe(0, "k7", pa.string())).num_rows == 200
    # Fences of another rule (a future sub key): ignored.
    ordered = _file_table(keys, pa.string(), [0] * 200)
    entry, data = encode_state_file(REL, ordered, "snapshot", 3, KeyGroupRange(0, 0))
    reader = pa.ipc.open_file(pa.BufferReader(data))
    meta = dict(reader.schema.metadata)
    assert json.loads(meta[b"keyscale.fences"])
    meta[b"keyscale.fence_rule"] = b"99"
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, reader.schema.with_metadata(meta)) as w:
        for i in range(reader.num_record_batches):
            w.write_batch(reader.get_batch(i))
    raw = sink.getvalue().to_pybytes()
    store.put(REL, raw)
    other = type(entry)(**{**entry.__dict__, "bytes": len(raw)})
    assert read_key_groups_ranged(store, other, KeyGroupRange(0, 0), probe=_probe(0, "k7", pa.string())).num_rows == 200


def test_a_snapshot_of_a_state_table_is_in_file_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the snapshot path hands ``spill_state_file(ordered=True)``: KeyedStateTable.arrow_parts
    in key group, then sub key order, across its parts."""
    count = StateDescriptor("count", "value", pa.int64())
    t = KeyedStateTable(["user", "shard"], [pa.string(), pa.int32()], [count])
    rng = np.random.default_rng(5)
    n = 3000
    rows = pa.table({"user": [f"u{i}" for i in rng.permutation(n)], "shard": pa.array(rng.integers(0, 3, n), pa.int32()),
                     KG_COLUMN: pa.array(rng.integers(0, 16, n), pa.int32()), "count": pa.array(rng.integers(0, 9, n))})
    t.apply(rows)
    parts = list(t.arrow_parts(t.rows_in_range(0, 15), chunk=700))
    whole = pa.concat_tables(parts)
    keys = sort_keys(whole.column(KG_COLUMN).to_numpy(), whole.column("user"))
    assert whole.num_rows == n and (np.diff(keys) >= 0).all()
