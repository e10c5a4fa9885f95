"""State files (Arrow IPC indexed by key group)."""

from __future__ import annotations

import itertools
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keyscale.checkpoint.encode import (
    encode_state_file,
    kg_index,
    put_state_file,
    spill_state_file,
    write_state_file,
)
from keyscale.checkpoint.files import CHUNK_ROWS, read_state_slice, verify_state_file
from keyscale.checkpoint.manifest import StateFile
from keyscale.checkpoint.uploads import UPLOADING, heartbeat, record_upload_failure, wait_stored
from keyscale.errors import StateError
from keyscale.state.keygroups import KeyGroupRange
from keyscale.state.order import order_rows
from keyscale.state.table import KG_COLUMN, KeyedStateTable
from keyscale.state.types import StateDescriptor
from keyscale.storage import LocalStore
from keyscale.storage.scratch import remove_scratch, scratch_children, scratch_dir

REL = "state/op/000000000003-s00001-delta.arrow"


def _state_table() -> pa.Table:
    """Keys in key groups 10..19 (none in 13 and 17), several keys per group, sorted by key group."""
    kgs, keys, counts, tags = [], [], [], []
    for kg in range(10, 20):
        if kg in (13, 17):
            continue
        for j in range(kg % 3 + 1):
            kgs.append(kg)
            keys.append(f"k{kg}-{j}")
            counts.append(None if j == 1 else kg * 10 + j)
            tags.append([kg, j])
    return pa.table({
        "key": pa.array(keys, pa.string()),
        KG_COLUMN: pa.array(kgs, pa.int32()),
        "count": pa.array(counts, pa.int64()),
        "tags": pa.array(tags, pa.list_(pa.int64())),
    })


@pytest.fixture
def written(tmp_path: Path) -> tuple[Path, StateFile, pa.Table]:
    table = _state_table()
    f = write_state_file(tmp_path, REL, table, "delta", 3, KeyGroupRange(10, 19))
    return tmp_path, f, table


def test_write_returns_its_manifest_entry(written: tuple[Path, StateFile, pa.Table]) -> None:
    job_dir, f, table = written
    path = job_dir / REL
    assert (f.path, f.batch, f.kind, f.start, f.end, f.rows) == (REL, 3, "delta", 10, 19, table.num_rows)
    assert f.bytes == path.stat().st_size
    assert f.crc32 == zlib.crc32(path.read_bytes())
    assert verify_state_file(job_dir, f) is None
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp file left


def test_read_whole_file_round_trips(written: tuple[Path, StateFile, pa.Table]) -> None:
    job_dir, f, table = written
    got = read_state_slice(job_dir, f, KeyGroupRange(0, 100), verify=True)
    assert got.to_pylist() == table.to_pylist()
    assert got.schema.remove_metadata() == table.schema


@pytest.mark.parametrize(
    ("start", "end"),
    [(10, 10), (11, 12), (12, 14), (13, 13), (13, 17), (15, 19), (19, 19), (0, 11), (18, 40), (0, 9), (20, 30)],
)
def test_read_slice_returns_only_the_requested_key_groups(written: tuple[Path, StateFile, pa.Table], start: int, end: int) -> None:
    job_dir, f, table = written
    got = read_state_slice(job_dir, f, KeyGroupRange(start, end))
    want = [r for r in table.to_pylist() if start <= r[KG_COLUMN] <= end]
    assert got.to_pylist() == want


def test_empty_state_file(tmp_path: Path) -> None:
    table = _state_table().slice(0, 0)
    f = write_state_file(tmp_path, REL, table, "snapshot", 0, KeyGroupRange(0, 7))
    assert f.rows == 0 and f.kind == "snapshot"
    got = read_state_slice(tmp_path, f, KeyGroupRange(0, 7), verify=True)
    assert got.num_rows == 0 and got.column_names == table.column_names


