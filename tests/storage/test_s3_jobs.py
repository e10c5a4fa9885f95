"""Jobs whose job directory and output are on S3 (a real SeaweedFS server): every rule of
exactly-once holds there, with no rename, no flock and no directory fsync.

The running count over Parquet files; the reference is an uninterrupted run at
parallelism 1 on local disk. Each run's output is read back from S3 through the sink's
markers (complete batches only).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from conftest import ROOT, RUNNING_COUNT, cli, cli_here, read_output, run_job
from keyscale.checkpoint.jobdir import JobDir
from keyscale.errors import FencedError
from keyscale.storage import open_store

pytestmark = [pytest.mark.spark, pytest.mark.slow]

FILES = 6
EVENTS = {"files": FILES, "rows": 1500, "keys": 250, "seed": 11}


def _feed(events: Path, dest: Path, upto: int) -> None:
    """Make the first ``upto`` event files visible in ``dest`` (a job's input folder)."""
    dest.mkdir(exist_ok=True)
    for p in sorted(events.glob("part-*.parquet"))[:upto]:
        if not (dest / p.name).exists():
            os.link(p, dest / p.name)


def _same_output(out: pd.DataFrame, reference: pd.DataFrame) -> None:
    assert not out.duplicated(["batch", "key"]).any()
    pd.testing.assert_frame_equal(out.reset_index(drop=True), reference.reset_index(drop=True), check_dtype=False)


def test_rescale_live_and_on_restart_on_s3_equals_parallelism_1(
    spark: Any, events: Path, reference: pd.DataFrame, s3_bucket: str, tmp_path: Path,
) -> None:
    job, out, inp = f"{s3_bucket}/jobs/rc", f"{s3_bucket}/out", tmp_path / "in"
    jd = JobDir(job)
    plan = {0: 4, 1: 1}  # live: 2 -> 4 after batch 0, -> 1 after batch 1
    _feed(events, inp, 3)
    s1 = run_job(RUNNING_COUNT, job, 2, {"input": str(inp), "output": out}, max_chain=2,
                 on_batch=lambda rec: jd.request_rescale(plan[rec.batch]) if rec.batch in plan else None)
    assert [b.parallelism["totals"] for b in s1.batches] == [2, 4, 1]
    _feed(events, inp, 5)
    s2 = run_job(RUNNING_COUNT, job, 3, {"input": str(inp), "output": out}, max_chain=2)  # restart 1 -> 3
    _feed(events, inp, FILES)
    s3 = run_job(RUNNING_COUNT, job, 2, {"input": str(inp), "output": out}, max_chain=2)  # restart 3 -> 2
    assert [b.batch for b in (*s2.batches, *s3.batches)] == [3, 4, 5]
    _same_output(read_output(out), reference)
    # Nothing of the job went to local disk: no folder named after the scheme, no job dir files.
    assert not (ROOT / "s3:").exists() and not any(tmp_path.glob("**/manifest-*.json"))
    # Object writes per batch: state files (at most two per subtask: a snapshot and the delta
    # beside it) + output + intent + manifest + Spark bundle; listings only at a run's start
    # (recovery, the first retention sweep).
    assert s2.batches[1].batch == 4
    for b in s2.batches[1:]:
        writes = b.requests.get("put", 0) + b.requests.get("create", 0)
        assert writes <= 3 * b.parallelism["totals"] + 2, b.requests
        assert b.requests.get("list", 0) == 0, b.requests  # no listing on the hot path


# The fault points where the object store matters: a state file's upload in flight, output
# written before the commit (a kill mid-batch, with no upload begun, is tests/runtime/test_crash.py's).
# With asynchronous checkpoints the upload of batch 2 is still in flight while batch 3 runs.
@pytest.mark.parametrize(("fault", "asynchronous"), [("mid-upload:2", False), ("after-sink:2", False), ("mid-upload:2", True)])
def test_killed_driver_on_s3_restarts_exactly_once(
    fault: str, asynchronous: bool, events: Path, reference: pd.DataFrame, s3_bucket: str, tmp_path: Path,
) -> None:
    job, out = f"{s3_bucket}/jobs/rc", f"{s3_bucket}/out"
    base = ["run", str(RUNNING_COUNT), "--job-dir", job, "-p", "2", "--until-idle", "--compaction-chain", "2",
            "--set", f"input={events}", "--set", f"output={out}", *(["--async-checkpoints"] if asynchronous else [])]
    crashed = cli(*base, "--fault", fault)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    jd = JobDir(job)
    assert jd.manifest_batches()[-1] == 1  # batch 2 never committed
    if asynchronous:
        assert jd.read_intent(3) is not None  # the driver was on to batch 3
    if fault.startswith("after-sink"):  # its output is complete (marked) on S3
        assert open_store(out, "out").exists("batch=000000000002/_keyscale.json")
    resumed = cli_here(*base, check=True)  # a new driver: the killed one's JVM and workers are gone with it
    assert "resuming job 'running_count' from checkpoint 1" in resumed.stderr
    _same_output(read_output(out), reference)
    assert jd.manifest_batches()[-1] == FILES - 1


def test_a_paused_driver_is_fenced_by_the_run_that_took_over(
    events: Path, reference: pd.DataFrame, s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Driver A is stopped (SIGSTOP) mid-run; B cannot start while A's heartbeat is fresh,
    takes over once it is stale, and runs the job to its end. A, resumed (SIGCONT), is
    fenced at its next commit: it exits with FencedError and commits nothing."""
    job, out, inp = f"{s3_bucket}/jobs/rc", f"{s3_bucket}/out", tmp_path / "in"
    _feed(events, inp, 2)
    env = {**os.environ, "KEYSCALE_TAKEOVER_AFTER": "6", "KEYSCALE_SPARK_LOG_LEVEL": "ERROR"}
    args = ["run", str(RUNNING_COUNT), "--job-dir", job, "-p", "2", "--set", f"input={inp}", "--set", f"output={out}"]
    a = subprocess.Popen([sys.executable, "-m", "keyscale.cli.main", *args, "--trigger-interval", "500 milliseconds"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    jd = JobDir(job)
    try:
        deadline = time.time() + 180
        while (not jd.manifest_batches() or jd.manifest_batches()[-1] < 1) and time.time() < deadline:
            assert a.poll() is None, a.communicate()[1][-2000:]
            time.sleep(0.5)
        assert jd.manifest_batches()[-1] == 1
        time.sleep(3)  # a heartbeat after the batches: A is seen running
        a.send_signal(signal.SIGSTOP)
        _feed(events, inp, FILES)
        refused = cli(*args, "--until-idle", timeout=120)
        assert refused.returncode == 3 and "in use by a running job" in refused.stderr, refused.stderr[-2000:]
        time.sleep(7)  # A's heartbeat goes stale
        monkeypatch.setenv("KEYSCALE_TAKEOVER_AFTER", "6")  # A's, for B in this process
        b = cli_here(*args, "--until-idle")
        assert b.returncode == 0, b.stderr[-2000:]
        assert jd.manifest_batches()[-1] == FILES - 1
        a.send_signal(signal.SIGCONT)
        _, a_err = a.communicate(timeout=180)
    finally:
        if a.poll() is None:
            a.send_signal(signal.SIGCONT)
            a.kill()
            a.wait()
    assert a.returncode == FencedError.exit_code, a_err[-3000:]
    assert "a newer run took over" in a_err
    _same_output(read_output(out), reference)
    latest = jd.read_manifest(FILES - 1)
    assert latest.extra["epoch"] == 2
    assert json.loads(open_store(job, "job").get("epochs/0000000002.json"))["pid"] == os.getpid()  # B's, not A's


def test_a_paused_driver_waking_while_the_new_run_runs_leaves_it_controllable(events: Path, s3_bucket: str, tmp_path: Path) -> None:
    """Issue 32, case 4, as it happens: driver A is paused past the takeover time, B takes
    over and keeps running; A wakes, is fenced at its next commit and exits. A's exit deleted
    B's control secret and address (B could no longer be stopped with a savepoint) and wrote
    ``running: false`` over B's status (a new start would have taken over from the healthy
    B). Now A leaves both: B answers and stops with a savepoint."""
    from keyscale.checkpoint.savepoint import read_savepoint
    from keyscale.runtime.control.server import call

    job, out, inp = f"{s3_bucket}/jobs/rc", f"{s3_bucket}/out", tmp_path / "in"
    _feed(events, inp, 2)
    env = {**os.environ, "KEYSCALE_TAKEOVER_AFTER": "6", "KEYSCALE_SPARK_LOG_LEVEL": "ERROR"}
    args = ["run", str(RUNNING_COUNT), "--job-dir", job, "-p", "2", "--set", f"input={inp}", "--set", f"output={out}",
            "--trigger-interval", "500 milliseconds"]

    def start() -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, "-m", "keyscale.cli.main", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=env, cwd=ROOT)

    jd = JobDir(job)
    a, b = start(), None
    try:
        deadline = time.time() + 180
        while (not jd.manifest_batches() or jd.manifest_batches()[-1] < 1) and time.time() < deadline:
            assert a.poll() is None, a.communicate()[1][-2000:]
            time.sleep(0.5)
        a.send_signal(signal.SIGSTOP)
        time.sleep(7)  # A's heartbeat goes stale
        b = start()
        while jd.read_json("control/http.json").get("epoch") != 2 and time.time() < deadline:
            assert b.poll() is None, b.communicate()[1][-2000:]
            time.sleep(0.5)
        assert call(jd, "GET", "/status", timeout=30)["pid"] == b.pid
        a.send_signal(signal.SIGCONT)
        _feed(events, inp, 3)  # a batch for A to run: its commit finds B's epoch
        _, a_err = a.communicate(timeout=180)
        assert a.returncode == FencedError.exit_code, a_err[-3000:]
        status = jd.read_status()
        assert status["epoch"] == 2 and status["running"] and status["pid"] == b.pid, status
        answer = call(jd, "POST", "/stop", {"savepoint": True}, timeout=120)  # B's secret and address are B's
        _, b_err = b.communicate(timeout=180)
        assert b.returncode == 0, b_err[-3000:]
        assert answer["stopping"] and read_savepoint(answer["savepoint"]).batch >= 1
    finally:
        for p in (a, b):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
                p.wait()
