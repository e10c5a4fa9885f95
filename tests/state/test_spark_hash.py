from __future__ import annotations

import datetime as dt
import decimal
import math
import os
import random
import struct
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import keyscale.state.spark_hash as spark_hash_module
from keyscale.errors import InputDataError, KeyscaleError
from keyscale.state.keygroups import subtask_of, subtask_of_sql
from keyscale.state.spark_hash import (
    SPARK_HASH_SEED,
    TYPE_NAMES,
    hash_boolean,
    hash_bytes,
    hash_double,
    hash_float,
    hash_int,
    hash_long,
    hash_string,
    key_group_of,
    key_group_sql,
    key_groups,
    route_sql,
    routing_values,
    spark_hash,
    spark_hashes,
)

FAST = settings(max_examples=200, deadline=None)
INT_MIN, INT_MAX = -(2**31), 2**31 - 1
LONG_MIN, LONG_MAX = -(2**63), 2**63 - 1
ints = st.integers(INT_MIN, INT_MAX)
longs = st.integers(LONG_MIN, LONG_MAX)
seeds = st.one_of(st.just(SPARK_HASH_SEED), ints)


# --- values computed by real Spark -------------------------------------------------------


def test_known_spark_values() -> None:
    assert hash_int(1) == -559580957  # SELECT hash(CAST(1 AS INT))
    assert hash_long(1) == -1712319331  # SELECT hash(CAST(1 AS BIGINT))
    assert hash_string("a") == 1485273170  # SELECT hash('a')
    assert spark_hash([1], ["int"]) == -559580957
    assert spark_hash([1], ["bigint"]) == -1712319331
    assert spark_hash(["a"], ["string"]) == 1485273170
    assert hash_int(5) == 1023896466  # SELECT hash(5)


def test_spark_documented_example() -> None:
    # Spark's own docs: SELECT hash('Spark', array(123), 2) = -1321691492. An array chains
    # its elements like columns, so this is three ints/strings chained.
    h = hash_int(2, hash_int(123, hash_string("Spark")))
    assert h == -1321691492
    assert spark_hash(["Spark", 123, 2], ["string", "int", "int"]) == -1321691492


# --- internal consistency -----------------------------------------------------------------


@FAST
@given(ints, seeds)
def test_int_is_one_little_endian_word(v: int, seed: int) -> None:
    # hashUnsafeBytes of 4 bytes mixes one word and finalises with length 4, like hashInt.
    assert hash_int(v, seed) == hash_bytes(struct.pack("<i", v), seed)


@FAST
@given(longs, seeds)
def test_long_is_two_words_low_then_high(v: int, seed: int) -> None:
    assert hash_long(v, seed) == hash_bytes(struct.pack("<q", v), seed)


@FAST
@given(st.binary(max_size=40), seeds)
def test_results_are_signed_32_bit(b: bytes, seed: int) -> None:
    h = hash_bytes(b, seed)
    assert INT_MIN <= h <= INT_MAX


def test_tail_bytes_are_mixed_one_at_a_time_sign_extended() -> None:
    # One tail byte hashes like hashInt of the sign-extended byte, but finalised with
    # length 1 instead of 4: so b"\x80" relates to the int -128, not 128.
    def spark_single_byte(v: int) -> int:
        h = spark_hash_module._mix_h1(SPARK_HASH_SEED, spark_hash_module._mix_k1(v & 0xFFFFFFFF))
        return spark_hash_module._signed(spark_hash_module._fmix(h, 1))

    assert hash_bytes(b"a") == spark_single_byte(97)
    assert hash_bytes(b"\x80") == spark_single_byte(-128)
    assert hash_bytes(b"\x80") != spark_single_byte(128)
    # Standard Murmur3 would pack "ab" into one block; Spark mixes two blocks.
    h = spark_hash_module._mix_h1(SPARK_HASH_SEED, spark_hash_module._mix_k1(ord("a")))
    h = spark_hash_module._mix_h1(h, spark_hash_module._mix_k1(ord("b")))
    assert hash_bytes(b"ab") == spark_hash_module._signed(spark_hash_module._fmix(h, 2))


def test_string_is_utf8_bytes() -> None:
    for s in ["", "a", "é", "€uro", "😀", "ключ", "a\x00b"]:
        assert hash_string(s) == hash_bytes(s.encode("utf-8"))
    assert hash_string("é") != hash_bytes("é".encode("latin-1"))


