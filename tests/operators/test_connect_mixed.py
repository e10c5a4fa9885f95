"""A two-input stage over a Spark source and a log (either way round), on real Spark: the
join equals the plain one across a live rescale, a savepoint and a kill, with the log's
offsets in keyscale's checkpoints. The inputs are test_connect.py's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tests.operators import test_connect as base

from conftest import read_output, run_job
from keyscale.checkpoint.jobdir import JobDir

pytestmark = [pytest.mark.spark, pytest.mark.slow]

inputs, logs = base.inputs, base.logs  # the fixtures, made here again (module scope)
_pairs, _rescale_after_batch_1 = base._pairs, base._rescale_after_batch_1

JOB_MIXED = '''
import keyscale as ks

NAME = "connected_mixed"

def build(ctx):
    files = lambda name, schema: ks.stream(ctx.spark.readStream.schema(schema).option("maxFilesPerTrigger", int(ctx.arg("files_per_batch", "1"))).parquet(ctx.arg(name)))
    log = lambda name: ks.stream(ks.sources.log_source(ctx.arg(name), uid=name, max_records_per_batch=int(ctx.arg("cap"))))
    if ctx.arg("users_from") == "spark":
        users, clicks = files("users", "id string, name string, ts timestamp"), log("clicks")
    else:
        users, clicks = log("users"), files("clicks", "user string, page string, ts timestamp")
    idle = ctx.args.get("idleness")
    users, clicks = users.with_watermark("ts", "1 hour", idleness=idle), clicks.with_watermark("ts", "1 hour", idleness=idle)
    clicks = clicks.filter("page != 'p0-0'")
    out = users.connect(clicks).key_by("id", "user").interval_join("-30 seconds", "1 minute", uid="join")
    return out.sink(ks.sinks.ParquetSink(ctx.arg("output")))
'''


def _offsets(job_dir: Path, uid: str) -> dict[int, int]:
    from keyscale.sources import reader

    manifest = JobDir(job_dir).latest_manifest()
    assert manifest is not None
    return {p: o for entries in reader.from_state(manifest.operators[uid].operator_state) or [] for p, o in entries}


def test_a_spark_source_joined_with_a_log_across_a_live_rescale_and_a_savepoint(spark: Any, inputs: Any, logs: Any, tmp_path: Path) -> None:
    """Users from Spark's file source, clicks from a log: the join is the plain one, the
    log read to its end with its offsets in the checkpoint, across a live 2 -> 3; a
    savepoint of batch 2 restored at P=3 carries both inputs' positions."""
    from keyscale.checkpoint.savepoint import write_savepoint
    from keyscale.sources.log import open_log

    users_dir, _, _, _ = inputs
    _, clicks_log, want = logs
    job = tmp_path / "mixed.py"
    job.write_text(JOB_MIXED)
    jd = JobDir(tmp_path / "job")
    rescale = _rescale_after_batch_1(jd)

    args = {"users_from": "spark", "users": str(users_dir), "clicks": str(clicks_log), "cap": "20"}
    summary = run_job(job, tmp_path / "job", 2, {**args, "output": str(tmp_path / "out")}, rescale, drain_at_end=True, retain=20)
    assert any(r[1] == "join" and r[3] == 3 for r in summary.rescales)
    assert _pairs(tmp_path / "out") == want
    assert _offsets(tmp_path / "job", "clicks") == dict(enumerate(open_log(clicks_log).end_offsets()))
    shown = jd.read_status()["operators"]["clicks"]  # the log's readers and lag, as a log source's
    assert shown["kind"] == "log" and shown["lag"] == 0 and len(shown["readers"]) == 3

    sp = write_savepoint(jd, jd.read_manifest(2), tmp_path / "sp")
    run_job(job, tmp_path / "restored", 3, {**args, "output": str(tmp_path / "out-restored")}, from_savepoint=str(sp), drain_at_end=True)
    whole, after = read_output(tmp_path / "out"), read_output(tmp_path / "out-restored")
    pairs = lambda df: sorted(zip(df["id"], df["page"], strict=True))  # noqa: E731
    assert len(after) > 0
    assert pairs(whole) == sorted(pairs(whole[whole.batch <= 2]) + pairs(after))


def test_a_log_joined_with_a_spark_source_resumes_exactly_once_after_a_kill(spark: Any, inputs: Any, logs: Any, tmp_path: Path) -> None:
    """Users from a log, clicks from Spark's file source: killed after a batch's output
    and before its commit, then resumed at another parallelism: each pair once."""
    import signal

    from conftest import cli, cli_here

    _, clicks_dir, _, _ = inputs
    users_log, _, want = logs
    job = tmp_path / "mixed.py"
    job.write_text(JOB_MIXED)
    argv = ["run", str(job), "--job-dir", str(tmp_path / "job"), "--until-idle", "--set", "users_from=log", "--set", f"users={users_log}",
            "--set", f"clicks={clicks_dir}", "--set", "files_per_batch=2", "--set", "cap=10", "--set", f"output={tmp_path / 'out'}"]
    crashed = cli(*argv, "-p", "2", "--fault", "after-sink:2")
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    cli_here(*argv, "-p", "3", "--drain-at-end", check=True)  # a new driver: the killed one's JVM went with it
    out = read_output(tmp_path / "out")
    assert not out.duplicated(["id", "page"]).any()
    assert _pairs(tmp_path / "out") == want
    assert sum(_offsets(tmp_path / "job", "users").values()) == sum(len(b) for b in inputs[2])


def test_a_job_run_until_idle_ends_after_its_spark_source_and_log_went_idle(inputs: Any, logs: Any, tmp_path: Path) -> None:
    """With idleness, once both inputs are idle the watermark follows the clock and moved on
    every batch (the rate source keeps Spark's batches coming): a run until idle never
    ended. It ends now, after at most one batch moved only by the clock."""
    import time

    users_dir, _, _, _ = inputs
    _, clicks_log, want = logs
    job = tmp_path / "mixed.py"
    job.write_text(JOB_MIXED)
    seen: list[int] = []

    def slow_at_the_end(rec: Any) -> None:
        seen.append(rec.batch)
        if rec.batch == 5:  # the last file: the inputs fall idle while it runs
            time.sleep(0.5)
        assert rec.batch < 20, "a job run until idle went on batch after batch"

    args = {"users_from": "spark", "users": str(users_dir), "clicks": str(clicks_log), "cap": "1000", "idleness": "200 milliseconds",
            "output": str(tmp_path / "out")}
    run_job(job, tmp_path / "job", 2, args, slow_at_the_end, trigger_interval="100 milliseconds")
    assert max(seen) <= 8
    assert _pairs(tmp_path / "out") == want
