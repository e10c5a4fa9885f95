"""`keyscale run`'s pacing and sizing options reach the run's options (no Spark: the runner is a stand-in)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from keyscale.cli.main import main
from keyscale.errors import KeyscaleError
from keyscale.runtime.batch.jobstate import RunOptions


def _options(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *flags: str) -> RunOptions:
    got: list[RunOptions] = []

    class Runner:
        def __init__(self, opts: RunOptions, **_: Any) -> None:
            got.append(opts)
            raise KeyscaleError("stand-in runner: stop here")

    monkeypatch.setattr("keyscale.runtime.driver.runner.JobRunner", Runner)
    assert main(["run", "job.py", "--job-dir", str(tmp_path / "job"), *flags]) == 2
    return got[0]


def test_wait_for_trigger_and_a_latency_target_reach_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    default = _options(tmp_path, monkeypatch)
    assert default.wait_for_trigger is False and default.latency_target is None
    given = _options(tmp_path, monkeypatch, "--wait-for-trigger", "--latency-target", "750ms")
    assert given.wait_for_trigger is True and given.latency_target == "750ms"
