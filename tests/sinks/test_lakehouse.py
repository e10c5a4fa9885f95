"""Delta Lake and Iceberg sinks (issue 14, part 3): one table commit per batch, carrying the
job lineage and the batch id, so a batch written again (a replay after a crash) is
recognised and skipped; on local disk and on S3 (SeaweedFS)."""

from __future__ import annotations

import logging
import signal
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow.parquet as pq
import pytest

from conftest import cli, cli_here, write_events
from keyscale.checkpoint.jobdir import JobDir
from keyscale.checkpoint.lineage import Lineage
from keyscale.errors import OutputError, StorageError
from keyscale.sinks import DeltaSink, IcebergSink
from keyscale.sinks import delta as delta_module
from keyscale.sinks import iceberg as iceberg_module
from keyscale.sinks.base import SinkContext

pytestmark = [pytest.mark.spark]

SCHEMA = "key string, n long"


def _ctx(lineage: Lineage, committed: int = -1) -> SinkContext:
    return SinkContext(lineage, "lakehouse-test", "/jobs/lakehouse-test", "run-1", committed)


class Lake:
    """A table of one kind (Delta or Iceberg) in one place: makes its sinks, reads it back."""

    kind = ""

    def sink(self, mode: str = "append", keys: list[str] | None = None) -> Any:
        raise NotImplementedError

    def table(self) -> pd.DataFrame:
        raise NotImplementedError

    def rows(self) -> list[tuple[Any, ...]]:
        return sorted(self.table().itertuples(index=False, name=None))

    def commits(self) -> list[int]:
        """The keyscale batch of each commit that carries one, oldest first."""
        raise NotImplementedError


class DeltaLake(Lake):
    kind = "delta"

    def __init__(self, uri: str, storage_options: dict[str, str] | None = None):
        self.uri, self.storage_options = uri, storage_options

    def sink(self, mode: str = "append", keys: list[str] | None = None) -> DeltaSink:
        return DeltaSink(self.uri, mode=mode, keys=keys, storage_options=self.storage_options)  # type: ignore[arg-type]

    def table(self) -> pd.DataFrame:
        from deltalake import DeltaTable

        return DeltaTable(self.uri, storage_options=self.sink().options()).to_pandas()

    def commits(self) -> list[int]:
        history = delta_module.delta_history(self.uri, self.storage_options)
        return [int(h["keyscale.batch"]) for h in reversed(history) if "keyscale.batch" in h]


class IcebergLake(Lake):
    kind = "iceberg"

    def __init__(self, catalog: dict[str, str], name: str):
        self.catalog, self.name = catalog, name

    def sink(self, mode: str = "append", keys: list[str] | None = None) -> IcebergSink:
        return IcebergSink(self.catalog, self.name, mode=mode, keys=keys)  # type: ignore[arg-type]

    def table(self) -> pd.DataFrame:
        return iceberg_module.table_rows(self.catalog, self.name).to_pandas()

    def commits(self) -> list[int]:
        """Per snapshot of the current history (an append is one snapshot, an upsert one or two)."""
        from pyiceberg.table.snapshots import ancestors_of

        table = IcebergSink(self.catalog, self.name).catalog().load_table(self.name)
        snaps = list(ancestors_of(table.current_snapshot(), table.metadata))
        return [int(s.summary["keyscale.batch"]) for s in reversed(snaps) if s.summary and s.summary["keyscale.batch"]]


def _local(kind: str, root: Path) -> Lake:
    if kind == "delta":
        return DeltaLake(str(root / "table"))
    catalog = {"type": "sql", "uri": f"sqlite:///{root / 'catalog.db'}", "warehouse": f"file://{root / 'warehouse'}"}
    return IcebergLake(catalog, "analytics.counts")


@pytest.fixture(params=["delta", "iceberg"])
def lake(request: pytest.FixtureRequest, tmp_path: Path) -> Lake:
    return _local(request.param, tmp_path)


