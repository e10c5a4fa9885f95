"""A conditional create that landed but was answered with an error (issue 32, case 8).

The client retries the PUT, the retry finds the object the first try created and gets
412: "exists". Read back, the object is this writer's: the commit stands, the Parquet sink
keeps its files. A real SeaweedFS server behind :class:`keyscale.storage.faultproxy.FaultProxy`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from keyscale.checkpoint.jobdir import JobDir
from keyscale.checkpoint.lineage import Lineage
from keyscale.checkpoint.manifest import Manifest
from keyscale.sinks.base import SinkContext
from keyscale.sinks.parquet import ParquetSink, read_output
from keyscale.storage import ObjectStore, open_store
from keyscale.storage.faultproxy import FaultProxy, Rule


@pytest.fixture
def proxy(s3_server: Any) -> Iterator[FaultProxy]:
    p = FaultProxy(s3_server.endpoint_url)
    try:
        yield p
    finally:
        p.stop()


def _via(proxy: FaultProxy, uri: str) -> ObjectStore:
    store = open_store(uri, "test", {"endpoint": proxy.url})
    assert isinstance(store, ObjectStore)
    return store


def test_a_create_answered_with_an_error_after_it_landed_is_this_writers(s3_bucket: str, proxy: FaultProxy) -> None:
    store = _via(proxy, f"{s3_bucket}/x")
    proxy.rules.append(Rule("PUT", "mine", conditional=True, times=1))
    assert store.create("mine", b"unique-bytes")
    assert proxy.failed, "the proxy did not fail the create: the test proves nothing"
    assert not store.create("mine", b"other-bytes")  # someone else's object stays someone else's
    assert store.get("mine") == b"unique-bytes"


def test_a_commit_whose_answer_was_lost_stands(s3_bucket: str, proxy: FaultProxy) -> None:
    jd = JobDir(_via(proxy, f"{s3_bucket}/job"))
    jd.claim("j", 8, 8)
    jd.lock()
    proxy.rules.append(Rule("PUT", "manifest-", conditional=True, times=1))
    jd.commit(Manifest(job="j", batch=0, batch_time_ms=int(time.time() * 1000), operators={}, created_ms=1, extra={"epoch": jd.epoch}))
    assert proxy.failed
    assert JobDir(open_store(f"{s3_bucket}/job", "test")).manifest_batches() == [0]


def test_the_parquet_sink_keeps_its_files_when_its_markers_answer_was_lost(spark: Any, s3_bucket: str, proxy: FaultProxy) -> None:
    sink = ParquetSink(_via(proxy, f"{s3_bucket}/out"))
    sink.open(SinkContext(Lineage("me"), "j", "jd", "run", -1))
    proxy.rules.append(Rule("PUT", "_keyscale.json", conditional=True, times=1))
    assert sink.write(spark.createDataFrame([("a", 1), ("b", 2)], "k string, n long").repartition(2), 0) == 2
    assert proxy.failed
    out = read_output(open_store(f"{s3_bucket}/out", "test")).to_pandas()
    assert sorted(zip(out.k, out.n, strict=True)) == [("a", 1), ("b", 2)]


def test_the_proxy_changes_nothing_but_the_answers_it_fails(s3_bucket: str, proxy: FaultProxy, tmp_path: Any) -> None:
    """What the chaos bench relies on: objects written through the proxy, whose answers it
    drops now and then, read back whole, with their sizes (HEAD) and in listings."""
    import os

    store = _via(proxy, f"{s3_bucket}/p")
    proxy.rules.append(Rule("PUT", "", None, times=None, chance=0.3))
    written = {}
    for i in range(8):
        written[f"small-{i}"] = os.urandom(100 + i)
        store.put(f"small-{i}", written[f"small-{i}"])
        src = tmp_path / f"big-{i}"
        src.write_bytes(os.urandom(200_000 + i))
        store.put_file(f"big-{i}", src)  # streamed from the file
        written[f"big-{i}"] = src.read_bytes()
    assert proxy.failed
    assert {k: (store.get(k), store.size(k)) for k in written} == {k: (v, len(v)) for k, v in written.items()}
    assert sorted((o.key, o.size) for o in store.list("")) == sorted((k, len(v)) for k, v in written.items())
