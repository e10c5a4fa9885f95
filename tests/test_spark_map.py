"""``map_in_arrow`` (keyscale/_spark_map.py): PySpark's ``mapInArrow``, the same rows, in fewer
calls to the JVM (each one a round trip on a batch's fixed path: issue 35)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from conftest import jvm_calls
from keyscale._spark_map import map_in_arrow


def plus(n: int) -> Any:
    def add(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for b in batches:
            yield pa.RecordBatch.from_arrays([pc.add(b.column(0), n), b.column(1)], names=["k", "v"])
    return add


def test_the_same_rows_as_pysparks_map_in_arrow_in_fewer_jvm_calls(spark: Any) -> None:
    from pyspark.sql.types import LongType, StringType, StructField, StructType

    df = spark.range(0, 6, 1, 3).selectExpr("id as k", "cast(id % 2 as string) as v")
    assert df.schema is not None  # both sides read the input's schema from the same cached DataFrame
    schema = StructType([StructField("k", LongType()), StructField("v", StringType())])
    for s in (schema, "k long, v string"):
        map_in_arrow(df, plus(0), s)  # the Spark context's shared parts, once
        with jvm_calls() as ours:
            lean = map_in_arrow(df, plus(10), s)
        with jvm_calls() as theirs:
            own = df.mapInArrow(plus(10), s)
        assert sorted(lean.collect()) == sorted(own.collect()) == [(10 + i, str(i % 2)) for i in range(6)]
        assert lean.schema == own.schema
        # Two calls a column, the function, the UDF, the plan node; PySpark's made ~33 here.
        assert len(ours) <= 2 * len(df.columns) + 7 < len(theirs), (len(ours), len(theirs))


def test_a_function_over_the_broadcast_threshold_goes_as_pyspark_sends_it(spark: Any) -> None:
    # PySpark ships a pickled function over 1 MiB as a broadcast; map_in_arrow leaves that to it.
    ballast = b"x" * (2 << 20)

    def sized(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for b in batches:
            yield pa.RecordBatch.from_arrays([pc.add(b.column(0), len(ballast))], names=["k"])

    rows = map_in_arrow(spark.range(0, 2, 1, 1).selectExpr("id as k"), sized, "k long").collect()
    assert sorted(r.k for r in rows) == [len(ballast), len(ballast) + 1]


def test_a_py_file_added_after_the_first_call_reaches_the_tasks(spark: Any, tmp_path: Path) -> None:
    # The environment and includes are kept as Java objects; addPyFile must still reach the workers.
    df = spark.range(0, 1, 1, 1).selectExpr("id as k", "'a' as v")
    map_in_arrow(df, plus(0), "k long, v string").collect()
    module = tmp_path / "ks_spark_map_added.py"
    module.write_text("ANSWER = 42\n")
    spark.sparkContext.addPyFile(str(module))

    def imported(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import ks_spark_map_added  # type: ignore[import-not-found]

        for b in batches:
            yield pa.RecordBatch.from_arrays([pc.add(b.column(0), ks_spark_map_added.ANSWER)], names=["k"])

    assert [r.k for r in map_in_arrow(df.select("k"), imported, "k long").collect()] == [42]


def test_a_column_name_with_a_dot_is_one_column(spark: Any) -> None:
    df = spark.range(0, 2, 1, 1).selectExpr("id as `a.b`", "'x' as v")
    rows = map_in_arrow(df, plus(1), "k long, v string").collect()
    assert sorted(r.k for r in rows) == [1, 2]


# ------------------------------------------------------------------ chaining: a map over a map's output

def _every_type() -> tuple[pa.Schema, dict[str, list[Any]]]:
    """A first function's output of every kind of column a stage emits, typed the way a
    task builds it (a list's element field named as pyarrow names it, a naive timestamp
    for a zoned one), not the way Spark would hand it on."""
    import datetime
    import decimal

    at = datetime.datetime(2020, 1, 2, 3, 4, 5, 6)
    schema = pa.schema([("s", pa.string()), ("b", pa.binary()), ("i8", pa.int8()), ("i", pa.int64()), ("f", pa.float32()),
                        ("d", pa.float64()), ("dec", pa.decimal128(10, 2)), ("t", pa.bool_()), ("dt", pa.date32()),
                        ("ts", pa.timestamp("us", "UTC")), ("ntz", pa.timestamp("us")), ("ls", pa.list_(pa.string())),
                        ("m", pa.map_(pa.string(), pa.int64())), ("st", pa.struct([("x", pa.int64()), ("y", pa.string())]))])
    rows = {"s": ["a", None], "b": [b"x", None], "i8": [1, None], "i": [2, None], "f": [1.5, None], "d": [2.5, None],
            "dec": [decimal.Decimal("1.25"), None], "t": [True, None], "dt": [at.date(), None],
            "ts": [at.replace(tzinfo=datetime.UTC), None], "ntz": [at, None], "ls": [["a", None], None],
            "m": [[("k", 1)], None], "st": [{"x": 1, "y": "z"}, None]}
    return schema, rows


def _emit(schema: pa.Schema, rows: dict[str, list[Any]]) -> Any:
    def first(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import os

        for _ in batches:
            yield pa.RecordBatch.from_pydict({**rows, "pid": [os.getpid()] * 2}, schema=schema.append(pa.field("pid", pa.int64())))
    return first


def _seen() -> Any:
    """A second function saying what it was handed: its schema, its rows, and both workers' pids."""

    def seen(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import os

        for b in batches:
            rows = b.drop_columns(["pid"]).to_pylist()
            yield pa.RecordBatch.from_pydict({"schema": [str(b.schema.remove(b.schema.get_field_index("pid")))], "rows": [repr(rows)],
                                              "first_pid": [b.column("pid")[0].as_py()], "pid": [os.getpid()]})
    return seen


_SEEN = "schema string, rows string, first_pid long, pid long"


@pytest.mark.parametrize(("zone", "large"), [("UTC", "false"), ("Europe/Paris", "true")])
def test_a_map_over_a_maps_output_runs_in_its_python_worker_handed_what_spark_would_hand_it(spark: Any, zone: str, large: str) -> None:
    schema, rows = _every_type()
    out = from_arrow_schema_of(schema)
    spark.conf.set("spark.sql.session.timeZone", zone)
    spark.conf.set("spark.sql.execution.arrow.useLargeVarTypes", large)
    try:
        df = spark.range(0, 1, 1, 1)
        chained = map_in_arrow(map_in_arrow(df, _emit(schema, rows), out), _seen(), _SEEN)
        plan = chained._jdf.queryExecution().executedPlan().toString()
        (ours,) = chained.collect()
        (theirs,) = df.mapInArrow(_emit(schema, rows), out).mapInArrow(_seen(), _SEEN).collect()
    finally:
        spark.conf.unset("spark.sql.session.timeZone")
        spark.conf.unset("spark.sql.execution.arrow.useLargeVarTypes")
    assert plan.count("MapInArrow") == 1, plan
    assert ours.pid == ours.first_pid  # one Python worker ran both
    assert theirs.pid != theirs.first_pid  # PySpark's own chain: two workers
    assert (ours.schema, ours.rows) == (theirs.schema, theirs.rows)
    assert ("large_string" in ours.schema) == (large == "true") and f"tz={zone}" in ours.schema


def test_a_cached_maps_output_is_not_chained(spark: Any) -> None:
    # Other readers share a cached output: chaining would run the first function again for each.
    schema, rows = _every_type()
    first = map_in_arrow(spark.range(0, 1, 1, 1), _emit(schema, rows), from_arrow_schema_of(schema)).persist()
    try:
        (row,) = map_in_arrow(first, _seen(), _SEEN).collect()
        assert row.pid != row.first_pid
    finally:
        first.unpersist()


def from_arrow_schema_of(schema: pa.Schema) -> Any:
    from keyscale._spark_types import from_arrow_schema

    return from_arrow_schema(schema.append(pa.field("pid", pa.int64())))
