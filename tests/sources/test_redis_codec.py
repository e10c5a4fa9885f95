"""The Redis backend's record codec, a pure function pair: every value of every type round-trips."""

from __future__ import annotations

import datetime as dt
import decimal
import math
from typing import Any

import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from keyscale.sources.redis_log import decode_records, encode_records

UTC = dt.UTC

# (Arrow type, strategy of its Python values)
TYPES: list[tuple[pa.DataType, st.SearchStrategy[Any]]] = [
    (pa.int8(), st.integers(-(2**7), 2**7 - 1)),
    (pa.int32(), st.integers(-(2**31), 2**31 - 1)),
    (pa.int64(), st.integers(-(2**63), 2**63 - 1)),
    (pa.uint64(), st.integers(0, 2**64 - 1)),
    (pa.float64(), st.floats(allow_nan=False)),
    (pa.float32(), st.floats(allow_nan=False, width=32)),
    (pa.bool_(), st.booleans()),
    (pa.string(), st.text()),
    (pa.large_string(), st.text(max_size=5)),
    (pa.binary(), st.binary()),
    (pa.timestamp("us", tz="UTC"), st.datetimes(timezones=st.just(UTC))),
    (pa.timestamp("ms"), st.datetimes().map(lambda d: d.replace(microsecond=d.microsecond // 1000 * 1000))),
    (pa.timestamp("ns", tz="UTC"), st.integers(-(2**63) + 1, 2**63 - 1)),
    (pa.date32(), st.dates()),
    (pa.duration("us"), st.timedeltas(min_value=dt.timedelta(days=-10**6), max_value=dt.timedelta(days=10**6))),
    (pa.decimal128(20, 4), st.decimals(min_value=-(10**15), max_value=10**15, places=4, allow_nan=False)),
    (pa.list_(pa.string()), st.lists(st.none() | st.text(max_size=3), max_size=3)),
    (pa.struct([("x", pa.int64()), ("t", pa.timestamp("us"))]), st.fixed_dictionaries({"x": st.none() | st.integers(0, 9), "t": st.none() | st.datetimes()})),
]


@st.composite
def tables(draw: st.DrawFn) -> pa.Table:
    chosen = draw(st.lists(st.sampled_from(range(len(TYPES))), min_size=1, max_size=5, unique=True))
    rows = draw(st.integers(0, 6))
    cols = {}
    for i in chosen:
        t, values = TYPES[i]
        data = draw(st.lists(st.none() | values, min_size=rows, max_size=rows))
        cols[f"c{i}"] = pa.array(data, t)
    return pa.table(cols)


@settings(max_examples=300, deadline=None)
@given(tables())
def test_every_type_round_trips(table: pa.Table) -> None:
    back = decode_records(table.schema, encode_records(table))
    assert back.schema.equals(table.schema)
    assert back.equals(table), (table.to_pylist(), back.to_pylist())


@given(st.lists(st.none() | st.floats(allow_nan=True) | st.just(-0.0), max_size=8))
def test_floats_round_trip_bit_for_bit(values: list[float | None]) -> None:
    table = pa.table({"f": pa.array(values, pa.float64())})
    back = decode_records(table.schema, encode_records(table)).column("f").to_pylist()
    for a, b in zip(values, back, strict=True):
        if a is None or b is None:
            assert a is b
        elif math.isnan(a):
            assert math.isnan(b)
        else:
            assert a == b and math.copysign(1, a) == math.copysign(1, b)


def test_nulls_are_missing_fields_and_all_null_rows_have_a_marker() -> None:
    table = pa.table({"k": pa.array(["a", None, ""]), "v": pa.array([None, None, decimal.Decimal("1.5")], pa.decimal128(5, 2))})
    entries = encode_records(table)
    assert entries == [{b"k": b"a"}, {b"": b""}, {b"k": b"", b"v": b"1.50"}]
    assert decode_records(table.schema, entries).equals(table)
