from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keyscale.errors import KeyscaleError, StateError
from keyscale.state.redistribution import broadcast, split_merge, union

FAST = settings(max_examples=100, deadline=None)

# Entries may repeat (e.g. the same offset twice): multiset equality must still hold.
old_states = st.lists(st.lists(st.integers(0, 20), max_size=8), max_size=8)
parallelisms = st.integers(1, 12)


def pooled(old: list[list[int]]) -> list[int]:
    return [e for entries in old for e in entries]


@FAST
@given(old_states, parallelisms)
def test_split_merge_loses_and_duplicates_nothing(old: list[list[int]], p: int) -> None:
    new = split_merge(old, p)
    assert len(new) == p
    assert Counter(pooled(new)) == Counter(pooled(old))


@FAST
@given(old_states, parallelisms)
def test_split_merge_shares_are_even_contiguous_and_ordered(old: list[list[int]], p: int) -> None:
    new = split_merge(old, p)
    total = len(pooled(old))
    sizes = [len(share) for share in new]
    assert max(sizes) - min(sizes) <= 1
    # The first total % P subtasks get the extra entry.
    assert sizes == [total // p + (1 if j < total % p else 0) for j in range(p)]
    # Concatenating the shares in subtask order gives back the pooled order.
    assert pooled(new) == pooled(old)


@FAST
@given(old_states, parallelisms)
def test_split_merge_is_deterministic_and_idempotent(old: list[list[int]], p: int) -> None:
    new = split_merge(old, p)
    assert split_merge(old, p) == new
    assert split_merge(new, p) == new


@FAST
@given(old_states, parallelisms, parallelisms)
def test_split_merge_composes(old: list[list[int]], p: int, q: int) -> None:
    # Scaling in two steps ends where scaling in one step does.
    assert split_merge(split_merge(old, p), q) == split_merge(old, q)


def test_split_merge_returns_fresh_lists() -> None:
    old = [["a", "b"]]
    new = split_merge(old, 1)
    new[0].append("c")
    assert old == [["a", "b"]]


def test_flip8_example() -> None:
    # Two readers of partitions KP1..KP4, each keeping (partition, offset).
    old = [[("KP1", "o1"), ("KP2", "o2")], [("KP3", "o3"), ("KP4", "o4")]]
    # 2 -> 1: no partition is skipped.
    assert split_merge(old, 1) == [[("KP1", "o1"), ("KP2", "o2"), ("KP3", "o3"), ("KP4", "o4")]]
    # 2 -> 4: no reader idles.
    assert split_merge(old, 4) == [
        [("KP1", "o1")],
        [("KP2", "o2")],
        [("KP3", "o3")],
        [("KP4", "o4")],
    ]
    # 2 -> 3: sizes 2, 1, 1.
    assert split_merge(old, 3) == [
        [("KP1", "o1"), ("KP2", "o2")],
        [("KP3", "o3")],
        [("KP4", "o4")],
    ]


def test_split_merge_edge_cases() -> None:
    assert split_merge([], 3) == [[], [], []]
    assert split_merge([[], []], 2) == [[], []]
    assert split_merge([["x"]], 3) == [["x"], [], []]


@FAST
@given(old_states, parallelisms)
def test_union_gives_everyone_everything(old: list[list[int]], p: int) -> None:
    new = union(old, p)
    assert len(new) == p
    assert all(share == pooled(old) for share in new)
    assert union(old, p) == new


def test_union_lists_are_independent() -> None:
    new = union([["a"], ["b"]], 2)
    new[0].append("z")
    assert new[1] == ["a", "b"]


maps = st.dictionaries(st.text(max_size=3), st.integers(), max_size=6)


@FAST
@given(maps, st.integers(0, 5), parallelisms)
def test_broadcast_copies(state: dict[str, int], copies: int, p: int) -> None:
    old = [dict(state) for _ in range(copies)]
    new = broadcast(old, p)
    assert len(new) == p
    assert all(m == (state if copies else {}) for m in new)
    # Each subtask owns its map: changing one changes no other.
    new[0]["\x00changed"] = 1
    assert all("\x00changed" not in m for m in new[1:])
    assert all("\x00changed" not in m for m in old)


@FAST
@given(maps, st.integers(1, 4), parallelisms, st.data())
def test_broadcast_disagreement_raises(
    state: dict[str, int], copies: int, p: int, data: st.DataObject
) -> None:
    other = dict(state)
    changed = data.draw(st.text(max_size=3), label="changed key")
    if changed in other:
        other[changed] += 1
    else:
        other[changed] = 0
    old = [dict(state) for _ in range(copies)] + [other]
    with pytest.raises(StateError) as info:
        broadcast(old, p)
    message = str(info.value)
    assert f"subtask {copies}" in message
    assert repr(changed) in message


def test_broadcast_names_first_differing_key() -> None:
    a = {"x": 1, "y": 2, "z": 3}
    with pytest.raises(StateError, match="subtask 0 and subtask 2 at key 'y'"):
        broadcast([a, dict(a), {"x": 1, "y": 5, "z": 4}], 2)
    with pytest.raises(StateError, match="at key 'w'"):
        broadcast([a, {**a, "w": 0}], 2)  # an extra key in a later subtask
    with pytest.raises(StateError, match="at key 'z'"):
        broadcast([a, {"x": 1, "y": 2}], 2)  # a missing key


def test_broadcast_empty_and_nan() -> None:
    assert broadcast([], 3) == [{}, {}, {}]
    nan = float("nan")
    assert len(broadcast([{"k": nan}, {"k": nan}], 2)) == 2


@pytest.mark.parametrize("p", [0, -1])
def test_new_parallelism_must_be_positive(p: int) -> None:
    for f in (split_merge, union):
        with pytest.raises(KeyscaleError, match=f"new parallelism {p}"):
            f([[1]], p)
    with pytest.raises(KeyscaleError, match=f"new parallelism {p}"):
        broadcast([{}], p)
