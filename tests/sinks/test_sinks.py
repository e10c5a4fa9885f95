"""Sinks: Parquet writes a batch once and atomically; the console prints."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow.dataset as pads
import pytest

from keyscale.checkpoint.lineage import Lineage
from keyscale.sinks.base import SinkContext
from keyscale.sinks.console import ConsoleSink
from keyscale.sinks.parquet import MARKER, ParquetSink, batch_folder_name, read_output

pytestmark = [pytest.mark.spark]


def test_parquet_sink_writes_a_batch_once(spark: Any, tmp_path: Path) -> None:
    sink = ParquetSink(tmp_path / "out")
    first = spark.createDataFrame([("a", 1), ("b", 2)], "key string, n long")
    assert sink.write(first, 7) == 2
    again = spark.createDataFrame([("a", 100)], "key string, n long")
    assert sink.write(again, 7) == -1  # a replay: the first complete write stays
    rows = pads.dataset(str(tmp_path / "out"), partitioning="hive").to_table().to_pylist()
    assert sorted((r["key"], r["n"], r["batch"]) for r in rows) == [("a", 1, 7), ("b", 2, 7)]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["_spark_metadata", batch_folder_name(7)]  # Spark's log: sinks/test_spark_log.py
    # the marker lists every Parquet file of the batch, with its rows and size; nothing else is there
    folder = tmp_path / "out" / batch_folder_name(7)
    marker = json.loads((folder / MARKER).read_text())
    assert sorted(p.name for p in folder.iterdir()) == sorted([MARKER, *(f["name"] for f in marker["files"])])
    assert {f["name"]: (f["bytes"]) for f in marker["files"]} == {f["name"]: (folder / f["name"]).stat().st_size for f in marker["files"]}
    assert sum(f["rows"] for f in marker["files"]) == marker["rows"] == 2
    # Spark reads the output path as one dataset with a batch column
    back = spark.read.parquet(str(tmp_path / "out")).collect()
    assert sorted((r["key"], r["n"], r["batch"]) for r in back) == [("a", 1, 7), ("b", 2, 7)]


def test_parquet_sink_writes_one_file_per_nonempty_partition(spark: Any, tmp_path: Path) -> None:
    sink = ParquetSink(tmp_path / "out")
    df = spark.createDataFrame([("a", 1), ("b", 2), ("c", 3)], "key string, n long").repartition(8)
    assert sink.write(df, 0) == 3
    marker = json.loads((tmp_path / "out" / batch_folder_name(0) / MARKER).read_text())
    assert 1 <= len(marker["files"]) <= 3 and all(f["rows"] > 0 for f in marker["files"])  # empty partitions: no file
    # a batch without rows still gets its marker: a replay knows it is done
    assert sink.write(spark.createDataFrame([], "key string, n long"), 1) == 0
    assert [p.name for p in (tmp_path / "out" / batch_folder_name(1)).iterdir()] == [MARKER]
    assert sink.write(spark.createDataFrame([("z", 9)], "key string, n long"), 1) == -1
    assert sorted(tuple(r.values()) for r in read_output(tmp_path / "out").to_pylist()) == [("a", 1, 0), ("b", 2, 0), ("c", 3, 0)]


def test_parquet_sink_removes_folders_of_the_rename_protocol(tmp_path: Path) -> None:
    """keyscale before issue 11 wrote into _tmp-* folders and renamed them: a crash left them."""
    (tmp_path / "out" / "_tmp-3-deadbeef").mkdir(parents=True)
    (tmp_path / "out" / "_tmp-3-deadbeef" / "part-0.parquet").write_bytes(b"x")
    ParquetSink(tmp_path / "out").open(SinkContext(Lineage("me"), "j", "jd", "run", -1))
    assert list((tmp_path / "out").iterdir()) == []


def test_console_sink_prints_rows(spark: Any, capsys: pytest.CaptureFixture[str]) -> None:
    df = spark.createDataFrame([(f"k{i}", i) for i in range(5)], "key string, n long")
    assert ConsoleSink(rows=3).write(df, 4) == 5
    out = capsys.readouterr().out
    assert "batch 4: 5 rows" in out and "2 more" in out
