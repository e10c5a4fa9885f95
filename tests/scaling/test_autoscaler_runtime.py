"""The autoscaler inside a running job: recommend records, active rescales live."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from conftest import RUNNING_COUNT, read_output, run_job
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
