"""The Parquet sink's ``_spark_metadata`` log: Spark's own batch reader of the output folder
(``spark.read.parquet(PATH)``, PySpark as installed) sees committed batches only: never an
unfinished attempt, a stray file, or an ancestor's superseded batches; after a crash
between a marker and its log entry, the replay completes the log (keyscale.sinks.spark_log)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_parquet_store import SCHEMA, parquet_bytes

from keyscale.checkpoint.lineage import Lineage
from keyscale.sinks import spark_log
from keyscale.sinks.base import SinkContext
from keyscale.sinks.parquet import ParquetSink, batch_folder_name
from keyscale.storage import join, open_store


def ctx(lineage: Lineage, committed: int = -1) -> SinkContext:
    return SinkContext(lineage, "j", "jd", "run", committed)


def spark_rows(spark: Any, out: Path) -> list[tuple[Any, ...]]:
    """What Spark's batch reader returns for the folder (a fresh read: no cached listing)."""
    return sorted(tuple(r) for r in spark.read.parquet(str(out)).select("key", "n", "batch").collect())


def test_spark_reads_committed_batches_only_across_compactions(spark: Any, tmp_path: Path) -> None:
    out = tmp_path / "out"
    sink = ParquetSink(out)
    sink.open(ctx(Lineage("me")))
    for b in range(12):  # batch 9 is a compaction (10 batches per compaction, as Spark's sink)
        sink.write(spark.createDataFrame([(f"k{b}", b)], SCHEMA).repartition(2), b)
    store = open_store(out, "test")
    # an attempt that crashed before its marker, and a file no marker lists
    store.put(join(batch_folder_name(12), "part-00000-0123456789ab.parquet"), parquet_bytes({"key": ["unfinished"], "n": [-1]}))
    store.put(join(batch_folder_name(3), "part-00009-ffffffffffff.parquet"), parquet_bytes({"key": ["stray"], "n": [-2]}))
    assert spark_rows(spark, out) == sorted((f"k{b}", b, b) for b in range(12))
    assert sorted(store.list_names(spark_log.LOG), key=lambda n: int(n.split(".")[0])) == [*map(str, range(9)), "9.compact", "10", "11"]
    assert spark_log.parse_entry(store.get(join(spark_log.LOG, "0")))[0]["path"].startswith(f"file://{out}/{batch_folder_name(0)}/part-")


