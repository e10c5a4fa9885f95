"""The Python API (issue 13): a job started from the user's own script, SparkSession and
settings, controlled from Python; the same job file under spark-submit; what the status says."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow.parquet as pq
import pytest

import keyscale as ks
from conftest import read_output, write_events
from keyscale.errors import KeyscaleError

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def _env_without_venv_on_path() -> dict[str, str]:
    """As in a notebook started outside the venv: its bin is not on PATH, PYSPARK_PYTHON unset."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", "VIRTUAL_ENV")}
    venv_bin = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p != venv_bin)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
    return env


def _input_totals(folder: Path) -> pd.DataFrame:
    df = pq.read_table(folder).to_pandas()
    return df.groupby("key").agg(count=("value", "size"), total=("value", "sum")).sort_index()


def _last_per_key(out: pd.DataFrame) -> pd.DataFrame:
    return out.sort_values(["key", "count"]).groupby("key").last()[["count", "total"]].sort_index()


@pytest.mark.spark
@pytest.mark.slow
def test_a_users_script_starts_rescales_savepoints_and_stops_a_job(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(HERE / "user_script.py"), str(tmp_path)], env=_env_without_venv_on_path(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result: dict[str, Any] = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    # The user's settings are theirs; the Spark UI is on.
    assert result["conf"] == {"spark.sql.shuffle.partitions": "7", "spark.sql.session.timeZone": "Europe/Paris", "spark.app.name": "my-own-app"}
    assert result["ui"]
    # The rescale showed as pending, then applied at the next batch.
    assert result["pending"]["parallelism"] == {"*": 3}
    assert result["after"] == {"state": "running", "pending": None, "parallelism": 3}
    assert [b["totals"] for b in result["batches"]] == [2, 3, 3]
    assert Path(result["savepoint"]).exists() and Path(result["final_savepoint"]).exists()
    assert result["final_state"] == "stopped"
    # Exactly once: each key's last row holds its totals over the whole input.
    pd.testing.assert_frame_equal(_last_per_key(read_output(tmp_path / "out")), _input_totals(tmp_path / "in"), check_dtype=False)


@pytest.mark.spark
@pytest.mark.slow
def test_the_job_file_runs_under_spark_submit_with_the_users_conf(tmp_path: Path) -> None:
    import pyspark

    submit = Path(pyspark.__file__).parent / "bin" / "spark-submit"
    write_events(tmp_path / "in", files=2, rows=1000, keys=30)
    env = {**_env_without_venv_on_path(), "PYSPARK_PYTHON": sys.executable}  # the one line a spark-submit user sets
    proc = subprocess.run(
        [str(submit), "--master", "local[2]", "--conf", "spark.sql.shuffle.partitions=3", "--conf", "spark.ui.enabled=false",
         str(ROOT / "examples" / "running_count.py"), "--job-dir", str(tmp_path / "job"), "-p", "2", "--until-idle",
         "--set", f"input={tmp_path / 'in'}", "--set", f"output={tmp_path / 'out'}"],
        env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "processed 2 batches" in proc.stdout
    out = read_output(tmp_path / "out").rename(columns={"sum": "total"})
    pd.testing.assert_frame_equal(_last_per_key(out), _input_totals(tmp_path / "in"), check_dtype=False)


class Boom(ks.KeyedProcessFunction):
    """Defined at module level in a test file workers cannot import: shipped by value."""

    def process_element(self, row: Any, ctx: Any) -> Any:
        if row.key == "k3":
            raise ValueError(f"cannot handle {row.key}")
        yield (ctx.key, row.value)


def test_a_failed_job_says_failed_with_its_error(spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from keyscale.cli.main import main as cli


    write_events(tmp_path / "in", files=1, rows=200, keys=10)
    events = spark.readStream.schema("key string, value long, ts timestamp").parquet(str(tmp_path / "in"))
    job = (ks.stream(events).key_by("key").process(Boom(), "key string, value long", uid="boom")
           .sink(ks.sinks.ParquetSink(str(tmp_path / "out"))).start(str(tmp_path / "job"), 2, until_idle=True))
    with pytest.raises(Exception, match="cannot handle k3"):
        job.await_termination(300)
    st = job.status()
    assert st["state"] == "failed" and not st["running"]
    assert "cannot handle k3" in st["last_error"]["message"] and st["last_error"]["batch"] == 0
    assert "Traceback" in st["last_error"]["traceback"]
    with pytest.raises(KeyscaleError, match="not running"):
        job.rescale(3)
    assert cli(["status", str(tmp_path / "job")]) == 0
    shown = capsys.readouterr().out
    assert ": failed" in shown and "cannot handle k3" in shown


def test_a_bad_start_option_is_named(spark: Any, tmp_path: Path) -> None:
    events = spark.readStream.schema("key string, value long").parquet(str(tmp_path))
    pipeline = ks.stream(events).key_by("key").aggregate(uid="n", n=ks.aggregates.count()).sink(ks.sinks.NoopSink())
    with pytest.raises(KeyscaleError, match=r"unknown keyword argument 'paralelism' \(did you mean 'parallelism'\?\)"):
        pipeline.start(str(tmp_path / "job"), paralelism=2)


def test_start_takes_an_slo_for_the_autoscaler_and_refuses_one_it_cannot_serve(spark: Any, tmp_path: Path) -> None:
    write_events(tmp_path / "in", files=2, rows=100, keys=10)
    events = spark.readStream.schema("key string, value long, ts timestamp").parquet(str(tmp_path / "in"))
    pipeline = ks.stream(events).key_by("key").aggregate(uid="n", n=ks.aggregates.count()).sink(ks.sinks.NoopSink())
    with pytest.raises(KeyscaleError, match=r"--slo 'latency=soon': 'soon' is not a duration"):
        pipeline.start(str(tmp_path / "bad"), scaling="auto", slo="latency=soon")
    with pytest.raises(KeyscaleError, match=r"--slo lag=30s: only the autoscaler sizes for an SLO"):
        pipeline.start(str(tmp_path / "bad"), slo="lag=30s")
    job = pipeline.start(str(tmp_path / "job"), 2, until_idle=True, scaling="auto", slo="lag=1min")
    job.await_termination(300)
    scaling = job.status()["scaling"]
    assert scaling["slo"] == "lag=60s" and scaling["last_decisions"]["n"]["slo"]["kind"] == "lag"


def test_a_set_up_failure_is_raised_by_start_not_left_in_a_failed_handle(spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The run marks itself failed before its error reaches the handle's thread; start() saw
    # "failed", stopped waiting and returned a failed handle (parallelism=0, now and then).
    # The pause between the two makes that order certain.
    import time

    from keyscale.runtime.driver.runner import JobRunner

    record = JobRunner._record_failure

    def slow_record(self: JobRunner, exc: BaseException) -> None:
        record(self, exc)
        time.sleep(0.5)

    monkeypatch.setattr(JobRunner, "_record_failure", slow_record)
    events = spark.readStream.schema("key string, value long").parquet(str(tmp_path))
    pipeline = ks.stream(events).key_by("key").aggregate(uid="n", n=ks.aggregates.count()).sink(ks.sinks.NoopSink())
    with pytest.raises(KeyscaleError, match="parallelism 0 must be at least 1"):
        pipeline.start(str(tmp_path / "job"), parallelism=0)


CONNECT_SCRIPT = '''
import sys
from pyspark.sql import SparkSession
import keyscale as ks

spark = SparkSession.builder.remote("local[1]").getOrCreate()
df = spark.readStream.schema("key string, value long").parquet(sys.argv[1])
try:
    ks.stream(df)
except ks.KeyscaleError as e:
    print("REFUSED", e)
spark.stop()
'''


@pytest.mark.spark
def test_a_spark_connect_session_is_refused_by_name(tmp_path: Path) -> None:
    # keyscale drives Spark from the driver's JVM (tasks' reports, the executors, the
    # plan): a Spark Connect client has none in its process. Said where the job is built,
    # not as Spark's "attribute not supported" from deep inside a started job.
    (tmp_path / "in").mkdir()
    script = tmp_path / "connect_user.py"
    script.write_text(CONNECT_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "in")], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    refused = [line for line in proc.stdout.splitlines() if line.startswith("REFUSED ")]
    assert refused, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "Spark Connect" in refused[0] and "SparkSession.builder.getOrCreate()" in refused[0]


def test_a_log_source_pipeline_starts_from_python_and_counts_every_record(spark: Any, tmp_path: Path) -> None:
    """A pipeline on a log source, built and started from a user's script on its own session
    (no job file): it runs on that session from the job's thread, and counts each record once."""
    from keyscale.sources import create_log, generate

    log = create_log(str(tmp_path / "log"), "key string, value long, ts timestamp", partitions=2)
    assert generate(log, "400/s for 1s", keys=7).records == 400
    job = (ks.stream(ks.sources.log_source(log, uid="reader")).key_by("key")
           .aggregate(uid="totals", count=ks.aggregates.count())
           .sink(ks.sinks.ParquetSink(str(tmp_path / "out"))).start(str(tmp_path / "job"), 2, until_idle=True))
    assert job.await_termination(300)
    got = read_output(str(tmp_path / "out")).groupby("key")["count"].max()
    assert int(got.sum()) == 400 and len(got) == 7
