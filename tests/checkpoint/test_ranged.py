"""Point reads planned from parsed footers (keyscale.checkpoint.ranged): what a plan reads
of a state file, by the byte ranges of its record batches, equals what a read of the whole
key group gives (for a key of a fenced snapshot: that key's rows), for snapshots and deltas
of any size of record batch, compressed or not, on keys present, absent and across batch boundaries; the
footer's record batch blocks are as many as pyarrow reads; a missing or damaged file is an
error naming it. (tests/state_processor/test_lookup.py: a lookup's rounds of reads.)"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import keyscale.checkpoint.encode as encode
import keyscale.checkpoint.files as files
import keyscale.checkpoint.ranged as ranged
from keyscale.checkpoint.encode import write_state_file
from keyscale.checkpoint.files import read_state_slice
from keyscale.checkpoint.ranged import plan_read, read_footers, read_planned
from keyscale.errors import StateError
from keyscale.state.keygroups import KeyGroupRange
from keyscale.state.order import order_rows, sort_keys
from keyscale.state.table import KG_COLUMN
from keyscale.storage import LocalStore

M = 8
_keys = st.one_of(st.text(max_size=4), st.integers(0, 10**6).map(lambda i: f"user-{i:07d}@example.com"))


def _table(keys: list[str], kgs: list[int], ordered: bool) -> pa.Table:
    table = pa.table({"key": pa.array(keys, pa.string()), KG_COLUMN: pa.array(kgs, pa.int32()),
                      "v": pa.array(range(len(keys)), pa.int64()), "tags": pa.array([[k] * (i % 3) for i, k in enumerate(keys)])})
    if ordered:  # a snapshot: key group, then sub key (fenced)
        return table.take(pa.array(order_rows(np.array(kgs), table.column("key"))))
    return table.sort_by(KG_COLUMN)  # a delta: key-group order only


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), chunk=st.integers(1, 9), snapshot=st.booleans(), short_tail=st.booleans(), compressed=st.booleans())
def test_a_planned_read_equals_the_whole_key_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, data: st.DataObject, chunk: int, snapshot: bool, short_tail: bool, compressed: bool,
) -> None:
    monkeypatch.setattr(encode, "compressed_on", lambda store: compressed)  # as on an object store, or not
    monkeypatch.setattr(files, "CHUNK_ROWS", chunk)
    monkeypatch.setattr(files, "DELTA_CHUNK_ROWS", chunk)
    if short_tail:  # a first read shorter than the footer: read again, the footer alone
        monkeypatch.setattr(files, "tail_bytes", lambda f: min(f.bytes, 64))
        monkeypatch.setattr(ranged, "tail_bytes", lambda f: min(f.bytes, 64))
    distinct = data.draw(st.lists(_keys, min_size=1, max_size=40, unique=True))
    groups = data.draw(st.lists(st.integers(0, M - 1), min_size=len(distinct), max_size=len(distinct)))
    table = _table(distinct, groups, snapshot)
    store = LocalStore(tmp_path / str(data.draw(st.integers(0, 10**9))))
    rel = f"state/op/000000000003-s00000-{'snapshot' if snapshot else 'delta'}.arrow"
    f = write_state_file(store, rel, table, "snapshot" if snapshot else "delta", 3, KeyGroupRange(0, M - 1))
    [footer] = read_footers(store, [f])
    reader = pa.ipc.open_file(pa.memory_map(str(store.path(rel))))
    assert len(footer.blocks) == reader.num_record_batches
    absent = data.draw(_keys.filter(lambda k: k not in distinct))
    for key, kg in [*zip(distinct, groups, strict=True), (absent, data.draw(st.integers(0, M - 1)))]:
        rng = KeyGroupRange(kg, kg)
        whole = read_state_slice(store, f, rng)
        plan = plan_read(f, footer, rng)
        got = read_planned(store, [plan])[0] if plan is not None else None
        assert (got.to_pylist() if got is not None else []) == whole.to_pylist()  # the key group, exactly
        probe = int(sort_keys(np.array([kg]), pa.array([key]))[0])
        fenced = plan_read(f, footer, rng, probe)
        rows = read_planned(store, [fenced])[0].to_pylist() if fenced is not None else []
        assert {r[KG_COLUMN] for r in rows} <= {kg}
        assert [r for r in rows if r["key"] == key] == [r for r in whole.to_pylist() if r["key"] == key]
    # Several plans of several key groups in one round, in the order asked.
    plans = [p for p in (plan_read(f, footer, KeyGroupRange(g, g)) for g in range(M)) if p is not None]
    assert [t.to_pylist() for t in read_planned(store, plans)] == [read_state_slice(store, f, p.rng).to_pylist() for p in plans]


def test_a_large_footer_is_read_in_one_request(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A snapshot with fences of ~1,000 record batches (a 10M-key job's slices have ~600):
    # its footer is past TAIL_BYTES, and its first read, sized from the file's rows and key
    # groups, holds it whole.
    monkeypatch.setattr(files, "CHUNK_ROWS", 4)
    store = LocalStore(tmp_path)
    keys = [f"user-{i:07d}@example.com" for i in range(4000)]
    table = _table(keys, [i % M for i in range(len(keys))], ordered=True)
    f = write_state_file(store, "state/op/000000000003-s00000-snapshot.arrow", table, "snapshot", 3, KeyGroupRange(0, M - 1))
    with pa.ipc.open_file(pa.memory_map(str(store.path(f.path)))) as reader:
        assert reader.num_record_batches == 1000
    assert int.from_bytes(store.get_range(f.path, f.bytes - 10, 4), "little") > files.TAIL_BYTES
    asked: list[int] = []
    get_range = store.get_range

    def counted(key: str, start: int, length: int) -> bytes:
        asked.append(length)
        return get_range(key, start, length)

    monkeypatch.setattr(store, "get_range", counted)
    [footer] = read_footers(store, [f])
    assert len(asked) == 1 and asked[0] < f.bytes and len(footer.blocks) == 1000 and footer.fences is not None
    assert files.state_file_tail(store, f)[1] == store.get(f.path)[-asked[0]:] and len(asked) == 2  # the same, in one read


def test_a_missing_or_short_file_is_an_error_naming_it(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    table = _table([f"k{i}" for i in range(50)], [i % M for i in range(50)], True)
    f = write_state_file(store, "state/op/000000000001-s00000-snapshot.arrow", table, "snapshot", 1, KeyGroupRange(0, M - 1))
    [footer] = read_footers(store, [f])
    plan = plan_read(f, footer, KeyGroupRange(2, 2))
    assert plan is not None
    store.path(f.path).unlink()
    with pytest.raises(StateError, match=r"000000000001-s00000-snapshot\.arrow is missing"):
        read_planned(store, [plan])
    with pytest.raises(StateError, match=r"000000000001-s00000-snapshot\.arrow is missing"):
        read_footers(store, [f])
    store.put(f.path, b"x" * 20)
    with pytest.raises(StateError, match=r"000000000001-s00000-snapshot\.arrow is damaged"):
        read_planned(store, [plan])
