"""Replaying the batches after a deep fallback (keyscale.runtime.driver.recovery) with a stand-in for
Spark: a one-batch query runs the newest batch of the offsets log it finds, then commits."""

from __future__ import annotations

from pathlib import Path

import pytest

from keyscale.checkpoint import sparklog
from keyscale.checkpoint.jobdir import JobDir
from keyscale.checkpoint.manifest import Manifest
from keyscale.errors import StateError
from keyscale.runtime.driver.recovery import replay_spark_batches


def _job(tmp_path: Path, offsets: int, committed: int) -> JobDir:
    jd = JobDir(tmp_path / "job")
    jd.claim("j", 8, 8)
    for kind, n in (("offsets", offsets), ("commits", committed + 1)):
        (jd.spark_checkpoint / kind).mkdir(parents=True, exist_ok=True)
        for b in range(n):
            (jd.spark_checkpoint / kind / str(b)).write_text(f"{kind} {b}")
    for b in range(committed + 1):
        jd.commit(Manifest("j", b, 0, {}))
    return jd


class OneBatchQuery:
    """What Spark does with ``trigger(once=True)`` on a log ahead of its commits: the newest
    offsets entry runs (keyscale commits it), nothing else is planned."""

    def __init__(self, jd: JobDir, fail_at: int | None = None):
        self.jd, self.ran, self.fail_at = jd, list[int](), fail_at

    def __call__(self) -> None:
        newest = sparklog.offset_batches(self.jd.spark_checkpoint)[-1]
        if newest == self.fail_at:
            raise RuntimeError("killed")
        assert (self.jd.spark_checkpoint / "offsets" / str(newest - 1)).exists()  # its input's start
        self.ran.append(newest)
        self.jd.commit(Manifest("j", newest, 0, {}))
        (self.jd.spark_checkpoint / "commits" / str(newest)).write_text("commit")


def test_every_batch_after_the_fallback_is_replayed_in_order_then_the_log_is_whole(tmp_path: Path) -> None:
    jd = _job(tmp_path, offsets=7, committed=1)  # checkpoints 2..6 were lost
    query = OneBatchQuery(jd)
    assert replay_spark_batches(jd, 1, query, lambda: False) == [2, 3, 4, 5]
    assert query.ran == [2, 3, 4, 5]  # 6, the newest, is replayed by the normal start
    assert sparklog.offset_batches(jd.spark_checkpoint) == list(range(7)) and not jd.spark_hidden.exists()


def test_nothing_to_replay_after_a_fallback_of_one(tmp_path: Path) -> None:
    jd = _job(tmp_path, offsets=4, committed=2)
    assert replay_spark_batches(jd, 2, OneBatchQuery(jd), lambda: False) == []


def test_an_interrupted_replay_goes_on_at_the_next_start(tmp_path: Path) -> None:
    jd = _job(tmp_path, offsets=6, committed=0)
    with pytest.raises(RuntimeError):
        replay_spark_batches(jd, 0, OneBatchQuery(jd, fail_at=3), lambda: False)
    sparklog.hide_offsets_after(jd.spark_checkpoint, jd.spark_hidden, 3)  # as if killed before putting them back
    query = OneBatchQuery(jd)
    assert replay_spark_batches(jd, 2, query, lambda: False) == [3, 4]
    assert sparklog.offset_batches(jd.spark_checkpoint) == list(range(6))


def test_a_stop_request_ends_the_replay_between_batches(tmp_path: Path) -> None:
    jd = _job(tmp_path, offsets=6, committed=0)
    query = OneBatchQuery(jd)
    assert replay_spark_batches(jd, 0, query, lambda: len(query.ran) >= 2) == [1, 2]
    assert sparklog.offset_batches(jd.spark_checkpoint) == list(range(6))


def test_a_batch_whose_input_spark_purged_is_refused_before_anything_runs(tmp_path: Path) -> None:
    jd = _job(tmp_path, offsets=6, committed=1)
    (jd.spark_checkpoint / "offsets" / "1").unlink()
    query = OneBatchQuery(jd)
    with pytest.raises(StateError, match="batch 1"):
        replay_spark_batches(jd, 1, query, lambda: False)
    assert query.ran == []


def test_an_empty_restart_sets_aside_the_hidden_entries_with_spark_checkpoint(tmp_path: Path) -> None:
    jd = _job(tmp_path, offsets=6, committed=3)
    sparklog.hide_offsets_after(jd.spark_checkpoint, jd.spark_hidden, 2)  # killed during a replay
    for b in jd.manifest_batches():
        (jd.path / jd.manifest_key(b)).write_text("{")  # and then every checkpoint damaged
    with pytest.raises(StateError, match="--allow-empty-restart"):
        jd.recover()
    rec = jd.recover(allow_empty_restart=True)
    assert rec.empty_restart and rec.manifest is None and rec.spark_set_aside is not None
    assert sparklog.offset_batches(Path(rec.spark_set_aside)) == list(range(6))
    assert not jd.spark_hidden.exists() and not jd.spark_checkpoint.exists()
    assert replay_spark_batches(jd, -1, OneBatchQuery(jd), lambda: False) == []  # Spark starts afresh
