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

from keyscale.checkpoint.jobdir import JobDir
from keyscale.checkpoint.sparkmirror import SparkMirror
from keyscale.errors import FencedError


def _run(path: Path) -> JobDir:
    jd = JobDir(path)
    jd.claim("j", 8, 8)
    jd.lock()
    jd.unlock()  # the flock is per process; the epoch claim is what fences
    jd.recover()
    return jd


def test_an_intent_left_before_the_takeover_is_adopted(tmp_path: Path) -> None:
    old = _run(tmp_path / "job")
    old.write_intent(3, {"batch_time_ms": 1})  # then the old run crashed
    new = _run(tmp_path / "job")
    intent = new.read_intent(3)
    assert intent is not None and intent["batch_time_ms"] == 1


def test_an_intent_a_paused_run_writes_after_the_takeover_is_not_adopted(tmp_path: Path) -> None:
    old = _run(tmp_path / "job")
    new = _run(tmp_path / "job")
    # The old run passed its fence check before the takeover; its write lands now.
    old.store.create(old.intent_key(3), json.dumps({"batch_time_ms": 1, "epoch": old.epoch}).encode())
    assert new.read_intent(3) is None  # the new run plans batch 3 itself
    new.write_intent(3, {"batch_time_ms": 2}, replace=True)
    assert new.read_intent(3) == {"batch_time_ms": 2, "epoch": new.epoch}


def test_a_paused_run_cannot_replace_the_new_runs_intent(tmp_path: Path) -> None:
    old = _run(tmp_path / "job")
    assert old.read_intent(3) is None  # it reads, then pauses
    new = _run(tmp_path / "job")
    new.write_intent(3, {"batch_time_ms": 2})
    with pytest.raises(FencedError):
        old.write_intent(3, {"batch_time_ms": 1})
    assert JobDir(tmp_path / "job").read_intent(3) == {"batch_time_ms": 2, "epoch": new.epoch}


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
