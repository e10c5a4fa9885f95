"""The fast lane's guard (tests/conftest.py): a test left in ``pytest --fast`` that starts
Spark or a server fails, named, even where it catches the error; one that does not passes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

PROBES = '''
import subprocess, sys

def test_pure():
    assert 1 + 1 == 2

def test_session_in_process():
    from pyspark.sql import SparkSession
    try:
        SparkSession.builder.master("local[1]").getOrCreate()
    except Exception:
        pass

def test_session_in_a_child():
    code = "from pyspark.sql import SparkSession\\ntry:\\n  SparkSession.builder.master('local[1]').getOrCreate()\\nexcept Exception: pass\\n"
    subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)

def test_a_server():
    try:
        subprocess.run(["redis-server", "--port", "0"], capture_output=True, timeout=5)
    except Exception:
        pass

def test_marked_by_its_fixture(spark):
    pass
'''

# The probes' conftest is the suite's own, loaded under another name (both are "conftest").
CONFTEST = f'''
import importlib.util, sys
sys.path.insert(0, {str(ROOT / "tests")!r})
_spec = importlib.util.spec_from_file_location("keyscale_suite_conftest", {str(ROOT / "tests" / "conftest.py")!r})
_suite = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_suite)
globals().update({{k: v for k, v in vars(_suite).items() if not k.startswith("__")}})
'''


def test_the_fast_lane_fails_a_test_that_starts_spark_or_a_server_and_names_it(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_probes.py").write_text(PROBES)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--fast", "-p", "no:xdist", "--rootdir", str(tmp_path),
         "-c", os.devnull, "test_probes.py"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    out = proc.stdout
    assert "3 failed, 1 passed, 1 deselected" in out, out[-3000:]
    assert "this test starts Spark (SparkSession.builder.getOrCreate): test_probes.py::test_session_in_process" in out
    assert "this test started a JVM (Spark) in a child process (test_probes.py::test_session_in_a_child (call))" in out
    assert "this test starts redis-server" in out and "marks it redis" in out
