"""Grouping rows by key (keyscale.state.factorize)."""

from __future__ import annotations

import doctest

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import keyscale.state.factorize as factorize_module
from keyscale.state.factorize import factorize_keys, make_index


def test_docstring_examples_run() -> None:
    result = doctest.testmod(factorize_module)
    assert result.failed == 0 and result.attempted >= 3


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(-3, 3), st.sampled_from(["a", "b", "c"])), min_size=1, max_size=50))
def test_rows_with_one_key_share_a_group_in_first_appearance_order(rows: list[tuple[int, str]]) -> None:
    ints = np.array([r[0] for r in rows], dtype=np.int64)
    strs = np.array([r[1] for r in rows], dtype=object)
    codes, index, columns = factorize_keys([ints, strs])
    firsts = list(dict.fromkeys(rows))
    assert [(int(a), b) for a, b in zip(columns[0], columns[1], strict=True)] == firsts
    assert [firsts[c] for c in codes] == rows
    assert make_index(columns).get_indexer(index).tolist() == list(range(len(firsts)))