def test_boolean_double_float_rules() -> None:
    assert hash_boolean(True) == hash_int(1)
    assert hash_boolean(False) == hash_int(0)
    assert hash_double(0.0) == hash_double(-0.0) == hash_long(0)
    assert hash_float(0.0) == hash_float(-0.0) == hash_int(0)
    assert hash_double(1.0) == hash_long(0x3FF0000000000000)
    assert hash_float(1.0) == hash_int(0x3F800000)
    # Every NaN is doubleToLongBits' canonical NaN.
    (neg_nan,) = struct.unpack("<d", struct.pack("<q", -0x0007FFFFFFFFFFFF))
    assert math.isnan(neg_nan)
    assert hash_double(neg_nan) == hash_double(math.nan) == hash_long(0x7FF8000000000000)
    assert hash_float(math.nan) == hash_int(0x7FC00000)
    # Doubles beyond float range become +-Infinity as Java's (float) cast does.
    assert hash_float(1e300) == hash_float(math.inf) == hash_int(0x7F800000)
    assert hash_float(-1e300) == hash_int(struct.unpack("<i", struct.pack("<f", -math.inf))[0])
    # A double is rounded to the nearest float first.
    assert hash_float(0.1) == hash_int(struct.unpack("<i", struct.pack("<f", 0.1))[0])
    assert hash_double(0.1) != hash_float(0.1)


def test_int_and_long_differ() -> None:
    # The key's Spark type is part of the state's schema for this reason.
    assert hash_int(1) != hash_long(1)
    assert spark_hash([1], ["int"]) == spark_hash([1], ["short"]) == spark_hash([1], ["byte"])
    assert spark_hash([1], ["int"]) == spark_hash([1], ["date"])
    assert spark_hash([1], ["long"]) == spark_hash([1], ["timestamp"])


def test_spark_hash_chains_and_skips_nulls() -> None:
    assert spark_hash([], []) == SPARK_HASH_SEED
    assert spark_hash([None], ["string"]) == SPARK_HASH_SEED
    assert spark_hash([1, "a"], ["int", "string"]) == hash_string("a", hash_int(1))
    assert spark_hash([None, 1], ["long", "int"]) == hash_int(1)
    assert spark_hash([1, None, "x"], ["int", "int", "string"]) == hash_string("x", hash_int(1))
    assert spark_hash([7], ["int"], seed=0) == hash_int(7, 0)


def test_type_aliases_and_conversions() -> None:
    assert {"integer", "bigint", "smallint", "tinyint", "timestamp_ntz"} <= TYPE_NAMES
    assert spark_hash([5], ["integer"]) == hash_int(5)
    assert spark_hash([5], ["bigint"]) == hash_long(5)
    assert spark_hash([dt.date(1970, 1, 6)], ["date"]) == hash_int(5)
    assert spark_hash([dt.date(1969, 12, 31)], ["date"]) == hash_int(-1)
    ts = dt.datetime(1970, 1, 1, 0, 0, 1, 5, tzinfo=dt.UTC)
    assert spark_hash([ts], ["timestamp"]) == hash_long(1_000_005)
    cet = dt.timezone(dt.timedelta(hours=1))
    assert spark_hash([dt.datetime(1970, 1, 1, 1, tzinfo=cet)], ["timestamp"]) == hash_long(0)
    assert spark_hash([bytearray(b"ab")], ["binary"]) == hash_bytes(b"ab")
    assert spark_hash([memoryview(b"ab")], ["binary"]) == hash_bytes(b"ab")
    assert spark_hash([3], ["double"]) == hash_double(3.0)


def test_numpy_scalars_are_accepted() -> None:
    assert spark_hash([np.int32(-7)], ["int"]) == hash_int(-7)
    assert spark_hash([np.int64(2**40)], ["long"]) == hash_long(2**40)
    assert spark_hash([np.float32(0.1)], ["float"]) == hash_float(0.1)
    assert spark_hash([np.float64(0.1)], ["double"]) == hash_double(0.1)
    assert spark_hash([np.bool_(True)], ["boolean"]) == hash_boolean(True)
    assert spark_hash([np.str_("ab")], ["string"]) == hash_string("ab")


@pytest.mark.parametrize(
    ("value", "type_name"),
    [
        (2**31, "int"),
        (INT_MIN - 1, "int"),
        (2**63, "long"),
        (40000, "short"),
        (128, "byte"),
        (1.5, "int"),
        ("1", "int"),
        (True, "int"),
        (1, "string"),
        (b"a", "string"),
        ("a", "binary"),
        (1, "boolean"),
        ("1.0", "double"),
        (True, "double"),
        (dt.datetime(2024, 1, 1), "timestamp"),  # naive: ambiguous
        (dt.datetime(2024, 1, 1, tzinfo=dt.UTC), "date"),
    ],
)
def test_wrong_values_raise(value: object, type_name: str) -> None:
    with pytest.raises(InputDataError):
        spark_hash([value], [type_name])


