"""Spark SQL type names as users write them (in DDL schemas and state declarations) and as
PySpark spells them, mapped to the Arrow types Spark's own conversion gives."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pyspark.sql import types as T
from pyspark.sql.pandas.types import to_arrow_type

from keyscale.errors import JobDefinitionError
from keyscale.state.types import arrow_schema, arrow_type

_ATOMS = [T.ByteType(), T.ShortType(), T.IntegerType(), T.LongType(), T.FloatType(), T.DoubleType(), T.StringType(),
          T.BinaryType(), T.BooleanType(), T.DateType(), T.TimestampType(), T.TimestampNTZType()]
atoms = st.one_of(st.sampled_from(_ATOMS),
                  st.integers(1, 38).flatmap(lambda p: st.integers(0, p).map(lambda s: T.DecimalType(p, s))))
spark_types = st.recursive(atoms, lambda inner: st.one_of(
    st.builds(T.ArrayType, inner),
    st.builds(T.MapType, atoms, inner),
    st.lists(inner, min_size=1, max_size=3).map(lambda ts: T.StructType([T.StructField(f"f{i}", t) for i, t in enumerate(ts)])),
), max_leaves=6)


def _spark_arrow(t: Any) -> pa.DataType:
    """Spark's own Arrow type of ``t`` (a timestamp with the session's zone: UTC here, as keyscale keeps them)."""
    return to_arrow_type(t, timezone="UTC") if isinstance(t, T.TimestampType) else _nested(t)


def _nested(t: Any) -> pa.DataType:
    if isinstance(t, T.ArrayType):
        return pa.list_(_spark_arrow(t.elementType))
    if isinstance(t, T.MapType):
        return pa.map_(_spark_arrow(t.keyType), _spark_arrow(t.valueType))
    if isinstance(t, T.StructType):
        return pa.struct([pa.field(f.name, _spark_arrow(f.dataType)) for f in t.fields])
    return to_arrow_type(t)


@settings(max_examples=200, deadline=None)
@given(t=spark_types)
def test_every_spark_type_name_is_the_arrow_type_spark_converts_it_to(t: Any) -> None:
    assert arrow_type(t.simpleString()) == _spark_arrow(t)


@settings(max_examples=100, deadline=None)
@given(ts=st.lists(spark_types, min_size=1, max_size=4))
def test_a_ddl_schema_of_any_spark_types_has_each_columns_type(ts: list[Any]) -> None:
    """Commas inside a type (``decimal(12,3)``, ``map<string,long>``) do not end its column."""
    ddl = ", ".join(f"c{i} {t.simpleString()}" for i, t in enumerate(ts))
    assert arrow_schema(ddl) == pa.schema([pa.field(f"c{i}", _spark_arrow(t)) for i, t in enumerate(ts)])


@pytest.mark.parametrize(("name", "want"), [
    ("decimal", pa.decimal128(10, 0)), ("DECIMAL(12, 3)", pa.decimal128(12, 3)), ("dec(5)", pa.decimal128(5, 0)),
    ("numeric(4,2)", pa.decimal128(4, 2)), ("timestamp_ltz", pa.timestamp("us", tz="UTC")), ("real", pa.float32()),
])
def test_sparks_other_spellings(name: str, want: pa.DataType) -> None:
    assert arrow_type(name) == want


@pytest.mark.parametrize("name", ["decimal(50,2)", "decimal(3,5)", "decimal(x)", "decimals", "varchar(5)", "map<string>"])
def test_a_type_keyscale_cannot_hold_is_named(name: str) -> None:
    with pytest.raises(JobDefinitionError, match=rf"unknown type '{name.replace('(', '[(]').replace(')', '[)]')}'"):
        arrow_type(name)
