"""A Parquet output path belongs to one job lineage (issue 10, case 3), and its output is
complete before the manifest commits (case 10)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from conftest import cli_here, read_output, run_job
from keyscale.checkpoint.jobdir import JobDir
from keyscale.checkpoint.lineage import Lineage
from keyscale.checkpoint.savepoint import write_savepoint
from keyscale.errors import OutputError
from keyscale.sinks.base import SinkContext
from keyscale.sinks.parquet import MARKER, SUPERSEDED, ParquetSink, batch_folder_name
from keyscale.storage import LocalStore

EVENTS = {"files": 3, "rows": 300, "keys": 40, "seed": 3}

# The running count with a "code change": every value multiplied by --set factor=N.
JOB = '''
import keyscale as ks
from pyspark.sql import functions as F

NAME = "running_count"

def build(ctx):
    events = (ctx.spark.readStream.schema("key string, value long, ts timestamp")
              .option("maxFilesPerTrigger", 1).parquet(ctx.arg("input")))
    factor = int(ctx.arg("factor", "1"))
    return (ks.stream(events).transform(lambda df: df.withColumn("value", F.col("value") * factor))
            .key_by("key").aggregate(uid="totals", count=ks.aggregates.count(), sum=ks.aggregates.sum("value"))
            .sink(ks.sinks.ParquetSink(ctx.arg("output"))))
'''


@pytest.fixture()
def job(tmp_path: Path) -> Path:
    path = tmp_path / "scaled_count.py"
    path.write_text(JOB)
    return path


def _markers(out: Path) -> dict[int, dict[str, Any]]:
    return {int(p.name.split("=")[1]): json.loads((p / MARKER).read_text()) for p in sorted(out.glob("batch=*"))}


def test_a_second_job_dir_on_the_same_output_is_refused_before_its_first_batch(spark: Any, events: Path, job: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    run_job(job, tmp_path / "a", 1, {"input": str(events), "output": str(out)})
    before = read_output(out)
    assert {m["job_dir"] for m in _markers(out).values()} == {str(tmp_path / "a")}
    # e.g. a deployment restored with NONE: a new job directory, empty state, the same output
    proc = cli_here("run", str(job), "--job-dir", str(tmp_path / "b"), "-p", "1", "--until-idle",
               "--set", f"input={events}", "--set", f"output={out}", "--set", "factor=2")
    assert proc.returncode == OutputError.exit_code
    msg = proc.stderr.strip().splitlines()[-1]
    assert str(out) in msg and "batch 0" in msg and str(tmp_path / "a") in msg and str(tmp_path / "b") in msg and "another output path" in msg
    assert not JobDir(tmp_path / "b").manifest_batches()  # nothing ran
    pd.testing.assert_frame_equal(read_output(out), before)


def test_restore_of_an_older_savepoint_replaces_the_later_batches(spark: Any, events: Path, job: Path, tmp_path: Path) -> None:
    """After a code fix, a restore from the savepoint of batch 0 recomputes batches 1 and 2:
    their new output replaces the old, which is kept aside, never deleted."""
    out = tmp_path / "out"
    a = JobDir(tmp_path / "a")
    run_job(job, a.path, 1, {"input": str(events), "output": str(out)})
    old = read_output(out)
    old_lineage = Lineage.from_json(a.read_manifest(2).extra["lineage"])
    assert old_lineage is not None
    sp = write_savepoint(a, a.read_manifest(0), tmp_path / "sp")
    run_job(job, tmp_path / "b", 1, {"input": str(events), "output": str(out), "factor": "10"}, from_savepoint=str(sp))
    new = read_output(out)
    reference_dir = tmp_path / "ref"
    run_job(job, tmp_path / "r", 1, {"input": str(events), "output": str(reference_dir), "factor": "10"})
    ref = read_output(reference_dir)
    # batch 0 is the savepoint's (factor 1); 1 and 2 the fixed code's, on top of batch 0's state
    pd.testing.assert_frame_equal(new[new.batch == 0].reset_index(drop=True), old[old.batch == 0].reset_index(drop=True))
    later = new[new.batch > 0].reset_index(drop=True)
    assert len(later) and not later.equals(old[old.batch > 0].reset_index(drop=True))
    assert not later.equals(ref[ref.batch > 0].reset_index(drop=True))  # the state of batch 0 came with the savepoint
    markers = _markers(out)
    assert markers[0]["lineage"] == old_lineage.id and markers[1]["lineage"] != old_lineage.id == markers[0]["lineage"]
    # (Spark's file source, restored at batch 0, reads both later files in batch 1: the old
    # batch 2 has no counterpart and is set aside all the same)
    assert {m["job_dir"] for b, m in markers.items() if b > 0} == {str(tmp_path / "b")}
    kept = out / SUPERSEDED / old_lineage.id
    assert sorted(p.name for p in kept.iterdir()) == [batch_folder_name(1), batch_folder_name(2)]
    pd.testing.assert_frame_equal(read_output(kept), old[old.batch > 0].reset_index(drop=True))


def test_output_is_complete_before_the_manifest_commits(
    spark: Any, events: Path, job: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each batch's marker is created after every file it lists is in place (each task's
    durable put returned), and before the job commits the batch."""
    log: list[str] = []
    real_create = LocalStore.create

    def create(self: LocalStore, key: str, data: bytes) -> bool:
        if key.endswith(MARKER):
            folder = self.path(key).parent
            listed = json.loads(data)["files"]
            assert all((folder / f["name"]).stat().st_size == f["bytes"] for f in listed), listed
            log.append(f"marker:{json.loads(data)['batch']}")
        return real_create(self, key, data)

    real_commit = JobDir.commit

    def commit(self: JobDir, manifest: Any) -> None:
        real_commit(self, manifest)
        log.append(f"commit:{manifest.batch}")

    monkeypatch.setattr(LocalStore, "create", create)
    monkeypatch.setattr(JobDir, "commit", commit)
    out = tmp_path / "out"
    run_job(job, tmp_path / "a", 1, {"input": str(events), "output": str(out)})
    for b in range(3):
        assert log.index(f"marker:{b}") < log.index(f"commit:{b}")
    assert log.index("commit:0") < log.index("marker:1") and log.index("commit:1") < log.index("marker:2")
    assert len(read_output(out)) == sum(m["rows"] for m in _markers(out).values()) > 0


def test_an_unbound_sink_and_a_bound_one_agree_on_replays(spark: Any, tmp_path: Path) -> None:
    sink = ParquetSink(tmp_path / "out")
    me = Lineage("me")
    sink.open(SinkContext(me, "j", str(tmp_path / "jd"), "run1", -1))
    sink.write(spark.createDataFrame([("a", 1)], "key string, n long"), 0)
    sink.write(spark.createDataFrame([("a", 2)], "key string, n long"), 0)  # a replay: kept
    assert read_output(tmp_path / "out").n.tolist() == [1]
    other = ParquetSink(tmp_path / "out")
    other.open(SinkContext(Lineage("later", {"me": -1}), "j", str(tmp_path / "jd"), "run2", -1))  # started over
    assert not (tmp_path / "out" / batch_folder_name(0)).exists()
    assert (tmp_path / "out" / SUPERSEDED / "me" / batch_folder_name(0) / MARKER).exists()