@pytest.fixture(params=["delta", "iceberg"])
def s3_lake(request: pytest.FixtureRequest, s3_bucket: str, tmp_path: Path) -> Lake:
    """A table in the test's bucket; the sinks find the server through the environment
    (AWS_ENDPOINT_URL..., set by ``s3_bucket``), as the CLI would."""
    if request.param == "delta":
        return DeltaLake(f"{s3_bucket}/tables/counts")
    catalog = {"type": "sql", "uri": f"sqlite:///{tmp_path / 'catalog.db'}", "warehouse": f"{s3_bucket}/warehouse"}
    return IcebergLake(catalog, "analytics.counts")


# -- one batch at a time --------------------------------------------------------------------


def _replays_are_no_ops(spark: Any, lake: Lake) -> None:
    sink = lake.sink()
    sink.open(_ctx(Lineage("lineage-a")))
    assert sink.write(spark.createDataFrame([("a", 1), ("b", 1), ("c", 1)], SCHEMA), 0) == 3
    assert sink.write(spark.createDataFrame([("a", 2), ("d", 1)], SCHEMA), 1) == 2
    # replays of batches the table has (the rows may differ: the batch id decides) write nothing
    assert sink.write(spark.createDataFrame([("a", 2), ("d", 1)], SCHEMA), 1) == -1
    assert sink.write(spark.createDataFrame([("zzz", 9)], SCHEMA), 0) == -1
    # a new sink object (a restarted driver) knows it too
    again = lake.sink()
    again.open(_ctx(Lineage("lineage-a"), committed=0))
    assert again.write(spark.createDataFrame([("a", 2), ("d", 1)], SCHEMA), 1) == -1
    assert lake.rows() == [("a", 1), ("a", 2), ("b", 1), ("c", 1), ("d", 1)]
    assert lake.commits() == [0, 1]


def test_a_replayed_batch_is_not_written_again(spark: Any, lake: Lake) -> None:
    _replays_are_no_ops(spark, lake)


def test_upsert_keeps_the_latest_row_per_key_and_a_replay_changes_nothing(spark: Any, lake: Lake) -> None:
    sink = lake.sink("upsert", keys=["key"])
    sink.open(_ctx(Lineage("lineage-a")))
    assert sink.write(spark.createDataFrame([("a", 1), ("b", 1)], SCHEMA), 0) == 2
    # "b" twice in one batch: the last row of the batch is the newest
    assert sink.write(spark.createDataFrame([("a", 2), ("c", 1), ("b", 5), ("b", 6)], SCHEMA), 1) == 3
    assert lake.rows() == [("a", 2), ("b", 6), ("c", 1)]
    assert sink.write(spark.createDataFrame([("a", 99), ("e", 1)], SCHEMA), 1) == -1
    assert lake.rows() == [("a", 2), ("b", 6), ("c", 1)]
    commits = lake.commits()
    assert sorted(set(commits)) == [0, 1] and commits == sorted(commits)


def test_an_empty_batch_commits_nothing_and_lineages_have_their_own_batches(spark: Any, lake: Lake, caplog: pytest.LogCaptureFixture) -> None:
    sink = lake.sink()
    sink.open(_ctx(Lineage("lineage-a")))
    assert sink.write(spark.createDataFrame([], SCHEMA), 0) == 0  # no table yet, and none made
    assert sink.write(spark.createDataFrame([("a", 1)], SCHEMA), 1) == 1
    assert sink.write(spark.createDataFrame([], SCHEMA), 2) == 0
    assert sink.write(spark.createDataFrame([("b", 1)], SCHEMA), 3) == 1
    assert lake.commits() == [1, 3]
    # A restore of a savepoint of batch 1: a new lineage that recomputes batch 2 onwards.
    # Its batches are its own (written, not taken for replays); the log names what it supersedes.
    restored = lake.sink()
    with caplog.at_level(logging.WARNING, logger="keyscale"):
        restored.open(_ctx(Lineage("lineage-b", {"lineage-a": 1}), committed=1))
    assert "batches 2..3 of an earlier run (lineage lineage-" in caplog.text
    assert restored.write(spark.createDataFrame([("b", 1)], SCHEMA), 2) == 1
    assert lake.rows() == [("a", 1), ("b", 1), ("b", 1)]


