"""Retention and snapshots (keyscale.checkpoint.retention): one damaged state file never takes
every kept checkpoint, and a fallback replays a bounded number of batches.

A simulated job writes, per batch and subtask, a delta (when its keys changed), a snapshot
(when the pure rule says so, with the batch's changes as a delta beside it) or nothing, at a
parallelism that changes; the driver keeps the live files and applies retention, as the real
one does. What a damaged file takes is a checkpoint whose restore reads it
(``restore_files``): the deltas kept beside a snapshot for workers' copies are not read by
a restore.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from keyscale.checkpoint.manifest import (
    StateFile,
    chain_length,
    deltas_since,
    live_files,
    oldest_chain_file,
    restore_files,
)
from keyscale.checkpoint.retention import checkpoints_to_keep, should_snapshot
from keyscale.state.keygroups import key_group_range

M = 16


def _simulate(steps: list[tuple[int, list[bool]]], keep: int, max_chain: int, max_age: int) -> list[dict[int, list[StateFile]]]:
    """The kept checkpoints (batch -> the files its restore reads) after each batch."""
    files: list[StateFile] = []
    kept: dict[int, list[StateFile]] = {}
    history = []
    for batch, (p, changed) in enumerate(steps):
        new = []
        for s in range(p):
            rng = key_group_range(s, M, p)
            snap = should_snapshot(chain_length(files, rng, M) if files else 0, oldest_chain_file(files, rng, M), batch, max_chain, max_age)
            since = deltas_since(files, rng) if snap else None
            if snap:
                new.append(StateFile(f"{batch}-{s}-snapshot", batch, "snapshot", rng.start, rng.end, 1, 1, 0,
                                     deltas_since=since if since is not None and since < batch else None))
            if changed[s % len(changed)] and (not snap or new[-1].deltas_since is not None):
                new.append(StateFile(f"{batch}-{s}-delta", batch, "delta", rng.start, rng.end, 1, 1, 0))
        files = live_files([*files, *new], M)
        kept[batch] = restore_files(files, M)
        keep_now = checkpoints_to_keep({b: [f.batch for f in fs] for b, fs in kept.items()}, keep)
        kept = {b: fs for b, fs in kept.items() if b in keep_now}
        history.append(dict(kept))
    return history


jobs = st.tuples(
    st.lists(st.tuples(st.sampled_from([1, 2, 3, 4, 8]), st.lists(st.booleans(), min_size=1, max_size=8)), min_size=1, max_size=60),
    st.integers(1, 4),  # --retain
    st.integers(2, 10),  # compaction chain
    st.integers(1, 12),  # max file age
)


@settings(max_examples=150, deadline=None)
@given(jobs)
def test_one_damaged_file_never_takes_every_kept_checkpoint(job: tuple[list[tuple[int, list[bool]]], int, int, int]) -> None:
    steps, keep, max_chain, max_age = job
    for batch, kept in enumerate(_simulate(steps, keep, max_chain, max_age)):
        assert batch in kept  # the newest is always kept, and the newest ``keep``
        assert set(range(max(0, batch - keep + 1), batch + 1)) <= set(kept)
        assert len(kept) <= keep + 2
        if batch < max_age:
            # A young job's first files may be in all its checkpoints (a damaged one is
            # refused; --allow-empty-restart reads the whole input again).
            continue
        paths = {f.path for fs in kept.values() for f in fs}
        for damaged in paths:
            assert any(damaged not in {f.path for f in fs} for fs in kept.values()), (batch, damaged, kept)


@settings(max_examples=150, deadline=None)
@given(jobs)
def test_a_fallback_replays_a_bounded_number_of_batches(job: tuple[list[tuple[int, list[bool]]], int, int, int]) -> None:
    steps, keep, max_chain, max_age = job
    for batch, kept in enumerate(_simulate(steps, keep, max_chain, max_age)):
        newest_files = kept[batch]
        if not newest_files:
            continue
        # The newest checkpoint's files are at most ``max_age`` batches old ...
        assert batch - min(f.batch for f in newest_files) <= max_age
        # ... so from batch max_age on a kept checkpoint shares no file with it, less than
        # 2 * max_age batches back: the most a fallback to it replays.
        if batch >= max_age:
            anchor = max(b for b in kept if all(f.batch > b for f in newest_files))
            assert batch - anchor < 2 * max_age


def test_examples() -> None:
    assert checkpoints_to_keep({}, 3) == set()
    assert checkpoints_to_keep({4: [], 5: []}, 1) == {5}  # no state files: nothing to guard against
    assert checkpoints_to_keep({0: [0], 1: [0, 1], 2: [0, 1, 2]}, 1) == {0, 2}  # a young job: the next anchor
    assert checkpoints_to_keep({0: [0], 1: [0, 1], 2: [2]}, 1) == {1, 2}
    assert checkpoints_to_keep({0: [0], 3: [0, 3], 5: [3, 5], 6: [3, 6]}, 1) == {0, 3, 6}
    assert not should_snapshot(3, 10, 20, max_chain=8, max_age=32)
    assert should_snapshot(8, 10, 20, max_chain=8, max_age=32)
    assert should_snapshot(1, 10, 42, max_chain=8, max_age=32)
    assert not should_snapshot(0, None, 100, max_chain=8, max_age=32)
