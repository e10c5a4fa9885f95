"""Reactive scaling: parallelism follows the executor cores, within bounds, aligned to key groups."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from keyscale.errors import KeyscaleError
from keyscale.scaling.reactive import reactive_parallelism


@st.composite
def setups(draw: st.DrawFn) -> tuple[int, int, int]:
    """(min_p, max_p, M) with 1 <= min_p <= min(max_p, M)."""
    m = draw(st.one_of(st.sampled_from([1, 7, 60, 100, 120, 128, 360, 1024]), st.integers(1, 500)))
    min_p = draw(st.integers(1, m))
    max_p = draw(st.integers(min_p, 2 * m + 10))
    return min_p, max_p, m


@given(setups(), st.integers(0, 3000))
def test_always_within_bounds(setup: tuple[int, int, int], cores: int) -> None:
    min_p, max_p, m = setup
    p = reactive_parallelism(cores, min_p, max_p, m)
    assert min_p <= p <= min(max_p, m)


@given(setups(), st.integers(0, 3000))
def test_never_more_subtasks_than_cores_once_the_minimum_is_met(setup: tuple[int, int, int], cores: int) -> None:
    min_p, max_p, m = setup
    p = reactive_parallelism(cores, min_p, max_p, m)
    if cores >= min_p:
        assert p <= cores
    else:
        assert p == min_p


@given(setups(), st.integers(0, 3000))
def test_the_largest_divisor_in_range_when_there_is_one(setup: tuple[int, int, int], cores: int) -> None:
    min_p, max_p, m = setup
    p = reactive_parallelism(cores, min_p, max_p, m)
    ceiling = max(min_p, min(cores, max_p, m))
    divisors = [d for d in range(min_p, ceiling + 1) if m % d == 0]
    if divisors:
        assert m % p == 0 and p == divisors[-1]
    else:
        assert p == ceiling


@given(setups(), st.integers(0, 2000), st.integers(0, 1000))
def test_monotone_in_cores(setup: tuple[int, int, int], cores: int, more: int) -> None:
    min_p, max_p, m = setup
    assert reactive_parallelism(cores, min_p, max_p, m) <= reactive_parallelism(cores + more, min_p, max_p, m)


def test_walk_through_a_cluster_growing_and_shrinking() -> None:
    cores = [1, 2, 3, 4, 6, 8, 12, 16, 12, 5, 1]
    assert [reactive_parallelism(c, 1, 128, 128) for c in cores] == [1, 2, 2, 4, 4, 8, 8, 16, 8, 4, 1]
    assert [reactive_parallelism(c, 2, 10, 120) for c in cores] == [2, 2, 3, 4, 6, 8, 10, 10, 10, 5, 2]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((-1, 1, 4, 8), "cores must be 0 or more, got -1"),
        ((4, 0, 4, 8), "min parallelism must be at least 1, got 0"),
        ((4, 5, 4, 8), "min parallelism 5 is above max parallelism 4"),
        ((4, 9, 12, 8), "min parallelism 9 is above the number of key groups 8"),
        ((4, 1, 4, 0), "max parallelism \\(key groups\\) must be at least 1, got 0"),
    ],
)
def test_bad_arguments_are_named(args: tuple[int, int, int, int], message: str) -> None:
    with pytest.raises(KeyscaleError, match=message):
        reactive_parallelism(*args)
