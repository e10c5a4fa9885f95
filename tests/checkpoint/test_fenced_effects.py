"""Effects of a batch written by a run that a newer one took over (issue 32, case 2).

The old run passed its checks and paused; the new run claimed the next epoch. A batch
intent the old run writes afterwards is never adopted by the new run, never overwrites
the new run's, and Spark's mirrored checkpoint is neither written nor pruned by it. An
intent an old run left before the takeover (it crashed mid-batch) is adopted: its
replay must follow it. Two :class:`JobDir` objects on one folder are the two runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from keyscale.checkpoint.fence import Fence
from keyscale.checkpoint.intent import BatchIntent
from keyscale.checkpoint.jobdir import JobDir
from keyscale.checkpoint.sparkmirror import SparkMirror
from keyscale.errors import FencedError


class _CheckedBeforeTheTakeover(Fence):
    """A run's fence whose check passed before the takeover: its next write still lands."""

    def check(self, doing: str) -> None:
        pass


def _run(path: Path) -> JobDir:
    jd = JobDir(path)
    jd.claim("j", 8, 8)
    jd.lock()
    jd.unlock()  # the flock is per process; the epoch claim is what fences
    jd.recover()
    return jd


def test_an_intent_left_before_the_takeover_is_adopted(tmp_path: Path) -> None:
    old = _run(tmp_path / "job")
    old.write_intent(3, BatchIntent(batch_time_ms=1))  # then the old run crashed
    new = _run(tmp_path / "job")
    intent = new.read_intent(3)
    assert intent is not None and intent.batch_time_ms == 1


def test_an_intent_a_paused_run_writes_after_the_takeover_is_not_adopted(tmp_path: Path) -> None:
    old = _run(tmp_path / "job")
    new = _run(tmp_path / "job")
    # The old run passed its fence check before the takeover; its write lands now.
    old.store.create(old.intent_key(3), json.dumps({"batch_time_ms": 1, "epoch": old.epoch}).encode())
    assert new.read_intent(3) is None  # the new run plans batch 3 itself
    new.write_intent(3, BatchIntent(batch_time_ms=2), replace=True)
    assert new.read_intent(3) == BatchIntent(batch_time_ms=2, epoch=new.epoch)


def test_a_paused_run_cannot_replace_the_new_runs_intent(tmp_path: Path) -> None:
    old = _run(tmp_path / "job")
    assert old.read_intent(3) is None  # it reads, then pauses
    new = _run(tmp_path / "job")
    new.write_intent(3, BatchIntent(batch_time_ms=2))
    with pytest.raises(FencedError):
        old.write_intent(3, BatchIntent(batch_time_ms=1))
    assert JobDir(tmp_path / "job").read_intent(3) == BatchIntent(batch_time_ms=2, epoch=new.epoch)


def test_a_paused_run_neither_writes_nor_prunes_sparks_mirrored_checkpoint(tmp_path: Path) -> None:
    old = _run(tmp_path / "job")
    local = tmp_path / "spark-old"
    (local / "offsets").mkdir(parents=True)
    (local / "offsets" / "0").write_text("old run")
    mirror = SparkMirror(old.store, local, old.fence)
    new = _run(tmp_path / "job")
    new_local = tmp_path / "spark-new"
    (new_local / "offsets").mkdir(parents=True)
    (new_local / "offsets" / "0").write_text("new run")
    SparkMirror(new.store, new_local, new.fence).push(0)
    before = sorted(o.key for o in new.store.list("spark"))
    with pytest.raises(FencedError):
        mirror.push(1)  # a full bundle: it would also delete every older one
    assert sorted(o.key for o in new.store.list("spark")) == before


def test_a_bundle_a_paused_run_writes_after_its_check_is_not_the_jobs_history(tmp_path: Path) -> None:
    """The old run passed its fence check and paused before writing its bundle of batch 2;
    the new run wrote its own bundle of batch 2 meanwhile. The late bundle lands beside it
    (bundles are named per run) and the next rebuild of Spark's checkpoint ignores it."""
    old = _run(tmp_path / "job")
    old_local = tmp_path / "spark-old"
    (old_local / "offsets").mkdir(parents=True)
    old_mirror = SparkMirror(old.store, old_local, old.fence)
    for b in (0, 1):
        (old_local / "offsets" / str(b)).write_text(f"old {b}")
        old_mirror.push(b)
    new = _run(tmp_path / "job")
    new_local = tmp_path / "spark-new"
    SparkMirror(new.store, new_local, new.fence).pull()
    (new_local / "offsets" / "2").write_text("new 2")
    SparkMirror(new.store, new_local, new.fence).push(2)
    (old_local / "offsets" / "2").write_text("old 2")
    old_mirror.fence = _CheckedBeforeTheTakeover(old.store, old.epoch)  # the write lands now
    old_mirror.push(2)
    rebuilt = tmp_path / "spark-third"
    SparkMirror(new.store, rebuilt).pull()
    assert {p.name: p.read_text() for p in (rebuilt / "offsets").iterdir()} == {"0": "old 0", "1": "old 1", "2": "new 2"}


def test_a_paused_run_records_no_damage_for_the_next_start(tmp_path: Path) -> None:
    """A zombie that reads a damaged state file does not write the shared damage report
    (the run that took over reads the file itself)."""
    old = _run(tmp_path / "job")
    _run(tmp_path / "job")
    with pytest.raises(FencedError):
        old.report_damage("state file x is damaged")
    assert not old.store.exists("damage.json")
