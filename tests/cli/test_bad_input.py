"""Bad input gets one clear line naming the thing at fault, a non-zero exit, and nothing
lost or corrupted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import ALERTS, ROOT, RUNNING_COUNT, cli, read_output, run_job, write_events
from keyscale.checkpoint.jobdir import JobDir
from keyscale.errors import InputDataError, JobDefinitionError, JobDirError
from keyscale.runtime.control.server import call


def _one_line_error(proc: subprocess.CompletedProcess[str], code: int, *needles: str) -> str:
    assert proc.returncode == code, proc.stderr[-2000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("keyscale: error:")]
    assert len(errors) == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    for n in needles:
        assert n in errors[0], errors[0]
    return errors[0]


def test_missing_job_file(tmp_path: Path) -> None:
    _one_line_error(cli("run", str(tmp_path / "nope.py"), "--job-dir", str(tmp_path / "j")), 2, "nope.py", "does not exist")
    assert not (tmp_path / "j").exists()


def test_job_file_without_build(tmp_path: Path) -> None:
    job = tmp_path / "empty_job.py"
    job.write_text("x = 1\n")
    _one_line_error(cli("run", str(job), "--job-dir", str(tmp_path / "j")), 2, "empty_job.py", "no build(ctx)")


def test_job_file_that_raises(tmp_path: Path) -> None:
    job = tmp_path / "broken.py"
    job.write_text("import nonexistent_module_xyz\n")
    _one_line_error(cli("run", str(job), "--job-dir", str(tmp_path / "j")), 2, "broken.py", "nonexistent_module_xyz")


def test_parallelism_above_max_parallelism(tmp_path: Path) -> None:
    _one_line_error(
        cli("run", str(RUNNING_COUNT), "--job-dir", str(tmp_path / "j"), "-p", "300", "--max-parallelism", "128"),
        2, "parallelism 300", "128",
    )


def test_bad_set_argument(tmp_path: Path) -> None:
    _one_line_error(cli("run", str(RUNNING_COUNT), "--job-dir", str(tmp_path / "j"), "--set", "novalue"), 2, "novalue", "NAME=VALUE")


@pytest.mark.spark
def test_missing_key_column(spark: Any, tmp_path: Path) -> None:
    job = tmp_path / "wrong_key.py"
    job.write_text(
        "import keyscale as ks\n"
        "def build(ctx):\n"
        "    df = ctx.spark.readStream.schema('key string, value long').parquet(ctx.arg('input'))\n"
        "    return ks.stream(df).key_by('user').aggregate(uid='a', n=ks.aggregates.count()).sink(ks.sinks.ConsoleSink())\n"
    )
    (tmp_path / "in").mkdir()
    with pytest.raises(JobDefinitionError, match=r"key column 'user' is not in the stream .columns: key, value."):
        run_job(job, tmp_path / "job", 1, {"input": str(tmp_path / "in")})


@pytest.mark.spark
def test_missing_aggregate_column(spark: Any, tmp_path: Path) -> None:
    job = tmp_path / "wrong_col.py"
    job.write_text(
        "import keyscale as ks\n"
        "def build(ctx):\n"
        "    df = ctx.spark.readStream.schema('key string, value long').parquet(ctx.arg('input'))\n"
        "    return ks.stream(df).key_by('key').aggregate(uid='a', s=ks.aggregates.sum('amount')).sink(ks.sinks.ConsoleSink())\n"
    )
    (tmp_path / "in").mkdir()
    with pytest.raises(JobDefinitionError, match="column 'amount' is not in the stream"):
        run_job(job, tmp_path / "job", 1, {"input": str(tmp_path / "in")})


@pytest.mark.spark
def test_null_keys_stop_the_job_and_commit_nothing(spark: Any, tmp_path: Path) -> None:
    write_events(tmp_path / "in", files=2, rows=500, keys=50, null_keys=3)
    args = {"input": str(tmp_path / "in"), "output": str(tmp_path / "out")}
    with pytest.raises(InputDataError, match=r"null key in column 'key' of operator 'totals' .batch 0, 3 records."):
        run_job(RUNNING_COUNT, tmp_path / "job", 2, args)
    jd = JobDir(tmp_path / "job")
    assert jd.manifest_batches() == []
    assert read_output(tmp_path / "out").empty
    assert not jd.is_running()


@pytest.mark.spark
def test_null_keys_can_be_dropped(spark: Any, tmp_path: Path) -> None:
    write_events(tmp_path / "in", files=1, rows=500, keys=50, null_keys=3)
    job = tmp_path / "drop_nulls.py"
    job.write_text(RUNNING_COUNT.read_text().replace('.key_by("key")', '.key_by("key", null_keys="drop")'))
    run_job(job, tmp_path / "job", 2, {"input": str(tmp_path / "in"), "output": str(tmp_path / "out")})
    out = read_output(tmp_path / "out")
    assert out["count"].sum() == 497 and out["key"].notna().all()
    counted = JobDir(tmp_path / "job").latest_manifest().extra["counters"]  # type: ignore[union-attr]
    assert counted == {"totals": {"dropped_null_keys": 3}}  # dropped, but not without a sign


@pytest.mark.spark
def test_job_dir_of_another_job_is_refused(spark: Any, tmp_path: Path) -> None:
    write_events(tmp_path / "in", files=1, rows=200, keys=20)
    args = {"input": str(tmp_path / "in"), "output": str(tmp_path / "out")}
    run_job(RUNNING_COUNT, tmp_path / "job", 1, args)
    before = sorted(p.name for p in (tmp_path / "job" / "checkpoints").iterdir())
    with pytest.raises(JobDirError, match="belongs to job 'running_count', not 'threshold_alerts'"):
        run_job(ALERTS, tmp_path / "job", 1, {**args, "output": str(tmp_path / "out2")})
    with pytest.raises(JobDirError, match="max parallelism 128; it cannot change to 64"):
        run_job(RUNNING_COUNT, tmp_path / "job", 1, args, max_parallelism=64)
    assert sorted(p.name for p in (tmp_path / "job" / "checkpoints").iterdir()) == before


def test_non_job_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "j").mkdir()
    (tmp_path / "j" / "precious.txt").write_text("keep me")
    _one_line_error(cli("run", str(RUNNING_COUNT), "--job-dir", str(tmp_path / "j")), 3, "not empty and is not a keyscale job directory")
    assert (tmp_path / "j" / "precious.txt").read_text() == "keep me"


@pytest.mark.spark
@pytest.mark.slow
def test_running_job_refuses_a_second_writer_and_rescales_live(tmp_path: Path) -> None:
    """A long-running job: a second `keyscale run` is refused; `keyscale rescale` applies live;
    `keyscale status` shows it; SIGTERM stops it cleanly."""
    write_events(tmp_path / "in", files=2, rows=300, keys=40)
    job_dir = tmp_path / "job"
    argv = [sys.executable, "-m", "keyscale.cli.main", "run", str(RUNNING_COUNT), "--job-dir", str(job_dir), "-p", "2",
            "--trigger-interval", "200 milliseconds", "--set", f"input={tmp_path / 'in'}", "--set", f"output={tmp_path / 'out'}"]
    log_path = tmp_path / "job.log"
    log = open(log_path, "w")  # noqa: SIM115 - a file, not a pipe: a full pipe would block the job
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=log, text=True, env=os.environ.copy())
    try:
        jd = JobDir(job_dir)
        deadline = time.time() + 300
        while time.time() < deadline and (1 not in jd.manifest_batches()):
            assert proc.poll() is None, log_path.read_text()[-3000:]
            time.sleep(0.5)
        assert 1 in jd.manifest_batches(), log_path.read_text()[-3000:]
        assert jd.is_running()
        second = cli("run", str(RUNNING_COUNT), "--job-dir", str(job_dir), "--set", f"input={tmp_path / 'in'}", "--set", f"output={tmp_path / 'o2'}")
        _one_line_error(second, 3, "in use by a running job", f"pid {proc.pid}")

        status = cli("status", str(job_dir), check=True)
        assert f"running (pid {proc.pid})" in status.stdout and "subtask 1: key groups 64-127" in status.stdout

        # Rescale live; a new file makes the next batch happen.
        rescale = subprocess.Popen([sys.executable, "-m", "keyscale.cli.main", "rescale", str(job_dir), "-p", "4", "--wait", "120"],
                                   cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        # The next batch must come after the request: wait until the job shows it pending.
        while time.time() < deadline and not call(jd, "GET", "/status").get("pending_rescale"):
            assert rescale.poll() is None, rescale.communicate()
            time.sleep(0.2)
        write_events(tmp_path / "in", files=1, rows=300, keys=40, first=2)
        out, err = rescale.communicate(timeout=180)
        assert rescale.returncode == 0, err
        assert "ran at parallelism 4" in out
        m = jd.latest_manifest()
        assert m is not None and m.operators["totals"].parallelism == 4
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        log.close()
    err = log_path.read_text()
    assert proc.returncode == 0, err[-2000:]
    assert "rescaling 'totals' live from 2 to 4" in err
    assert not JobDir(job_dir).is_running()
    assert read_output(tmp_path / "out")["count"].groupby(read_output(tmp_path / "out")["key"]).max().sum() == 900


def test_rescale_of_stopped_job_says_how_to_restart(tmp_path: Path) -> None:
    jd = JobDir(tmp_path / "job")
    jd.claim("running_count", None, 128)
    _one_line_error(cli("rescale", str(tmp_path / "job"), "-p", "4"), 2, "not running", "keyscale run JOBFILE")
    _one_line_error(cli("rescale", str(tmp_path / "job"), "-p", "129"), 2, "parallelism 129")