def test_a_crash_between_marker_and_log_entry_is_completed_by_the_replay(spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    sink = ParquetSink(out)
    sink.open(ctx(Lineage("me")))
    sink.write(spark.createDataFrame([("a", 0)], SCHEMA), 0)

    def crash(self: Any, batch: int, files: Any) -> bool:
        raise KeyboardInterrupt("killed after the marker")  # the process dies here

    monkeypatch.setattr(spark_log.SinkLog, "add", crash)
    with pytest.raises(KeyboardInterrupt):
        sink.write(spark.createDataFrame([("b", 1)], SCHEMA), 1)
    monkeypatch.undo()
    assert spark_rows(spark, out) == [("a", 0, 0)]  # batch 1 is not committed: not in the log
    restarted = ParquetSink(out)
    restarted.open(ctx(Lineage("me"), committed=0))
    assert restarted.write(spark.createDataFrame([("b", 1)], SCHEMA), 1) == -1  # the replay keeps the output...
    assert spark_rows(spark, out) == [("a", 0, 0), ("b", 1, 1)]  # ...and logs it


def test_an_unfinished_attempt_stays_hidden_and_its_replay_is_read_once(spark: Any, tmp_path: Path) -> None:
    out = tmp_path / "out"
    sink = ParquetSink(out)
    sink.open(ctx(Lineage("me")))
    sink.write(spark.createDataFrame([("a", 0)], SCHEMA), 0)
    open_store(out, "test").put(join(batch_folder_name(1), "part-00000-0123456789ab.parquet"), parquet_bytes({"key": ["half"], "n": [1]}))
    assert spark_rows(spark, out) == [("a", 0, 0)]
    restarted = ParquetSink(out)
    restarted.open(ctx(Lineage("me"), committed=0))
    restarted.write(spark.createDataFrame([("b", 1)], SCHEMA).repartition(2), 1)
    assert spark_rows(spark, out) == [("a", 0, 0), ("b", 1, 1)]


def test_an_ancestors_superseded_batches_leave_the_log(spark: Any, tmp_path: Path) -> None:
    out = tmp_path / "out"
    old = ParquetSink(out)
    old.open(ctx(Lineage("old")))
    for b in range(3):
        old.write(spark.createDataFrame([(f"old{b}", b)], SCHEMA), b)
    new = ParquetSink(out)
    new.open(ctx(Lineage("new", {"old": 0}), committed=0))  # restored from batch 0's savepoint
    assert spark_rows(spark, out) == [("old0", 0, 0)]
    new.write(spark.createDataFrame([("new1", 10)], SCHEMA), 1)
    assert spark_rows(spark, out) == [("new1", 10, 1), ("old0", 0, 0)]


def test_batches_the_sink_never_wrote_and_output_from_before_the_log_are_logged(spark: Any, tmp_path: Path) -> None:
    out = tmp_path / "out"
    sink = ParquetSink(out)
    sink.open(ctx(Lineage("me")))
    sink.write(spark.createDataFrame([("a", 0)], SCHEMA), 0)
    sink.write(spark.createDataFrame([("b", 1)], SCHEMA), 1)
    store = open_store(out, "test")
    store.delete_prefix(spark_log.LOG)  # output of a keyscale without the log
    upgraded = ParquetSink(out)
    upgraded.open(ctx(Lineage("me"), committed=1))
    upgraded.write(spark.createDataFrame([("d", 3)], SCHEMA), 3)  # no batch 2 here (a dead-letter sink, say)
    assert spark_rows(spark, out) == [("a", 0, 0), ("b", 1, 1), ("d", 3, 3)]
    assert spark_log.parse_entry(store.get(join(spark_log.LOG, "2"))) == []


def test_a_fenced_run_logs_nothing(spark: Any, tmp_path: Path) -> None:
    """The log entry is made under the marker's fence check: a run a newer one took over adds none."""
    from test_fenced_output import _fenced_ctx

    from keyscale.errors import FencedError

    sink = ParquetSink(tmp_path / "out")
    sink.open(_fenced_ctx(tmp_path))
    with pytest.raises(FencedError):
        sink.write(spark.createDataFrame([("a", 1)], SCHEMA), 0)
    assert open_store(tmp_path / "out", "test").list_names(spark_log.LOG) == []


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["mid-batch:2", "after-sink:2"])
def test_spark_reads_the_same_as_keyscale_after_a_killed_driver_and_its_restart(spark: Any, tmp_path: Path, fault: str) -> None:
    """A real job, its driver killed (SIGKILL) in batch 2: Spark's reader of the output sees
    the batches whose output is complete (0, 1; and 2 once its marker exists), then, after
    the restart, every batch once: what keyscale's own reader (markers) returns."""
    import signal

    import pandas as pd

    from conftest import RUNNING_COUNT, cli, cli_here, read_output, write_events

    write_events(tmp_path / "in", files=4, rows=500, keys=50, seed=3)
    out = tmp_path / "out"
    base = ["run", str(RUNNING_COUNT), "--job-dir", str(tmp_path / "job"), "-p", "2", "--until-idle",
            "--set", f"input={tmp_path / 'in'}", "--set", f"output={out}"]

    def spark_read() -> Any:
        df = spark.read.parquet(str(out)).toPandas()
        return df[sorted(df.columns)].sort_values(sorted(df.columns)).reset_index(drop=True)

    def keyscale_read() -> Any:
        df = read_output(out)
        return df[sorted(df.columns)].sort_values(sorted(df.columns)).reset_index(drop=True)

    crashed = cli(*base, "--fault", fault)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    assert sorted(spark_read()["batch"].unique()) == ([0, 1] if fault.startswith("mid") else [0, 1, 2])
    pd.testing.assert_frame_equal(spark_read(), keyscale_read(), check_dtype=False)  # Spark reads batch=... as int
    cli_here(*base, check=True)  # a new driver: the killed one's JVM and workers are gone with it
    assert sorted(spark_read()["batch"].unique()) == [0, 1, 2, 3]
    pd.testing.assert_frame_equal(spark_read(), keyscale_read(), check_dtype=False)
