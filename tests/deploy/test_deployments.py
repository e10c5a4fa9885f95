"""Deployments end to end on real Spark: apply, live rescale, upgrades, restore strategies, restarts.

Every test runs a deployment of ``examples/running_count.py`` through ``keyscale apply``
(a detached supervisor and its job process) and checks the Parquet output for exactly-once:
each key's largest running count and sum equal a recount of the input, and no key appears
twice in one batch. Each test stops what it started (``deployment stop``, then by pid).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from conftest import RUNNING_COUNT, read_output, write_events
from keyscale.checkpoint.jobdir import JobDir
from keyscale.checkpoint.savepoint import read_savepoint
from keyscale.cli.main import main as keyscale_main
from keyscale.deploy.cli import main as deploy_main
from keyscale.deploy.store import DeploymentStore

pytestmark = [pytest.mark.spark, pytest.mark.slow]

WAIT = 240.0  # seconds for any one thing to happen (a loaded machine starts Spark slowly)


# -- helpers ------------------------------------------------------------------------------------


def _toml(v: Any) -> str:
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml(x)}" for k, x in v.items()) + " }"
    return json.dumps(v)


def write_deployment(folder: Path, args: dict[str, Any] | None = None, **fields: Any) -> Path:
    """``folder/deployment.toml`` for running_count over ``folder/in`` (relative paths)."""
    d: dict[str, Any] = {
        "name": "counts", "job": str(RUNNING_COUNT), "parallelism": 2, "max_parallelism": 8,
        "trigger_interval": "200 milliseconds", "state_dir": "state", "savepoint_dir": "savepoints",
        "upgrade_strategy": "STATEFUL", "restore_strategy": "LATEST_STATE",
    }
    d.update(fields)
    d["args"] = {"input": "in", "output": "out", "files_per_batch": 1, **(args or {})}
    d.setdefault("restart", {"attempts": 2, "backoff_seconds": 0.5})
    path = folder / "deployment.toml"
    path.write_text("".join(f"{k} = {_toml(v)}\n" for k, v in d.items()))
    return path


def deploy(*argv: str | Path) -> int:
    return deploy_main([str(a) for a in argv])


def expected_totals(inp: Path) -> pd.DataFrame:
    events = pd.concat([pd.read_parquet(f) for f in sorted(inp.glob("part-*.parquet"))])
    return pd.DataFrame(events.groupby("key")["value"].agg(count="size", sum="sum")).astype("int64")


def output_totals(out: pd.DataFrame) -> pd.DataFrame:
    return out.groupby("key")[["count", "sum"]].max().astype("int64")


def complete(out: pd.DataFrame, inp: Path) -> bool:
    """Has the output caught up with all of the input (exactly, not more)?"""
    return not out.empty and output_totals(out).equals(expected_totals(inp))


def assert_exactly_once(out: pd.DataFrame, inp: Path) -> None:
    assert not out.duplicated(["batch", "key"]).any(), "a key was written twice in one batch"
    pd.testing.assert_frame_equal(output_totals(out), expected_totals(inp))


def _diagnostics(store: DeploymentStore) -> str:
    parts = [json.dumps(store.read_status().to_json(), indent=1)[:3000]]
    for log in [store.supervisor_log, *sorted(store.logs.glob("*.log"))]:
        if log.exists():
            parts.append(f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-25:]))
    return "\n".join(parts)


def wait_until(cond: Callable[[], bool], what: str, store: DeploymentStore, timeout: float = WAIT) -> None:
    deadline = time.time() + timeout
    while not cond():
        if time.time() > deadline:
            raise AssertionError(f"not within {timeout:.0f} s: {what}\n{_diagnostics(store)}")
        time.sleep(0.3)


def _ours(pid: int, store: DeploymentStore) -> bool:
    try:
        return str(store.path) in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[Path]:
    """A folder for one deployment; whatever it left running is stopped, then killed by pid."""
    yield tmp_path
    store = DeploymentStore(tmp_path / "state")
    if not store.path.exists():
        return
    if store.exists() and (store.supervisor_running() or store.read_status().job_running()):
        deploy("deployment", "stop", store.path, "--wait", "120")
    pids = {store.supervisor_pid(), store.read_status().job_pid}
    pids |= {JobDir(d).lock_holder() for d in store.jobs.glob("*") if JobDir(d).is_running()}
    for pid in pids:
        if pid and _ours(pid, store):
            os.kill(pid, signal.SIGKILL)


# -- tests --------------------------------------------------------------------------------------


def test_apply_rescales_live_refuses_none_and_upgrades_with_state(deployment: Path, capsys: pytest.CaptureFixture[str]) -> None:
    inp, out = deployment / "in", deployment / "out"
    write_events(inp, files=2, rows=300, keys=40, seed=11)
    toml = write_deployment(deployment)
    store = DeploymentStore(deployment / "state")

    assert deploy("apply", toml) == 0
    assert "generation 1: the job runs in" in capsys.readouterr().out
    st = store.read_status()
    assert st.state == "RUNNING" and st.job_dir == str(deployment / "state" / "jobs" / "1")
    job1, pid1 = JobDir(st.job_dir), st.job_pid
    assert pid1 is not None and job1.lock_holder() == pid1 and store.supervisor_running()
    wait_until(lambda: complete(read_output(out), inp), "the first two files processed", store)

    # A parallelism change rescales live: same job process, the next batch runs at 3.
    write_deployment(deployment, parallelism=3)
    assert deploy("apply", toml) == 0
    assert "rescaling live to parallelism 3" in capsys.readouterr().out
    write_events(inp, files=1, rows=300, keys=40, seed=11, first=2)
    wait_until(lambda: complete(read_output(out), inp), "file 2 processed", store)
    m = job1.latest_manifest()
    assert m is not None and m.operators["totals"].parallelism == 3
    assert store.read_status().job_pid == pid1 == job1.lock_holder()

    # upgrade_strategy NONE refuses an argument change: apply fails, the job is untouched.
    write_deployment(deployment, parallelism=3, upgrade_strategy="NONE", args={"files_per_batch": 2})
    assert deploy("apply", toml) == 2
    err = capsys.readouterr().err
    assert "refused: upgrade_strategy NONE: refusing args: files_per_batch: 1 -> 2" in err
    st = store.read_status()
    assert st.state == "RUNNING" and st.job_pid == pid1 and job1.lock_holder() == pid1
    assert st.outcome is not None and st.outcome["ok"] is False and st.rejected_generation == 3
    assert store.events()[-1]["event"] == "refused"

    # STATEFUL: stop with a savepoint, start the new spec from it in a new job directory.
    write_deployment(deployment, parallelism=3, args={"files_per_batch": 2})
    assert deploy("apply", toml) == 0
    assert "the upgrade's savepoint of batch 2" in capsys.readouterr().out
    st = store.read_status()
    assert st.job_dir == str(deployment / "state" / "jobs" / "2") and st.job_pid not in (None, pid1)
    assert not job1.is_running()
    [sp] = st.savepoints
    assert sp["batch"] == 2 and sp["job_dir"] == str(job1.path) and Path(sp["path"]).parent == deployment / "savepoints"
    job2 = JobDir(st.job_dir)
    assert job2.read_manifest(2).extra["restored_from"]["savepoint"] == sp["path"]
    write_events(inp, files=3, rows=300, keys=40, seed=11, first=3)
    wait_until(lambda: complete(read_output(out), inp), "files 3-5 processed after the upgrade", store)
    m = job2.latest_manifest()
    assert m is not None and m.operators["totals"].parallelism == 3

    assert deploy("deployment", "status", toml, "--json") == 0
    status = json.loads(capsys.readouterr().out)
    assert status["state"] == "RUNNING" and status["differences"] == "no change"
    assert status["desired"]["generation"] == 4 and status["job"]["job_dir"] == str(job2.path)
    assert deploy("deployment", "status", deployment / "state") == 0
    assert "deployment 'counts'" in capsys.readouterr().out

    # Stop with a savepoint: of the last batch; the supervisor and the job are gone.
    assert deploy("deployment", "stop", toml, "--savepoint") == 0
    final = read_savepoint(capsys.readouterr().out.strip())
    # The output of a batch is visible before its checkpoint commits, so the job may have
    # committed a batch after `m` was read: the savepoint is of whatever was last.
    m = job2.latest_manifest()
    assert m is not None and final.batch == m.batch
    st = store.read_status()
    assert st.state == "STOPPED" and not store.supervisor_running() and not job2.is_running()

    result = read_output(out)
    assert_exactly_once(result, inp)  # one output folder for both job directories
    assert set(result["batch"]) == set(range(m.batch + 1))
    kinds = [e["event"] for e in store.events()]
    for kind in ("apply", "start", "running", "rescale", "refused", "upgrade", "savepoint", "stop"):
        assert kind in kinds, kinds
    assert deploy("deployment", "stop", toml) == 0  # stopping a stopped deployment is fine


def test_stateless_upgrades_restore_the_latest_savepoint_or_nothing(deployment: Path, capsys: pytest.CaptureFixture[str]) -> None:
    inp = deployment / "in"
    write_events(inp, files=2, rows=300, keys=40, seed=12)
    toml = write_deployment(deployment, upgrade_strategy="STATELESS", restore_strategy="LATEST_SAVEPOINT", args={"output": "out1"})
    store = DeploymentStore(deployment / "state")
    assert deploy("apply", toml) == 0
    job1 = JobDir(deployment / "state" / "jobs" / "1")
    wait_until(lambda: complete(read_output(deployment / "out1"), inp), "two files processed", store)
    # A savepoint taken by hand into the deployment's savepoint folder; the job goes on.
    assert keyscale_main(["savepoint", str(job1.path), "--dest", str(deployment / "savepoints" / "by-hand")]) == 0
    assert read_savepoint(deployment / "savepoints" / "by-hand").batch == 1
    write_events(inp, files=2, rows=300, keys=40, seed=12, first=2)
    wait_until(lambda: complete(read_output(deployment / "out1"), inp), "four files processed", store)

    # STATELESS + LATEST_SAVEPOINT: cancel (no savepoint), new job directory from the savepoint.
    write_deployment(deployment, upgrade_strategy="STATELESS", restore_strategy="LATEST_SAVEPOINT", args={"output": "out2"})
    assert deploy("apply", toml) == 0
    st = store.read_status()
    assert st.job_dir == str(deployment / "state" / "jobs" / "2") and not job1.is_running()
    assert st.restored_from is not None and st.restored_from.startswith("LATEST_SAVEPOINT: savepoint of batch 1") and "by-hand" in st.restored_from
    assert st.savepoints == []  # a STATELESS upgrade takes none
    assert any(e["event"] == "upgrade" and "STATELESS" in e["message"] for e in store.events())

    def replayed() -> pd.DataFrame:
        first = read_output(deployment / "out1")
        return pd.DataFrame(pd.concat([first[first["batch"] <= 1], read_output(deployment / "out2")], ignore_index=True))

    wait_until(lambda: complete(replayed(), inp), "batches 2-3 recomputed from the savepoint", store)
    assert_exactly_once(replayed(), inp)
    assert set(read_output(deployment / "out2")["batch"]) == {2, 3}

    # STATELESS + NONE: a new job directory with empty state, the whole input again.
    write_deployment(deployment, upgrade_strategy="STATELESS", restore_strategy="NONE", args={"output": "out3"})
    assert deploy("apply", toml) == 0
    st = store.read_status()
    assert st.job_dir == str(deployment / "state" / "jobs" / "3") and st.restored_from == "restore strategy NONE: empty state"
    assert st.state_since_ms > 0
    wait_until(lambda: complete(read_output(deployment / "out3"), inp), "all input recomputed from empty state", store)
    assert_exactly_once(read_output(deployment / "out3"), inp)
    assert set(read_output(deployment / "out3")["batch"]) == {0, 1, 2, 3}

    # A supervisor that dies leaves its job running; the next command adopts and stops it.
    sup, job3 = store.supervisor_pid(), JobDir(deployment / "state" / "jobs" / "3")
    assert sup is not None and job3.is_running()
    os.kill(sup, signal.SIGKILL)
    wait_until(lambda: not store.supervisor_running(), "the supervisor gone", store)
    assert job3.is_running()
    assert deploy("deployment", "stop", toml) == 0
    assert store.read_status().state == "STOPPED" and not store.supervisor_running() and not job3.is_running()
    assert "stopped (no savepoint)" in capsys.readouterr().err
    assert any(e["event"] == "adopt" for e in store.events())


def test_a_killed_job_is_restarted_from_its_latest_checkpoint(deployment: Path, capsys: pytest.CaptureFixture[str]) -> None:
    inp, out = deployment / "in", deployment / "out"
    write_events(inp, files=2, rows=300, keys=40, seed=13)
    toml = write_deployment(deployment, restart={"attempts": 2, "backoff_seconds": 0.5, "backoff_factor": 2})
    store = DeploymentStore(deployment / "state")
    assert deploy("apply", toml) == 0
    st = store.read_status()
    job, pid1 = JobDir(st.job_dir or ""), st.job_pid
    assert pid1 is not None
    wait_until(lambda: complete(read_output(out), inp), "two files processed", store)

    write_events(inp, files=1, rows=300, keys=40, seed=13, first=2)
    time.sleep(0.5)  # the kill lands before, during or after the batch of file 2: all must be fine
    os.kill(pid1, signal.SIGKILL)

    def restarted() -> bool:
        s = store.read_status()
        return s.restarts == 1 and s.state == "RUNNING" and s.job_pid not in (None, pid1)

    wait_until(restarted, "the job restarted by the restart strategy", store)
    st = store.read_status()
    assert st.job_dir == str(job.path)  # LATEST_STATE: its own latest checkpoint, same job directory
    assert st.restored_from is not None and st.restored_from.startswith("LATEST_STATE: checkpoint ")
    exits = [e for e in store.events() if e["event"] == "job-exit"]
    assert exits[-1]["exit_code"] == -9 and "SIGKILL" in exits[-1]["message"]
    assert any(e["event"] == "restart" and "restart 1 of 2 in 0.5 s" in e["message"] for e in store.events())

    write_events(inp, files=1, rows=300, keys=40, seed=13, first=3)
    wait_until(lambda: complete(read_output(out), inp), "files 2-3 processed after the restart", store)
    wait_until(lambda: store.read_status().failures == 0, "failures in a row reset by the new checkpoint", store)
    assert_exactly_once(read_output(out), inp)

    # SIGTERM to the supervisor cancels its job and ends it.
    sup, job_pid = store.supervisor_pid(), store.read_status().job_pid
    assert sup is not None and job_pid is not None
    os.kill(sup, signal.SIGTERM)
    wait_until(lambda: not store.supervisor_running() and not job.is_running(), "supervisor and job ended", store, timeout=120)
    assert store.read_status().state == "STOPPED"
