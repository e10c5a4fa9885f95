"""Asynchronous checkpoints (``--async-checkpoints``): a batch's state files upload while the
next batch runs, and its manifest commits once they are stored. Exactly-once must hold as
without them: the same output as an uninterrupted run, with the driver killed while an
upload is in flight during the next batch, and with the worker uploading a file killed."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from conftest import RUNNING_COUNT, cli, cli_here, read_output, run_job, write_events
from keyscale.checkpoint.jobdir import JobDir
from keyscale.errors import StateError

pytestmark = [pytest.mark.spark]
EVENTS = {"files": 5, "rows": 2000, "keys": 300, "seed": 11}
REFERENCE = {"parallelism": 2, "max_chain": 2}


def _run_args(events: Path, tmp_path: Path, *extra: str) -> list[str]:
    """``keyscale run`` of the running count with asynchronous checkpoints, a snapshot every other batch."""
    return ["run", str(RUNNING_COUNT), "--job-dir", str(tmp_path / "job"), "-p", "2", "--until-idle", "--async-checkpoints",
            "--compaction-chain", "2", "--set", f"input={events}", "--set", f"output={tmp_path / 'out'}", *extra]


def test_live_rescales_with_checkpoints_in_flight_give_the_same_output(
    spark: Any, events: Path, reference: pd.DataFrame, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each rescale moves key groups to subtasks whose state comes from the files of the
    batch before, still uploading when the rescaled batch starts: its tasks wait for them."""
    from keyscale.runtime.batch import parallelism
    from keyscale.runtime.control.jobstatus import status_dict

    # Each rescale at the batch after its request, the scale-up 1 -> 2 too: the files it
    # reads are the ones still uploading (a scale-up starts its Python workers first and would apply a batch or two later).
    monkeypatch.setattr(parallelism, "awaiting_workers", lambda job, batch_id, wanted: False)

    jd = JobDir(tmp_path / "job")
    plan = {0: 3, 1: 1, 2: 2}
    seen: dict[str, Any] = {}

    def during(rec: Any) -> None:
        jd.request_rescale(plan[rec.batch])
        if rec.batch == 1:  # what `keyscale status` says while batch 1's checkpoint commits
            seen.update(status_dict(str(tmp_path / "job")))

    # Batch 1's files appear 2 s after its tasks end: batch 2, at parallelism 1, needs them.
    summary = run_job(RUNNING_COUNT, tmp_path / "job", 2, {"input": str(events), "output": str(tmp_path / "out")}, max_chain=2,
                      async_checkpoints=True, fault="slow-upload:1", on_batch=lambda rec: during(rec) if rec.batch in plan else None)
    assert [b.parallelism["totals"] for b in summary.batches] == [2, 3, 1, 2, 2]
    assert (seen["last_checkpoint"], seen["checkpoint_committing"]) == (0, 1)
    out = read_output(tmp_path / "out")
    assert not out.duplicated(["batch", "key"]).any()
    pd.testing.assert_frame_equal(out, reference)
    # The run ends with every batch committed: the last checkpoint is not left in flight.
    assert JobDir(tmp_path / "job").manifest_batches()[-1] == 4


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fault", "backend"),
    [("mid-upload:2", "memory"), ("after-sink:2", "memory"), ("mid-batch:2", "memory"),
     # RocksDB: the databases are at batch 3, a batch after the last commit: reloaded, not reused.
     ("mid-upload:2", "rocksdb")],
)
def test_killed_driver_restarts_exactly_once(fault: str, backend: str, events: Path, reference: pd.DataFrame, tmp_path: Path) -> None:
    base = _run_args(events, tmp_path, "--state-backend", backend)
    crashed = cli(*base, "--fault", fault)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    jd = JobDir(tmp_path / "job")
    assert jd.manifest_batches()[-1] <= 1  # batch 2 never committed
    if fault.startswith("mid-upload"):
        # Killed while batch 2's state file uploads, its task over: the driver had moved on to batch 3.
        assert jd.read_intent(3) is not None
    resumed = cli_here(*base, check=True)  # a new driver: the killed one's JVM and workers are gone with it
    assert "resuming job 'running_count' from checkpoint" in resumed.stderr
    out = read_output(tmp_path / "out")
    assert not out.duplicated(["batch", "key"]).any()
    pd.testing.assert_frame_equal(out, reference)
    assert jd.manifest_batches()[-1] == 4


