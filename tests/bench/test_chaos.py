"""The fault-injection harness, short: a few faults of random kinds, then exactly-once against the model.

``bench/chaos.py`` runs for minutes with many faults (docs/reliability.md); this is its
smoke-sized run, so a change that makes recovery lose or double records, or that breaks the
harness itself, fails the suite.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

pytestmark = [pytest.mark.spark, pytest.mark.slow]


def test_chaos_short_run_is_exactly_once(tmp_path: Path) -> None:
    out = tmp_path / "chaos.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "chaos.py"), "--seed", "3", "--minutes", "1", "--target-faults", "4",
         "--rate", "100", "--work", str(tmp_path / "work"), "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads(out.read_text())
    assert s["records"] > 0 and s["windows"] > 0
    assert s["faults_total"] >= 2 and s["recoveries"] >= 1, s
    # Every byte flip ended one of the two acceptable ways: recovered (a batch committed after it) or
    # refused with an error; never a silent restart from empty state.
    assert s["empty_restarts"] == 0 and s["flips"]["restarted_empty"] == 0, s["events"]
    assert sum(s["flips"].values()) == s["faults"].get("flip", 0), s["events"]
    assert (s["records_lost"], s["records_duplicated"], s["keyed_state"]["updates_lost"], s["keyed_state"]["updates_doubled"]) == (0, 0, 0, 0), \
        json.dumps({k: s[k] for k in ("faults", "events", "examples", "refusals", "job_failures")}, indent=1)
    assert s["exactly_once"] and proc.returncode == 0, proc.stdout[-3000:]
