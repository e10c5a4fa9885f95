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


def test_keyscale_status_says_the_batch_size_and_whose_limit_holds(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    size = {"target_seconds": 1.0, "records": 400, "records_per_partition": 100, "partitions": 4, "expected_batch_seconds": 0.3,
            "meets_target": False, "limited_by": "source 'reader' max_records_per_batch", "reason": "below keeping up"}
    st = {"job": "j", "job_dir": "d", "running": True, "state": "running", "pid": 1, "last_error": None, "pending_rescale": None,
          "max_parallelism": 128, "last_checkpoint": 3, "checkpoints": [3], "checkpoint_committing": None, "operators": {},
          "counters": {"total": {}, "last_batch": {}}, "latency": None, "batch_size": size}
    monkeypatch.setattr("keyscale.cli.status.status_dict", lambda _: st)
    assert main(["status", "d"]) == 0
    out = capsys.readouterr().out
    assert ("batch size for the 1 s latency target: at most 400 records (source 'reader' max_records_per_batch); "
            "target met: no: below keeping up") in out


@pytest.mark.parametrize(("flag", "value"), [("--compaction-chain", "0"), ("--max-file-age", "0")])
def test_compaction_settings_keyscale_cannot_follow_are_refused_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str,
) -> None:
    job = Path(__file__).resolve().parents[2] / "examples" / "log_count.py"
    assert main(["run", str(job), "--job-dir", str(tmp_path / "job"), flag, value,
                 "--set", f"log={tmp_path / 'log'}", "--set", f"output={tmp_path / 'out'}"]) == 2
    assert f"{flag} {value}: give" in capsys.readouterr().err
    assert not (tmp_path / "job").exists()
