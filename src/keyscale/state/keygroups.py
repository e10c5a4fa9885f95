"""Key groups: the unit in which keyed state is stored, checkpointed and moved.

A record's key group is ``pmod(hash(key columns), M)`` (see :mod:`keyscale.state.spark_hash`),
where ``M`` is the max parallelism, fixed for the life of the state. A subtask at parallelism
``P`` owns one contiguous range of key groups. Rescaling reassigns ranges; a key never changes
key group. The arithmetic is Flink's ``KeyGroupRangeAssignment``, so the layouts match; this
module is its one home: :func:`subtask_of` (and the ranges it implies), and
:func:`subtask_of_sql`, the same rule as the Spark SQL the stages route rows with.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from keyscale.errors import KeyscaleError

__all__ = [
    "DEFAULT_LOWER_BOUND_MAX_PARALLELISM",
    "UPPER_BOUND_MAX_PARALLELISM",
    "KeyGroupRange",
    "aligned_parallelism",
    "check_parallelism",
    "default_max_parallelism",
    "is_aligned",
    "key_group_range",
    "key_group_ranges",
    "subtask_of",
    "subtask_of_sql",
]

#: Smallest default max parallelism: leaves room to scale up small jobs (Flink's value).
DEFAULT_LOWER_BOUND_MAX_PARALLELISM = 128
#: Largest number of key groups (Flink's value, 2**15).
UPPER_BOUND_MAX_PARALLELISM = 32768


@dataclass(frozen=True, order=True)
class KeyGroupRange:
    """A non-empty range of key groups, inclusive at both ends.

    >>> r = KeyGroupRange(0, 63)
    >>> len(r), 63 in r, 64 in r, str(r)
    (64, True, False, '0-63')
    >>> r.intersection(KeyGroupRange(60, 100))
    KeyGroupRange(start=60, end=63)
    """

    start: int
    end: int

    def __post_init__(self) -> None:
        # An empty range never describes a subtask (P <= M), so it can only be a bug.
        if not 0 <= self.start <= self.end:
            raise ValueError(f"invalid key group range {self.start}-{self.end}")

    def __len__(self) -> int:
        return self.end - self.start + 1

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.end + 1))

    def __contains__(self, key_group: object) -> bool:
        return isinstance(key_group, int) and self.start <= key_group <= self.end

    def __str__(self) -> str:
        return f"{self.start}-{self.end}"

    def overlaps(self, other: KeyGroupRange) -> bool:
        """Whether the two ranges share at least one key group.

        >>> KeyGroupRange(0, 9).overlaps(KeyGroupRange(9, 20))
        True
        >>> KeyGroupRange(0, 9).overlaps(KeyGroupRange(10, 20))
        False
        """
        return self.start <= other.end and other.start <= self.end

    def intersection(self, other: KeyGroupRange) -> KeyGroupRange | None:
        """The key groups in both ranges, or ``None`` when they are disjoint.

        >>> KeyGroupRange(0, 63).intersection(KeyGroupRange(32, 127))
        KeyGroupRange(start=32, end=63)
        >>> KeyGroupRange(0, 9).intersection(KeyGroupRange(10, 20)) is None
        True
        """
        if not self.overlaps(other):
            return None
        return KeyGroupRange(max(self.start, other.start), min(self.end, other.end))


def _round_up_to_power_of_two(x: int) -> int:
    return 1 << (x - 1).bit_length() if x > 1 else 1


def default_max_parallelism(parallelism: int) -> int:
    """Flink's default number of key groups for a first parallelism ``parallelism``.

    ``min(max(roundUpToPowerOfTwo(P + P // 2), 128), 32768)``: at least 50% headroom to scale
    up, a power of two so that power-of-two parallelisms get equal ranges.

    >>> [default_max_parallelism(p) for p in (1, 85, 86, 100, 20000, 50000)]
    [128, 128, 256, 256, 32768, 32768]
    """
    if parallelism < 1:
        raise KeyscaleError(f"parallelism {parallelism} must be at least 1")
    wanted = _round_up_to_power_of_two(parallelism + parallelism // 2)
    return min(max(wanted, DEFAULT_LOWER_BOUND_MAX_PARALLELISM), UPPER_BOUND_MAX_PARALLELISM)


def check_parallelism(parallelism: int, max_parallelism: int) -> None:
    """Raise :class:`KeyscaleError` unless ``1 <= parallelism <= max_parallelism <= 32768``.

    >>> check_parallelism(4, 128)
    >>> check_parallelism(300, 128)
    Traceback (most recent call last):
    ...
    keyscale.errors.KeyscaleError: parallelism 300 is larger than the max parallelism 128 (the number of key groups); choose 1..128
    """
    if max_parallelism < 1:
        raise KeyscaleError(
            f"max parallelism {max_parallelism} must be at least 1 (it is the number of key groups)"
        )
    if max_parallelism > UPPER_BOUND_MAX_PARALLELISM:
        raise KeyscaleError(
            f"max parallelism {max_parallelism} is larger than {UPPER_BOUND_MAX_PARALLELISM}, "
            "the largest supported number of key groups"
        )
    if parallelism < 1:
        raise KeyscaleError(f"parallelism {parallelism} must be at least 1")
    if parallelism > max_parallelism:
        raise KeyscaleError(
            f"parallelism {parallelism} is larger than the max parallelism {max_parallelism} "
            f"(the number of key groups); choose 1..{max_parallelism}"
        )


def subtask_of(key_group: int, max_parallelism: int, parallelism: int) -> int:
    """The subtask that owns ``key_group`` at ``parallelism``: ``key_group * P // M``.

    >>> [subtask_of(kg, 10, 3) for kg in range(10)]
    [0, 0, 0, 0, 1, 1, 1, 2, 2, 2]
    """
    check_parallelism(parallelism, max_parallelism)
    if not 0 <= key_group < max_parallelism:
        raise KeyscaleError(f"key group {key_group} is outside 0..{max_parallelism - 1}")
    return key_group * parallelism // max_parallelism


def subtask_of_sql(key_group: str, max_parallelism: int, parallelism: int) -> str:
    """:func:`subtask_of` as a Spark SQL int expression over the SQL int expression
    ``key_group`` (Spark's ``div`` truncates, which is ``//`` for these non-negative ints,
    and ``key_group * P`` stays below ``2**30``, inside Spark's int).

    >>> subtask_of_sql("kg", 10, 3)
    'int((kg * 3) div 10)'
    """
    check_parallelism(parallelism, max_parallelism)
    return f"int(({key_group} * {int(parallelism)}) div {int(max_parallelism)})"


def key_group_range(subtask: int, max_parallelism: int, parallelism: int) -> KeyGroupRange:
    """The contiguous key groups owned by ``subtask``.

    ``[ceil(i*M/P), floor(((i+1)*M - 1)/P)]``, in integer arithmetic so it is exact for every
    ``M``; it is exactly the set of key groups ``kg`` with ``subtask_of(kg, M, P) == i``.

    >>> [str(key_group_range(i, 10, 3)) for i in range(3)]
    ['0-3', '4-6', '7-9']
    """
    check_parallelism(parallelism, max_parallelism)
    if not 0 <= subtask < parallelism:
        raise KeyscaleError(f"subtask {subtask} is outside 0..{parallelism - 1}")
    start = (subtask * max_parallelism + parallelism - 1) // parallelism
    end = ((subtask + 1) * max_parallelism - 1) // parallelism
    return KeyGroupRange(start, end)


def key_group_ranges(max_parallelism: int, parallelism: int) -> list[KeyGroupRange]:
    """The key-group range of every subtask, in subtask order; together they cover ``[0, M)``.

    >>> [str(r) for r in key_group_ranges(128, 4)]
    ['0-31', '32-63', '64-95', '96-127']
    """
    check_parallelism(parallelism, max_parallelism)
    return [key_group_range(i, max_parallelism, parallelism) for i in range(parallelism)]


def is_aligned(parallelism: int, max_parallelism: int) -> bool:
    """Whether ``parallelism`` divides ``max_parallelism``, i.e. all ranges have equal size.

    >>> is_aligned(4, 128), is_aligned(3, 128)
    (True, False)
    """
    check_parallelism(parallelism, max_parallelism)
    return max_parallelism % parallelism == 0


def aligned_parallelism(target: int, max_parallelism: int, lower: int, upper: int) -> int:
    """The smallest parallelism ``>= target`` in ``[lower, upper]`` that divides ``M``.

    Equal ranges keep subtasks equally loaded, so the autoscaler rounds up to one. When no
    divisor fits, returns ``target`` clamped to ``[lower, upper]``. ``upper`` is capped at
    ``M``, since no subtask can own less than one key group.

    >>> aligned_parallelism(3, 128, 1, 64), aligned_parallelism(5, 128, 1, 64)
    (4, 8)
    >>> aligned_parallelism(7, 100, 1, 9)  # no divisor of 100 in 7..9
    7
    """
    check_parallelism(1, max_parallelism)
    if lower < 1:
        raise KeyscaleError(f"lower parallelism bound {lower} must be at least 1")
    upper = min(upper, max_parallelism)
    if lower > upper:
        raise KeyscaleError(
            f"lower parallelism bound {lower} is larger than the upper bound {upper} "
            f"(capped at the max parallelism {max_parallelism})"
        )
    clamped = min(max(target, lower), upper)
    for p in range(clamped, upper + 1):
        if max_parallelism % p == 0:
            return p
    return clamped


def mask_runs(mask: np.ndarray, offset: int = 0) -> list[tuple[int, int]]:
    """Contiguous runs of True in ``mask`` as inclusive ``(start, end)``, shifted by ``offset``.

    Key groups that need the same treatment come in runs; handling a run at once (one
    slice of a state file, one drop) is what keeps per-key-group work off the hot path.

    >>> mask_runs(np.array([False, True, True, False, True]), offset=10)
    [(11, 12), (14, 14)]
    """
    if not mask.any():
        return []
    padded = np.concatenate([[False], mask, [False]])
    edges = np.flatnonzero(padded[1:] != padded[:-1])
    return [(int(a) + offset, int(b) - 1 + offset) for a, b in zip(edges[::2], edges[1::2], strict=True)]
