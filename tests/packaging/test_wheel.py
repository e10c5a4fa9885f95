"""keyscale as a library (issue 33, item 2): the wheel ``pip install``s into a fresh venv of
another Python with another PySpark from pyproject.toml's range, and runs the demo to its
end there. The suite's own venv is Python 3.11 with PySpark 4.3; ``make test-oldest`` covers
PySpark 4.0; this covers Python 3.12 with PySpark 4.1 (docs/install.md lists them).

Downloads land under ``.cache/`` (the Makefile's, git-ignored): PySpark's wheel, built once
from its sdist by the Makefile's rule, and pip's cache, so a rerun downloads nothing."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache"
PYTHON = (3, 12)
PYSPARK = "4.1.4"


def _other_python() -> str | None:
    """A Python 3.12 interpreter: on PATH, or one of pyenv's (its shim answers only for the
    versions pyenv has made global)."""
    found = [shutil.which("python3.12")]
    if shutil.which("pyenv"):
        root = subprocess.run(["pyenv", "root"], capture_output=True, text=True).stdout.strip()
        found += sorted(glob.glob(f"{root}/versions/3.12*/bin/python3.12"))
    probe = f"import sys; sys.exit(sys.version_info[:2] != {PYTHON})"
    return next((p for p in found if p and subprocess.run([p, "-c", probe], capture_output=True).returncode == 0), None)


def _run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, **kw)  # type: ignore[call-overload]
    assert proc.returncode == 0, f"{' '.join(cmd)}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc  # type: ignore[no-any-return]


@pytest.mark.slow
@pytest.mark.spark
def test_the_wheel_installs_into_a_fresh_venv_and_runs_the_demo(tmp_path: Path) -> None:
    python = _other_python()
    if python is None:
        pytest.skip(f"needs a Python {PYTHON[0]}.{PYTHON[1]} (pyenv install 3.12)")
    pip_cache = ["--cache-dir", str(CACHE / "pip")]
    # Only what a user's shell would have: not the suite's PYTHONPATH (pip would take the
    # source tree's egg-info for an installed keyscale), Python workers or JVM options.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYSPARK_PYTHON", "SPARK_SUBMIT_OPTS", "VIRTUAL_ENV")}
    # The wheel a user would get, built from a copy of the sources: setuptools packs its
    # build/ folder, where an in-tree build would find files of earlier builds.
    source = tmp_path / "source"
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("*.egg-info", "__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    _run([python, "-m", "pip", "wheel", "--quiet", "--no-deps", *pip_cache, "--wheel-dir", str(tmp_path / "dist"), str(source)], env=env)
    [wheel] = (tmp_path / "dist").glob("keyscale-*.whl")
    # PySpark's wheel: the Makefile's rule, the one way it is built and cached.
    _run(["make", "--no-print-directory", "-C", str(ROOT), f".cache/wheels/pyspark-{PYSPARK}-py2.py3-none-any.whl"], env=env)

    venv = tmp_path / "venv"
    _run([python, "-m", "venv", str(venv)], env=env)
    py = str(venv / "bin" / "python")
    # --no-compile: no bytecode compiled up front for the ~3,700 modules installed (31.8 ->
    # 17.6 s for this install on a quiet machine, 2026-11-30); the demo compiles what it imports.
    _run([py, "-m", "pip", "install", "--quiet", "--no-compile", *pip_cache, "--find-links", str(CACHE / "wheels"),
          f"{wheel}[kafka,s3,rocksdb]", f"pyspark=={PYSPARK}"], env=env)
    _run([py, "-m", "pip", "check"], env=env)  # the resolver found one consistent set
    env["PATH"] = f"{venv / 'bin'}:{env.get('PATH', '')}"
    where = _run([py, "-c", "import sys, keyscale, pyspark; print(sys.version_info[:2], pyspark.__version__, keyscale.__file__)"],
                 cwd=tmp_path, env=env).stdout
    assert where.startswith(f"{PYTHON} {PYSPARK} {venv}/lib/python3.12/site-packages/keyscale/"), where

    demo = _run([py, str(ROOT / "examples" / "demo.py"), "--out", str(tmp_path / "demo"), "--batches", "7", "--rows", "5000",
                 "--keys", "2000"], cwd=tmp_path, env=env).stdout
    assert "exactly-once check: PASSED" in demo, demo[-3000:]
    assert "live rescale of 'totals' at batch 3: 2 -> 4 subtasks" in demo, demo[-3000:]
