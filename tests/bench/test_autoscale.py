"""bench/autoscale.py on one short trace, as docs/benchmarks.md runs it: every policy gives
its figures, none loses a record, and the plot is written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import ROOT


def test_autoscale_bench_runs_every_policy_on_a_trace(tmp_path: Path) -> None:
    out = tmp_path / "autoscale.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "autoscale.py"), "--traces", "spike_10x",
         "--png-dir", str(tmp_path), "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin", "MPLBACKEND": "Agg"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["policy"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"fixed-peak", "fixed-average", "keyscale-reactive", "keyscale-slo", "flink"}
    assert all(abs(r["records_lost"]) < 1 for r in rows.values())
    assert rows["fixed-peak"]["core_seconds_vs_peak"] == 1.0
    assert rows["fixed-peak"]["rescales"] == 0 and rows["fixed-peak"]["pct_minutes_within_slo"] == 100.0
    # The Flink policy paid a restart for each of its rescales.
    assert rows["flink"]["downtime_seconds"] > 0
    assert "| spike_10x | keyscale reactive |" in proc.stdout
    assert (tmp_path / "autoscale_spike_10x.png").stat().st_size > 10_000
