"""The deployment's state folder: desired spec, status, events, locks (no Spark, no job)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from keyscale.deploy.cli import main as deploy_main
from keyscale.deploy.file import load_deployment
from keyscale.deploy.plan import Desired, DesiredState
from keyscale.deploy.spec import DeploymentError, DeploymentSpec
from keyscale.deploy.store import DeploymentStatus, DeploymentStore


def _spec(tmp_path: Path) -> DeploymentSpec:
    (tmp_path / "job.py").write_text("def build(ctx): ...\n")
    (tmp_path / "d.toml").write_text('name = "counts"\njob = "job.py"\nstate_dir = "st"\n')
    return load_deployment(tmp_path / "d.toml")


def test_desired_round_trip_and_artifact(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    store = DeploymentStore(tmp_path / "st")
    assert store.read_desired() is None
    store.write_desired(Desired(3, DesiredState.SUSPENDED, spec))
    d = store.read_desired()
    assert d is not None and d.generation == 3 and d.state is DesiredState.SUSPENDED and d.spec == spec
    art = store.install_artifact(spec)
    assert art.read_text() == (tmp_path / "job.py").read_text() and art.parent.parent == tmp_path / "st" / "artifacts"
    store.desired_path.write_text("{not json")
    with pytest.raises(DeploymentError, match=r"desired\.json is damaged"):
        store.read_desired()


def test_status_tolerates_missing_and_unknown_fields(tmp_path: Path) -> None:
    store = DeploymentStore(tmp_path)
    assert store.read_status() == DeploymentStatus()
    st = DeploymentStatus(name="x", state="RUNNING", restarts=2)
    store.write_status(st)
    raw = json.loads(store.status_path.read_text())
    raw["from_a_newer_version"] = 1
    store.status_path.write_text(json.dumps(raw))
    again = store.read_status()
    assert again.name == "x" and again.restarts == 2 and again.updated_ms > 0


def test_events_are_json_lines(tmp_path: Path) -> None:
    store = DeploymentStore(tmp_path)
    for i in range(5):
        store.event("apply", f"generation {i}", generation=i)
    with open(store.events_path, "a") as f:
        f.write("garbage\n")
    assert [e["generation"] for e in store.events()] == [0, 1, 2, 3, 4]
    assert [e["message"] for e in store.events(2)] == ["generation 4"]  # the last 2 lines, one unreadable
    assert all({"time", "ms", "event", "message"} <= set(e) for e in store.events())


def test_one_supervisor_per_deployment(tmp_path: Path) -> None:
    store = DeploymentStore(tmp_path)
    assert not store.supervisor_running()
    assert store.lock_supervisor()
    try:
        assert store.supervisor_running() and store.supervisor_pid() is not None
        # Another process cannot take the lock (flock is per open file description).
        code = "import sys; from keyscale.deploy.store import DeploymentStore; sys.exit(0 if DeploymentStore(sys.argv[1]).lock_supervisor() else 7)"
        assert subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=False).returncode == 7
    finally:
        store.unlock_supervisor()
    assert not store.supervisor_running() and store.supervisor_pid() is None


def test_job_dirs_are_numbered(tmp_path: Path) -> None:
    store = DeploymentStore(tmp_path)
    assert store.next_job_dir() == tmp_path / "jobs" / "1"
    (tmp_path / "jobs" / "1").mkdir(parents=True)
    (tmp_path / "jobs" / "7").mkdir()
    (tmp_path / "jobs" / "tmp").mkdir()
    assert store.next_job_dir() == tmp_path / "jobs" / "8"


def test_cli_without_a_deployment(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = _spec(tmp_path)
    assert deploy_main(["deployment", "status", str(tmp_path / "d.toml")]) == 2
    assert "no deployment in" in capsys.readouterr().err
    assert deploy_main(["deployment", "stop", str(tmp_path / "st")]) == 2
    assert deploy_main(["apply", str(tmp_path / "d.toml"), "--dry-run"]) == 0
    assert "would START: starting the deployment" in capsys.readouterr().out
    assert not (tmp_path / "st" / "desired.json").exists()  # a dry run writes nothing
    (tmp_path / "bad.toml").write_text('name = "counts"\njob = "job.py"\nparallelism = -1\n')
    assert deploy_main(["apply", str(tmp_path / "bad.toml")]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"keyscale: error: {tmp_path / 'bad.toml'}: parallelism: must be an integer >= 1, not -1"
    # Another deployment's state folder is refused by name.
    DeploymentStore(tmp_path / "st").write_desired(Desired(1, DesiredState.RUNNING, spec))
    (tmp_path / "other.toml").write_text('name = "other"\njob = "job.py"\nstate_dir = "st"\n')
    assert deploy_main(["apply", str(tmp_path / "other.toml")]) == 2
    assert "holds deployment 'counts', not 'other'" in capsys.readouterr().err
