"""Poison input never blocks a job with no way forward: a function that raises for one key,
an unreadable input file, NaN keys; a failed batch can be retried at another parallelism."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import cli, cli_here, read_output, run_job, write_events
from keyscale.checkpoint.jobdir import JobDir
from keyscale.errors import InputDataError, RecordError

FRAGILE = '''
import keyscale as ks

NAME = "fragile"


class Fragile(ks.KeyedProcessFunction):
    def __init__(self, bad):
        self.bad = bad

    def open(self, ctx):
        self.total = ctx.value_state("total", "long")

    def process_element(self, row, ctx):
        total = (self.total.value() or 0) + row.value
        self.total.update(total)
        if ctx.key == self.bad:
            raise ValueError(f"cannot handle {row.value}")
        yield (ctx.key, total)


def build(ctx):
    events = ctx.spark.readStream.schema("key string, value long, ts timestamp").option("maxFilesPerTrigger", 1).parquet(ctx.arg("input"))
    kw = {}
    if ctx.arg("on_error", "fail") != "fail":
        kw = {"on_error": ctx.arg("on_error"), "dead_letter": ks.sinks.ParquetSink(ctx.arg("dead"))}
    return (
        ks.stream(events).key_by("key")
        .process(Fragile(ctx.arg("bad", "none")), "key string, total long", uid="alerts")
        .sink(ks.sinks.ParquetSink(ctx.arg("output")), **kw)
    )
'''


def _job(tmp_path: Path) -> Path:
    job = tmp_path / "fragile.py"
    job.write_text(FRAGILE)
    return job


def _error_block(stderr: str) -> list[str]:
    lines = stderr.splitlines()
    starts = [i for i, ln in enumerate(lines) if ln.startswith("keyscale: error:")]
    assert len(starts) == 1, stderr[-3000:]
    return lines[starts[0] :]


@pytest.mark.slow
def test_raising_function_stops_in_one_screen_then_dead_letters_let_it_go_on(spark: Any, tmp_path: Path) -> None:
    write_events(tmp_path / "in", files=2, rows=50, keys=5)
    job = _job(tmp_path)
    base = ["run", str(job), "--job-dir", str(tmp_path / "job"), "-p", "2", "--until-idle",
            "--set", f"input={tmp_path / 'in'}", "--set", f"output={tmp_path / 'out'}", "--set", "bad=k3"]
    proc = cli(*base)
    assert proc.returncode == 7, proc.stderr[-3000:]
    block = _error_block(proc.stderr)
    assert block[0].startswith("""keyscale: error: operator 'alerts' failed on key "k3" in batch 0 (subtask """), block
    text = "\n".join(block)
    assert '"key": "k3"' in text and f'File "{job}"' in text and 'raise ValueError(f"cannot handle {row.value}")' in text
    assert block[-1].startswith("ValueError: cannot handle ")
    assert len(proc.stderr.splitlines()) < 30, proc.stderr  # no Spark, Py4J or keyscale trace
    assert "Traceback" not in proc.stderr and "\tat org.apache" not in proc.stderr
    assert "PythonException" in (tmp_path / "job" / "last-error.txt").read_text()  # the full text is kept
    assert JobDir(tmp_path / "job").manifest_batches() == []

    # The way forward: the same job directory, the bad key's records dead-lettered (run on
    # the tests' session: the first run's own process is what the screen above checked).
    proc = cli_here(*base, "--set", "on_error=dead_letter", "--set", f"dead={tmp_path / 'dead'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out, dead = read_output(tmp_path / "out"), read_output(tmp_path / "dead")
    assert "k3" not in set(out["key"]) and len(out) + len(dead) == 100
    assert set(dead["operator"]) == {"alerts"} and set(dead["key"]) == {'"k3"'} and sorted(set(dead["batch"])) == [0, 1]
    assert all(json.loads(r)["key"] == "k3" for r in dead["record"])
    assert (dead["error"].str.startswith("ValueError: cannot handle ")).all()
    n0 = int((dead["batch"] == 0).sum())
    assert f"batch 0: operator 'alerts' got {n0} records whose processing raised, sent to the dead-letter sink" in proc.stderr
    events = [json.loads(ln) for ln in (tmp_path / "job" / "events.jsonl").read_text().splitlines()]
    counted = [e["operators"]["alerts"]["dead_lettered"] for e in events if e["type"] == "records_not_processed_normally"]
    assert counted == [n0, len(dead) - n0]


@pytest.mark.slow
def test_unreadable_input_file_is_named_in_one_line(tmp_path: Path) -> None:
    write_events(tmp_path / "in", files=1, rows=20, keys=5)
    bad = tmp_path / "in" / "part-00001.parquet"
    pq.write_table(pa.table({"key": ["x"], "value": pa.array([1], pa.int64()), "ts": pa.array([1], pa.timestamp("ns", tz="UTC"))}), bad, version="2.6")
    os.utime(bad, (1_700_000_001, 1_700_000_001))
    proc = cli("run", str(_job(tmp_path)), "--job-dir", str(tmp_path / "job"), "--until-idle",
               "--set", f"input={tmp_path / 'in'}", "--set", f"output={tmp_path / 'out'}")
    assert proc.returncode == 5, proc.stderr[-3000:]
    block = _error_block(proc.stderr)
    assert len(block) == 1, block
    assert block[0].startswith(f"keyscale: error: cannot read input file {bad}: ")
    assert "column [ts]" in block[0] and "timestamp[ns, tz=UTC]" in block[0]
    assert JobDir(tmp_path / "job").manifest_batches() == [0]  # the good file before it was committed


def test_failed_batch_is_retried_at_another_parallelism(spark: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    write_events(tmp_path / "in", files=1, rows=60, keys=6)
    job = _job(tmp_path)
    args = {"input": str(tmp_path / "in"), "output": str(tmp_path / "out")}
    with pytest.raises(RecordError, match=r'operator .alerts. failed on key "k3" in batch 0'):
        run_job(job, tmp_path / "job", 1, {**args, "bad": "k3"})
    jd = JobDir(tmp_path / "job")
    intent = jd.read_intent(0)
    assert intent is not None and intent.parallelism == {"alerts": 1}
    with caplog.at_level(logging.INFO, logger="keyscale"):
        run_job(job, tmp_path / "job", 2, args)
    assert "batch 0: retrying the failed attempt at -p 2 (it ran with 'alerts' p=1)" in caplog.text
    m = jd.latest_manifest()
    assert m is not None and m.batch == 0 and m.operators["alerts"].parallelism == 2
    assert len(read_output(tmp_path / "out")) == 60


FLOAT_KEYS = '''
import keyscale as ks

NAME = "float_keys"


def build(ctx):
    df = ctx.spark.readStream.schema("key double, value long").parquet(ctx.arg("input"))
    return ks.stream(df).key_by("key", null_keys=ctx.arg("null_keys")).aggregate(uid="per_key", n=ks.aggregates.count()).sink(ks.sinks.ParquetSink(ctx.arg("output")))
'''


def test_nan_key_is_a_null_key(spark: Any, tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"key": [1.5, float("nan"), 2.5, 1.5, float("nan"), None], "value": pa.array([1, 2, 3, 4, 5, 6], pa.int64())}), tmp_path / "in" / "p.parquet")
    job = tmp_path / "float_keys.py"
    job.write_text(FLOAT_KEYS)
    args = {"input": str(tmp_path / "in"), "output": str(tmp_path / "out")}
    with pytest.raises(InputDataError, match=r"null key in column 'key' of operator 'per_key' \(batch 0, 3 records\) \(NaN counts as a null key\)"):
        run_job(job, tmp_path / "job", 1, {**args, "null_keys": "error"})
    run_job(job, tmp_path / "job2", 2, {**args, "null_keys": "drop"})
    out = read_output(tmp_path / "out")
    assert sorted(zip(out["key"], out["n"], strict=True)) == [(1.5, 2), (2.5, 1)]


@pytest.mark.slow
def test_dead_letters_are_exactly_once_across_a_crash_and_a_retry_at_another_parallelism(spark: Any, tmp_path: Path) -> None:
    import signal

    import pyarrow.dataset as pads

    write_events(tmp_path / "in", files=3, rows=40, keys=5)
    base = ["run", str(_job(tmp_path)), "--job-dir", str(tmp_path / "job"), "--until-idle",
            "--set", f"input={tmp_path / 'in'}", "--set", f"output={tmp_path / 'out'}", "--set", "bad=k3",
            "--set", "on_error=dead_letter", "--set", f"dead={tmp_path / 'dead'}"]
    crashed = cli(*base, "-p", "2", "--fault", "after-sink:1")
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    assert (tmp_path / "dead" / "batch=000000000001").exists() and JobDir(tmp_path / "job").manifest_batches() == [0]
    resumed = cli_here(*base, "-p", "3", check=True)  # a new driver: the killed one's JVM went with it
    assert "batch 1: retrying the failed attempt at -p 3 (it ran with 'alerts' p=2)" in resumed.stderr

    # What a run without faults computes: running totals per key in arrival order, k3 set aside.
    records = pads.dataset(str(tmp_path / "in")).to_table().to_pylist()  # files in name order, rows in order
    totals: dict[str, int] = {}
    want, want_dead = [], []
    for r in records:
        if r["key"] == "k3":
            want_dead.append(r["value"])
            continue
        totals[r["key"]] = totals.get(r["key"], 0) + r["value"]
        want.append((r["key"], totals[r["key"]]))
    out, dead = read_output(tmp_path / "out"), read_output(tmp_path / "dead")
    assert sorted(zip(out["key"], out["total"], strict=True)) == sorted(want)
    assert sorted(json.loads(r)["value"] for r in dead["record"]) == sorted(want_dead)  # none lost, none twice
    m = JobDir(tmp_path / "job").latest_manifest()
    assert m is not None and m.batch == 2 and m.operators["alerts"].parallelism == 3
