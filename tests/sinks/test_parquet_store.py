"""The Parquet sink on the storage seam: the same exactly-once protocol on local disk and
on S3 (a SeaweedFS server), with markers as the completion mark and no rename."""

from __future__ import annotations

import io
import json
import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from keyscale.checkpoint.lineage import Lineage, Marker
from keyscale.errors import OutputError
from keyscale.sinks.base import SinkContext
from keyscale.sinks.parquet import (
    MARKER,
    SUPERSEDED,
    BatchMarker,
    OutputFile,
    ParquetSink,
    batch_folder_name,
    read_output,
)
from keyscale.sinks.spark_log import LOG
from keyscale.storage import Store, join, open_store

pytestmark = [pytest.mark.spark]

SCHEMA = "key string, n long"


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def out(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An output location: a local folder, or a fresh prefix of the S3 test bucket."""
    if request.param == "local":
        return str(tmp_path / "out")
    try:
        bucket = request.getfixturevalue("s3_bucket")
    except pytest.FixtureLookupError:
        pytest.skip("no s3_bucket fixture (the SeaweedFS S3 server) in this tree")
    return f"{bucket}/sink-{uuid.uuid4().hex[:8]}"


def ctx(lineage: Lineage, committed: int = -1, job_dir: str = "jd") -> SinkContext:
    return SinkContext(lineage, "j", job_dir, "run", committed)


def rows(location: str | Store) -> list[tuple[Any, ...]]:
    return sorted(tuple(r.values()) for r in read_output(location).to_pylist())


def parquet_bytes(data: dict[str, list[Any]]) -> bytes:
    buf = io.BytesIO()
    pq.write_table(pa.table(data), buf)
    return buf.getvalue()


def test_a_replayed_batch_is_written_once(spark: Any, out: str) -> None:
    sink = ParquetSink(out)
    sink.open(ctx(Lineage("me")))
    assert sink.write(spark.createDataFrame([("a", 1), ("b", 2)], SCHEMA).repartition(3), 0) == 2
    assert sink.write(spark.createDataFrame([("a", 100)], SCHEMA), 0) == -1  # a replay after a crash: kept
    assert sink.write(spark.createDataFrame([("c", 3)], SCHEMA), 1) == 1
    assert rows(out) == [("a", 1, 0), ("b", 2, 0), ("c", 3, 1)]
    # a restarted job (a new sink on the same path, same lineage) replays batch 1: kept too
    again = ParquetSink(out)
    again.open(ctx(Lineage("me"), committed=0))
    assert again.write(spark.createDataFrame([("c", 300)], SCHEMA), 1) == -1
    assert rows(out) == [("a", 1, 0), ("b", 2, 0), ("c", 3, 1)]


def test_an_interrupted_attempt_is_replaced(spark: Any, out: str) -> None:
    """A crash between the tasks' files and the marker leaves a folder without marker:
    readers skip it, and the batch's next write replaces it."""
    store = open_store(out, "test")
    folder = batch_folder_name(4)
    store.put(join(folder, "part-00000-0123456789ab.parquet"), parquet_bytes({"key": ["old"], "n": [-1]}))
    store.put(join(folder, "part-00007-0123456789ab.parquet"), parquet_bytes({"key": ["old7"], "n": [-7]}))
    assert rows(out) == []  # no marker: not a complete batch
    sink = ParquetSink(out)
    sink.open(ctx(Lineage("me"), committed=3))  # an unfinished attempt is no conflict
    assert sink.write(spark.createDataFrame([("a", 1)], SCHEMA), 4) == 1
    assert rows(out) == [("a", 1, 4)]
    marker = BatchMarker.parse(store.get(join(folder, MARKER)))
    assert marker is not None and marker.files is not None
    assert sorted(o.key.rsplit("/", 1)[1] for o in store.list(folder)) == sorted([MARKER, *(f.name for f in marker.files)])


def test_another_lineages_output_is_refused(spark: Any, out: str) -> None:
    first = ParquetSink(out)
    first.open(ctx(Lineage("first"), job_dir="a"))
    first.write(spark.createDataFrame([("a", 1)], SCHEMA), 0)
    second = ParquetSink(out)
    with pytest.raises(OutputError, match="already has batch 0") as e:
        second.open(ctx(Lineage("second"), job_dir="b"))
    assert out.rstrip("/").split("/")[-1] in str(e.value) and "job directory a" in str(e.value)
    # a sink that was never opened against it refuses at write time too, and writes nothing
    late = ParquetSink(out)
    late._ctx = ctx(Lineage("second"), job_dir="b")
    with pytest.raises(OutputError, match="already has batch 0"):
        late.write(spark.createDataFrame([("b", 2)], SCHEMA), 0)
    assert rows(out) == [("a", 1, 0)]


def test_output_of_another_program_is_refused(spark: Any, out: str) -> None:
    store = open_store(out, "test")
    store.put(join(batch_folder_name(0), "part-00000-1b2e-c000.snappy.parquet"), parquet_bytes({"key": ["x"], "n": [0]}))
    with pytest.raises(OutputError, match="without a keyscale lineage marker"):
        ParquetSink(out).open(ctx(Lineage("me")))


def test_an_ancestors_later_batches_are_superseded(spark: Any, out: str) -> None:
    old = ParquetSink(out)
    old.open(ctx(Lineage("old")))
    for b in range(3):
        old.write(spark.createDataFrame([(f"k{b}", b)], SCHEMA), b)
    # restored from the savepoint of batch 0: batches 1 and 2 are recomputed by the new lineage
    new = ParquetSink(out)
    new.open(ctx(Lineage("new", {"old": 0}), committed=0))
    store = open_store(out, "test")
    # (SeaweedFS, like a local disk, may still list the emptied folders: they hold no object)
    assert {o.key.split("/")[0] for o in store.list("")} == {batch_folder_name(0), SUPERSEDED, LOG}
    kept = store.sub(join(SUPERSEDED, "old"))
    assert {o.key.split("/")[0] for o in kept.list("")} == {batch_folder_name(1), batch_folder_name(2)}
    assert rows(kept) == [("k1", 1, 1), ("k2", 2, 2)]  # complete, with their markers
    new.write(spark.createDataFrame([("n1", 10)], SCHEMA), 1)
    assert rows(out) == [("k0", 0, 0), ("n1", 10, 1)]
    marker = BatchMarker.parse(store.get(join(batch_folder_name(1), MARKER)))
    assert marker is not None and marker.marker.lineage == "new"


def test_a_batch_written_meanwhile_by_an_ancestor_is_superseded_at_write(spark: Any, out: str) -> None:
    new = ParquetSink(out)
    new.open(ctx(Lineage("new", {"old": -1})))
    old = ParquetSink(out)
    old.open(ctx(Lineage("old")))
    old.write(spark.createDataFrame([("k0", 0)], SCHEMA), 0)
    assert new.write(spark.createDataFrame([("n0", 1)], SCHEMA), 0) == 1
    assert rows(out) == [("n0", 1, 0)]
    assert rows(open_store(out, "test").sub(join(SUPERSEDED, "old"))) == [("k0", 0, 0)]


def test_read_output_reads_only_marked_batches_and_their_listed_files(spark: Any, out: str) -> None:
    sink = ParquetSink(out)
    sink.write(spark.createDataFrame([("a", 1)], SCHEMA), 0)
    sink.write(spark.createDataFrame([], SCHEMA), 1)
    store = open_store(out, "test")
    store.put(join(batch_folder_name(0), "part-00009-ffffffffffff.parquet"), parquet_bytes({"key": ["stray"], "n": [0]}))
    store.put(join(batch_folder_name(2), "part-00000-ffffffffffff.parquet"), parquet_bytes({"key": ["unfinished"], "n": [0]}))
    table = read_output(out)
    assert table.column_names == ["key", "n", "batch"] and table.schema.field("batch").type == pa.int64()
    assert rows(out) == [("a", 1, 0)]
    # output of the rename protocol (a marker without a file list): every Parquet file is the batch
    legacy = batch_folder_name(3)
    store.put(join(legacy, "part-00000-1b2e-c000.snappy.parquet"), parquet_bytes({"key": ["old"], "n": [5]}))
    store.put(join(legacy, MARKER), json.dumps(Marker("me", batch=3).to_json()).encode())
    assert rows(out) == [("a", 1, 0), ("old", 5, 3)]


def test_a_writer_that_loses_the_marker_race_keeps_the_winners_output(spark: Any, out: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two jobs on one output path write batch 0 at once: the first marker wins, the other
    job is refused, and its files are gone (the winner's are intact: other names)."""
    winner = ParquetSink(out)
    winner.open(ctx(Lineage("winner"), job_dir="a"))
    loser = ParquetSink(out)
    loser.open(ctx(Lineage("loser"), job_dir="b"))
    real_create = type(loser.store).create

    def create(self: Store, key: str, data: bytes) -> bool:
        if key.endswith(MARKER) and self is loser.store:
            monkeypatch.setattr(type(loser.store), "create", real_create)
            winner.write(spark.createDataFrame([("w", 1)], SCHEMA), 0)  # finishes first
        return real_create(self, key, data)

    monkeypatch.setattr(type(loser.store), "create", create)
    with pytest.raises(OutputError, match="job directory a"):
        loser.write(spark.createDataFrame([("l", 2)], SCHEMA).repartition(2), 0)
    assert rows(out) == [("w", 1, 0)]
    store = open_store(out, "test")
    marker = BatchMarker.parse(store.get(join(batch_folder_name(0), MARKER)))
    assert marker is not None and marker.files is not None
    assert sorted(o.key.rsplit("/", 1)[1] for o in store.list(batch_folder_name(0))) == sorted([MARKER, *(f.name for f in marker.files)])


def test_open_lists_the_output_path_once(spark: Any, out: str) -> None:
    """No request per batch folder of the committed history (the issue's HEAD storms)."""
    sink = ParquetSink(out)
    sink.open(ctx(Lineage("me")))
    for b in range(5):
        sink.write(spark.createDataFrame([("a", b)], SCHEMA), b)
    resumed = ParquetSink(out)
    resumed.open(ctx(Lineage("me"), committed=3))  # reads the marker of batch 4 only
    assert dict(resumed.store.requests) == {"list": 1, "get": 1}
    resumed = ParquetSink(out)
    resumed.open(ctx(Lineage("me"), committed=4))
    assert dict(resumed.store.requests) == {"list": 1}


def test_marker_round_trip() -> None:
    m = BatchMarker(Marker("me", "j", "jd", "run", 3), (OutputFile("part-00000-0123456789ab.parquet", 2, 700),))
    assert BatchMarker.parse(json.dumps(m.to_json()).encode()) == m
    assert BatchMarker.parse(b"{not json") is None
