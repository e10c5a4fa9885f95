"""A run that a newer one took over writes no sink output (issue 32, case 2).

The driver was paused (GC pause, VM freeze, SIGSTOP) past the takeover; when it wakes,
its batch's tasks may have run, but the step that makes output part of the batch (the
Parquet marker, the table commit) checks the run's fence first and stops with
:class:`FencedError`. The new run then writes the batch itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from keyscale.checkpoint.jobdir import JobDir
from keyscale.checkpoint.lineage import Lineage
from keyscale.errors import FencedError
from keyscale.sinks import DeltaSink, IcebergSink
from keyscale.sinks.base import SinkContext
from keyscale.sinks.parquet import ParquetSink, read_output

pytestmark = [pytest.mark.spark]


def _fenced_ctx(tmp_path: Path) -> SinkContext:
    """The context of run 1 of a job directory whose run 2 has started."""
    old = JobDir(tmp_path / "job")
    old.claim("j", 8, 8)
    old.claim_epoch()
    JobDir(tmp_path / "job").claim_epoch()  # the takeover
    return SinkContext(Lineage("me"), "j", str(tmp_path / "job"), "run-1", -1, fence=old.fence)


def _sink(kind: str, tmp_path: Path) -> Any:
    if kind == "parquet":
        return ParquetSink(tmp_path / "out")
    if kind == "delta":
        return DeltaSink(str(tmp_path / "delta"))
    (tmp_path / "warehouse").mkdir(exist_ok=True)
    catalog = {"type": "sql", "uri": f"sqlite:///{tmp_path / 'catalog.db'}", "warehouse": f"file://{tmp_path / 'warehouse'}"}
    return IcebergSink(catalog, "db.out")


@pytest.mark.parametrize("kind", ["parquet", "delta", "iceberg"])
def test_a_fenced_run_makes_no_output_visible(spark: Any, tmp_path: Path, kind: str) -> None:
    sink = _sink(kind, tmp_path)
    sink.open(_fenced_ctx(tmp_path))
    with pytest.raises(FencedError, match="newer run took over"):
        sink.write(spark.createDataFrame([("a", 1)], "k string, n long"), 0)
    if kind == "parquet":
        assert read_output(tmp_path / "out").num_rows == 0
    else:  # no table, or none with a commit of the batch
        fresh = _sink(kind, tmp_path)
        fresh.open(SinkContext(Lineage("me"), "j", str(tmp_path / "job"), "run-2", -1))
        table = fresh._load()
        assert table is None or not fresh._has(table, 0)
