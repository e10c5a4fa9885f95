from __future__ import annotations

import doctest
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import keyscale.state.keygroups as keygroups_module
from keyscale.errors import KeyscaleError
from keyscale.state.keygroups import (
    UPPER_BOUND_MAX_PARALLELISM,
    KeyGroupRange,
    aligned_parallelism,
    check_parallelism,
    default_max_parallelism,
    is_aligned,
    key_group_range,
    key_group_ranges,
    subtask_of,
    subtask_of_sql,
)

FAST = settings(max_examples=100, deadline=None)


@st.composite
def m_and_p(draw: st.DrawFn, max_m: int = UPPER_BOUND_MAX_PARALLELISM) -> tuple[int, int]:
    m = draw(st.integers(1, max_m))
    p = draw(st.integers(1, m))
    return m, p


def assert_layout(m: int, p: int, every_key_group: bool) -> None:
    ranges = key_group_ranges(m, p)
    assert len(ranges) == p
    # Contiguous and in order, covering [0, M): each key group is in exactly one range.
    assert ranges[0].start == 0
    assert ranges[-1].end == m - 1
    for a, b in itertools.pairwise(ranges):
        assert b.start == a.end + 1
    assert sum(len(r) for r in ranges) == m
    sizes = {len(r) for r in ranges}
    assert max(sizes) - min(sizes) <= 1
    if m % p == 0:
        assert sizes == {m // p}
    for i, r in enumerate(ranges):
        assert key_group_range(i, m, p) == r
        # subtask_of is monotone in kg, so agreeing at both ends of every contiguous range
        # means agreeing everywhere.
        assert subtask_of(r.start, m, p) == i
        assert subtask_of(r.end, m, p) == i
    if every_key_group:
        for kg in range(m):
            owners = [i for i, r in enumerate(ranges) if kg in r]
            assert owners == [subtask_of(kg, m, p)]


def _spark_int_sql(expr: str, **columns: int) -> int:
    """Evaluate the int SQL :func:`subtask_of_sql` makes as Spark does: ``int(..)`` of an
    int, ``*`` of ints (which must stay below 2**31, Spark's int would wrap), ``div``
    truncating towards zero (``//`` for the non-negative ints here). Only those tokens are
    accepted, so a changed form fails here instead of being evaluated as Python."""
    import re

    tokens = re.findall(r"\d+|\w+|\S", expr)
    assert all(t.isdigit() or t in columns or t in ("int", "div", "(", ")", "*") for t in tokens), expr
    assert all(v >= 0 for v in columns.values())
    for name, factor in re.findall(r"\((\w+) \* (\d+)\)", expr):
        assert columns[name] * int(factor) < 2**31
    return int(eval(expr.replace(" div ", " // "), {"__builtins__": {}, "int": int}, dict(columns)))


@FAST
@given(m_and_p(), st.data())
def test_subtask_of_sql_is_subtask_of(mp: tuple[int, int], data: st.DataObject) -> None:
    m, p = mp
    kg = data.draw(st.integers(0, m - 1), label="key group")
    assert _spark_int_sql(subtask_of_sql("kg", m, p), kg=kg) == subtask_of(kg, m, p)


def test_layout_exhaustive_for_small_max_parallelism() -> None:
    for m in range(1, 49):
        for p in range(1, m + 1):
            assert_layout(m, p, every_key_group=True)


@FAST
@given(m_and_p())
def test_layout_any_max_parallelism(mp: tuple[int, int]) -> None:
    m, p = mp
    assert_layout(m, p, every_key_group=False)


@FAST
@given(m_and_p(max_m=600))
def test_layout_every_key_group(mp: tuple[int, int]) -> None:
    m, p = mp
    assert_layout(m, p, every_key_group=True)


@FAST
@given(m_and_p(), st.data())
def test_subtask_of_agrees_with_range(mp: tuple[int, int], data: st.DataObject) -> None:
    m, p = mp
    kg = data.draw(st.integers(0, m - 1))
    assert kg in key_group_range(subtask_of(kg, m, p), m, p)


def test_largest_layout() -> None:
    m = UPPER_BOUND_MAX_PARALLELISM
    for p in (1, 3, 7, 1000, 32767, m):
        assert_layout(m, p, every_key_group=False)


def test_known_layouts() -> None:
    assert [str(r) for r in key_group_ranges(128, 3)] == ["0-42", "43-85", "86-127"]
    assert [str(r) for r in key_group_ranges(10, 4)] == ["0-2", "3-4", "5-7", "8-9"]
    assert key_group_ranges(5, 5) == [KeyGroupRange(i, i) for i in range(5)]


@pytest.mark.parametrize(
    ("parallelism", "expected"),
    [
        (1, 128),
        (2, 128),
        (64, 128),
        (85, 128),  # 85 + 42 = 127 -> 128
        (86, 256),  # 86 + 43 = 129 -> 256
        (100, 256),  # 150 -> 256
        (171, 256),  # 256 -> 256
        (172, 512),  # 258 -> 512
        (1000, 2048),  # 1500 -> 2048
        (16384, 32768),  # 24576 -> 32768
        (20000, 32768),  # 30000 -> 32768
        (40000, 32768),  # capped
    ],
)
def test_default_max_parallelism(parallelism: int, expected: int) -> None:
    assert default_max_parallelism(parallelism) == expected


def test_default_max_parallelism_rejects_zero() -> None:
    with pytest.raises(KeyscaleError, match="parallelism 0"):
        default_max_parallelism(0)


@pytest.mark.parametrize(
    ("p", "m", "message"),
    [
        (
            300,
            128,
            "parallelism 300 is larger than the max parallelism 128 (the number of key groups); "
            "choose 1..128",
        ),
        (0, 128, "parallelism 0 must be at least 1"),
        (-1, 128, "parallelism -1 must be at least 1"),
        (1, 0, "max parallelism 0 must be at least 1"),
        (1, 40000, "max parallelism 40000 is larger than 32768"),
    ],
)
def test_check_parallelism(p: int, m: int, message: str) -> None:
    with pytest.raises(KeyscaleError) as info:
        check_parallelism(p, m)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_check_parallelism_accepts_bounds() -> None:
    check_parallelism(1, 1)
    check_parallelism(32768, 32768)


def test_bad_arguments() -> None:
    with pytest.raises(KeyscaleError, match="key group 128"):
        subtask_of(128, 128, 4)
    with pytest.raises(KeyscaleError, match="key group -1"):
        subtask_of(-1, 128, 4)
    with pytest.raises(KeyscaleError, match="subtask 4"):
        key_group_range(4, 128, 4)
    with pytest.raises(KeyscaleError):
        key_group_ranges(4, 5)


def test_key_group_range_basics() -> None:
    r = KeyGroupRange(0, 63)
    assert len(r) == 64
    assert list(r) == list(range(64))
    assert 0 in r and 63 in r
    assert 64 not in r and -1 not in r and "1" not in r
    assert str(r) == "0-63"
    assert str(KeyGroupRange(7, 7)) == "7-7"
    assert len(KeyGroupRange(7, 7)) == 1
    with pytest.raises(ValueError):
        KeyGroupRange(5, 4)
    with pytest.raises(ValueError):
        KeyGroupRange(-1, 4)
    with pytest.raises(AttributeError):
        r.start = 1  # type: ignore[misc]


ranges_st = st.builds(
    lambda a, n: KeyGroupRange(a, a + n), st.integers(0, 100), st.integers(0, 100)
)


@FAST
@given(ranges_st, ranges_st)
def test_overlaps_and_intersection(a: KeyGroupRange, b: KeyGroupRange) -> None:
    common = set(a) & set(b)
    assert a.overlaps(b) == b.overlaps(a) == bool(common)
    inter = a.intersection(b)
    assert inter == b.intersection(a)
    if common:
        assert inter is not None and set(inter) == common
    else:
        assert inter is None


def test_is_aligned() -> None:
    assert is_aligned(1, 128)
    assert is_aligned(4, 128)
    assert is_aligned(128, 128)
    assert not is_aligned(3, 128)
    assert is_aligned(5, 100)
    with pytest.raises(KeyscaleError):
        is_aligned(200, 128)


def test_aligned_parallelism_examples() -> None:
    assert aligned_parallelism(3, 128, 1, 128) == 4
    assert aligned_parallelism(33, 128, 1, 128) == 64
    assert aligned_parallelism(33, 128, 1, 63) == 33  # no divisor in 33..63: clamped target
    assert aligned_parallelism(0, 128, 2, 10) == 2
    assert aligned_parallelism(500, 128, 1, 1000) == 128  # upper is capped at M
    assert aligned_parallelism(7, 100, 1, 9) == 7
    assert aligned_parallelism(7, 100, 1, 10) == 10
    assert aligned_parallelism(30, 100, 1, 20) == 20  # clamped down to upper, which divides
    with pytest.raises(KeyscaleError, match="lower parallelism bound 0"):
        aligned_parallelism(3, 128, 0, 10)
    with pytest.raises(KeyscaleError, match="lower parallelism bound 11"):
        aligned_parallelism(3, 128, 11, 10)


@FAST
@given(
    st.integers(1, 4096),
    st.integers(-10, 5000),
    st.integers(1, 5000),
    st.integers(0, 5000),
)
def test_aligned_parallelism_property(m: int, target: int, lower: int, width: int) -> None:
    upper = lower + width
    if lower > min(upper, m):
        with pytest.raises(KeyscaleError):
            aligned_parallelism(target, m, lower, upper)
        return
    p = aligned_parallelism(target, m, lower, upper)
    top = min(upper, m)
    clamped = min(max(target, lower), top)
    assert lower <= p <= top
    divisors = [d for d in range(clamped, top + 1) if m % d == 0]
    assert p == (divisors[0] if divisors else clamped)


def test_doctests() -> None:
    result = doctest.testmod(keygroups_module)
    assert result.attempted > 0
    assert result.failed == 0