@pytest.mark.slow
def test_a_state_file_never_stored_fails_the_run_and_the_restart_replays(
    events: Path, reference: pd.DataFrame, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The Python worker uploading batch 2's file dies after its task reported, leaving no
    failure record (as when its executor is lost): the run fails once the upload has been
    silent for SILENCE_SECONDS, with an error that says so, not after
    KEYSCALE_UPLOAD_TIMEOUT; the next start replays the batch."""
    monkeypatch.setenv("KEYSCALE_UPLOAD_TIMEOUT", "3600")  # a regression shows as cli's timeout
    base = _run_args(events, tmp_path)
    failed = cli(*base, "--fault", "worker-dies-mid-upload:2", timeout=240)
    assert failed.returncode not in (0, -signal.SIGKILL), failed.stderr[-2000:]
    # The commit (or a task of batch 3 reading the file) gives up, naming the file; or batch 3's
    # task was running in that worker when it died, and the run says a worker died.
    named = "000000000002-s0" in failed.stderr and "its upload has been silent for" in failed.stderr
    assert named or "a Python worker died while running a task" in failed.stderr, failed.stderr[-2000:]
    assert "Traceback" not in failed.stderr
    assert JobDir(tmp_path / "job").manifest_batches()[-1] <= 1
    cli_here(*base, check=True)  # the restart: a new driver, in this process
    out = read_output(tmp_path / "out")
    assert not out.duplicated(["batch", "key"]).any()
    pd.testing.assert_frame_equal(out, reference)


@pytest.mark.slow
def test_an_upload_failing_after_its_task_ended_fails_the_run_at_once_naming_the_file(
    events: Path, reference: pd.DataFrame, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Batch 2's uploads fail once their tasks have reported: no task is left to fail. The
    uploader leaves a failure record beside the file, so whoever waits for the file (the
    driver's commit of batch 2, a task of batch 3 reading it) fails at once with the upload's
    error, not after KEYSCALE_UPLOAD_TIMEOUT (issue 32, case 9: on a cluster, that timeout
    times Spark's task retries was 40 minutes). The next start replays the batch."""
    monkeypatch.setenv("KEYSCALE_UPLOAD_TIMEOUT", "3600")  # a regression shows as cli's timeout
    base = _run_args(events, tmp_path)
    failed = cli(*base, "--fault", "fail-upload:2", timeout=180)
    assert failed.returncode == StateError.exit_code, failed.stderr[-2000:]
    assert "000000000002-s0" in failed.stderr and "was not stored: its upload failed" in failed.stderr, failed.stderr[-2000:]
    assert "the store refused the upload (test fault)" in failed.stderr
    assert JobDir(tmp_path / "job").manifest_batches()[-1] == 1
    cli_here(*base, check=True)  # the restart: a new driver, in this process
    pd.testing.assert_frame_equal(read_output(tmp_path / "out"), reference)


def test_a_bad_upload_timeout_is_refused_by_name(events: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEYSCALE_UPLOAD_TIMEOUT", "soon")
    r = cli("run", str(RUNNING_COUNT), "--job-dir", str(tmp_path / "job"), "--until-idle", "--async-checkpoints",
            "--set", f"input={events}", "--set", f"output={tmp_path / 'out'}")
    assert r.returncode != 0
    assert "KEYSCALE_UPLOAD_TIMEOUT must be a number of seconds above 0, not 'soon'" in r.stderr
    assert not (tmp_path / "out").exists()


def test_status_and_metrics_name_the_last_committed_checkpoint_while_one_commits(tmp_path: Path) -> None:
    from concurrent.futures import Future

    from keyscale.checkpoint.manifest import Manifest
    from keyscale.runtime.batch.jobstate import (
        History,
        JobState,
        PendingCommit,
        RunOptions,
        RunSummary,
    )
    from keyscale.runtime.batch.status import checkpoint_fields, last_committed

    jd = JobDir(tmp_path / "job")
    m1, m2 = (Manifest(job="j", batch=b, batch_time_ms=0, operators={}, created_ms=b) for b in (1, 2))
    jd.store.put(jd.manifest_key(1), m1.dumps().encode())
    job = JobState(RunOptions("", str(tmp_path / "job"), async_checkpoints=True), jd, "run", History(RunSummary("j", jd.uri)))
    job.committed.manifest, job.committed.pending = m2, PendingCommit(2, m2, Future(), m1)  # batch 2 ran; its manifest commits
    assert checkpoint_fields(job) == {"last_checkpoint": 1, "checkpoint_committing": 2}
    assert last_committed(job) is m1
    jd.store.put(jd.manifest_key(2), m2.dumps().encode())  # committed by the background thread
    assert checkpoint_fields(job) == {"last_checkpoint": 2, "checkpoint_committing": None}
    assert last_committed(job) is m2


def test_a_savepoint_asked_for_while_the_last_checkpoint_commits_waits_for_it(spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 32, case 9: the run's final settle ran outside the batch lock. A savepoint asked
    for then (the control API's thread) found no pending commit (the settle had taken it)
    and saved ``job.committed``: batch 1's manifest, not yet committed. Every settle now
    holds the batch lock, so the savepoint waits for the commit. The commit of batch 1 is
    held back until the savepoint has had its chance to run."""
    import threading

    from keyscale.checkpoint.savepoint import read_savepoint
    from keyscale.runtime.batch import commit
    from keyscale.runtime.driver.runner import JobRunner, RunOptions

    write_events(tmp_path / "in", files=2, rows=300, keys=30)
    last = 1
    final_settle, release = threading.Event(), threading.Event()
    settle, commit_in_background = commit.settle, commit._commit_in_background

    def settling(job: Any) -> int:
        if job.committed.pending is not None and job.committed.pending.batch == last and threading.current_thread() is run_thread:
            final_settle.set()  # the run's own settle of its last checkpoint (not a savepoint's)
        return settle(job)

    def held_back(job: Any, manifest: Any) -> None:
        if manifest.batch == last:
            release.wait(120)
        commit_in_background(job, manifest)

    monkeypatch.setattr(commit, "settle", settling)
    monkeypatch.setattr(commit, "_commit_in_background", held_back)
    opts = RunOptions(job_file=str(RUNNING_COUNT), job_dir=str(tmp_path / "job"), parallelism=2, until_idle=True, async_checkpoints=True,
                      args={"input": str(tmp_path / "in"), "output": str(tmp_path / "out")})
    runner = JobRunner(opts)
    outcome: dict[str, Any] = {}
    run_thread = threading.Thread(target=lambda: outcome.setdefault("summary", runner.run()), daemon=True)
    run_thread.start()
    try:
        assert final_settle.wait(180), "the run never settled its last checkpoint"
        reader = JobDir(tmp_path / "job")  # a tool's view: what is in the store

        def savepoint() -> None:
            outcome["savepoint"] = runner.take_savepoint(str(tmp_path / "sp"))
            outcome["committed when saved"] = reader.has_manifest(last)

        saver = threading.Thread(target=savepoint, daemon=True)
        saver.start()
        saver.join(2)  # before the fix the savepoint is written by now, of the uncommitted batch
    finally:
        release.set()
    saver.join(120)
    run_thread.join(120)
    assert not run_thread.is_alive() and "summary" in outcome
    assert outcome["committed when saved"], "the savepoint saved a batch whose checkpoint had not committed"
    assert read_savepoint(tmp_path / "sp").batch == last


def test_settle_refuses_to_run_without_the_batch_lock(tmp_path: Path) -> None:
    from keyscale.runtime.batch import commit
    from keyscale.runtime.batch.jobstate import History, JobState, RunOptions, RunSummary

    jd = JobDir(tmp_path / "job")
    job = JobState(RunOptions("", str(tmp_path / "job"), async_checkpoints=True), jd, "run", History(RunSummary("j", jd.uri)))
    with pytest.raises(RuntimeError, match="without the batch lock"):
        commit.settle(job)
    with job.batch_lock:
        assert commit.settle(job) == 0  # nothing pending
