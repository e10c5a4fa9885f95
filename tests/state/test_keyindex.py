"""KeyIndex (row numbers in hash slots) and key_hash: a plain dict model gives the same answers."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keyscale.state.keyindex import MAX_LOAD, KeyIndex, key_hash, slots_for

# -- the index against a dict ------------------------------------------------------------------


def _weak(keys: np.ndarray) -> np.ndarray:
    """A hash with few values: most keys collide, so probes run long and wrap around."""
    return (keys % 3).astype(np.uint64)


@st.composite
def index_ops(draw: st.DrawFn) -> tuple[str, Any]:
    kind = draw(st.sampled_from(["insert", "insert", "insert", "keep"]))
    if kind == "insert":
        return kind, draw(st.lists(st.integers(-50, 400), unique=True, max_size=40))
    return kind, draw(st.integers(0, 2**32))  # seed of the rows kept


@pytest.mark.parametrize("weak", [False, True], ids=["mixed-hash", "colliding-hash"])
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(index_ops(), max_size=10), probe=st.lists(st.integers(-60, 410), max_size=30))
def test_index_finds_what_a_dict_finds(weak: bool, ops: list[tuple[str, Any]], probe: list[int]) -> None:
    hash_of = _weak if weak else (lambda k: key_hash([k]))
    keys = np.empty(0, dtype=np.int64)  # the table's key column: row r holds keys[r]
    ix = KeyIndex()
    for kind, arg in ops:
        if kind == "insert":
            new = np.array([k for k in arg if k not in set(keys.tolist())], dtype=np.int64)
            rows = np.arange(len(keys), len(keys) + len(new))
            keys = np.concatenate([keys, new])
            ix.insert(rows, hash_of(new), lambda keys=keys: hash_of(keys))
        else:  # the table keeps some rows, renumbered in order
            keep = np.flatnonzero(np.random.default_rng(arg).random(len(keys)) < 0.6)
            new_row = np.full(len(keys), -1, dtype=np.int64)
            new_row[keep] = np.arange(len(keep))
            keys = keys[keep]
            ix.renumber(new_row, len(keep), lambda keys=keys: hash_of(keys))
        assert ix.used == len(keys)
        assert ix.used + ix.gone <= MAX_LOAD * max(len(ix.slots), 1)
        model = {int(k): r for r, k in enumerate(keys)}
        look = np.array(probe + keys.tolist(), dtype=np.int64)
        got = ix.find(hash_of(look), lambda rows, at, look=look, keys=keys: keys[rows] == look[at])
        assert got.tolist() == [model.get(int(k), -1) for k in look]


def test_index_grows_and_shrinks_to_the_load_it_aims_for() -> None:
    keys = np.arange(10_000, dtype=np.int64) * 7919
    ix = KeyIndex()
    for part in np.array_split(np.arange(len(keys)), 10):  # ten batches of new keys
        ix.insert(part, key_hash([keys[part]]), lambda part=part: key_hash([keys[: part[-1] + 1]]))
    assert len(ix.slots) == slots_for(10_000) == 16_384 and ix.used == 10_000
    keep = np.arange(0, 10_000, 10)  # nine keys in ten dropped: the slots are rebuilt smaller
    new_row = np.full(len(keys), -1, dtype=np.int64)
    new_row[keep] = np.arange(len(keep))
    ix.renumber(new_row, len(keep), lambda: key_hash([keys[keep]]))
    assert len(ix.slots) == slots_for(1_000) and ix.gone == 0
    got = ix.find(key_hash([keys]), lambda rows, at: keys[keep][rows] == keys[at])
    assert (got[keep] == np.arange(len(keep))).all() and (np.delete(got, keep) == -1).all()


def test_slots_are_a_power_of_two_at_most_max_load_full() -> None:
    for n in [0, 1, 6, 7, 100, 838_860, 838_861, 5_000_000]:
        s = slots_for(n)
        assert s & (s - 1) == 0 and n <= MAX_LOAD * s and (s == 8 or n > MAX_LOAD * s / 2)


# -- the hash: equal keys, equal hashes, whatever their array -----------------------------------


def test_numeric_hash_is_by_value_not_width() -> None:
    assert (key_hash([np.array([1, -7, 2**31 - 1], dtype=np.int32)]) == key_hash([np.array([1, -7, 2**31 - 1], dtype=np.int64)])).all()
    assert (key_hash([np.array([0.5, -0.0], dtype=np.float32)]) == key_hash([np.array([0.5, 0.0], dtype=np.float64)])).all()
    assert key_hash([np.array([1], dtype=np.int64)])[0] != key_hash([np.array([2], dtype=np.int64)])[0]
    assert (key_hash([np.array([True, False])]) == key_hash([np.array([1, 0])])).all()


@settings(max_examples=100, deadline=None)
@given(texts=st.lists(st.text(max_size=20), min_size=1, max_size=20), start=st.integers(0, 19))
def test_string_hash_depends_on_the_string_alone(texts: list[str], start: int) -> None:
    arr = pa.array(texts)
    whole = key_hash([arr])
    one_by_one = [int(key_hash([pa.array([t])])[0]) for t in texts]
    assert whole.tolist() == one_by_one
    start = min(start, len(texts) - 1)
    assert key_hash([arr.slice(start)]).tolist() == one_by_one[start:]  # an array's offset does not matter
    assert key_hash([arr.cast(pa.large_string())]).tolist() == one_by_one
    assert key_hash([pa.array([t.encode() for t in texts], pa.binary())]).tolist() == one_by_one


def test_strings_differing_late_or_by_trailing_zero_bytes_hash_differently() -> None:
    h = key_hash([pa.array(["", "a", "a\x00", "abcdefgh", "abcdefghi", "abcdefgh\x00", "abcdefgh" * 3 + "x", "abcdefgh" * 3 + "y"])])
    assert len(set(h.tolist())) == len(h)


@pytest.mark.parametrize(("values", "t"), [
    ([dt.date(2024, 1, 1), dt.date(1970, 1, 1), dt.date(2024, 1, 1)], pa.date32()),
    ([dt.datetime(2024, 1, 1, 12, tzinfo=dt.UTC), dt.datetime(2024, 1, 1, 13, tzinfo=dt.UTC), dt.datetime(2024, 1, 1, 12, tzinfo=dt.UTC)],
     pa.timestamp("us", tz="UTC")),
    ([Decimal("1.50"), Decimal("-2.25"), Decimal("1.50")], pa.decimal128(10, 2)),
])
def test_fixed_width_keys_hash_by_their_bytes(values: list[Any], t: pa.DataType) -> None:
    arr = pa.array(values, type=t)
    h = key_hash([arr])
    assert h[0] == h[2] != h[1]
    assert key_hash([arr.slice(1)]).tolist() == h[1:].tolist()


def test_composite_keys_combine_their_columns() -> None:
    users = pa.array(["u", "u", "v", "u"])
    items = np.array([1, 2, 1, 1], dtype=np.int64)
    h = key_hash([users, items])
    assert h[0] == h[3] and len({h[0], h[1], h[2]}) == 3
    assert key_hash([items, users])[0] != h[0]  # column order is part of the key
