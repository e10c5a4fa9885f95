"""The batch-at-a-time co-process function's view of a batch (no Spark): the combined rows
``(key, __side, in1, in2)`` a two-input stage's task gets, split back into each input's
records, with their keys' codes and their places in the batch."""

from __future__ import annotations

import doctest
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

import keyscale.operators.coprocess as coprocess
from keyscale.errors import JobDefinitionError
from keyscale.operators.coprocess import (
    INPUTS,
    SIDE,
    KeyedCoBatch,
    VectorizedKeyedCoProcessFunction,
    adapt,
)
from keyscale.operators.vectorized import KeyedBatch

IN1 = pa.struct([("id", pa.string()), ("name", pa.string()), ("age", pa.int64())])
IN2 = pa.struct([("user", pa.string()), ("page", pa.string())])


def combined(rows: list[tuple[int, str, int]]) -> pa.Table:
    """Combined rows of (side, key, n) as the stage's task gets them."""
    side = [s for s, _, _ in rows]
    in1 = [{"id": k, "name": f"name{n}", "age": n} if s == 0 else None for s, k, n in rows]
    in2 = [{"user": k, "page": f"page{n}"} if s == 1 else None for s, k, n in rows]
    return pa.table({"id": [k for _, k, _ in rows], SIDE: pa.array(side, pa.int8()),
                     INPUTS[0]: pa.array(in1, IN1), INPUTS[1]: pa.array(in2, IN2)})


class Seen(VectorizedKeyedCoProcessFunction):
    input_columns1 = ("name", "age")

    def process_batch(self, batch: KeyedCoBatch) -> tuple[dict[str, Any], pd.DataFrame]:
        self.batch = batch
        return {}, pd.DataFrame()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1), st.sampled_from(["a", "b", "c", "d"]), st.integers(0, 99)), max_size=40))
def test_each_input_gets_its_own_records_in_arrival_order(rows: list[tuple[int, str, int]]) -> None:
    table = combined(rows)
    keys, codes = np.unique(np.array([k for _, k, _ in rows], dtype=object), return_inverse=True) if rows else (np.array([], dtype=object), np.array([], dtype=np.int64))
    fn = Seen()
    adapter = adapt(fn, 1)
    batch = KeyedBatch(records=pd.DataFrame(index=range(len(rows))), codes=np.asarray(codes, dtype=np.int64), keys=pd.DataFrame({"id": keys}),
                       state=pd.DataFrame(index=range(len(keys))), order=np.argsort(codes, kind="stable"), starts=np.zeros(1, dtype=np.int64),
                       batch_id=7, processing_time=0, arrow=table.select(adapter.input_columns))  # type: ignore[attr-defined]
    adapter.process_batch(batch)  # type: ignore[union-attr]
    b = fn.batch
    for n, records, codes_n, positions in ((0, b.records1, b.codes1, b.positions1), (1, b.records2, b.codes2, b.positions2)):
        mine = [(i, k, v) for i, (s, k, v) in enumerate(rows) if s == n]
        assert positions.tolist() == [i for i, _, _ in mine]
        assert [b.keys["id"][c] for c in codes_n] == [k for _, k, _ in mine]
        if n == 0:  # only the declared columns become pandas; integers stay integers
            assert list(records.columns) == ["name", "age"] and str(records["age"].dtype) == "Int64"
            assert records["age"].tolist() == [v for _, _, v in mine]
            assert b.arrow1 is not None and b.arrow1.column_names == ["name", "age"]
        else:  # None: every column
            assert list(records.columns) == ["user", "page"] and records["page"].tolist() == [f"page{v}" for _, _, v in mine]
    assert b.batch_id == 7


def test_arrow_only_functions_get_no_pandas() -> None:
    class ArrowOnly(Seen):
        pandas_records = False

    fn = ArrowOnly()
    adapter = adapt(fn, 1)
    rows = [(0, "a", 1), (1, "a", 2), (1, "b", 3)]
    batch = KeyedBatch(records=pd.DataFrame(index=range(3)), codes=np.array([0, 0, 1]), keys=pd.DataFrame({"id": ["a", "b"]}),
                       state=pd.DataFrame(index=range(2)), order=np.arange(3), starts=np.array([0, 2, 3]), batch_id=0, processing_time=0,
                       arrow=combined(rows).select(adapter.input_columns))  # type: ignore[attr-defined]
    adapter.process_batch(batch)  # type: ignore[union-attr]
    assert fn.batch.records2.shape == (2, 0) and fn.batch.arrow2 is not None and fn.batch.arrow2.column("page").to_pylist() == ["page2", "page3"]


def test_a_function_of_another_kind_is_refused_by_name() -> None:
    try:
        adapt(object(), 1)  # type: ignore[arg-type]
    except JobDefinitionError as e:
        assert "object is not a KeyedCoProcessFunction or VectorizedKeyedCoProcessFunction" in str(e)
    else:
        raise AssertionError("accepted")


def test_docstring_examples_run() -> None:
    result = doctest.testmod(coprocess)
    assert result.failed == 0 and result.attempted > 0