def test_wrong_shapes_raise() -> None:
    with pytest.raises(KeyscaleError, match=r"cannot hash Spark type 'array<int>'; supported: .*decimal\(p,s\)"):
        spark_hash([[1]], ["array<int>"])
    with pytest.raises(InputDataError, match=r"Decimal\('1.234'\) is not a Spark decimal\(5,2\)"):
        spark_hash([decimal.Decimal("1.234")], ["decimal(5,2)"])
    with pytest.raises(InputDataError, match=r"is not a Spark decimal\(5,2\)"):
        spark_hash([decimal.Decimal("1234.5")], ["decimal(5,2)"])  # 6 digits
    with pytest.raises(KeyscaleError, match="2 key values but 1 key types"):
        spark_hash([1, 2], ["int"])
    with pytest.raises(InputDataError):
        hash_int(2**31)
    with pytest.raises(InputDataError):
        hash_long(2**64)


@FAST
@given(st.lists(ints, min_size=1, max_size=3), st.integers(1, 32768))
def test_key_group_of(values: list[int], m: int) -> None:
    types = ["int"] * len(values)
    kg = key_group_of(values, types, m)
    assert 0 <= kg < m
    assert kg == spark_hash(values, types) % m


def test_key_group_of_checks_max_parallelism() -> None:
    with pytest.raises(KeyscaleError):
        key_group_of([1], ["int"], 0)
    with pytest.raises(KeyscaleError):
        key_group_of([1], ["int"], 40000)


def test_routing_values_small_parallelism_exhaustively() -> None:
    for p in range(1, 65):
        values = routing_values(p)
        assert len(values) == p
        for i, x in enumerate(values):
            assert hash_int(x) % p == i
            # The smallest such x: no smaller non-negative int lands on partition i.
            assert all(hash_int(y) % p != i for y in range(x))


def test_routing_values_largest_parallelism() -> None:
    p = 32768
    values = routing_values(p)
    assert len(values) == p
    assert len(set(values)) == p
    assert all(hash_int(x) % p == i for i, x in enumerate(values))
    # Minimality is checked exhaustively for small P above.


def test_routing_values_are_memoized_but_not_shared() -> None:
    a = routing_values(7)
    a[0] = -1
    assert routing_values(7)[0] != -1
    assert spark_hash_module._routing_values.cache_info().hits > 0
    with pytest.raises(KeyscaleError):
        routing_values(0)
    with pytest.raises(KeyscaleError):
        routing_values(32769)


# --- the numpy form is the per-value form ---------------------------------------------------

# Each Spark type the numpy form vectorizes: (name, Arrow type, values as Arrow holds them,
# the same value as spark_hash takes it).
_floats32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
ARRAY_COLUMNS: dict[str, tuple[pa.DataType, st.SearchStrategy[Any]]] = {
    "string": (pa.string(), st.text(max_size=12)),
    "binary": (pa.binary(), st.binary(max_size=13)),
    "int": (pa.int32(), ints),
    "long": (pa.int64(), longs),
    "short": (pa.int16(), st.integers(-(2**15), 2**15 - 1)),
    "byte": (pa.int8(), st.integers(-128, 127)),
    "boolean": (pa.bool_(), st.booleans()),
    "double": (pa.float64(), st.floats(allow_nan=True, allow_infinity=True)),
    "float": (pa.float32(), _floats32),
    "date": (pa.int32(), ints),  # days: as an int column, and as date32 below
    "timestamp": (pa.int64(), longs),  # micros
}


@st.composite
def key_tables(draw: st.DrawFn) -> tuple[pa.Table, list[str], list[list[Any]]]:
    types = draw(st.lists(st.sampled_from(sorted(ARRAY_COLUMNS)), min_size=1, max_size=3), label="key types")
    n = draw(st.integers(0, 12), label="rows")
    columns: dict[str, pa.Array] = {}
    rows: list[list[Any]] = [[] for _ in range(n)]
    for j, t in enumerate(types):
        arrow, values = ARRAY_COLUMNS[t]
        col = draw(st.lists(st.none() | values, min_size=n, max_size=n), label=f"column {j} ({t})")
        arr = pa.array(col, arrow)
        if t == "date" and draw(st.booleans(), label="as date32"):
            arr = pa.array([None if v is None else v % 2_000_000 for v in col], pa.int32()).cast(pa.date32())
            col = arr.cast(pa.int32()).to_pylist()
        if t == "string" and draw(st.booleans(), label="large"):
            arr = arr.cast(pa.large_string())
        columns[f"c{j}"] = arr
        for r, v in zip(rows, col, strict=True):
            r.append(v)
    return pa.table(columns), types, rows


