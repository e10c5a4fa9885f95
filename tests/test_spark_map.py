"""``map_in_arrow`` (keyscale/_spark_map.py): PySpark's ``mapInArrow``, the same rows, in fewer
calls to the JVM (each one a round trip on a batch's fixed path: issue 35)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

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
