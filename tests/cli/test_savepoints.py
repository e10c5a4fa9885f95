"""Savepoints in a job's life: take one, move it, restore at any parallelism, stop with one,
upgrade the job's code with its state."""

from __future__ import annotations

import contextlib
import os
import shutil
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
from keyscale.cli.main import main as keyscale_main
from keyscale.errors import StateError

EVENTS = {"files": 6, "rows": 1500, "keys": 250, "seed": 5}


def _stage(events: Path, inp: Path, files: slice) -> None:
    inp.mkdir(exist_ok=True)
    for f in sorted(events.glob("part-*.parquet"))[files]:
        shutil.copy2(f, inp / f.name)


def _union(*folders: Path) -> pd.DataFrame:
    df = pd.concat([read_output(f) for f in folders], ignore_index=True)
    return df.sort_values(list(df.columns)).reset_index(drop=True)


def test_savepoint_moved_and_restored_at_any_parallelism(spark: Any, events: Path, reference: pd.DataFrame, tmp_path: Path) -> None:
    inp = tmp_path / "in"
    _stage(events, inp, slice(0, 3))
    run_job(RUNNING_COUNT, tmp_path / "job", 2, {"input": str(inp), "output": str(tmp_path / "out")}, max_parallelism=16)
    assert keyscale_main(["savepoint", str(tmp_path / "job"), "--dest", str(tmp_path / "sp")]) == 0
    moved = tmp_path / "elsewhere" / "sp-copy"
    moved.parent.mkdir()
    shutil.move(tmp_path / "sp", moved)  # relocatable: nothing points back to where it was written
    _stage(events, inp, slice(3, 6))
    for n in (1, 2, 16):
        summary = run_job(RUNNING_COUNT, tmp_path / f"job{n}", n, {"input": str(inp), "output": str(tmp_path / f"out{n}")}, from_savepoint=str(moved))
        assert summary.recovered_from == 2
        assert [b.batch for b in summary.batches] == [3, 4, 5]
        assert all(b.parallelism["totals"] == n for b in summary.batches)
        pd.testing.assert_frame_equal(_union(tmp_path / "out", tmp_path / f"out{n}"), reference)
    # The original job keeps its own checkpoints; savepoints are outside retention's reach.
    assert moved.exists()


@pytest.mark.parametrize(("before", "after"), [("memory", "rocksdb"), ("rocksdb", "memory")])
def test_a_savepoint_taken_on_one_state_backend_restores_on_the_other(
    spark: Any, events: Path, reference: pd.DataFrame, tmp_path: Path, before: str, after: str,
) -> None:
    inp = tmp_path / "in"
    _stage(events, inp, slice(0, 3))
    run_job(RUNNING_COUNT, tmp_path / "job", 2, {"input": str(inp), "output": str(tmp_path / "out")}, max_parallelism=16, state_backend=before)
    assert keyscale_main(["savepoint", str(tmp_path / "job"), "--dest", str(tmp_path / "sp")]) == 0
    _stage(events, inp, slice(3, 6))
    summary = run_job(RUNNING_COUNT, tmp_path / "job2", 3, {"input": str(inp), "output": str(tmp_path / "out2")},
                      from_savepoint=str(tmp_path / "sp"), state_backend=after)
    assert summary.recovered_from == 2 and [b.batch for b in summary.batches] == [3, 4, 5]
    pd.testing.assert_frame_equal(_union(tmp_path / "out", tmp_path / "out2"), reference)


