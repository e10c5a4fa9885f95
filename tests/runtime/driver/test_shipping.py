"""The job's own modules reach Spark's Python workers by value, however the job starts
(here: Pipeline.start on the caller's session; keyscale run: tests/cli/test_job_modules.py),
and a module the workers cannot import is one line saying what to do."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow.parquet as pq
import pytest
from tests.cli.job_project import expected_totals, final_totals, write_project

from conftest import read_output, write_events
from keyscale._jobcontext import JobContext
from keyscale.runtime.driver.shipping import unimportable_module


@pytest.mark.slow
def test_pipeline_start_ships_a_module_and_the_modules_it_imports(spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The workers run in the repository's folder: the project's modules reach them only by
    # value. Before, only the stages' own module (myjob) was shipped, not helpers.scale,
    # which Scaled calls: "No module named 'helpers'" on the worker.
    write_project(tmp_path / "project")
    monkeypatch.syspath_prepend(str(tmp_path / "project"))
    for name in ("myjob", "helpers", "mypkg", "mypkg.columns", "mypkg.units"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    from myjob import Scaled, pipeline_of  # type: ignore[import-not-found]
    from mypkg.columns import doubled  # type: ignore[import-not-found]

    write_events(tmp_path / "in", files=1, rows=100, keys=8)
    ctx = JobContext(spark, {"input": str(tmp_path / "in"), "output": str(tmp_path / "out")})
    job = pipeline_of(ctx, Scaled(), doubled).start(str(tmp_path / "job"), 2, until_idle=True)
    job.await_termination(300)
    events = pq.read_table(tmp_path / "in").to_pandas()
    assert final_totals(read_output(tmp_path / "out")) == expected_totals(pd.DataFrame(events))


def test_the_message_says_what_to_do_for_each_kind_of_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = "py4j... pyspark.errors.exceptions.captured.PythonException: ... ModuleNotFoundError: No module named '{}'\n  at ..."
    assert unimportable_module("ValueError: bad", "python3") is None
    assert unimportable_module(text.format("keyscale"), "python3") is None  # its own message (missing_keyscale)
    # Installed for the driver only (site-packages): install it on the workers.
    installed = unimportable_module(text.format("pyarrow.compute"), "/opt/py/bin/python3")
    assert installed is not None and "'pyarrow'" in installed and "/opt/py/bin/python3" in installed and "install" in installed
    # Nowhere at all.
    nowhere = unimportable_module(text.format("no_such_module_xyz"), "python3")
    assert nowhere is not None and "'no_such_module_xyz'" in nowhere and "\n" not in nowhere
    # The job's own code, found by the driver: import it at the top of a module.
    (tmp_path / "own_helpers.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    own = unimportable_module(text.format("own_helpers"), "python3")
    assert own is not None and str(tmp_path / "own_helpers.py") in own and "top of" in own
