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


def test_real_mode_figures_from_a_runs_batches() -> None:
    """bench/autoscale_real.py's figures (no cluster): 10 s windows are within the SLO when
    every batch committed in them is, core-seconds are against fixed at peak, a rescale of
    two operators between the same two batches counts once."""
    sys.path.insert(0, str(ROOT / "bench"))
    import autoscale_real

    history = {"batches": [
        {"batch": b, "seconds": 1.0, "parallelism": {"totals": 1}, "backlog": 0,
         "latency": {"records": 10, "committed_ms": int((1000.0 + t) * 1000), "p50_seconds": p / 2, "p99_seconds": p, "max_seconds": p + 1}}
        for b, (t, p) in enumerate([(1.0, 2.0), (5.0, 3.0), (12.0, 14.0), (15.0, 4.0), (25.0, 5.0), (31.0, 30.0)])
    ] + [{"batch": 9, "latency": None}]}  # fmt: skip
    rows = autoscale_real.batch_rows(history, 1000.0)
    assert [r["batch"] for r in rows] == [0, 1, 2, 3, 4, 5]
    run = {"batches": rows, "duration": 30.0, "load": [{"load1": 1.0}, {"load1": 3.0}], "core_seconds": 60.0,
           "parallelism_seconds": 40.0, "exactly_once": {"ok": True, "records": 123},
           "rescales": [{"batch": 3, "operator": "reader"}, {"batch": 3, "operator": "totals"}]}
    f = autoscale_real.figures("t", "keyscale-slo", "label", run, 10.0, peak_core_seconds=120.0)
    # Windows [0, 10): p99 2, 3; [10, 20): 14 -> over; [20, 30): 5. The batch at 31 s is after the trace.
    assert (f.windows, f.windows_within_slo, f.batches, f.batches_over_slo) == (3, 2, 5, 1)
    assert f.worst_batch_p99_seconds == 14.0 and f.worst_latency_seconds == 15.0
    assert f.core_seconds_vs_peak == 0.5 and f.rescales == 1 and f.exactly_once and f.load_avg_max == 3.0
    assert "| t | label | 66.7% (2/3) | 60 (50%) | 1 |" in autoscale_real.table([f], 10.0)
