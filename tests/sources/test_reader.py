"""The log source's pure planning: offsets as split/merge operator state (FLIP-8)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from keyscale.sources.reader import (
    add_partitions,
    advance,
    from_state,
    initial_assignment,
    lag,
    plan_batch,
    rescale_assignment,
    to_state,
)


def flat(a: list[list[tuple[int, int]]]) -> list[tuple[int, int]]:
    return [e for entries in a for e in entries]


def test_flip8_example() -> None:
    a = initial_assignment(4, 2)
    assert [[p for p, _ in e] for e in a] == [[0, 1], [2, 3]]  # S1: KP1, KP2; S2: KP3, KP4
    a = advance(plan_batch(a, [10, 20, 30, 40], limit=5))
    down = rescale_assignment(a, 1)
    assert down == [[(0, 5), (1, 5), (2, 5), (3, 5)]]  # one reader, each partition from its offset
    up = rescale_assignment(down, 4)
    assert up == [[(0, 5)], [(1, 5)], [(2, 5)], [(3, 5)]]  # no reader idles


@given(st.integers(1, 40), st.integers(1, 12), st.integers(1, 12), st.integers(0, 6))
def test_rescale_never_drops_or_duplicates_a_partition(partitions: int, p_old: int, p_new: int, added: int) -> None:
    a = initial_assignment(partitions, p_old)
    a = [[(p, p * 7) for p, _ in e] for e in a]
    a, new = add_partitions(a, partitions + added)
    assert [p for p, _ in new] == list(range(partitions, partitions + added))
    b = rescale_assignment(a, p_new)
    assert sorted(flat(b)) == sorted(flat(a))  # same partitions, same offsets
    sizes = [len(e) for e in b]
    assert max(sizes) - min(sizes) <= 1
    if partitions + added >= p_new:
        assert min(sizes) >= 1  # no idle reader while there are partitions for it
    assert rescale_assignment(a, p_new) == b  # deterministic
    assert from_state(to_state(b)) == b


@given(st.lists(st.integers(0, 50), min_size=1, max_size=8), st.none() | st.integers(1, 20))
def test_plans_read_each_record_once(ends: list[int], limit: int | None) -> None:
    a = initial_assignment(len(ends), 3)
    seen = [0] * len(ends)
    for _ in range(60):
        for ranges in plan_batch(a, ends, limit):
            for p, start, end in ranges:
                assert start == seen[p] and end <= ends[p]
                seen[p] = end
        a = advance(plan_batch(a, ends, limit))
    assert seen == ends
    assert set(lag(a, ends).values()) == {0}


def test_new_partitions_go_to_the_reader_holding_fewest() -> None:
    a, added = add_partitions([[(0, 3), (1, 0)], [(2, 9)]], 5)
    assert added == [(3, 1), (4, 0)]
    assert a == [[(0, 3), (1, 0), (4, 0)], [(2, 9), (3, 0)]]
