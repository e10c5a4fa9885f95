"""A job's arguments (--set/--unset): only a successful start's are kept, a kept one can be
dropped, and a --set the job never reads is an error naming the closest name it reads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import keyscale.runtime.driver.jobargs as jobargs_module
from conftest import read_output, run_job, write_events
from keyscale._jobcontext import JobContext
from keyscale.checkpoint.jobdir import JobDir
from keyscale.cli.main import build_parser
from keyscale.errors import JobDefinitionError, KeyscaleError, RecordError
from keyscale.runtime.driver.jobargs import ARGS_FILE, check_args_read, kept_args, resolve_args

LIMITED = '''
import keyscale as ks

NAME = "limited"


class Check(ks.KeyedProcessFunction):
    def __init__(self, limit):
        self.limit = limit

    def process_element(self, row, ctx):
        if row.value > self.limit:
            raise ValueError(f"value {row.value} above the limit {self.limit}")
        yield (ctx.key, row.value)


def build(ctx):
    df = ctx.spark.readStream.schema("key string, value long, ts timestamp").parquet(ctx.arg("input"))
    limit = int(ctx.arg("limit", "1000"))
    return ks.stream(df).key_by("key").process(Check(limit), "key string, value long", uid="check").sink(ks.sinks.ParquetSink(ctx.arg("output")))
'''


def _kept(job_dir: Path) -> dict[str, str]:
    return kept_args(JobDir(job_dir))


@pytest.mark.slow
def test_only_a_successful_start_keeps_its_arguments(spark: Any, tmp_path: Path) -> None:
    job = tmp_path / "limited.py"
    job.write_text(LIMITED)
    write_events(tmp_path / "in", files=1, rows=50, keys=5)  # values 1..99
    good = {"input": str(tmp_path / "in"), "output": str(tmp_path / "out"), "limit": "1000"}
    run_job(job, tmp_path / "job", 1, dict(good))
    assert _kept(tmp_path / "job") == good

    # A start whose first batch fails (a bad value) keeps nothing: the next run reuses the good ones.
    write_events(tmp_path / "in", files=1, rows=50, keys=5, first=1)
    with pytest.raises(RecordError, match="above the limit 5"):
        run_job(job, tmp_path / "job", 1, resolve_args(JobDir(tmp_path / "job"), {"limit": "5"}))
    assert _kept(tmp_path / "job") == good

    # A --set the job never reads fails the start before any batch, and is not kept either.
    with pytest.raises(JobDefinitionError, match=r"--set limt=\.\.\.: the job reads no argument 'limt' \(did you mean 'limit'\?\)"):
        run_job(job, tmp_path / "job", 1, resolve_args(JobDir(tmp_path / "job"), {"limt": "5"}))
    assert _kept(tmp_path / "job") == good

    # --unset drops a kept argument (the job's default applies); that start is a success, so kept.
    args = resolve_args(JobDir(tmp_path / "job"), {}, ["limit"])
    assert args == {"input": good["input"], "output": good["output"]}
    run_job(job, tmp_path / "job", 1, args)
    assert _kept(tmp_path / "job") == args
    assert len(read_output(tmp_path / "out")) == 100


def test_a_failed_first_start_keeps_nothing(spark: Any, tmp_path: Path) -> None:
    job = tmp_path / "limited.py"
    job.write_text(LIMITED)
    (tmp_path / "in").mkdir()
    with pytest.raises(JobDefinitionError, match="did you mean 'output'"):
        run_job(job, tmp_path / "job", 1, {"input": str(tmp_path / "in"), "output": str(tmp_path / "out"), "ouptut": "x"})
    assert not (tmp_path / "job" / ARGS_FILE).exists()
    assert resolve_args(JobDir(tmp_path / "job"), {"a": "1"}) == {"a": "1"}


def _job_dir_keeping(tmp_path: Path, args: dict[str, str]) -> JobDir:
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / ARGS_FILE).write_text(json.dumps(args))
    return JobDir(tmp_path / "job")


def test_kept_arguments_are_reused_under_those_given(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    jd = _job_dir_keeping(tmp_path, {"input": "/data/in", "output": "/data/out"})
    with caplog.at_level("INFO", logger="keyscale"):
        assert resolve_args(jd, {"output": "/elsewhere"}) == {"input": "/data/in", "output": "/elsewhere"}
    assert "input=/data/in" in caplog.text and "output=/data/out" not in caplog.text
    # A deployment lists every argument itself: none kept is used.
    assert resolve_args(jd, {"output": "/elsewhere"}, use_kept=False) == {"output": "/elsewhere"}


def test_unset_drops_a_kept_argument_and_names_a_wrong_one(tmp_path: Path) -> None:
    jd = _job_dir_keeping(tmp_path, {"input": "/data/in", "late": "/data/late"})
    assert resolve_args(jd, {}, ["late"]) == {"input": "/data/in"}
    with pytest.raises(KeyscaleError, match=r"--unset lat: the job directory keeps no argument 'lat' \(did you mean 'late'\?\) \(it keeps: input, late\)"):
        resolve_args(jd, {}, ["lat"])
    with pytest.raises(KeyscaleError, match=r"--set late=\.\.\. and --unset late contradict"):
        resolve_args(jd, {"late": "x"}, ["late"])


def test_an_argument_the_job_does_not_read(caplog: pytest.LogCaptureFixture) -> None:
    ctx = JobContext(None, {"inptu": "/data", "late": "/l"})  # type: ignore[arg-type]
    with pytest.raises(JobDefinitionError, match=r"the job needs the argument 'input': pass --set input=VALUE \(--set inptu=\.\.\. was given"):
        ctx.arg("input")
    ctx.args.get("late")  # what examples do for an optional argument: it counts as read
    read = ctx.args.read  # type: ignore[attr-defined]
    assert read == {"input", "late"}
    with pytest.raises(JobDefinitionError, match=r"reads no argument 'inptu' \(did you mean 'input'\?\); the arguments it reads: input, late"):
        check_args_read(ctx.args, read, kept={})
    # Kept from a start that ran with it (a new version of the job no longer reads it): a warning.
    with caplog.at_level("WARNING", logger="keyscale"):
        check_args_read({"old": "1"}, set(), kept={"old": "1"})
    assert "argument 'old'" in caplog.text and "--unset old" in caplog.text
    # A job that lists its arguments reads them all.
    listing = JobContext(None, {"anything": "1"})  # type: ignore[arg-type]
    assert dict(listing.args) == {"anything": "1"}
    assert listing.args.read is None  # type: ignore[attr-defined]


def test_run_help_documents_set_and_unset() -> None:
    sub = build_parser()._subparsers._group_actions[0].choices["run"]  # type: ignore[union-attr]
    text = sub.format_help()
    assert "--unset NAME" in text and "--no-stored-args" in text and "last successful start" in text


def test_a_deployment_runs_its_job_with_exactly_the_arguments_of_its_file(tmp_path: Path) -> None:
    from keyscale.deploy.spec import DeploymentSpec

    spec = DeploymentSpec("c", tmp_path / "c.toml", tmp_path / "job.py", "ab" * 32, {"input": "in"}, parallelism=2, state_dir=tmp_path)
    argv = spec.command(tmp_path / "jobs" / "1")
    assert "--no-stored-args" in argv
    parsed = build_parser().parse_args(argv[3:])
    jd = _job_dir_keeping(tmp_path, {"input": "old", "removed": "x"})  # kept by a start with the file's previous version
    assert resolve_args(jd, jobargs_module.parse_sets(parsed.set), parsed.unset, use_kept=not parsed.no_stored_args) == {"input": "in"}


def test_a_run_a_newer_one_took_over_keeps_no_arguments(tmp_path: Path) -> None:
    """A paused run that wakes after a takeover must not replace the live run's kept
    arguments with its own (issue 32's rule: a fenced run writes nothing shared)."""
    from keyscale.errors import FencedError
    from keyscale.runtime.driver.jobargs import keep_args

    old = JobDir(tmp_path / "job")
    old.lock()
    old.unlock()
    new = JobDir(tmp_path / "job")
    new.lock()
    keep_args(new, {"input": "new"})
    with pytest.raises(FencedError):
        keep_args(old, {"input": "old"})
    assert kept_args(JobDir(tmp_path / "job")) == {"input": "new"}
    new.unlock()