@pytest.mark.parametrize("mode", ["append", "upsert"])
def test_a_batch_another_writer_commits_meanwhile_is_not_written_twice(
    spark: Any, lake: Lake, mode: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """A zombie driver of the same job commits the batch between this writer's check and its
    commit: the commit fails (same Delta transaction; Iceberg: no blind retry), the sink
    looks again, finds the batch, and writes nothing."""
    keys = ["key"] if mode == "upsert" else None
    sink, zombie = lake.sink(mode, keys), lake.sink(mode, keys)
    for s in (sink, zombie):
        s.open(_ctx(Lineage("lineage-a")))
    assert sink.write(spark.createDataFrame([("a", 1)], SCHEMA), 0) == 1
    commit = sink._commit

    def racing(table: Any, data: Any, batch_id: int) -> None:
        assert zombie.write(spark.createDataFrame([("a", 2), ("b", 1)], SCHEMA), batch_id) == 2
        commit(table, data, batch_id)

    monkeypatch.setattr(sink, "_commit", racing)
    with caplog.at_level(logging.WARNING, logger="keyscale"):
        assert sink.write(spark.createDataFrame([("a", 2), ("b", 1)], SCHEMA), 1) == -1
    assert "batch 1" in caplog.text and "checking the table again" in caplog.text
    assert lake.rows() == ([("a", 1), ("a", 2), ("b", 1)] if mode == "append" else [("a", 2), ("b", 1)])
    commits = lake.commits()
    assert commits.count(0) == 1 and set(commits) == {0, 1} and commits == sorted(commits)


def test_output_that_does_not_fit_the_table_is_refused_naming_the_column(spark: Any, lake: Lake) -> None:
    sink = lake.sink()
    sink.open(_ctx(Lineage("lineage-a")))
    sink.write(spark.createDataFrame([("a", 1)], SCHEMA), 0)
    with pytest.raises(OutputError, match=r"column 'n' is string in the job's output, int64 in the table") as e:
        sink.write(spark.createDataFrame([("a", "1")], "key string, n string"), 1)
    assert "no longer fits the table" in str(e.value)
    with pytest.raises(OutputError, match=r"the job's output has column 'extra'"):
        sink.write(spark.createDataFrame([("a", 1, 2)], "key string, n long, extra long"), 1)
    with pytest.raises(OutputError, match=r"key column 'id' is not in the job's output \(its columns: key, n\)"):
        lake.sink("upsert", keys=["id"]).write(spark.createDataFrame([("a", 1)], SCHEMA), 1)
    assert lake.rows() == [("a", 1)]


@pytest.mark.parametrize("uri", ["hdfs://namenode/tables/counts", "kafka://broker/topic", "s3:/bucket/missing-slash"])
def test_a_uri_the_delta_sink_cannot_serve_is_refused(uri: str) -> None:
    with pytest.raises(OutputError, match=r"^Delta sink: cannot write a table at .*: the URI scheme '\w+:' is not one delta-rs serves"):
        DeltaSink(uri)


def test_sink_arguments_are_checked(tmp_path: Path) -> None:
    catalog = {"type": "sql", "uri": f"sqlite:///{tmp_path / 'c.db'}", "warehouse": f"file://{tmp_path}"}
    with pytest.raises(OutputError, match=r"Delta sink for .*/t: mode='upsert' needs keys=\[\.\.\.\]"):
        DeltaSink(tmp_path / "t", mode="upsert")
    with pytest.raises(OutputError, match=r"Iceberg sink for ns\.t: mode='upsert' needs keys=\[\.\.\.\]"):
        IcebergSink(catalog, "ns.t", mode="upsert")
    with pytest.raises(OutputError, match=r"mode must be 'append' or 'upsert', not 'merge'"):
        DeltaSink(tmp_path / "t", mode="merge")  # type: ignore[arg-type]
    with pytest.raises(OutputError, match=r"keys=\['key'\] only apply to mode='upsert'"):
        IcebergSink(catalog, "ns.t", keys=["key"])
    with pytest.raises(OutputError, match=r"table 'counts' needs a namespace"):
        IcebergSink(catalog, "counts")
    with pytest.raises(OutputError, match=r"cannot write to warehouse ftp://host/wh: pyiceberg has no file system for 'ftp:'"):
        IcebergSink({**catalog, "warehouse": "ftp://host/wh"}, "ns.t")
    # never a local folder named after a URI: a local path is made absolute, URIs stay as given
    assert DeltaSink("rel/table").uri == str(Path.cwd() / "rel" / "table")
    assert DeltaSink("s3://bucket/t").uri == "s3://bucket/t"
    # a password in a catalog URI stays out of messages
    sink = IcebergSink({"type": "sql", "uri": "postgresql://me:secret@db:5432/cat"}, "ns.t")
    assert "secret" not in sink.describe() and "me@db:5432" in sink.describe()


def test_s3_settings_come_from_the_environment_unless_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "env-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "env-secret")
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
    assert DeltaSink("s3://b/t", storage_options={"aws_access_key_id": "mine"}).options() == {
        "aws_access_key_id": "mine", "AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_SECRET_ACCESS_KEY": "env-secret",
        "AWS_REGION": "eu-west-1", "AWS_ALLOW_HTTP": "true", "conditional_put": "etag",
    }
    assert DeltaSink("/tmp/t").options() == {}  # a local table takes no S3 settings
    from keyscale.sinks._lakehouse import iceberg_s3_properties

    assert iceberg_s3_properties({"type": "sql", "s3.endpoint": "http://mine:1"}) == {
        "type": "sql", "s3.endpoint": "http://mine:1", "s3.access-key-id": "env-key", "s3.secret-access-key": "env-secret",
        "s3.region": "eu-west-1",
    }


# -- on S3 ------------------------------------------------------------------------------------


def test_on_s3_a_replayed_batch_is_not_written_again(spark: Any, s3_lake: Lake) -> None:
    _replays_are_no_ops(spark, s3_lake)
    upserts = DeltaLake(s3_lake.uri.replace("counts", "latest")) if isinstance(s3_lake, DeltaLake) else \
        IcebergLake(s3_lake.catalog, "analytics.latest")  # type: ignore[attr-defined]
    sink = upserts.sink("upsert", keys=["key"])
    sink.open(_ctx(Lineage("lineage-a")))
    assert sink.write(spark.createDataFrame([("a", 1), ("b", 1)], SCHEMA), 0) == 2
    assert sink.write(spark.createDataFrame([("a", 2)], SCHEMA), 1) == 1
    assert sink.write(spark.createDataFrame([("a", 3)], SCHEMA), 1) == -1
    assert upserts.rows() == [("a", 2), ("b", 1)]


def test_on_s3_a_missing_bucket_is_a_one_line_error(spark: Any, s3_lake: Lake, tmp_path: Path) -> None:
    if isinstance(s3_lake, DeltaLake):
        sink: Any = DeltaSink("s3://no-such-bucket/tables/counts")
    else:
        sink = IcebergSink({**s3_lake.catalog, "warehouse": "s3://no-such-bucket/warehouse"}, "analytics.counts")  # type: ignore[attr-defined]
    with pytest.raises(StorageError) as e:  # at open (Delta reads the table's log) or at the first batch
        sink.open(_ctx(Lineage("lineage-a")))
        sink.write(spark.createDataFrame([("a", 1)], SCHEMA), 0)
    assert "\n" not in str(e.value) and "\x1b" not in str(e.value)
    assert str(e.value).startswith(f"{sink.describe()}: cannot ") and "bucket" in str(e.value).lower()


# -- a real job, killed after its sinks wrote batch 2 and before its checkpoint ------------------

# The running count into four tables: Delta and Iceberg, upsert (the totals) and append (a
# row per key and batch: its count grows by batch, so a batch written twice shows as a
# repeated (key, count)).
JOB = '''
import keyscale as ks

NAME = "lakehouse_count"

def build(ctx):
    events = (ctx.spark.readStream.schema("key string, value long, ts timestamp")
              .option("maxFilesPerTrigger", 1).parquet(ctx.arg("input")))
    counts = ks.stream(events).key_by("key").aggregate(uid="totals", count=ks.aggregates.count(), sum=ks.aggregates.sum("value"))
    catalog = {"type": "sql", "uri": ctx.arg("catalog"), "warehouse": ctx.arg("warehouse")}
    return ks.pipeline(
        counts.sink(ks.sinks.DeltaSink(ctx.arg("delta") + "/totals", mode="upsert", keys=["key"])),
        counts.sink(ks.sinks.DeltaSink(ctx.arg("delta") + "/updates")),
        counts.sink(ks.sinks.IcebergSink(catalog, "lake.totals", mode="upsert", keys=["key"])),
        counts.sink(ks.sinks.IcebergSink(catalog, "lake.updates")),
    )
'''


def _recount(events: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """What the job must write, from the input files (one per batch) with pandas: the rows
    of each batch (key, running count, running sum), and the final totals per key."""
    totals: dict[str, tuple[int, int]] = {}
    updates = []
    for batch, path in enumerate(sorted(events.glob("part-*.parquet"))):
        frame = pq.read_table(path).to_pandas()
        for key, group in frame.groupby("key"):
            count, total = totals.get(str(key), (0, 0))
            totals[str(key)] = (count + len(group), total + int(group["value"].sum()))
            updates.append((str(key), *totals[str(key)], batch))
    upd = pd.DataFrame(updates, columns=["key", "count", "sum", "batch"])
    final = pd.DataFrame([(k, c, s) for k, (c, s) in totals.items()], columns=["key", "count", "sum"])
    return upd, final


def _canon(frame: pd.DataFrame) -> pd.DataFrame:
    frame = frame[["key", "count", "sum"]].astype({"key": str, "count": "int64", "sum": "int64"})
    return frame.sort_values(["key", "count"]).reset_index(drop=True)


@pytest.mark.slow
def test_a_job_killed_after_its_sinks_wrote_resumes_with_every_batch_once(spark: Any, tmp_path: Path) -> None:
    events = tmp_path / "events"
    write_events(events, files=4, rows=300, keys=30, seed=11)
    job = tmp_path / "lakehouse_count.py"
    job.write_text(JOB)
    catalog, warehouse = f"sqlite:///{tmp_path / 'catalog.db'}", f"file://{tmp_path / 'warehouse'}"
    base = ["run", str(job), "--job-dir", str(tmp_path / "job"), "-p", "2", "--until-idle", "--set", f"input={events}",
            "--set", f"delta={tmp_path / 'delta'}", "--set", f"catalog={catalog}", "--set", f"warehouse={warehouse}"]

    crashed = cli(*base, "--fault", "after-sink:2")
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-3000:]
    assert JobDir(tmp_path / "job").manifest_batches()[-1] == 1  # batch 2 is in the tables, not in the checkpoint
    delta = {name: DeltaLake(str(tmp_path / "delta" / name)) for name in ("totals", "updates")}
    iceberg = {name: IcebergLake({"type": "sql", "uri": catalog, "warehouse": warehouse}, f"lake.{name}") for name in ("totals", "updates")}
    for lake in (*delta.values(), *iceberg.values()):
        assert max(lake.commits()) == 2

    resumed = cli_here(*base, check=True)  # a new driver: the killed one's JVM and workers are gone with it
    assert "resuming job 'lakehouse_count' from checkpoint 1" in resumed.stderr
    assert resumed.stderr.count("already has batches up to 2 of this job (committed: 1)") == 4

    updates, final = _recount(events)
    for name, lake in [("delta", delta["updates"]), ("iceberg", iceberg["updates"])]:
        got = lake.table()
        assert not got.duplicated(["key", "count"]).any(), f"{name}: a batch's rows are in the table twice"
        pd.testing.assert_frame_equal(_canon(got), _canon(updates), obj=f"{name} append table")
    for name, lake in [("delta", delta["totals"]), ("iceberg", iceberg["totals"])]:
        pd.testing.assert_frame_equal(_canon(lake.table()), _canon(final), obj=f"{name} upsert table")
    # every batch committed once to each table, in order (batch 2 by the killed run only)
    for lake in delta.values():
        assert lake.commits() == [0, 1, 2, 3]
    assert iceberg["updates"].commits() == [0, 1, 2, 3]  # an append: one snapshot per batch
    totals = iceberg["totals"].commits()  # an upsert: an overwrite and an append per batch
    assert sorted(set(totals)) == [0, 1, 2, 3] and totals == sorted(totals)
