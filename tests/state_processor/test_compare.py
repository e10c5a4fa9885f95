"""The pure parts of a state diff (issue 37, item 4), against models in plain Python:
value equality of nested state columns, and the diff of two tables of keyed state."""

from __future__ import annotations

import math
from typing import Any

import pyarrow as pa
from hypothesis import given
from hypothesis import strategies as st

from keyscale.state_processor.compare import diff_tables, values_equal

LIST = pa.list_(pa.int64())
MAP = pa.map_(pa.string(), pa.int64())
STRUCT = pa.struct([("a", pa.float64()), ("b", pa.list_(pa.string()))])

small = st.integers(-3, 3)
doubles = st.one_of(st.sampled_from([0.0, 1.5, math.nan, -math.inf]), st.none())
lists = st.one_of(st.none(), st.lists(st.one_of(small, st.none()), max_size=3))
maps = st.one_of(st.none(), st.dictionaries(st.sampled_from("abc"), small, max_size=3))
structs = st.one_of(st.none(), st.fixed_dictionaries({"a": doubles, "b": st.one_of(st.none(), st.lists(st.sampled_from(["x", "y"]), max_size=2))}))


def _same(x: Any, y: Any) -> bool:
    """The model: null only equals null, NaN equals NaN, maps are sets of entries."""
    if x is None or y is None:
        return x is None and y is None
    if isinstance(x, float) and isinstance(y, float):
        return (math.isnan(x) and math.isnan(y)) or x == y
    if isinstance(x, dict) and isinstance(y, dict):
        return x.keys() == y.keys() and all(_same(x[k], y[k]) for k in x)
    if isinstance(x, list) and isinstance(y, list):
        return len(x) == len(y) and all(_same(a, b) for a, b in zip(x, y, strict=True))
    return bool(x == y)


def _map_rows(rows: list[dict[str, int] | None], order: int) -> list[Any]:
    """Maps as Arrow takes them, their entries in one of two orders."""
    return [None if r is None else sorted(r.items(), reverse=bool(order)) for r in rows]


@given(st.lists(st.tuples(lists, lists, maps, maps, structs, structs, doubles, doubles), max_size=25), st.integers(0, 1))
def test_values_equal_matches_the_model(rows: list[Any], order: int) -> None:
    cols = list(zip(*rows, strict=True)) if rows else [()] * 8
    pairs = [(LIST, 0), (MAP, 2), (STRUCT, 4), (pa.float64(), 6)]
    for t, i in pairs:
        x, y = list(cols[i]), list(cols[i + 1])
        ax = pa.array(_map_rows(x, 0) if t == MAP else x, t)  # type: ignore[arg-type]
        ay = pa.array(_map_rows(y, order) if t == MAP else y, t)  # type: ignore[arg-type]
        got = values_equal(ax, ay).tolist()
        assert got == [_same(a, b) for a, b in zip(x, y, strict=True)], t
        # a slice compares as its own rows
        if len(x) > 2:
            assert values_equal(ax.slice(1), ay.slice(1)).tolist() == got[1:]


keyed = st.dictionaries(st.integers(0, 40), st.tuples(st.one_of(small, st.none()), lists), max_size=30)


def _table(state: dict[int, tuple[Any, Any]]) -> pa.Table:
    keys = sorted(state)
    return pa.table({
        "k": pa.array(keys, pa.int64()), "key_group": pa.array([k % 4 for k in keys], pa.int32()),
        "n": pa.array([state[k][0] for k in keys], pa.int64()), "l": pa.array([state[k][1] for k in keys], LIST),
    })


@given(keyed, keyed)
def test_diff_tables_matches_a_dict_diff(a: dict[int, Any], b: dict[int, Any]) -> None:
    rows, unchanged = diff_tables(_table(a), _table(b), ["k"], ["n", "l"])
    want = {}
    for k in a.keys() | b.keys():
        if k not in b:
            want[k] = ("only_a", [], {"n": a[k][0], "l": a[k][1]}, None)
        elif k not in a:
            want[k] = ("only_b", [], None, {"n": b[k][0], "l": b[k][1]})
        else:
            changed = [s for s, i in (("n", 0), ("l", 1)) if not _same(a[k][i], b[k][i])]
            if changed:
                want[k] = ("changed", changed, {"n": a[k][0], "l": a[k][1]}, {"n": b[k][0], "l": b[k][1]})
    got = {r["k"]: (r["kind"], r["changed_states"], r["value_a"], r["value_b"]) for r in rows.to_pylist()}
    assert got == want
    assert [r["k"] for r in rows.to_pylist()] == sorted(want)
    assert unchanged == len(a.keys() & b.keys()) - sum(1 for v in want.values() if v[0] == "changed")
    for r in rows.to_pylist():
        assert r["key_group_a"] == (r["k"] % 4 if r["k"] in a else None)
        assert r["key_group_b"] == (r["k"] % 4 if r["k"] in b else None)
