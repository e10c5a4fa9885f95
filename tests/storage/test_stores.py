"""The storage seam's contract, which the commit protocol relies on, on every store.

The local store runs always; the S3 store runs against a real S3-compatible server
(SeaweedFS, started by the tests) when the ``s3_bucket`` fixture is available.
"""

from __future__ import annotations

import os
import pickle
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from keyscale.errors import StorageError
from keyscale.storage import LocalStore, Store, join, open_store
from keyscale.storage.base import check_key
from keyscale.storage.local import atomic_write_bytes, atomic_write_json


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    if request.param == "local":
        yield open_store(tmp_path / "root", "test store")
        return
    try:
        bucket = request.getfixturevalue("s3_bucket")
    except pytest.FixtureLookupError:
        pytest.skip("no S3 server fixture")
    yield open_store(f"{bucket}/root", "test store")


def test_put_get_replace(store: Store) -> None:
    store.put("a/b.json", b"one")
    assert store.get("a/b.json") == b"one" and store.size("a/b.json") == 3
    store.put("a/b.json", b"two, longer")
    assert store.get("a/b.json") == b"two, longer"
    with pytest.raises(FileNotFoundError):
        store.get("a/missing.json")
    assert store.get_or_none("a/missing.json") is None and store.size("a/missing.json") is None


def test_put_file_writes_a_local_file_whole_and_replaces(store: Store, tmp_path: Path) -> None:
    """A large state file is uploaded from disk (a multipart upload on an object store)."""
    src = tmp_path / "big"
    data = os.urandom(70 << 20)  # over the 64 MB multipart threshold
    src.write_bytes(data)
    store.put("state/big.arrow", b"old")
    store.put_file("state/big.arrow", src)
    assert store.size("state/big.arrow") == len(data) and store.get("state/big.arrow") == data


@pytest.mark.s3
def test_a_multipart_upload_one_part_at_a_time(s3_bucket: str, tmp_path: Path) -> None:
    """``upload_concurrency=1``: a file over the multipart threshold still goes up whole."""
    store = open_store(f"{s3_bucket}/root", "test store", {"upload_concurrency": "1"})
    src = tmp_path / "big"
    data = os.urandom(70 << 20)
    src.write_bytes(data)
    store.put_file("state/big.arrow", src)
    assert store.get("state/big.arrow") == data


def test_ranged_reads_at_once_come_back_in_the_order_asked(store: Store) -> None:
    """``get_ranges``: a point lookup's reads of several objects in one round (at once on
    an object store); each answer is its range's bytes, fewer at the object's end; a
    missing object is FileNotFoundError."""
    objects = {f"state/f{i}.arrow": os.urandom(1000 + 97 * i) for i in range(6)}
    for key, data in objects.items():
        store.put(key, data)
    reads = [(key, (7 * i) % 500, 50 + 131 * i) for i, key in enumerate(objects)] + [("state/f2.arrow", 1180, 100)]
    assert store.get_ranges(reads) == [objects[k][a : a + n] for k, a, n in reads]
    assert store.get_ranges([]) == []
    with pytest.raises(FileNotFoundError):
        store.get_ranges([("state/f0.arrow", 0, 10), ("state/missing.arrow", 0, 10)])


def test_create_only_if_absent(store: Store) -> None:
    assert store.create("checkpoints/manifest-1.json", b"first")
    assert not store.create("checkpoints/manifest-1.json", b"second")
    assert store.get("checkpoints/manifest-1.json") == b"first"


def test_concurrent_creates_have_exactly_one_winner(store: Store) -> None:
    results: list[bool] = []
    barrier = threading.Barrier(4)

    def attempt(i: int) -> None:
        barrier.wait()
        results.append(store.create("epochs/0000000002.json", f"writer {i}".encode()))

    threads = [threading.Thread(target=attempt, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [False] * 3 + [True]
    assert store.get("epochs/0000000002.json").startswith(b"writer ")


def test_list_is_recursive_sorted_and_names_are_one_level(store: Store) -> None:
    for key in ("state/op/2.arrow", "state/op/1.arrow", "state/other/x.arrow", "checkpoints/manifest-3.json", "job.json"):
        store.put(key, b"x")
    assert [o.key for o in store.list("state")] == ["state/op/1.arrow", "state/op/2.arrow", "state/other/x.arrow"]
    assert store.list_names("state") == ["op", "other"]
    assert store.list_names("") == ["checkpoints", "job.json", "state"]
    assert store.list("nothing-here") == [] and store.list_names("nothing-here") == []


def test_delete_copy_and_sub(store: Store) -> None:
    store.put("a/1", b"1")
    store.put("a/2", b"2")
    store.copy("a/1", "b/1")
    store.delete("a/1")
    store.delete("a/never-there")
    assert [o.key for o in store.list("")] == ["a/2", "b/1"]
    sub = store.sub("b")
    assert sub.get("1") == b"1" and sub.url("1") == store.url("b/1")
    assert store.delete_prefix("a") == 1 and [o.key for o in store.list("")] == ["b/1"]


def test_a_store_travels_to_tasks_by_pickle(store: Store) -> None:
    store.put("x", b"data")
    again = pickle.loads(pickle.dumps(store))
    assert again.get("x") == b"data" and again.uri == store.uri


def test_keys_never_leave_their_root(store: Store) -> None:
    for bad in ("../escape", "/abs", "a/../../b"):
        with pytest.raises(StorageError, match="invalid object key"):
            store.put(bad, b"x")


@given(st.lists(st.from_regex(r"[a-z0-9_.-]{1,8}", fullmatch=True).filter(lambda p: p not in (".", "..")), min_size=1, max_size=4))
def test_join_and_check_key_agree(parts: list[str]) -> None:
    key = join(*parts)
    assert check_key(key) == key == "/".join(parts)


def test_local_writes_leave_no_temp_file_and_a_failed_write_keeps_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "x.bin"
    atomic_write_bytes(path, b"one")
    atomic_write_bytes(path, b"two, longer", durable=False)
    atomic_write_json(tmp_path / "y.json", {"b": 1, "a": [1, 2]})
    assert path.read_bytes() == b"two, longer" and (tmp_path / "y.json").read_text().startswith("{")
    with pytest.raises(TypeError):
        atomic_write_bytes(path, "not bytes")  # type: ignore[arg-type]
    assert path.read_bytes() == b"two, longer"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.bin", "y.json"]


def test_private_local_objects_are_owner_only(tmp_path: Path) -> None:
    s = LocalStore(tmp_path)
    s.put("control/secret", b"token", private=True)
    assert (tmp_path / "control" / "secret").stat().st_mode & 0o777 == 0o600
