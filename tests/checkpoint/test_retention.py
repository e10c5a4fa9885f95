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

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keyscale.checkpoint.manifest import (
    StateFile,
    chain_length,
    chains,
    deltas_since,
    live_files,
    restore_files,
)
from keyscale.checkpoint.retention import (
    SLICE_ROWS,
    check_compaction,
    checkpoints_to_keep,
    snapshot_range,
)
from keyscale.errors import KeyscaleError
from keyscale.state.keygroups import KeyGroupRange, key_group_range

M = 16


def _simulate(steps: list[tuple[int, list[bool]]], keep: int, max_chain: int, max_age: int,
              rows: int = 1) -> list[dict[int, list[StateFile]]]:
    """The kept checkpoints (batch -> the files its restore reads) after each batch, with
    ``rows`` rows a key group in each file (a large state is compacted in slices); asserts
    on the way that no restore chain is longer than ``max_chain`` files."""
    files: list[StateFile] = []
    kept: dict[int, list[StateFile]] = {}
    history = []
    for batch, (p, changed) in enumerate(steps):
        new = []
        for s in range(p):
            rng = key_group_range(s, M, p)
            part = snapshot_range(rng, batch, chains(files, rng), max_chain, max_age)
            if part is not None:
                since = deltas_since(files, part)
                new.append(StateFile(f"{batch}-{s}-snapshot", batch, "snapshot", part.start, part.end, rows * len(part), 1, 0,
                                     deltas_since=since if since < batch else None))
            # The task's rule: a delta of the changes, but none beside a snapshot of the whole
            # range that no copy can cross.
            if changed[s % len(changed)] and (part is None or part != rng or new[-1].deltas_since is not None):
                new.append(StateFile(f"{batch}-{s}-delta", batch, "delta", rng.start, rng.end, rows * len(rng), 1, 0))
        files = live_files([*files, *new], M)
        assert chain_length(files, KeyGroupRange(0, M - 1), M) <= max_chain
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
    st.sampled_from([1, SLICE_ROWS // 4, SLICE_ROWS]),  # rows a key group: a small state, or slices of 4 or 1 key groups
)


@settings(max_examples=150, deadline=None)
@given(jobs)
def test_one_damaged_file_never_takes_every_kept_checkpoint(job: tuple[list[tuple[int, list[bool]]], int, int, int, int]) -> None:
    steps, keep, max_chain, max_age, rows = job
    for batch, kept in enumerate(_simulate(steps, keep, max_chain, max_age, rows)):
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
def test_a_fallback_replays_a_bounded_number_of_batches(job: tuple[list[tuple[int, list[bool]]], int, int, int, int]) -> None:
    steps, keep, max_chain, max_age, rows = job
    for batch, kept in enumerate(_simulate(steps, keep, max_chain, max_age, rows)):
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
    everything = KeyGroupRange(0, 15)
    large = chains([StateFile("d", 0, "delta", 0, 15, 16 * SLICE_ROWS, 1, 0)], everything)
    small = chains([StateFile("d", 0, "delta", 0, 15, 1000, 1, 0)], everything)
    assert snapshot_range(everything, 1, large, max_chain=8, max_age=32) == KeyGroupRange(2, 3)  # 8 slices, slice 1's turn
    assert snapshot_range(everything, 1, small, max_chain=8, max_age=32) is None  # one slice, its turn at batch 0, 8, ...
    assert snapshot_range(everything, 8, small, max_chain=8, max_age=32) == everything
    assert snapshot_range(everything, 1, chains([], everything), max_chain=8, max_age=32) is None
    # The oldest file 32 batches old: every slice at once.
    assert snapshot_range(everything, 33, large, max_chain=8, max_age=32) == everything


def test_compaction_settings_the_rule_cannot_follow_are_refused_by_name() -> None:
    check_compaction(1, 1)
    with pytest.raises(KeyscaleError, match="--compaction-chain 0"):
        check_compaction(0, 32)
    with pytest.raises(KeyscaleError, match="--max-file-age -1"):
        check_compaction(8, -1)
