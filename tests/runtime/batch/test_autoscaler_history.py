"""The autoscaler's input-rate history survives a restart: written to the job directory when
a bucket begins, read back by the next run's autoscaler (no Spark)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from keyscale.checkpoint.jobdir import JobDir
from keyscale.errors import KeyscaleError
from keyscale.runtime.batch.jobstate import RunOptions
from keyscale.runtime.batch.parallelism import RATES_KEY, make_autoscaler, save_rate_history
from keyscale.scaling.model import AutoscalerConfig, BatchMetrics
from keyscale.scaling.slo import Slo


def _batch(t: float) -> BatchMetrics:
    return BatchMetrics(time=t, uid="totals", parallelism=2, max_parallelism=8, input_records=500, batch_seconds=1.0,
                        trigger_interval_seconds=5.0, busy_seconds=(0.5, 0.5), records=(250, 250))


def test_the_rate_history_is_saved_and_the_next_run_reads_it_back(tmp_path: Path) -> None:
    jd = JobDir(tmp_path / "job")
    opts = RunOptions(job_file="", job_dir=str(tmp_path / "job"), scaling="auto", slo="lag=30s",
                      autoscaler=AutoscalerConfig(forecast_bucket_seconds=60.0))
    scaler = make_autoscaler(opts, jd)
    assert scaler is not None and scaler.slo == Slo("lag", 30.0)
    job: Any = SimpleNamespace(autoscaler=scaler, jobdir=jd)
    for t in range(0, 300, 5):
        scaler.observe(_batch(float(t)))
        save_rate_history(job)
    saved = jd.read_json(RATES_KEY)
    assert saved["version"] == 1 and len(saved["operators"]["totals"]["buckets"]) == 5  # one per minute begun

    again = make_autoscaler(opts, jd)
    assert again is not None and again.histories["totals"].mean(0.0, 300.0) == pytest.approx(100.0)


def test_an_unusable_history_is_set_aside_and_the_job_runs(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    jd = JobDir(tmp_path / "job")
    jd.write_json(RATES_KEY, {"version": 1, "operators": {"totals": {"version": 99}}})
    scaler = make_autoscaler(RunOptions(job_file="", job_dir=str(tmp_path / "job"), scaling="auto", slo="latency=1min"), jd)
    assert scaler is not None and scaler.histories == {}
    assert "input-rate history of 'totals'" in caplog.text and "version 99 is not 1" in caplog.text


def test_without_an_slo_nothing_is_kept(tmp_path: Path) -> None:
    jd = JobDir(tmp_path / "job")
    scaler = make_autoscaler(RunOptions(job_file="", job_dir=str(tmp_path / "job"), scaling="auto"), jd)
    assert scaler is not None and scaler.slo is None
    scaler.observe(_batch(0.0))
    save_rate_history(SimpleNamespace(autoscaler=scaler, jobdir=jd))  # type: ignore[arg-type]
    assert jd.read_json(RATES_KEY) == {} and scaler.histories == {}
    with pytest.raises(KeyscaleError, match="autoscaler mode must be off, recommend or active"):
        make_autoscaler(RunOptions(job_file="", job_dir=str(tmp_path / "job"), scaling="auto", autoscaler_mode="on"), jd)
