"""A small batch of a log source read by its first keyed stage's own tasks, with no reader
tasks and no shuffle (issue 35): the same output and state as through the shuffle, switching
ways through live rescales (through the shuffle while the stage has more tasks than the
executors have cores), and the job says which way its batches go."""

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
        if rec.batch == 1:
            jd.request_rescale(3, "totals")  # 2 -> 3 live: more tasks than local[2]'s cores, so through the shuffle
        elif rec.batch == 3:
            jd.request_rescale(1, "totals")  # 3 -> 1: read in the stage again

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
    said = [r.getMessage() for r in caplog.records if "offsets to read" in r.getMessage()]
    assert [m.split(":")[0] for m in said] == ["batch 0", "batch 2", "batch 4"], said  # it says so when the way changes
    assert "the keyed stage 'totals' reads them in its own tasks" in said[0] and "reader tasks read them" in said[1], said
    assert "reads them in its own tasks" in said[2], said
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
    assert JobDir(tmp_path / "in-stage").read_status()["operators"]["totals"]["parallelism"] == 1  # the rescales happened