def test_savepoint_of_a_job_on_s3_restored_anywhere(spark: Any, events: Path, reference: pd.DataFrame, s3_bucket: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A job directory on S3: savepoints to S3 and to local disk (the job stopped), each
    restored into job directories on S3 and on local disk at other parallelisms."""
    from keyscale.state_processor import read_keyed_state

    inp, job = tmp_path / "in", f"{s3_bucket}/jobs/rc"
    _stage(events, inp, slice(0, 3))
    run_job(RUNNING_COUNT, job, 2, {"input": str(inp), "output": str(tmp_path / "out")}, max_parallelism=16)
    sps = {"s3": f"{s3_bucket}/savepoints/sp", "local": str(tmp_path / "sp")}
    for sp in sps.values():
        assert keyscale_main(["savepoint", job, "--dest", sp]) == 0
        assert capsys.readouterr().out.strip() == sp
    assert keyscale_main(["inspect", sps["s3"]]) == 0
    assert capsys.readouterr().out.splitlines()[0] == f"savepoint {sps['s3']}"
    _stage(events, inp, slice(3, 6))
    for sp_kind, new_job, n in (("s3", f"{s3_bucket}/jobs/a", 3), ("local", f"{s3_bucket}/jobs/b", 1), ("s3", str(tmp_path / "job-c"), 16)):
        out = tmp_path / f"out-{n}"
        summary = run_job(RUNNING_COUNT, new_job, n, {"input": str(inp), "output": str(out)}, from_savepoint=sps[sp_kind])
        assert summary.recovered_from == 2 and [b.batch for b in summary.batches] == [3, 4, 5]
        assert all(b.parallelism["totals"] == n for b in summary.batches)
        pd.testing.assert_frame_equal(_union(tmp_path / "out", out), reference)
    state = read_keyed_state(spark, f"{s3_bucket}/jobs/a", "totals").toPandas().set_index("key")
    everything = pd.concat([pd.read_parquet(f) for f in sorted(inp.glob("part-*.parquet"))])
    assert (state["count"].sort_index() == everything.groupby("key").size().sort_index()).all()


def test_restore_refuses_a_job_dir_with_checkpoints(spark: Any, events: Path, tmp_path: Path) -> None:
    inp = tmp_path / "in"
    _stage(events, inp, slice(0, 1))
    args = {"input": str(inp), "output": str(tmp_path / "out")}
    run_job(RUNNING_COUNT, tmp_path / "job", 1, args)
    assert keyscale_main(["savepoint", str(tmp_path / "job"), "--dest", str(tmp_path / "sp")]) == 0
    from keyscale.errors import JobDirError

    with pytest.raises(JobDirError, match="already has checkpoint 0"):
        run_job(RUNNING_COUNT, tmp_path / "job", 1, args, from_savepoint=str(tmp_path / "sp"))


def test_damaged_savepoint_names_the_file(spark: Any, events: Path, tmp_path: Path) -> None:
    inp = tmp_path / "in"
    _stage(events, inp, slice(0, 1))
    run_job(RUNNING_COUNT, tmp_path / "job", 2, {"input": str(inp), "output": str(tmp_path / "out")})
    assert keyscale_main(["savepoint", str(tmp_path / "job"), "--dest", str(tmp_path / "sp")]) == 0
    data = sorted((tmp_path / "sp").rglob("*.parquet"))[0]
    data.write_bytes(data.read_bytes()[:-20] + b"x" * 20)
    with pytest.raises(StateError, match=data.name):
        run_job(RUNNING_COUNT, tmp_path / "job2", 2, {"input": str(inp), "output": str(tmp_path / "o2")}, from_savepoint=str(tmp_path / "sp"))
    shutil.rmtree(tmp_path / "job2")
    (tmp_path / "sp" / "_metadata.json").unlink()
    with pytest.raises(StateError, match=r"_metadata\.json"):
        run_job(RUNNING_COUNT, tmp_path / "job2", 2, {"input": str(inp), "output": str(tmp_path / "o2")}, from_savepoint=str(tmp_path / "sp"))


V2 = '''
import keyscale as ks
from pyspark.sql import functions as F
NAME = "running_count"

class FirstSeen(ks.KeyedProcessFunction):
    def open(self, ctx):
        self.seen = ctx.value_state("seen", "long")
    def process(self, key, rows, ctx):
        if self.seen.value() is None:
            self.seen.update(ctx.batch_id)
            yield (key, ctx.batch_id)

def build(ctx):
    events = ctx.spark.readStream.schema("key string, value long, ts timestamp").option("maxFilesPerTrigger", 1).parquet(ctx.arg("input"))
    return (ks.stream(events).key_by("key")
            .aggregate(uid="totals", count=ks.aggregates.count(), sum=ks.aggregates.sum("value"), biggest=ks.aggregates.max("value"))
            .transform(lambda df: df.select(F.col("key"), F.col("count"), F.col("sum"), F.col("biggest")))
            .key_by("key").process(FirstSeen(), "key string, first_batch long", uid="first_seen")
            .sink(ks.sinks.ParquetSink(ctx.arg("output"))))
'''

V2_INCOMPATIBLE = '''
import keyscale as ks
NAME = "running_count"

class Totals(ks.KeyedProcessFunction):
    def open(self, ctx):
        self.count = ctx.value_state("count", "string")
    def process(self, key, rows, ctx):
        return []

def build(ctx):
    events = ctx.spark.readStream.schema("key string, value long, ts timestamp").parquet(ctx.arg("input"))
    return ks.stream(events).key_by("key").process(Totals(), "key string", uid="totals").sink(ks.sinks.ParquetSink(ctx.arg("output")))
'''


def test_upgrade_adds_an_operator_and_a_state(spark: Any, events: Path, tmp_path: Path) -> None:
    inp = tmp_path / "in"
    _stage(events, inp, slice(0, 3))
    run_job(RUNNING_COUNT, tmp_path / "job", 2, {"input": str(inp), "output": str(tmp_path / "out1")})
    assert keyscale_main(["savepoint", str(tmp_path / "job"), "--dest", str(tmp_path / "sp")]) == 0
    v2 = tmp_path / "running_count_v2.py"
    v2.write_text(V2)
    _stage(events, inp, slice(3, 6))
    summary = run_job(v2, tmp_path / "job_v2", 3, {"input": str(inp), "output": str(tmp_path / "out2")}, from_savepoint=str(tmp_path / "sp"))
    assert [b.batch for b in summary.batches] == [3, 4, 5]
    m = JobDir(tmp_path / "job_v2").latest_manifest()
    assert m is not None and set(m.operators) == {"totals", "first_seen"}
    # The new stage starts empty: every key is "first seen" in the first batch after the upgrade.
    out = read_output(tmp_path / "out2")
    later = pd.concat([pd.read_parquet(f) for f in sorted(inp.glob("part-*.parquet"))[3:]])
    assert set(out["key"]) == set(later["key"])
    assert not out["key"].duplicated().any()  # each key is first seen once
    assert (out["first_batch"] == out["batch"]).all()
    # The evolved aggregate kept count and sum across the upgrade: check via a state read.
    from keyscale.state_processor import read_keyed_state

    state = read_keyed_state(spark, str(tmp_path / "job_v2"), "totals").toPandas().set_index("key")
    everything = pd.concat([pd.read_parquet(f) for f in sorted(inp.glob("part-*.parquet"))])
    expected = everything.groupby("key")["value"].agg(["size", "sum"])
    assert (state["count"].reindex(expected.index) == expected["size"]).all()
    assert (state["sum"].reindex(expected.index) == expected["sum"]).all()
    # `biggest` did not exist before the upgrade: it covers only what came after.
    assert (state["biggest"].dropna().reindex(later.groupby("key")["value"].max().index) == later.groupby("key")["value"].max()).all()


def test_incompatible_state_change_is_refused(spark: Any, events: Path, tmp_path: Path) -> None:
    inp = tmp_path / "in"
    _stage(events, inp, slice(0, 1))
    run_job(RUNNING_COUNT, tmp_path / "job", 1, {"input": str(inp), "output": str(tmp_path / "out")})
    assert keyscale_main(["savepoint", str(tmp_path / "job"), "--dest", str(tmp_path / "sp")]) == 0
    bad = tmp_path / "incompatible.py"
    bad.write_text(V2_INCOMPATIBLE)
    with pytest.raises(StateError, match=r"totals.*count.*(long|int64).*string"):
        run_job(bad, tmp_path / "job2", 1, {"input": str(inp), "output": str(tmp_path / "o2")}, from_savepoint=str(tmp_path / "sp"))
    with pytest.raises(StateError, match=r"totals.*count"):  # also on a plain restart from the checkpoint
        run_job(bad, tmp_path / "job", 1, {"input": str(inp), "output": str(tmp_path / "out")})


@pytest.mark.slow
def test_stop_with_savepoint_then_restart_loses_nothing(spark: Any, events: Path, reference: pd.DataFrame, tmp_path: Path) -> None:
    inp = tmp_path / "in"
    _stage(events, inp, slice(0, 2))
    job = tmp_path / "job"
    log_path = tmp_path / "job.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "keyscale.cli.main", "run", str(RUNNING_COUNT), "--job-dir", str(job), "-p", "2",
             "--trigger-interval", "200 milliseconds", "--set", f"input={inp}", "--set", f"output={tmp_path / 'out1'}"],
            cwd=ROOT, stdout=log, stderr=log, env=os.environ.copy(),
        )
        try:
            jd = JobDir(job)
            deadline = time.time() + 300
            while 1 not in jd.manifest_batches() and time.time() < deadline:
                assert proc.poll() is None, log_path.read_text()[-3000:]
                time.sleep(0.3)
            stop = cli("stop", str(job), "--savepoint", "--dest", str(tmp_path / "sp"), check=True)
            assert stop.stdout.strip() == str(tmp_path / "sp")
            assert proc.wait(timeout=120) == 0
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
    assert not JobDir(job).is_running()
    _stage(events, inp, slice(2, 6))
    cli_here("run", str(RUNNING_COUNT), "--job-dir", str(tmp_path / "job2"), "-p", "3", "--until-idle", "--from-savepoint", str(tmp_path / "sp"),
        "--set", f"input={inp}", "--set", f"output={tmp_path / 'out2'}", check=True)
    pd.testing.assert_frame_equal(_union(tmp_path / "out1", tmp_path / "out2"), reference)


def test_bootstrap_run_read_back_and_rekey(spark: Any, events: Path, tmp_path: Path) -> None:
    """State Processor API: bootstrap a job's state from a historical table, run the job on
    it, read the state back; re-key the bootstrap to another max parallelism: same results."""
    from keyscale.checkpoint.savepoint import read_savepoint
    from keyscale.state_processor import (
        read_keyed_state,
        rekey_savepoint,
        write_savepoint_from_dataframes,
    )

    history = spark.createDataFrame([(f"k{i}", 10, 1000 + i) for i in range(0, 250, 2)], "key string, count long, sum long")
    sp16 = Path(write_savepoint_from_dataframes(tmp_path / "sp16", "running_count", {"totals": (history, ["key"], {"count": "long", "sum": "long"})}, 16))
    sp32 = Path(rekey_savepoint(sp16, tmp_path / "sp32", 32))
    assert read_savepoint(sp32).max_parallelism == 32

    inp = tmp_path / "in"
    _stage(events, inp, slice(0, 2))
    outs = {}
    for name, sp, p in (("m16", sp16, 2), ("m32", sp32, 3)):
        run_job(RUNNING_COUNT, tmp_path / f"job_{name}", p, {"input": str(inp), "output": str(tmp_path / f"out_{name}")}, from_savepoint=str(sp))
        outs[name] = read_output(tmp_path / f"out_{name}")
    pd.testing.assert_frame_equal(outs["m16"], outs["m32"])

    everything = pd.concat([pd.read_parquet(f) for f in sorted(inp.glob("part-*.parquet"))])
    recount = everything.groupby("key")["value"].agg(["size", "sum"])
    base = history.toPandas().set_index("key")
    want_count = recount["size"].add(base["count"], fill_value=0)
    want_sum = recount["sum"].add(base["sum"], fill_value=0)
    state = read_keyed_state(spark, str(tmp_path / "job_m32"), "totals").toPandas().set_index("key")
    assert (state["count"].reindex(want_count.index) == want_count).all()
    assert (state["sum"].reindex(want_sum.index) == want_sum).all()
    check = spark.createDataFrame(state.reset_index()[["key", "key_group"]]).selectExpr("key_group = pmod(hash(key), 32) AS ok")
    assert all(r.ok for r in check.collect())


@pytest.mark.slow
@pytest.mark.parametrize("new_process", [False, True], ids=["same-spark-application", "new-process"])
def test_rescale_with_restart(events: Path, reference: pd.DataFrame, tmp_path: Path, new_process: bool) -> None:
    """`keyscale rescale --restart`: savepoint, stop, start again at N (by default in the same
    process and Spark application; with --new-process, a new one); a failing savepoint
    leaves the job running untouched."""
    inp = tmp_path / "in"
    _stage(events, inp, slice(0, 2))
    job = tmp_path / "job"
    log_path = tmp_path / "job.log"
    started: list[int] = []
    try:
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "keyscale.cli.main", "run", str(RUNNING_COUNT), "--job-dir", str(job), "-p", "2",
                 "--trigger-interval", "200 milliseconds", "--set", f"input={inp}", "--set", f"output={tmp_path / 'out'}"],
                cwd=ROOT, stdout=log, stderr=log, env=os.environ.copy(),
            )
        started.append(proc.pid)
        jd = JobDir(job)
        deadline = time.time() + 300
        while 1 not in jd.manifest_batches() and time.time() < deadline:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            time.sleep(0.3)

        (job / "savepoints").write_text("in the way")  # the savepoint cannot be written
        failed = cli("rescale", str(job), "-p", "3", "--restart")
        assert failed.returncode != 0 and "savepoint" in failed.stderr and "failed" in failed.stderr
        assert proc.poll() is None and jd.is_running()  # untouched
        (job / "savepoints").unlink()

        app_before = jd.read_status()["spark"]["application_id"]
        done = cli("rescale", str(job), "-p", "3", "--restart", *(["--new-process"] if new_process else []), check=True)
        assert "restarted at parallelism 3" in done.stdout
        if new_process:
            assert proc.wait(timeout=120) == 0
            started.append(int(done.stdout.split("(pid ")[1].split(",")[0]))
        else:
            assert f"same process, pid {proc.pid}" in done.stdout and proc.poll() is None
        _stage(events, inp, slice(2, 6))
        while (jd.latest_manifest() is None or jd.latest_manifest().batch < 5) and time.time() < deadline:  # type: ignore[union-attr]
            time.sleep(0.3)
        m = jd.latest_manifest()
        assert m is not None and m.batch == 5 and m.operators["totals"].parallelism == 3
        app_after = jd.read_status()["spark"]["application_id"]
        assert (app_after != app_before) if new_process else (app_after == app_before)  # executors kept: the same application
        cli("stop", str(job), check=True)
    finally:
        for pid in started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    pd.testing.assert_frame_equal(read_output(tmp_path / "out"), reference)
