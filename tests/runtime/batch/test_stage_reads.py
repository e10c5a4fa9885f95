"""A small batch of a log source read by its first keyed stage's own tasks, with no reader
tasks and no shuffle (issue 35): the same output and state as through the shuffle, at any
parallelism, through a live rescale, and the job says which way each batch went."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from conftest import EXAMPLES, read_output, run_job
from keyscale.checkpoint.jobdir import JobDir
from keyscale.runtime.batch import stages
from keyscale.sources import LogWriter

pytestmark = [pytest.mark.slow]

JOB = EXAMPLES / "log_count.py"


def _run(log: Any, job: Path, out: Path) -> None:
    jd = JobDir(job)

    def rescale(rec: Any) -> None:
        if rec.batch == 2:
            jd.request_rescale(3, "totals")  # 2 -> 3 live, between two batches

    run_job(JOB, job, 2, {"log": log.uri, "output": str(out), "max_records_per_batch": "150"}, on_batch=rescale)


def test_a_small_batch_read_in_the_keyed_stage_gives_what_the_shuffle_gives(
    spark: Any, make_log: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    log = make_log("key string, value long", 3)
    rng = np.random.default_rng(7)
    records = pd.DataFrame({"key": [f"user-{i}" for i in rng.integers(0, 80, 2000)], "value": rng.integers(1, 100, 2000)})
    LogWriter(log, ["key"]).write(pa.Table.from_pandas(records, preserve_index=False))

    with caplog.at_level(logging.INFO, logger="keyscale"):
        _run(log, tmp_path / "in-stage", tmp_path / "out-in-stage")
    assert "the keyed stage 'totals' reads them in its own tasks" in caplog.text
    assert "reader tasks read them" not in caplog.text
    caplog.clear()
    monkeypatch.setattr(stages, "STAGE_READS", -1)  # every batch, even an empty one, through reader tasks and the shuffle
    with caplog.at_level(logging.INFO, logger="keyscale"):
        _run(log, tmp_path / "shuffled", tmp_path / "out-shuffled")
    assert "reads them in its own tasks" not in caplog.text

    def rows(out: Path) -> pd.DataFrame:
        return read_output(out).sort_values(list(read_output(out).columns)).reset_index(drop=True)

    in_stage, shuffled = rows(tmp_path / "out-in-stage"), rows(tmp_path / "out-shuffled")
    pd.testing.assert_frame_equal(in_stage, shuffled)  # row for row, each batch's updates
    final = in_stage.sort_values("count").groupby("key").tail(1).set_index("key")[["count", "sum"]].sort_index()
    model = records.groupby("key").agg(count=("value", "size"), sum=("value", "sum")).sort_index()
    pd.testing.assert_frame_equal(final, model, check_dtype=False)
    assert JobDir(tmp_path / "in-stage").read_status()["operators"]["totals"]["parallelism"] == 3  # the rescale happened
