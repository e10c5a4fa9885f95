"""The sub key of a state file's row order (keyscale.state.order): a function of the key's
value alone, whatever form its Arrow array takes, so a lookup computes the one a snapshot
wrote."""

from __future__ import annotations

import datetime as dt
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keyscale.state.order import order_rows, sort_key, sort_keys, sub_key, sub_keys


@settings(max_examples=100, deadline=None)
@given(values=st.lists(st.one_of(st.none(), st.text(max_size=12), st.sampled_from(["", "a", "user-000000001"])), min_size=1, max_size=30),
       cut=st.integers(0, 30), large=st.booleans())
def test_a_string_keys_sub_key_is_its_values_whatever_the_array(values: list[str | None], cut: int, large: bool) -> None:
    whole = pa.array(values, pa.large_string() if large else pa.string())
    alone = [int(sub_keys(pa.array([v], pa.string()))[0]) for v in values]  # as a lookup computes it
    assert sub_keys(whole).tolist() == alone
    cut = min(cut, len(values))
    assert sub_keys(pa.chunked_array([whole[:cut], whole[cut:]], whole.type)).tolist() == alone  # chunks, sliced offsets
    assert sub_keys(whole.slice(cut)).tolist() == alone[cut:]
    assert all(s == 0 for s, v in zip(alone, values, strict=True) if v is None)


@settings(max_examples=100, deadline=None)
@given(values=st.lists(st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)), min_size=1, max_size=30))
def test_a_numeric_keys_sub_key_is_its_values(values: list[int | None]) -> None:
    alone = [int(sub_keys(pa.array([v], pa.int64()))[0]) for v in values]
    assert sub_keys(pa.array(values, pa.int64())).tolist() == alone


def _sub_key_of_bytes(v: bytes) -> int:
    """The rule for a string or binary value, one value at a time in plain Python: the files
    written by every version of keyscale hold fences of it, so the vectorized form must not
    drift from it."""
    m = 2**32
    word = int.from_bytes(v[-4:].rjust(4, b"\0"), "little") ^ (len(v) * 0x01000193 % m)
    if len(v) >= 4:
        mid = (len(v) - 4) // 2
        first4, mid4 = int.from_bytes(v[:4], "little"), int.from_bytes(v[mid : mid + 4], "little")
        word ^= (first4 * 0x85EBCA6B % m) ^ ((mid4 * 0xC2B2AE35 % m) >> 7)
    return (word * 0x9E3779B1 % m) >> 24


@settings(max_examples=200, deadline=None)
@given(values=st.lists(st.one_of(st.none(), st.binary(max_size=12)), min_size=1, max_size=40), cut=st.integers(0, 40),
       kind=st.sampled_from([pa.binary(), pa.large_binary(), pa.string()]))
def test_a_string_keys_sub_key_is_the_rule_of_its_bytes(values: list[bytes | None], cut: int, kind: pa.DataType) -> None:
    if kind == pa.string():
        values = [None if v is None else v.decode("latin-1").encode() for v in values]  # valid UTF-8
        arr = pa.array([None if v is None else v.decode() for v in values], kind)
    else:
        arr = pa.array(values, kind)
    want = [0 if v is None else _sub_key_of_bytes(v) for v in values]
    assert sub_keys(arr).tolist() == want
    assert sub_keys(arr.slice(min(cut, len(values)))).tolist() == want[min(cut, len(values)) :]


@settings(max_examples=200, deadline=None)
@given(v=st.one_of(st.none(), st.binary(max_size=12)), kind=st.sampled_from([pa.binary(), pa.large_binary(), pa.string(), pa.large_string()]),
       kg=st.integers(0, 32767))
def test_one_strings_sort_key_is_the_rule_of_its_bytes(v: bytes | None, kind: pa.DataType, kg: int) -> None:
    """What a lookup probes with, one value in plain Python, against the rule written out."""
    value: Any = v
    if v is not None and kind in (pa.string(), pa.large_string()):
        value = v.decode("latin-1")
        v = value.encode()
    assert sort_key(kg, value, kind) == kg << 8 | (0 if v is None else _sub_key_of_bytes(v))
    assert sort_key(kg, value, kind) == int(sort_keys(np.array([kg]), pa.array([value], kind))[0])


@settings(max_examples=200, deadline=None)
@given(data=st.data(), kind=st.sampled_from([pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.uint8(), pa.uint32(), pa.uint64(),
                                             pa.float64(), pa.bool_(), pa.date32(), pa.timestamp("us", "UTC")]))
def test_one_values_sub_key_is_the_columns(data: st.DataObject, kind: pa.DataType) -> None:
    """Every other key type: the one-value form agrees with the column form."""
    if pa.types.is_integer(kind):
        bits = kind.bit_width
        lo, hi = (0, 2**bits - 1) if pa.types.is_unsigned_integer(kind) else (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
        value: Any = data.draw(st.integers(lo, hi))
    elif pa.types.is_floating(kind):
        value = data.draw(st.floats(allow_nan=False))
    elif pa.types.is_boolean(kind):
        value = data.draw(st.booleans())
    elif pa.types.is_date(kind):
        value = data.draw(st.dates())
    else:
        value = data.draw(st.datetimes(timezones=st.just(dt.UTC)))
    assert sub_key(value, kind) == int(sub_keys(pa.array([value], kind))[0])


def test_zero_and_negative_zero_are_one_key() -> None:
    assert sub_keys(pa.array([0.0]))[0] == sub_keys(pa.array([-0.0]))[0]


@settings(max_examples=50, deadline=None)
@given(kgs=st.lists(st.integers(0, 40), min_size=1, max_size=200), seed=st.integers(0, 2**32 - 1))
def test_order_rows_sorts_by_key_group_then_sub_key_and_keeps_a_keys_rows_in_order(kgs: list[int], seed: int) -> None:
    rng = np.random.default_rng(seed)
    keys = pa.array([f"k{int(i)}" for i in rng.integers(0, 20, len(kgs))])
    p = order_rows(np.array(kgs), keys)
    assert sorted(p.tolist()) == list(range(len(kgs)))
    s = sort_keys(np.array(kgs), keys)[p]
    assert (np.diff(s) >= 0).all()
    tied = np.flatnonzero(np.diff(s) == 0)  # stable: rows of equal sort keys keep their input order
    assert (p[tied] < p[tied + 1]).all()


@pytest.mark.parametrize("make", [lambda i: f"{i}@example.com", lambda i: f"user-{i:08d}", lambda i: f"eu-{i:06d}-prod"],
                         ids=["e-mail", "prefix", "prefix-and-tag"])
def test_keys_sharing_a_prefix_or_a_suffix_spread_over_the_sub_keys(make: Any) -> None:
    """A lookup reads the record batches of its key's sub key: keys alike at one end (e-mail
    addresses, ids with a prefix or a tag) must still spread, or a lookup reads its whole
    key group."""
    counts = np.bincount(sub_keys(pa.array([make(i) for i in range(20_000)])), minlength=256)
    assert (counts > 0).sum() == 256 and counts.max() < 4 * counts.mean()
