"""A Spark source whose commit discards its input (a file source's ``cleanSource``) is refused
by name: keyscale may read a batch again after Spark committed it (asynchronous checkpoints,
a fallback to an older checkpoint), and by then the input would be archived or deleted."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

import keyscale as ks
from conftest import cli_here, write_events
from keyscale.errors import JobDefinitionError

JOB = '''
import keyscale as ks

def build(ctx):
    events = (
        ctx.spark.readStream.schema("key string, value long, ts timestamp")
        .option("cleanSource", "archive").option("sourceArchiveDir", ctx.arg("archive"))
        .parquet(ctx.arg("input"))
    )
    return ks.stream(events).key_by("key").aggregate(uid="totals", n=ks.aggregates.count()).sink(ks.sinks.ParquetSink(ctx.arg("output")))
'''


@pytest.mark.parametrize("value", ["archive", "delete", "DELETE"])
def test_clean_source_refused(spark: Any, tmp_path: Path, value: str) -> None:
    write_events(tmp_path / "in", files=1, rows=10, keys=2)
    df = spark.readStream.schema("key string, value long, ts timestamp").option("cleanSource", value).parquet(str(tmp_path / "in"))
    with pytest.raises(JobDefinitionError) as e:
        ks.stream(df.filter("value > 0"))
    msg = str(e.value)
    assert f"cleanSource={value}" in msg and str(tmp_path / "in") in msg
    assert "read a batch again" in msg and "leave cleanSource off" in msg
    assert (tmp_path / "in" / "part-00000.parquet").exists()


def test_clean_source_off_accepted(spark: Any, tmp_path: Path) -> None:
    write_events(tmp_path / "in", files=1, rows=10, keys=2)
    df = spark.readStream.schema("key string, value long, ts timestamp").option("cleanSource", "off").parquet(str(tmp_path / "in"))
    assert ks.stream(df).columns == ["key", "value", "ts"]


def test_ignore_missing_files_warned(spark: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    write_events(tmp_path / "in", files=1, rows=10, keys=2)
    df = spark.readStream.schema("key string, value long, ts timestamp").option("ignoreMissingFiles", "true").parquet(str(tmp_path / "in"))
    with caplog.at_level(logging.WARNING, logger="keyscale"):
        ks.stream(df)
    warned = [r.getMessage() for r in caplog.records if "ignoreMissingFiles" in r.getMessage()]
    assert len(warned) == 1 and str(tmp_path / "in") in warned[0] and "replay" in warned[0]


@pytest.mark.slow
def test_keyscale_run_refuses_clean_source(tmp_path: Path) -> None:
    write_events(tmp_path / "in", files=2, rows=10, keys=2)
    job = tmp_path / "cleaning_job.py"
    job.write_text(JOB)
    proc = cli_here("run", str(job), "--job-dir", str(tmp_path / "job"), "--until-idle", "--set", f"input={tmp_path / 'in'}",
               "--set", f"archive={tmp_path / 'archive'}", "--set", f"output={tmp_path / 'out'}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("keyscale: error:")]
    assert len(errors) == 1 and "cleanSource=archive" in errors[0] and str(tmp_path / "in") in errors[0], proc.stderr[-2000:]
    # Nothing ran: the input is where it was, nothing archived, no output.
    assert sorted(p.name for p in (tmp_path / "in").iterdir()) == ["part-00000.parquet", "part-00001.parquet"]
    assert not (tmp_path / "archive").exists() and not (tmp_path / "out").exists()


def test_ignore_missing_files_session_setting_warned(spark: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    write_events(tmp_path / "in", files=1, rows=10, keys=2)
    df = spark.readStream.schema("key string, value long, ts timestamp").parquet(str(tmp_path / "in"))
    spark.conf.set("spark.sql.files.ignoreMissingFiles", "true")
    try:
        with caplog.at_level(logging.WARNING, logger="keyscale"):
            ks.stream(df)
    finally:
        spark.conf.unset("spark.sql.files.ignoreMissingFiles")
    warned = [r.getMessage() for r in caplog.records if "ignoreMissingFiles=true (spark.sql.files.ignoreMissingFiles)" in r.getMessage()]
    assert len(warned) == 1
