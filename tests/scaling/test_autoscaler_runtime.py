"""The autoscaler inside a running job: recommend records, active rescales live."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import pandas as pd

from conftest import RUNNING_COUNT, cli, cli_here, read_output, run_job
from keyscale.checkpoint.jobdir import JobDir
from keyscale.scaling.policy import AutoscalerConfig

EVENTS = {"files": 6, "rows": 400, "keys": 60, "seed": 21}

# React at once: no stabilisation, no scale-down delay, every batch counts.
EAGER = AutoscalerConfig(stabilization_seconds=0, scale_down_delay_seconds=0, warmup_batches=0, min_busy_seconds=0.0)


def test_recommend_mode_records_and_never_rescales(spark: Any, events: Path, reference: pd.DataFrame, tmp_path: Path) -> None:
    summary = run_job(RUNNING_COUNT, tmp_path / "job", 4, {"input": str(events), "output": str(tmp_path / "out")},
                      scaling="auto", autoscaler_mode="recommend", autoscaler=EAGER)
    assert [b.parallelism["totals"] for b in summary.batches] == [4] * 6
    decisions = [e for e in JobDir(tmp_path / "job").read_events() if e["type"] == "autoscaler"]
    assert [e["batch"] for e in decisions] == list(range(6))
    assert all(e["mode"] == "recommend" and e["uid"] == "totals" and e["reason"] for e in decisions)
    assert any(e["action"] == "scale_down" for e in decisions)  # tiny batches: it would shrink
    assert JobDir(tmp_path / "job").read_status()["scaling"]["autoscaler"] == "recommend"
    # Each subtask reports the garbage collector's pauses within its busy time (report version 3).
    subtasks = JobDir(tmp_path / "job").read_status()["operators"]["totals"]["subtasks"]
    assert len(subtasks) == 4 and all(0.0 <= s["gc_seconds"] <= s["busy_seconds"] for s in subtasks), subtasks
    pd.testing.assert_frame_equal(read_output(tmp_path / "out"), reference)


def test_active_mode_rescales_live_exactly_once(spark: Any, events: Path, reference: pd.DataFrame, tmp_path: Path) -> None:
    summary = run_job(RUNNING_COUNT, tmp_path / "job", 4, {"input": str(events), "output": str(tmp_path / "out")},
                      scaling="auto", autoscaler_mode="active", autoscaler=EAGER)
    seen = [b.parallelism["totals"] for b in summary.batches]
    decisions = {e["batch"]: e for e in JobDir(tmp_path / "job").read_events() if e["type"] == "autoscaler"}
    changes = [(b, e["target_parallelism"]) for b, e in decisions.items() if e["action"] != "none"]
    assert changes, decisions
    for batch, target in changes:  # each decision applies at the next batch, live
        if batch + 1 < len(seen):
            assert seen[batch + 1] == target
    assert seen[0] == 4 and min(seen) < 4
    assert [(b, f, t) for b, _, f, t in summary.rescales] == [(b + 1, seen[b], t) for b, t in changes if b + 1 < len(seen)]
    pd.testing.assert_frame_equal(read_output(tmp_path / "out"), reference)


def test_keyscale_run_with_an_slo_shows_it_and_its_decisions_with_reasons(events: Path, reference: pd.DataFrame, tmp_path: Path) -> None:
    # The files' modification times are their append times: make them recent (in name order),
    # so the records are seconds old when the job reads them, as in a live folder.
    fresh = tmp_path / "in"
    fresh.mkdir()
    now = time.time()
    for i, f in enumerate(sorted(events.glob("part-*.parquet"))):
        shutil.copy(f, fresh / f.name)
        os.utime(fresh / f.name, (now - 60 + i, now - 60 + i))
    job = tmp_path / "job"
    cli_here("run", str(RUNNING_COUNT), "--job-dir", str(job), "-p", "4", "--until-idle", "--set", f"input={fresh}",
        "--set", f"output={tmp_path / 'out'}", "--scaling", "auto", "--slo", "latency=10min",
        "--autoscaler-option", "stabilization_seconds=0", "--autoscaler-option", "warmup_batches=0",
        "--autoscaler-option", "min_busy_seconds=0", "--autoscaler-option", "forecast_bucket_seconds=1", check=True)
    jd = JobDir(job)
    scaling = jd.read_status()["scaling"]
    assert scaling["slo"] == "latency=600s" and scaling["autoscaler"] == "recommend"
    assert scaling["slo_batches"] == scaling["slo_batches_met"] == 6 and scaling["slo_attainment"] == 1.0
    last = scaling["last_decisions"]["totals"]
    assert last["slo"]["state"] == "met" and last["slo"]["seconds"] == 600.0
    assert last["forecast"]["text"] and last["inputs"]["forecast_input_rate"] >= 0
    decisions = [e for e in jd.read_events() if e["type"] == "autoscaler"]
    assert len(decisions) == 6 and all("SLO latency=600s" in e["reason"] and "forecast" in e for e in decisions)
    assert jd.read_json("autoscaler/rates.json")["operators"]["totals"]["version"] == 1  # the forecast's history, kept
    shown = cli("status", str(job), check=True).stdout
    assert "autoscaler (recommend), SLO latency=600s: 100.0% of 6 batches within it" in shown
    assert "'totals', batch 5: " + last["reason"] in shown
    pd.testing.assert_frame_equal(read_output(tmp_path / "out"), reference)