@settings(max_examples=300, deadline=None)
@given(key_tables(), st.integers(1, 32768))
def test_numpy_form_is_the_per_value_form(case: tuple[pa.Table, list[str], list[list[Any]]], m: int) -> None:
    table, types, rows = case
    names = table.column_names
    assert spark_hashes(table, names, types).tolist() == [spark_hash(r, types) for r in rows]
    assert key_groups(table, names, types, m).tolist() == [key_group_of(r, types, m) for r in rows]


def test_numpy_form_of_doctests_and_fallback() -> None:
    table = pa.table({"k": ["a", "bcdef"], "n": [1, None]})
    assert key_groups(table, ["k", "n"], ["string", "long"], 128).tolist() == [81, 26]
    # a type without a numpy form goes row by row, through the same rule
    dec = pa.table({"d": pa.array([1, None, -7], pa.decimal128(5, 0))})
    assert spark_hashes(dec, ["d"], ["decimal(5,0)"]).tolist() == [spark_hash([v], ["decimal(5,0)"]) for v in (1, None, -7)]


def test_sql_forms() -> None:
    assert key_group_sql(["k"], 128) == "cast(pmod(hash(`k`), 128) as int)"
    assert key_group_sql(["a`b", "c"], 8) == "cast(pmod(hash(`a``b`, `c`), 8) as int)"
    assert route_sql("s", 4) == f"element_at(array({', '.join(map(str, routing_values(4)))}), s + 1)"
    with pytest.raises(KeyscaleError):
        key_group_sql(["k"], 0)
    with pytest.raises(KeyscaleError):
        route_sql("s", 0)


# --- against real Spark --------------------------------------------------------------------

SINGLE_TYPES = [
    ("int", "int"),
    ("long", "bigint"),
    ("short", "smallint"),
    ("byte", "tinyint"),
    ("boolean", "boolean"),
    ("double", "double"),
    ("float", "float"),
    ("string", "string"),
    ("binary", "binary"),
    ("date", "int"),  # sent as days, turned into a date in SQL
    ("timestamp", "bigint"),  # sent as micros, turned into a timestamp in SQL
]
STRING_ALPHABET = ["a", "Z", "0", " ", "\x00", "\x7f", "é", "ÿ", "€", "ключ", "😀", "中"]


def _random_value(rng: random.Random, type_name: str) -> Any:
    if type_name == "int" or type_name == "date":
        return (
            rng.choice([0, 1, -1, INT_MIN, INT_MAX, rng.randint(-1000, 1000)])
            if (rng.random() < 0.2)
            else rng.randint(INT_MIN, INT_MAX)
        )
    if type_name == "long" or type_name == "timestamp":
        return (
            rng.choice([0, 1, -1, LONG_MIN, LONG_MAX, 2**32, -(2**32)])
            if (rng.random() < 0.2)
            else rng.randint(LONG_MIN, LONG_MAX)
        )
    if type_name == "short":
        return rng.randint(-(2**15), 2**15 - 1)
    if type_name == "byte":
        return rng.randint(-128, 127)
    if type_name == "boolean":
        return rng.random() < 0.5
    if type_name == "double":
        r = rng.random()
        if r < 0.2:
            return rng.choice([0.0, -0.0, math.nan, math.inf, -math.inf, 5e-324, 1.5, -2.25])
        if r < 0.6:
            return rng.uniform(-1e6, 1e6)
        bits = struct.pack("<Q", rng.getrandbits(64))
        return struct.unpack("<d", bits)[0]
    if type_name == "float":
        r = rng.random()
        if r < 0.2:
            return rng.choice([0.0, -0.0, math.nan, math.inf, -math.inf, 1.5, 0.1, 3.4e38])
        if r < 0.6:
            return rng.uniform(-1e6, 1e6)  # not representable: rounded to float32
        value = struct.unpack("<f", struct.pack("<I", rng.getrandbits(32)))[0]
        return 1.0 if math.isnan(value) else value
    if type_name == "string":
        return "".join(rng.choice(STRING_ALPHABET) for _ in range(rng.randint(0, 9)))
    if type_name == "binary":
        return bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 13)))
    raise AssertionError(type_name)


