"""`python -m keyscale.kafka.broker --help` prints its help; it does not start a broker."""

from __future__ import annotations

import subprocess
import sys

from conftest import ROOT


def test_help_prints_help_and_starts_nothing() -> None:
    proc = subprocess.run([sys.executable, "-m", "keyscale.kafka.broker", "--help"], capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python -m keyscale.kafka.broker") and "--port" in proc.stdout
    assert "Tansu broker on" not in proc.stdout
