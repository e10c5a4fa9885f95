"""Redistribution of non-keyed (operator) state when the parallelism changes.

Operator state is a list of entries per subtask (for example a source's
``(partition, offset)`` pairs). It has no key, so on rescale it is pooled and handed out
again by one of Flink's three rules:

- :func:`split_merge` (even split): each entry goes to exactly one new subtask;
- :func:`union`: every new subtask gets every entry and keeps what it needs;
- :func:`broadcast`: every subtask holds the same map, so any copy will do.

All three are deterministic: the same old state and parallelism give the same result, so a
replayed rescale restores exactly what the first attempt did.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeVar

from keyscale.errors import KeyscaleError, StateError

__all__ = ["broadcast", "split_merge", "union"]

T = TypeVar("T")
K = TypeVar("K")
V = TypeVar("V")


def _check_new_parallelism(new_parallelism: int) -> None:
    if new_parallelism < 1:
        raise KeyscaleError(f"new parallelism {new_parallelism} must be at least 1")


def _pool(old: Sequence[Sequence[T]]) -> list[T]:
    # Subtask order, then entry order: the only order every run agrees on.
    return [entry for entries in old for entry in entries]


def split_merge(old: Sequence[Sequence[T]], new_parallelism: int) -> list[list[T]]:
    """Pool all entries and give each new subtask a contiguous share.

    Shares differ in size by at most one; the first ``total % P`` subtasks get the larger
    share. Contiguous shares keep neighbouring entries (often one reader's partitions)
    together, and the split is idempotent: splitting its result again at the same
    parallelism changes nothing.

    >>> split_merge([["p1", "p2"], ["p3", "p4"]], 1)
    [['p1', 'p2', 'p3', 'p4']]
    >>> split_merge([["p1", "p2"], ["p3", "p4", "p5"]], 3)
    [['p1', 'p2'], ['p3', 'p4'], ['p5']]
    """
    _check_new_parallelism(new_parallelism)
    pooled = _pool(old)
    base, extra = divmod(len(pooled), new_parallelism)
    shares: list[list[T]] = []
    start = 0
    for j in range(new_parallelism):
        size = base + (1 if j < extra else 0)
        shares.append(pooled[start : start + size])
        start += size
    return shares


def union(old: Sequence[Sequence[T]], new_parallelism: int) -> list[list[T]]:
    """Give every new subtask all entries, in pooled order (each its own list).

    >>> union([["a"], ["b"]], 3)
    [['a', 'b'], ['a', 'b'], ['a', 'b']]
    """
    _check_new_parallelism(new_parallelism)
    pooled = _pool(old)
    return [list(pooled) for _ in range(new_parallelism)]


def broadcast(old: Sequence[Mapping[K, V]], new_parallelism: int) -> list[dict[K, V]]:
    """Give every new subtask its own copy of the broadcast map.

    Broadcast state must be identical on every subtask; if the old subtasks disagree the
    state is damaged (or an operator wrote to it unevenly) and no copy can be trusted, so
    this raises :class:`StateError` naming the first differing key. Copies are shallow.

    >>> broadcast([{"rule": 1}, {"rule": 1}], 3)
    [{'rule': 1}, {'rule': 1}, {'rule': 1}]
    >>> broadcast([{"rule": 1}, {"rule": 2}], 3)
    Traceback (most recent call last):
    ...
    keyscale.errors.StateError: broadcast state differs between subtask 0 and subtask 1 at key 'rule'; broadcast state must be identical on every subtask
    """
    _check_new_parallelism(new_parallelism)
    if not old:
        return [{} for _ in range(new_parallelism)]
    first = old[0]
    for i, other in enumerate(old[1:], start=1):
        key = _first_difference(first, other)
        if key is not _SAME:
            raise StateError(
                f"broadcast state differs between subtask 0 and subtask {i} at key {key!r}; "
                "broadcast state must be identical on every subtask"
            )
    return [dict(first) for _ in range(new_parallelism)]


_SAME = object()


def _first_difference(a: Mapping[K, V], b: Mapping[K, V]) -> object:
    """The first key (in ``a``'s order, then ``b``'s) whose presence or value differs."""
    for key, value in a.items():
        # `is` first: a NaN value equals itself only by identity.
        if key not in b or (b[key] is not value and b[key] != value):
            return key
    for key in b:
        if key not in a:
            return key
    return _SAME
