"""A run that a newer one fenced cannot bring a checkpoint back (issue 32, case 3).

The old run passed its fence check and paused before creating manifest ``b``; the new run
resumed from an earlier checkpoint, committed ``b`` and later batches, and retention deleted
``b``. Created only if absent, the old run's manifest would land again: a stale checkpoint
among the new run's, a fallback anchor whose intents are gone. The jobs here run no Spark:
two :class:`JobDir` objects on one folder are the two runs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from keyscale.checkpoint.fence import superseded
from keyscale.checkpoint.intent import BatchIntent
from keyscale.checkpoint.jobdir import JobDir
from keyscale.checkpoint.manifest import Manifest
from keyscale.errors import FencedError, StateError


def _manifest(batch: int, **extra: int) -> Manifest:
    return Manifest("j", batch, batch, {}, created_ms=batch, extra=dict(extra))


def _run(path: Path) -> JobDir:
    jd = JobDir(path)
    jd.claim("j", 8, 8)
    jd.claim_epoch()  # the lock's claim, without the flock two runs of one process cannot both hold
    return jd


def _takeover(path: Path, commits: range, keep: int = 2) -> JobDir:
    new = _run(path)
    new.recover()
    for b in commits:
        new.write_intent(b, BatchIntent(batch_time_ms=b))
        new.commit(_manifest(b))
        new.retain(keep)
    return new


def test_a_fenced_runs_late_commit_does_not_resurrect_a_retired_checkpoint(tmp_path: Path) -> None:
    old = _run(tmp_path / "job")
    for b in (0, 1):
        old.commit(_manifest(b))
    real_create = old.store.create

    def paused(key: str, data: bytes) -> bool:
        if key == old.manifest_key(2):  # the old run passed its checks and pauses here
            _takeover(tmp_path / "job", range(2, 7))
            assert 2 not in JobDir(tmp_path / "job").manifest_batches()  # retention deleted it
        return real_create(key, data)

    old.store.create = paused  # type: ignore[method-assign]
    with pytest.raises(FencedError):
        old.commit(_manifest(2))  # it wakes up, creates its manifest, and learns it is fenced
    # The next start resumes from the newest checkpoint and sets the late one aside.
    third = _run(tmp_path / "job")
    rec = third.recover()
    assert rec.manifest is not None and rec.manifest.batch == 6
    assert third.manifest_batches() == [5, 6]
    assert (tmp_path / "job" / "checkpoints" / "manifest-000000000002.json.superseded").exists()


def test_recovery_sets_aside_a_checkpoint_an_older_run_created_after_a_newer_one_resumed(tmp_path: Path) -> None:
    """The old run died between its late create and the fence check after it: the next
    start finds the manifest and never resumes from it, nor falls back to it."""
    old = _run(tmp_path / "job")
    for b in (0, 1):
        old.commit(_manifest(b))
    _takeover(tmp_path / "job", range(2, 7))
    old.store.create(old.manifest_key(2), _manifest(2, epoch=old.epoch, resumed_from=-1).dumps().encode())
    for b in JobDir(tmp_path / "job").manifest_batches():
        if b > 2:
            (tmp_path / "job" / "checkpoints" / f"manifest-{b:012d}.json").write_text("damaged")
    third = _run(tmp_path / "job")
    with pytest.raises(StateError, match="no intact checkpoint"):
        third.recover()  # 5 and 6 are damaged; 2 is not theirs to fall back to
    assert third.recover(allow_empty_restart=True).manifest is None
    assert 2 not in third.manifest_batches()


@given(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 3), st.booleans()), min_size=1, max_size=7))
def test_superseded_finds_exactly_the_late_commits_no_run_resumed_from(runs: list[tuple[int, int, bool]]) -> None:
    """A model of a job's life: each run resumes from the newest checkpoint there is,
    commits some batches, and keeps the newest few (retention); a run taken over while
    paused before a commit creates that manifest late (if it is absent: retention deleted
    it, or the newer run has not got there). The rule finds the late manifests that no
    later run resumed from, and only them."""
    present: dict[int, int] = {}  # batch -> epoch of the run that created it
    resumed: dict[int, tuple[int, int]] = {}
    late: set[tuple[int, int]] = set()
    paused: tuple[int, int] | None = None  # (epoch, batch) of a run paused before its create
    for epoch, (commits, keep, pauses) in enumerate(runs, start=1):
        start = max(present, default=-1)
        resumed[epoch] = (start, present.get(start, 0))
        for b in range(start + 1, start + 1 + commits):
            if b in present:  # the late manifest is there: this run's create fails, it stops
                break
            present[b] = epoch
            for old in sorted(present)[: max(0, len(present) - keep - 1)]:
                del present[old]
        if paused is not None and paused[1] not in present:  # the paused run wakes up
            present[paused[1]] = paused[0]
            late.add((paused[1], paused[0]))
        paused = (epoch, max(present, default=-1) + 1) if pauses else None
    expected = {b for b, e in late if present.get(b) == e and (b, e) not in resumed.values()}
    assert set(superseded(present, resumed)) == expected
