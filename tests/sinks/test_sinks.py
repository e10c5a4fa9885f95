"""Sinks: Parquet writes a batch once and atomically; the console prints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow.dataset as pads
import pytest

from keyscale.sinks.console import ConsoleSink
from keyscale.sinks.parquet import MARKER, ParquetSink, batch_folder_name

pytestmark = [pytest.mark.spark]


def test_parquet_sink_writes_a_batch_once(spark: Any, tmp_path: Path) -> None:
    sink = ParquetSink(tmp_path / "out")
    first = spark.createDataFrame([("a", 1), ("b", 2)], "key string, n long")
    sink.write(first, 7)
    again = spark.createDataFrame([("a", 100)], "key string, n long")
    sink.write(again, 7)  # a replay: the first complete write stays
    rows = pads.dataset(str(tmp_path / "out"), partitioning="hive").to_table().to_pylist()
    assert sorted((r["key"], r["n"], r["batch"]) for r in rows) == [("a", 1, 7), ("b", 2, 7)]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [batch_folder_name(7)]
    # only the marker of who wrote it (Spark's _SUCCESS and .crc files are removed)
    assert [p.name for p in (tmp_path / "out" / batch_folder_name(7)).iterdir() if p.name.startswith(("_", "."))] == [MARKER]


def test_parquet_sink_cleans_half_written_folders(tmp_path: Path) -> None:
    (tmp_path / "out" / "_tmp-3-deadbeef").mkdir(parents=True)
    ParquetSink(tmp_path / "out").cleanup()
    assert list((tmp_path / "out").iterdir()) == []


def test_console_sink_prints_rows(spark: Any, capsys: pytest.CaptureFixture[str]) -> None:
    df = spark.createDataFrame([(f"k{i}", i) for i in range(5)], "key string, n long")
    assert ConsoleSink(rows=3).write(df, 4) == 5
    out = capsys.readouterr().out
    assert "batch 4: 5 rows" in out and "2 more" in out
