"""A job that keeps failing: restarted per the restart strategy, then FAILED (no Spark needed).

The job file raises when it is loaded, so each attempt fails in about a second, before any
Spark session starts; the supervisor and its decisions are the real ones.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from keyscale.deploy.cli import main as deploy_main
from keyscale.deploy.store import DeploymentStore

pytestmark = [pytest.mark.slow]

BROKEN = 'raise RuntimeError("broken on purpose")\n'


@pytest.fixture
def state(tmp_path: Path) -> Iterator[DeploymentStore]:
    store = DeploymentStore(tmp_path / "state")
    yield store
    pid = store.supervisor_pid()
    if pid and store.supervisor_running():
        os.kill(pid, signal.SIGKILL)


def test_restart_attempts_then_failed(tmp_path: Path, state: DeploymentStore, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "job.py").write_text(BROKEN)
    toml = tmp_path / "d.toml"
    toml.write_text('name = "broken"\njob = "job.py"\nstate_dir = "state"\n[restart]\nattempts = 2\nbackoff_seconds = 0.2\nbackoff_factor = 2\n')
    started = time.time()
    assert deploy_main(["apply", str(toml), "--wait", "120"]) == 2
    err = capsys.readouterr().err
    assert "FAILED: the job failed (exit code 2) and all 2 restart attempts in a row failed" in err
    st = state.read_status()
    assert st.state == "FAILED" and st.restarts == 2 and st.failures == 3 and st.job_pid is None
    deadline = time.time() + 30
    while state.supervisor_running() and time.time() < deadline:
        time.sleep(0.1)
    assert not state.supervisor_running()  # a FAILED deployment has no supervisor

    events = state.events()
    exits = [e for e in events if e["event"] == "job-exit"]
    assert len(exits) == 3 and all(e["exit_code"] == 2 for e in exits)
    assert "RuntimeError: broken on purpose" in exits[0]["message"]  # the job's own error, in the event
    restarts = [e for e in events if e["event"] == "restart"]
    assert [e["delay"] for e in restarts] == [0.2, 0.4]  # exponential backoff
    assert events[-2]["event"] == "failed"

    assert deploy_main(["deployment", "status", str(toml)]) == 0
    out = capsys.readouterr().out
    assert "FAILED" in out and "restarts: 2" in out and "NOT DONE" in out

    # apply on a FAILED deployment tries again from scratch (a new supervisor, a fresh count).
    assert deploy_main(["apply", str(toml), "--wait", "120"]) == 2
    assert state.read_status().restarts == 4
    assert time.time() - started < 90

    # Stopping a FAILED deployment is a no-op; status --json is machine-readable.
    assert deploy_main(["deployment", "stop", str(toml)]) == 0
    assert deploy_main(["deployment", "status", str(state.path), "--json", "--events", "3"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["state"] == "FAILED" and len(d["events"]) == 3 and d["supervisor"]["running"] is False
