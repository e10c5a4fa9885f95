"""A worker's stale copies of key groups (keyscale.runtime.task.memory._evict): kept newest
first up to ``KEYSCALE_STALE_STATE_MB``, against a model of that rule."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import keyscale.runtime.task.memory as memory
from keyscale.state.keygroups import KeyGroupRange
from keyscale.state.types import StateDescriptor

M = 8


def _held(rows_per_group: list[int], last_used: list[int]) -> memory.Held:
    spec = SimpleNamespace(run_id="r", key_names=("k",), extra_keys=(), key_types=(pa.string(),),
                           states=(StateDescriptor("n", "value", pa.int64()),), max_parallelism=M)
    held = memory.Held(spec)  # type: ignore[arg-type]
    kgs = np.repeat(np.arange(M), rows_per_group).astype(np.int32)
    if len(kgs):
        held.table.apply(pa.table({"k": [f"key{i}" for i in range(len(kgs))], "__kg": pa.array(kgs, pa.int32()),
                                   "n": pa.array(np.ones(len(kgs), dtype=np.int64))}))
    held.version[:] = [0 if r else -1 for r in rows_per_group]
    held.last_used[:] = last_used
    return held


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(st.integers(0, 30), min_size=M, max_size=M), last_used=st.lists(st.integers(0, 9), min_size=M, max_size=M),
       start=st.integers(0, M - 1), width=st.integers(1, M), budget_rows=st.integers(0, 200))
def test_stale_copies_are_kept_newest_first_up_to_the_budget(
    rows: list[int], last_used: list[int], start: int, width: int, budget_rows: int,
) -> None:
    """The worker serves key groups ``rng`` in batch 10 (its first subtask of the batch, as in
    the batch before); the others it holds are stale, kept newest first while their rows fit
    the budget (ties: the lower key group first), the rest dropped."""
    held = _held(rows, last_used)
    row_bytes = sum(held.table.memory().values()) / max(1, len(held.table))
    rng = KeyGroupRange(start, min(M - 1, start + width - 1))
    held.tasks = {9: (1, 2)}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KEYSCALE_STALE_STATE_MB", str(budget_rows * row_bytes / 2**20))
        budget = memory.stale_copy_bytes()
        memory._evict(held, rng, 10, 2)
    stale = [g for g in range(M) if rows[g] and not rng.start <= g <= rng.end]
    kept, used = set(), 0.0
    for g in sorted(stale, key=lambda g: -last_used[g]):  # sorted() is stable: the lower key group first
        used += rows[g] * row_bytes
        if used > budget:
            break
        kept.add(g)
    want = {g for g in range(M) if rows[g] and (rng.start <= g <= rng.end or g in kept)}
    assert {int(g) for g in np.unique(held.table.kg)} == want
    assert {g for g in range(M) if held.version[g] >= 0} == want
