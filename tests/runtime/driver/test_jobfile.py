"""Loading a job file: its imports resolve from its own folder (and package) whatever the
working directory, and loading it again (keyscale upgrade) imports its own modules afresh."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from keyscale.runtime.driver.jobfile import load_job


def test_a_job_in_a_package_uses_relative_imports_from_any_working_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "proj" / "jobs"
    pkg.mkdir(parents=True)
    (tmp_path / "proj" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "common.py").write_text("LIMIT = 7\n")
    (pkg / "clicks.py").write_text("from .common import LIMIT\nfrom proj.jobs import common\ndef build(ctx):\n    return (LIMIT, common.LIMIT)\n")
    monkeypatch.chdir("/")
    monkeypatch.setattr(sys, "path", list(sys.path))
    name, build, module = load_job(pkg / "clicks.py")
    assert (name, build(None), module.__name__) == ("clicks", (7, 7), "proj.jobs.clicks")


def test_loading_a_job_again_imports_its_changed_sibling_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # keyscale upgrade restarts the job in the same process: a sibling module cached from
    # the first version would silently run the old code.
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "upgraded_rules.py").write_text("LIMIT = 1\n")
    (tmp_path / "upgraded_job.py").write_text("from upgraded_rules import LIMIT\ndef build(ctx):\n    return LIMIT\n")
    assert load_job(tmp_path / "upgraded_job.py")[1](None) == 1
    (tmp_path / "upgraded_rules.py").write_text("LIMIT = 2  # the new version\n")
    assert load_job(tmp_path / "upgraded_job.py")[1](None) == 2
    # keyscale's own modules are never imported again, wherever the job file is.
    import keyscale

    assert sys.modules["keyscale"] is keyscale