@pytest.fixture(scope="module")
def hash_spark() -> Iterator[Any]:
    """A local Spark session for this module, stopped after it.

    If another fixture (tests/conftest.py's session-wide ``spark``) already runs a
    session, it is reused and left running: stopping it would break later modules.
    """
    old = os.environ.get("PYSPARK_PYTHON")
    # Executors must run this interpreter, or PySpark may pick another Python.
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    existing = SparkSession.getActiveSession()
    session = existing or (
        SparkSession.builder.master("local[1]")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "1")
        .getOrCreate()
    )
    try:
        yield session
    finally:
        if existing is None:
            session.stop()
        if old is None:
            os.environ.pop("PYSPARK_PYTHON", None)
        else:
            os.environ["PYSPARK_PYTHON"] = old


@pytest.mark.spark
def test_matches_spark_hash(hash_spark: Any) -> None:
    from pyspark.sql import functions as F

    rng = random.Random(20240601)
    n = 400
    names = [f"c_{t}" for t, _ in SINGLE_TYPES]
    rows: list[tuple[Any, ...]] = []
    for r in range(n):
        # The first rows carry a value in every column; later ones ~15% nulls.
        rows.append(
            tuple(
                None if r >= 20 and rng.random() < 0.15 else _random_value(rng, t)
                for t, _ in SINGLE_TYPES
            )
        )
    # Strings of every UTF-8 byte length 0..7, ASCII and not, so every tail length is hit.
    fixed_strings = ["", "a", "ab", "abc", "abcd", "abcde", "abcdef", "abcdefg"]
    fixed_strings += ["é", "aé", "é€", "😀", "a😀", "€€", "😀€", "ÿÿÿ", "\x80"]
    string_col = names.index("c_string")
    for i, s in enumerate(fixed_strings):
        row = list(rows[i])
        row[string_col] = s
        rows[i] = tuple(row)
    tail_lengths = {len(row[string_col].encode()) % 4 for row in rows if row[string_col]}
    assert tail_lengths == {0, 1, 2, 3}
    assert {len(s.encode()) for s in fixed_strings} >= set(range(8))

    schema = ", ".join(f"{name} {sql}" for name, (_, sql) in zip(names, SINGLE_TYPES, strict=True))
    df = hash_spark.createDataFrame(rows, schema)
    typed = {name: F.col(name) for name in names}
    typed["c_date"] = F.date_from_unix_date(F.col("c_date"))
    typed["c_timestamp"] = F.timestamp_micros(F.col("c_timestamp"))

    multi_keys = [
        ["c_int", "c_string"],
        ["c_long", "c_string", "c_boolean"],
        ["c_double", "c_binary", "c_short", "c_byte"],
        names,
    ]
    exprs = [F.hash(typed[name]).alias(f"h_{name}") for name in names]
    exprs += [F.hash(*[typed[c] for c in key]).alias(f"m{k}") for k, key in enumerate(multi_keys)]
    result = df.select(*exprs).collect()
    assert len(result) == n

    types = [t for t, _ in SINGLE_TYPES]
    mismatches: list[tuple[object, object, object]] = []
    for values, got in zip(rows, result, strict=True):
        for j, (name, t) in enumerate(zip(names, types, strict=True)):
            want = got[f"h_{name}"]
            if spark_hash([values[j]], [t]) != want:
                mismatches.append((t, values[j], want))
        for k, key in enumerate(multi_keys):
            idx = [names.index(c) for c in key]
            ours = spark_hash([values[i] for i in idx], [types[i] for i in idx])
            if ours != got[f"m{k}"]:
                mismatches.append((key, [values[i] for i in idx], got[f"m{k}"]))
    assert mismatches == []


