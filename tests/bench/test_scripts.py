"""The benchmark scripts start as docs/benchmarks.md runs them (``python bench/X.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT


def test_no_script_folder_shadows_a_standard_module() -> None:
    # ``python bench/nexmark/run.py`` puts bench/nexmark/ first on sys.path: a file there named
    # like a standard module (profile.py did) replaces it for every import, pyspark's too.
    for folder in (ROOT / "bench", ROOT / "bench" / "nexmark"):
        clash = sorted(p.name for p in folder.glob("*.py") if p.stem in sys.stdlib_module_names)
        assert not clash, f"{folder.relative_to(ROOT)}: {clash} shadow standard modules"


@pytest.mark.parametrize("script", ["run.py", "ladder.py", "profile_query.py"])
def test_the_nexmark_scripts_start(script: str) -> None:
    proc = subprocess.run([sys.executable, f"bench/nexmark/{script}", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage:" in proc.stdout


@pytest.mark.spark
@pytest.mark.slow
def test_the_state_scan_bench_reads_through_the_data_source(tmp_path: Path) -> None:
    """bench/state_scan.py asks its session for the ``keyscale`` data source (sessions get it
    only when asked: it stopped working silently when they no longer did)."""
    proc = subprocess.run([sys.executable, "bench/state_scan.py", "--keys", "2000", "--repeat", "1", "--where", str(tmp_path / "job")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["datasource_keys_per_s"] > 0 and out["one_key"]["partitions"] == 1
