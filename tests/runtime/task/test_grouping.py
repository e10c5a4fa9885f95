"""A subtask's batch grouped by key (keyscale.runtime.task.grouping): pure, no Spark."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from keyscale.runtime.task import grouping
from keyscale.runtime.task.spec import KG


class _Spec:
    uid, batch_id = "op", 7

    def __init__(self, names: list[str], types: list[pa.DataType]):
        self.key_names, self.key_types = names, types


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "ü", ""]), st.integers(-2, 2)), max_size=30), st.booleans())
def test_every_record_gets_its_keys_index_and_each_key_its_records_in_arrival_order(rows: list[tuple[str, int]], two: bool) -> None:
    names, types = (["s", "n"], [pa.string(), pa.int64()]) if two else (["s"], [pa.string()])
    keys = [r if two else (r[0],) for r in rows]
    kg = [len(k[0]) * 10 + (k[1] if two else 0) + 2 for k in keys]  # one key group per key
    table = pa.table({"s": [r[0] for r in rows], "n": [r[1] for r in rows], KG: pa.array(kg, pa.int32())})
    g = grouping.group_keys(_Spec(names, types), table)  # type: ignore[arg-type]

    distinct = list(dict.fromkeys(keys))  # first-appearance order
    assert [tuple(k) if two else (k,) for k in g.index] == distinct
    assert g.codes.tolist() == [distinct.index(k) for k in keys]
    assert g.kgs.tolist() == [kg[keys.index(k)] for k in distinct]
    for j, key in enumerate(distinct):
        mine = g.order[g.starts[j]:g.starts[j + 1]].tolist()
        assert mine == [i for i, k in enumerate(keys) if k == key]  # all of them, in arrival order
    assert np.array_equal(np.sort(g.order), np.arange(len(rows)))