@pytest.mark.spark
def test_decimals_and_wall_clock_times_match_spark_hash(hash_spark: Any) -> None:
    """``decimal(p,s)`` (a long of the unscaled value up to 18 digits, Java's BigInteger
    bytes beyond) and ``timestamp_ntz`` (naive datetimes), each column and together."""
    from pyspark.sql import functions as F

    rng = random.Random(20261202)
    types = ["decimal(12,3)", "decimal(18,0)", "decimal(19,2)", "decimal(38,10)", "timestamp_ntz"]

    def value(t: str) -> Any:
        if t == "timestamp_ntz":
            return dt.datetime(1900, 1, 1) + dt.timedelta(microseconds=rng.randint(0, 200 * 365 * 86_400 * 10**6))
        p, sc = (int(x) for x in t[8:-1].split(","))
        digits = rng.choice([0, 1, 2, p // 2, p - 1, p])  # zero, small, and the widest (every byte length)
        unscaled = rng.choice([-1, 1]) * rng.randint(0, 10**digits - 1)
        return decimal.Decimal(unscaled).scaleb(-sc)

    rows = [tuple(value(t) for t in types) for _ in range(300)]
    rows += [tuple(decimal.Decimal(v).scaleb(-int(t[:-1].split(",")[1])) if t != "timestamp_ntz" else dt.datetime(1970, 1, 1) for t in types)
             for v in (0, -1, 1, 127, 128, -128, -129, 255, 256)]  # where the shortest two's complement gains a byte
    names = [f"c{i}" for i in range(len(types))]
    df = hash_spark.createDataFrame(rows, ", ".join(f"{n} {t}" for n, t in zip(names, types, strict=True)))
    got = df.select(*[F.hash(n).alias(n) for n in names], F.hash(*names).alias("all")).collect()
    for r, g in zip(rows, got, strict=True):
        assert [spark_hash([v], [t]) for v, t in zip(r, types, strict=True)] == [g[n] for n in names], r
        assert spark_hash(list(r), types) == g["all"], r


@pytest.mark.spark
def test_routing_values_in_spark(hash_spark: Any) -> None:
    from pyspark.sql import functions as F

    parallelisms = [1, 2, 3, 4, 7, 128]
    rows = [(p, i, x) for p in parallelisms for i, x in enumerate(routing_values(p))]
    df = hash_spark.createDataFrame(rows, "p int, i int, x int")
    got = df.select("p", "i", F.pmod(F.hash("x"), F.col("p")).alias("part")).collect()
    assert all(r["part"] == r["i"] for r in got)
    assert len(got) == len(rows)

    # And the point of it all: repartition(P, x) really puts subtask i on partition i.
    for p in (3, 7):
        sub = df.where(F.col("p") == p).repartition(p, "x")
        placed = sub.select("i", F.spark_partition_id().alias("pid")).collect()
        assert sorted((r["i"], r["pid"]) for r in placed) == [(i, i) for i in range(p)]


@pytest.mark.spark
def test_sql_forms_in_spark(hash_spark: Any) -> None:
    """The SQL the stages run (key group, subtask, route) is the Python rule, in Spark."""
    from pyspark.sql import functions as F

    rng = random.Random(34)
    rows = [(_random_value(rng, "string"), _random_value(rng, "long")) for _ in range(300)]
    rows += [(None, 1), ("a", None), (None, None)]
    df = hash_spark.createDataFrame(rows, "k string, `n.v` bigint")
    ms = [1, 7, 128, 32768]
    got = df.select("k", "`n.v`", *[F.expr(key_group_sql(["k", "n.v"], m)).alias(f"kg{m}") for m in ms]).collect()
    for r in got:
        for m in ms:
            assert r[f"kg{m}"] == key_group_of([r["k"], r["n.v"]], ["string", "long"], m)

    # Key group -> subtask -> partition: every key group of every (M, P) below, in one query.
    pairs = [(1, 1), (10, 3), (128, 4), (128, 7), (100, 100), (32768, 3), (32768, 32768)]
    kgs = sorted({0, 1, 2, 5, 9, 63, 64, 99, 127, *range(0, 32768, 997), 32767})
    frame = hash_spark.createDataFrame([(kg,) for kg in kgs], "kg int")
    # (CASE WHEN keeps a key group >= M away from the expressions, as no stage ever has one)
    exprs = [F.when(F.col("kg") < m, F.expr(subtask_of_sql("kg", m, p))).alias(f"s{j}") for j, (m, p) in enumerate(pairs)]
    exprs += [
        F.when(F.col("kg") < m, F.pmod(F.hash(F.expr(route_sql(subtask_of_sql("kg", m, p), p))), F.lit(p))).alias(f"r{j}")
        for j, (m, p) in enumerate(pairs)
    ]
    for r in frame.select("kg", *exprs).collect():
        for j, (m, p) in enumerate(pairs):
            if r["kg"] < m:
                assert r[f"s{j}"] == subtask_of(r["kg"], m, p)
                assert r[f"r{j}"] == subtask_of(r["kg"], m, p)  # the row lands on its subtask's partition