def test_round_trip_through_the_state_table(tmp_path: Path) -> None:
    states = [
        StateDescriptor("n", "value", pa.int64()),
        StateDescriptor("xs", "list", pa.string()),
        StateDescriptor("m", "map", pa.int64(), map_key_type=pa.string()),
    ]
    t = KeyedStateTable(["key", "id"], [pa.string(), pa.int64()], states)
    keys = [np.array(["a", "b", "c", "a"], dtype=object), np.array([1, 1, 2, 2], dtype=np.int64)]
    kgs = np.array([5, 2, 7, 2], dtype=np.int32)
    t.upsert(keys, kgs, {
        "n": (np.array([1, 2, 0, 4]), np.array([True, True, False, True])),
        "xs": (np.array([["x"], None, ["y", "z"], []], dtype=object), np.array([True, False, True, True])),
        "m": (np.array([{"p": 1}, {}, None, {"q": 2, "r": 3}], dtype=object), np.array([True, True, False, True])),
    })
    f = write_state_file(tmp_path, REL, t.to_arrow(), "snapshot", 9, KeyGroupRange(0, 7))
    back = KeyedStateTable(["key", "id"], [pa.string(), pa.int64()], states)
    back.apply(read_state_slice(tmp_path, f, KeyGroupRange(0, 7), verify=True))
    assert back.to_arrow().to_pylist() == t.to_arrow().to_pylist()
    part = KeyedStateTable(["key", "id"], [pa.string(), pa.int64()], states)
    part.apply(read_state_slice(tmp_path, f, KeyGroupRange(2, 5)))
    assert sorted(r["key"] + str(r["id"]) for r in part.to_arrow().to_pylist()) == ["a1", "a2", "b1"]


def test_missing_file_raises_state_error_naming_the_path(written: tuple[Path, StateFile, pa.Table]) -> None:
    job_dir, f, _ = written
    (job_dir / REL).unlink()
    with pytest.raises(StateError, match=r"000000000003-s00001-delta\.arrow is missing"):
        read_state_slice(job_dir, f, KeyGroupRange(10, 19))
    assert "missing" in (verify_state_file(job_dir, f) or "")


def test_truncated_file_raises_state_error_naming_the_path(written: tuple[Path, StateFile, pa.Table]) -> None:
    job_dir, f, _ = written
    path = job_dir / REL
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(StateError, match=rf"{path}.*damaged.*size {len(data) // 2}.*{f.bytes}"):
        read_state_slice(job_dir, f, KeyGroupRange(10, 19))
    problem = verify_state_file(job_dir, f)
    assert problem is not None and REL in problem and str(f.bytes) in problem


def test_size_mismatch_raises_state_error(written: tuple[Path, StateFile, pa.Table]) -> None:
    job_dir, f, _ = written
    (job_dir / REL).write_bytes((job_dir / REL).read_bytes() + b"\0")
    with pytest.raises(StateError, match=rf"{job_dir / REL}.*damaged"):
        read_state_slice(job_dir, f, KeyGroupRange(10, 19))


def test_unreadable_file_of_the_recorded_size_raises_state_error(written: tuple[Path, StateFile, pa.Table]) -> None:
    job_dir, f, _ = written
    path = job_dir / REL
    path.write_bytes(b"x" * f.bytes)  # right size, not Arrow
    with pytest.raises(StateError, match=rf"{path}.*unreadable"):
        read_state_slice(job_dir, f, KeyGroupRange(10, 19))


