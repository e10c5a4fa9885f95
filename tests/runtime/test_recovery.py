"""Damaged checkpoints: keyscale falls back to the newest intact one, says so, and Spark
replays the batches after it, so nothing is lost and nothing is written twice."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from conftest import RUNNING_COUNT, read_output, reference_output, run_job, write_events
from keyscale.checkpoint.jobdir import JobDir

pytestmark = [pytest.mark.spark]


@pytest.fixture(scope="module")
def events(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("events")
    write_events(folder, files=4, rows=1500, keys=200, seed=3)
    return folder


@pytest.fixture(scope="module")
def reference(spark: Any, events: Path, tmp_path_factory: pytest.TempPathFactory) -> pd.DataFrame:
    return reference_output(tmp_path_factory, events, 2)


def _damage_manifest(jd: JobDir) -> str:
    path = jd.manifest_path(jd.manifest_batches()[-1])
    path.write_text(path.read_text()[:100])  # a torn write
    return path.name


def _delete_state_file(jd: JobDir) -> str:
    m = jd.latest_manifest()
    assert m is not None
    f = max(m.operators["totals"].files, key=lambda f: f.batch)
    (jd.path / f.path).unlink()
    return f.path


def _flip_state_byte(jd: JobDir) -> str:
    m = jd.latest_manifest()
    assert m is not None
    f = max(m.operators["totals"].files, key=lambda f: f.batch)
    p = jd.path / f.path
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p.write_bytes(bytes(data))
    return f.path


@pytest.mark.parametrize("damage", [_damage_manifest, _delete_state_file, _flip_state_byte])
def test_damaged_latest_checkpoint_falls_back(damage: Any, spark: Any, events: Path, reference: pd.DataFrame, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    args = {"input": str(events), "output": str(tmp_path / "out")}
    run_job(RUNNING_COUNT, tmp_path / "job", 2, args)
    jd = JobDir(tmp_path / "job")
    assert jd.manifest_batches()[-1] == 3
    damage(jd)
    caplog.set_level("INFO", logger="keyscale")
    summary = run_job(RUNNING_COUNT, tmp_path / "job", 2, args)
    assert summary.recovered_from == 2
    assert len(summary.discarded) == 1 and "checkpoint 3" in summary.discarded[0]
    assert "checkpoint 3" in caplog.text and "set it aside" in caplog.text
    assert "resuming job 'running_count' from checkpoint 2 (the newer ones were damaged)" in caplog.text
    assert [b.batch for b in summary.batches] == [3]  # Spark replayed the lost batch
    out = read_output(tmp_path / "out")
    assert not out.duplicated(["batch", "key"]).any()
    pd.testing.assert_frame_equal(out, reference)
