"""Rescaling changes who owns which key groups, never the results.

One input, a P=1 reference; the same input at P=2 -> 4 -> 1 rescaled live between batches
and at P=3 -> 2 across a restart must give identical output, row for row.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from conftest import ALERTS, RUNNING_COUNT, read_output, run_job
from keyscale.checkpoint.jobdir import JobDir
from keyscale.checkpoint.manifest import restore_files

JOBS = {"aggregate": RUNNING_COUNT, "per-record": ALERTS}
EVENTS = {"files": 6, "rows": 3000, "keys": 400}


def _args(inp: Path, out: Path, job: Path = RUNNING_COUNT) -> dict[str, str]:
    """The job's arguments (an argument a job does not read is an error)."""
    return {"input": str(inp), "output": str(out), **({"threshold": "300"} if job == ALERTS else {})}


@pytest.fixture(scope="module")
def references(spark: Any, events: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, pd.DataFrame]:
    """Each of JOBS' output in one uninterrupted run at parallelism 1 (conftest's reference is the running count's alone)."""
    refs = {}
    for name, job in JOBS.items():
        tmp = tmp_path_factory.mktemp(f"ref-{name}")
        run_job(job, tmp / "job", 1, _args(events, tmp / "out", job))
        refs[name] = read_output(tmp / "out")
        assert len(refs[name]) > 0
    return refs


# The RocksDB state backend too (the reference runs in memory): its databases keep the key
# groups a subtask still owns, drop the others and load the moved ones.
@pytest.mark.parametrize(("name", "backend"), [*((n, "memory") for n in JOBS), *((n, "rocksdb") for n in JOBS)])
def test_live_rescale_2_4_1_equals_parallelism_1(
    name: str, backend: str, spark: Any, events: Path, references: dict[str, pd.DataFrame], tmp_path: Path,
) -> None:
    plan = {1: 4, 3: 1}  # after batch 1 ask for 4 subtasks, after batch 3 for 1
    jd = JobDir(tmp_path / "job")

    def rescale(rec: Any) -> None:
        if rec.batch in plan:
            jd.request_rescale(plan[rec.batch])

    summary = run_job(JOBS[name], tmp_path / "job", 2, _args(events, tmp_path / "out", JOBS[name]), on_batch=rescale, state_backend=backend)
    seen = [b.parallelism[next(iter(b.parallelism))] for b in summary.batches]
    assert seen == [2, 2, 4, 4, 1, 1]
    assert [(b, f, t) for b, _, f, t in summary.rescales] == [(2, 2, 4), (4, 4, 1)]
    pd.testing.assert_frame_equal(read_output(tmp_path / "out"), references[name])


def test_restart_at_new_parallelism_equals_parallelism_1(spark: Any, events: Path, references: dict[str, pd.DataFrame], tmp_path: Path) -> None:
    inp = tmp_path / "in"
    inp.mkdir()
    files = sorted(events.glob("part-*.parquet"))
    for f in files[:3]:
        shutil.copy2(f, inp / f.name)
    args = _args(inp, tmp_path / "out")
    run_job(RUNNING_COUNT, tmp_path / "job", 3, args)
    for f in files[3:]:
        shutil.copy2(f, inp / f.name)
    summary = run_job(RUNNING_COUNT, tmp_path / "job", 2, args)
    assert summary.recovered_from == 2
    assert [b.parallelism["totals"] for b in summary.batches] == [2, 2, 2]
    pd.testing.assert_frame_equal(read_output(tmp_path / "out"), references["aggregate"])


def test_unaligned_and_extreme_parallelism(spark: Any, events: Path, references: dict[str, pd.DataFrame], tmp_path: Path) -> None:
    """P that does not divide M, and P = M (one key group per subtask)."""
    jd = JobDir(tmp_path / "job")
    plan = {0: 7, 2: 16, 4: 3}
    summary = run_job(
        RUNNING_COUNT, tmp_path / "job", 5, _args(events, tmp_path / "out"), max_parallelism=16,
        on_batch=lambda rec: jd.request_rescale(plan[rec.batch]) if rec.batch in plan else None,
    )
    assert [b.parallelism["totals"] for b in summary.batches] == [5, 7, 7, 16, 16, 3]
    pd.testing.assert_frame_equal(read_output(tmp_path / "out"), references["aggregate"])


def test_compaction_keeps_results_and_bounds_files(spark: Any, events: Path, references: dict[str, pd.DataFrame], tmp_path: Path) -> None:
    run_job(RUNNING_COUNT, tmp_path / "job", 2, _args(events, tmp_path / "out"), max_chain=2, retain=1)
    m = JobDir(tmp_path / "job").latest_manifest()
    assert m is not None
    files = m.operators["totals"].files
    assert any(f.kind == "snapshot" for f in files)
    # Compaction in slices (max_chain of them a subtask, one a batch): a key group's restore
    # reads its slice's snapshot and at most max_chain - 1 deltas, so a subtask's restore reads
    # at most max_chain snapshots and the max_chain - 1 deltas after the oldest. Beside them
    # the manifest keeps, for workers' copies, the deltas since each snapshot's slice had its
    # snapshot before: at most 2 * max_chain - 1 deltas a subtask.
    assert len(restore_files(files, m.operators["totals"].max_parallelism)) <= 2 * (2 + (2 - 1))
    assert len(files) <= 2 * (2 + (2 * 2 - 1))
    jd = JobDir(tmp_path / "job")
    on_disk = {p.relative_to(jd.path).as_posix() for p in (jd.path / "state" / "totals").glob("*.arrow")}
    kept = {f.path for b in jd.manifest_batches() for f in jd.read_manifest(b).operators["totals"].files}
    assert on_disk == kept  # retention removed the rest (it keeps --retain checkpoints and a fallback that shares no file)
    assert len(jd.manifest_batches()) <= 1 + 2
    pd.testing.assert_frame_equal(read_output(tmp_path / "out"), references["aggregate"])