def test_flipped_byte_is_detected_by_crc(written: tuple[Path, StateFile, pa.Table]) -> None:
    job_dir, f, _ = written
    path = job_dir / REL
    data = bytearray(path.read_bytes())
    for i in (len(data) // 3, len(data) // 2, len(data) - 20):
        damaged = bytearray(data)
        damaged[i] ^= 0x10
        path.write_bytes(bytes(damaged))
        problem = verify_state_file(job_dir, f)
        assert problem is not None and REL in problem and "checksum" in problem
        with pytest.raises(StateError, match=rf"{path}.*checksum"):
            read_state_slice(job_dir, f, KeyGroupRange(10, 19), verify=True)
    path.write_bytes(bytes(data))
    assert verify_state_file(job_dir, f) is None


def test_kg_index() -> None:
    kgs = np.array([3, 3, 5, 6, 6, 6], dtype=np.int32)
    assert kg_index(kgs, 0, 7) == [[3, 0, 2], [5, 2, 1], [6, 3, 3]]
    assert kg_index(kgs, 5, 5) == [[5, 2, 1]]
    assert kg_index(np.empty(0, dtype=np.int32), 0, 7) == []


def test_a_few_key_groups_of_a_large_file_on_an_object_store_are_read_by_range(
    s3_bucket: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    """A key group that moved to another subtask reads its rows, not the whole file."""
    from keyscale.checkpoint import files
    from keyscale.storage import open_store

    monkeypatch.setattr(files, "CHUNK_ROWS", 500)
    monkeypatch.setattr(files, "RANGED_MIN_BYTES", 0)
    rng = np.random.default_rng(3)
    kgs = np.sort(rng.integers(0, 128, 20_000)).astype(np.int32)
    table = pa.table({"key": pa.array([f"key-{i:08d}" for i in range(len(kgs))]), KG_COLUMN: pa.array(kgs),
                      "count": pa.array(rng.integers(0, 1000, len(kgs)))})
    store = open_store(f"{s3_bucket}/job", "job directory")
    f = write_state_file(store, REL, table, "snapshot", 3, KeyGroupRange(0, 127))
    # Compressed on an object store (LZ4: what a ranged read there fetches is what it decodes);
    # the same table on local disk is written as it is, to be memory-mapped.
    local = write_state_file(tmp_path, REL, table, "snapshot", 3, KeyGroupRange(0, 127))
    assert f.bytes < 0.7 * local.bytes and f.rows == local.rows
    for lo, hi in [(0, 0), (5, 9), (64, 127), (127, 127), (40, 41)]:
        store.requests.clear()
        got = read_state_slice(store, f, KeyGroupRange(lo, hi))
        want = table.filter((table.column(KG_COLUMN).to_numpy() >= lo) & (table.column(KG_COLUMN).to_numpy() <= hi))
        assert got.to_pylist() == want.to_pylist()
        assert store.requests["get"] == 0 and store.requests["get_range"] >= 1
    # The whole range is one plain read.
    store.requests.clear()
    assert read_state_slice(store, f, KeyGroupRange(0, 127)).num_rows == table.num_rows
    assert store.requests["get"] == 1 and store.requests["get_range"] == 0


def test_a_state_file_that_cannot_be_written_is_a_storage_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A task that cannot write a local job directory (on a cluster: a folder on the driver's
    disk the executor does not share) fails naming the file, its user and host, and what
    to do; not with a raw PermissionError the batch blames on the operator."""
    from keyscale.errors import StorageError
    from keyscale.storage import LocalStore

    def denied(self: LocalStore, key: str, data: bytes, durable: bool = True, private: bool = False) -> None:
        raise PermissionError(13, "Permission denied", str(self.path(key)))

    monkeypatch.setattr(LocalStore, "put", denied)
    with pytest.raises(StorageError, match=rf"state file: cannot write {tmp_path / REL} as user '.+' on host '.+': Permission denied \(.*use an object store: s3://"):
        write_state_file(tmp_path, REL, _state_table(), "delta", 3, KeyGroupRange(10, 19))


@settings(max_examples=40, deadline=None)
@given(
    kgs=st.lists(st.integers(0, 63), max_size=3 * CHUNK_ROWS // 1000).map(sorted),
    cuts=st.lists(st.integers(0, 400), max_size=6),
    repeat=st.integers(1, 1000),
    compressed=st.booleans(),
)
def test_a_spilled_state_file_is_byte_for_byte_the_encoded_one(kgs: list[int], cuts: list[int], repeat: int, compressed: bool) -> None:
    """A snapshot written in parts to scratch (never whole in memory) is the file the whole
    table would have made: same bytes (its fences too), same manifest entry, whatever the
    parts, compressed or not; and it reads back as the table, by key group too."""
    kg = np.repeat(np.array(kgs, dtype=np.int32), repeat)  # rows past CHUNK_ROWS: several record batches
    table = pa.table({"key": pa.array([f"k{i}" for i in range(len(kg))]), KG_COLUMN: kg,
                      "n": pa.array([None if i % 5 == 0 else i for i in range(len(kg))], pa.int64())})
    table = table.take(pa.array(order_rows(kg, table.column("key"))))  # in file order, as a snapshot writes
    bounds = sorted({0, len(kg), *(min(len(kg), c * repeat) for c in cuts)})
    parts = [table.slice(a, b - a) for a, b in itertools.pairwise(bounds)]
    rng = KeyGroupRange(0, 63)
    entry, data = encode_state_file(REL, table, "snapshot", 7, rng, compressed)
    spilled_entry, path = spill_state_file(REL, parts, table.schema, "snapshot", 7, rng, ordered=True, compressed=compressed)
    try:
        assert spilled_entry == entry
        assert path.read_bytes() == data
        store = LocalStore(path.parent)
        store.put(REL, data)
        assert read_state_slice(store, entry, rng).to_pylist() == table.to_pylist()
        if len(kgs):
            kg0 = KeyGroupRange(kgs[0], kgs[0])
            assert read_state_slice(store, entry, kg0).to_pylist() == table.filter(pa.array(kg == kgs[0])).to_pylist()
    finally:
        remove_scratch(path.parent)


def test_a_spilled_state_file_refuses_rows_out_of_key_group_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEYSCALE_LOCAL_DIR", str(tmp_path))
    t = pa.table({"key": ["a", "b"], KG_COLUMN: pa.array([5, 4], pa.int32())})
    with pytest.raises(StateError, match="not in key-group order"):
        spill_state_file(REL, [t], t.schema, "snapshot", 1, KeyGroupRange(0, 63))
    assert not scratch_children(scratch_dir("spill"))  # nothing left behind


def test_a_spilled_state_file_is_uploaded_from_disk_to_either_store(tmp_path: Path) -> None:
    t = _state_table()
    rng = KeyGroupRange(10, 19)
    entry, path = spill_state_file(REL, [t], t.schema, "snapshot", 3, rng)
    try:
        put_state_file(LocalStore(tmp_path), REL, path)
    finally:
        remove_scratch(path.parent)
    assert verify_state_file(tmp_path, entry) is None
    assert read_state_slice(tmp_path, entry, KeyGroupRange(14, 15)).to_pylist() == t.filter(
        pa.compute.is_in(t[KG_COLUMN], pa.array([14, 15], pa.int32()))).to_pylist()


def test_wait_stored_returns_once_every_file_appears_and_names_the_one_that_never_does(tmp_path: Path) -> None:
    """Asynchronous checkpoints: the commit waits for uploads that outlive their tasks."""
    import threading

    store = LocalStore(tmp_path)
    late, never = StateFile("state/op/3-s0-delta-a.arrow", 3, "delta", 0, 7, 1, 1, 0), StateFile("state/op/3-s1-delta-b.arrow", 3, "delta", 8, 15, 1, 1, 0)
    threading.Timer(0.3, lambda: store.put(late.path, b"x")).start()
    wait_stored(store, [late], 10, "the test")  # appears while it waits
    assert store.exists(late.path)
    with pytest.raises(StateError, match=r"3-s1-delta-b\.arrow of batch 3 was not stored within 0\.2 s .*\(the test\)"):
        wait_stored(store, [late, never], 0.2, "the test")


def test_wait_stored_tells_a_slow_upload_that_beats_from_one_whose_worker_is_gone(tmp_path: Path) -> None:
    """A detached upload's worker can vanish without a failure record (it died; its executor
    was lost, or released by a scale-down). The waiters (the commit, the next batch's tasks)
    fail once its upload has been silent for a while, not after KEYSCALE_UPLOAD_TIMEOUT
    (600 s); an upload that takes longer but beats is waited for."""
    import threading
    import time

    store = LocalStore(tmp_path)
    slow, lost = StateFile("state/op/3-s0-delta-a.arrow", 3, "delta", 0, 7, 1, 1, 0), StateFile("state/op/3-s1-delta-b.arrow", 3, "delta", 8, 15, 1, 1, 0)

    def upload() -> None:
        with heartbeat(store, [slow.path], every=0.1):
            time.sleep(1.5)
            store.put(slow.path, b"x")

    uploader = threading.Thread(target=upload)
    uploader.start()
    wait_stored(store, [slow], 600, "the test", silence=0.6)  # 1.5 s, over twice the silence: its beats keep the wait on
    uploader.join()
    assert store.exists(slow.path) and not store.exists(slow.path + UPLOADING)  # the beats go with the upload
    started = time.monotonic()
    gone = r"3-s1-delta-b\.arrow of batch 3 was not stored and its upload has been silent for \d+ s \(the test\): the Python worker uploading it is gone"
    with pytest.raises(StateError, match=gone):  # never a beat
        wait_stored(store, [lost], 600, "the test", silence=0.6)
    store.put(lost.path + UPLOADING, b'{"beat": 4}')  # beats, then no more
    with pytest.raises(StateError, match=gone):
        wait_stored(store, [lost, slow], 600, "the test", silence=0.6)
    assert time.monotonic() - started < 5


def test_wait_stored_fails_at_once_on_a_failed_upload_and_a_stored_file_wins(tmp_path: Path) -> None:
    """Issue 32, case 9: a detached upload that failed leaves a record beside its file; the
    commit and the next batch's tasks, waiting for the file, fail at once with its error."""
    import time

    store = LocalStore(tmp_path)
    ok, failed = StateFile("state/op/3-s0-delta-a.arrow", 3, "delta", 0, 7, 1, 1, 0), StateFile("state/op/3-s1-delta-b.arrow", 3, "delta", 8, 15, 1, 1, 0)
    store.put(ok.path, b"x")
    assert record_upload_failure(store, failed.path, OSError("the store refused the upload"))
    started = time.monotonic()
    with pytest.raises(StateError, match=r"3-s1-delta-b\.arrow of batch 3 was not stored: its upload failed "
                       r"\(OSError: the store refused the upload\) \(the test\)"):
        wait_stored(store, [ok, failed], 600, "the test")
    assert time.monotonic() - started < 5
    # An upload reported as failed that landed after all: the file is there, the wait is over.
    store.put(failed.path, b"x")
    wait_stored(store, [ok, failed], 600, "the test")
