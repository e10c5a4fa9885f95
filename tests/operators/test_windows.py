"""Window operator semantics without Spark: the vectorized operator against a record-by-record model."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.operators.window_reference import batches, fixed_windows, last_rows, sessions, watermarks

import keyscale as ks
from keyscale.errors import JobDefinitionError
from keyscale.operators.eventtime import END_OF_TIME, NO_WATERMARK
from keyscale.operators.windows import WINDOW_START, WindowAggregate, run_windows
from keyscale.state.table import KeyedStateTable

TYPES = {"key": pa.string(), "value": pa.int64(), "ts": pa.int64()}


def run(assigner: object, data: list[pd.DataFrame], ooo: int, lateness: int, aggs: dict[str, object]) -> tuple[pd.DataFrame, pd.DataFrame, KeyedStateTable]:
    op = WindowAggregate(assigner, aggs, ["key"], TYPES, "ts", lateness)  # type: ignore[arg-type]
    schema = pa.schema([pa.field("key", pa.string()), *op.output_fields()])
    table = KeyedStateTable(["key", WINDOW_START], [pa.string(), pa.int64()], op.state_descriptors())
    outs, lates = [], []
    for b, (df, w) in enumerate(zip([*data, data[0].iloc[:0]], [*watermarks(data, ooo), END_OF_TIME], strict=True)):
        rec = pa.Table.from_pandas(df, preserve_index=False)
        keys = np.asarray(df["key"], dtype=object)
        res = run_windows(op, table, 0, 127, rec, [keys], np.zeros(len(df), np.int32), w, schema)
        outs.append(res.output.to_pandas().assign(batch=b))
        lates.append(res.late.to_pandas())
        table.compact()
    return pd.concat(outs, ignore_index=True), pd.concat(lates, ignore_index=True), table


def _sorted(df: pd.DataFrame) -> pd.DataFrame:
    return df.sort_values(list(df.columns)).reset_index(drop=True)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), lateness=st.sampled_from([0, 3_000, 30_000]), sliding=st.booleans())
def test_fixed_windows_equal_the_model(seed: int, lateness: int, sliding: bool) -> None:
    data = batches(seed)
    assigner = ks.windows.SlidingWindows(10, 5) if sliding else ks.windows.TumblingWindows(10)
    out, late, table = run(assigner, data, 2000, lateness, {"count": ks.aggregates.count(), "total": ks.aggregates.sum("value")})
    want, want_late = fixed_windows(data, 2000, lateness, 10_000, 5_000 if sliding else None)
    got = last_rows(out, ["key", "window_start"])
    assert_frame = pd.testing.assert_frame_equal
    assert_frame(_sorted(got[["key", "window_start", "window_end", "count", "total"]]), _sorted(want), check_dtype=False)
    assert_frame(_sorted(late), _sorted(want_late), check_dtype=False)
    assert len(table.rows_in_range(0, 127, live_only=True)) == 0  # the drain purged everything


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), lateness=st.sampled_from([0, 5_000]))
def test_sessions_equal_the_model(seed: int, lateness: int) -> None:
    data = batches(seed, span=9_000)
    out, late, _ = run(ks.windows.SessionWindows(2.999), data, 2000, lateness, {"events": ks.aggregates.count(), "total": ks.aggregates.sum("value")})
    want, want_late = sessions(data, 2000, lateness, 2999)
    got = last_rows(out, ["key", "window_start"]).set_index(["key", "window_start"])
    for r in want.itertuples(index=False):
        row = got.loc[(r.key, r.window_start)]
        assert (row.window_end, row.events, row.total) == (r.window_end, r.events, r.total)
    # A session that grew backwards after it fired leaves its older row behind: inside a final one.
    extra = got.drop(index=[(r.key, r.window_start) for r in want.itertuples(index=False)])
    for (key, start), row in extra.iterrows():
        mine = want[want.key == key]
        assert ((mine.window_start <= start) & (mine.window_end >= row.window_end)).any()
    if lateness == 0:
        assert extra.empty
    pd.testing.assert_frame_equal(_sorted(late), _sorted(want_late), check_dtype=False)


def test_a_window_fires_once_on_time_and_again_per_late_update() -> None:
    on_time = pd.DataFrame({"key": ["a", "a"], "value": [1, 2], "ts": [1_000, 9_000]})
    advance = pd.DataFrame({"key": ["b"], "value": [0], "ts": [30_000]})
    late = pd.DataFrame({"key": ["a"], "value": [5], "ts": [4_000]})
    out, dropped, _ = run(ks.windows.TumblingWindows(10), [on_time, advance, late, late.assign(ts=2_000)], 0, 25_000, {"n": ks.aggregates.count(), "s": ks.aggregates.sum("value")})
    a = out[out.key == "a"].sort_values("batch")
    # Batch 2 runs with W = 29,999: [0, 10 s) fires, with that batch's late record in it;
    # batch 3's late record (within the lateness) makes it fire again, once.
    assert a[["batch", "n", "s"]].values.tolist() == [[2, 3, 8], [3, 4, 13]]
    assert dropped.empty


def test_all_aggregates_and_nulls() -> None:
    df = pd.DataFrame({"key": ["a", "a", "a"], "value": pd.array([4, None, 2], dtype="Int64"), "ts": [1, 2, 3]})
    aggs = {"n": ks.aggregates.count(), "nv": ks.aggregates.count("value"), "s": ks.aggregates.sum("value"), "lo": ks.aggregates.min("value"), "hi": ks.aggregates.max("value"),
            "avg": ks.aggregates.mean("value"), "product": ks.aggregates.reduce("value", lambda x, y: x * y)}
    out, _, _ = run(ks.windows.TumblingWindows(1), [df], 0, 0, aggs)
    row = out.iloc[0]
    assert (row.n, row.nv, row.s, row.lo, row.hi, row.avg, row["product"]) == (3, 2, 6, 2, 4, 3.0, 8)


def test_nothing_fires_before_the_watermark() -> None:
    df = pd.DataFrame({"key": ["a"], "value": [1], "ts": [5]})
    op = WindowAggregate(ks.windows.TumblingWindows(1), {"n": ks.aggregates.count()}, ["key"], TYPES, "ts")
    schema = pa.schema([pa.field("key", pa.string()), *op.output_fields()])
    table = KeyedStateTable(["key", WINDOW_START], [pa.string(), pa.int64()], op.state_descriptors())
    res = run_windows(op, table, 0, 127, pa.Table.from_pandas(df), [np.array(["a"], dtype=object)], np.zeros(1, np.int32), NO_WATERMARK, schema)
    assert res.output.num_rows == 0 and res.fired == 0
    res = run_windows(op, table, 0, 127, pa.Table.from_pandas(df.iloc[:0]), [np.empty(0, dtype=object)], np.zeros(0, np.int32), 998, schema)
    assert res.output.num_rows == 0  # [0, 1000) is due at W >= 999
    res = run_windows(op, table, 0, 127, pa.Table.from_pandas(df.iloc[:0]), [np.empty(0, dtype=object)], np.zeros(0, np.int32), 999, schema)
    assert res.output.to_pylist() == [{"key": "a", "window_start": 0, "window_end": 1000, "n": 1}]


@pytest.mark.parametrize("bad", ["0 s", "ten seconds", "-5 s"])
def test_bad_window_sizes_are_named(bad: str) -> None:
    with pytest.raises(JobDefinitionError, match=r"window size|duration|negative|positive"):
        ks.windows.TumblingWindows(bad)


def test_aggregate_errors_name_the_column() -> None:
    with pytest.raises(JobDefinitionError, match="column 'nope'"):
        WindowAggregate(ks.windows.TumblingWindows(1), {"s": ks.aggregates.sum("nope")}, ["key"], TYPES, "ts")
    with pytest.raises(JobDefinitionError, match="'key' has type string"):
        WindowAggregate(ks.windows.TumblingWindows(1), {"s": ks.aggregates.sum("key")}, ["key"], TYPES, "ts")


def test_a_far_future_record_goes_to_the_late_output_and_opens_no_window() -> None:
    """Issue 10, case 7: event times beyond the batch's bound are late, counted apart."""
    op = WindowAggregate(ks.windows.TumblingWindows(1), {"n": ks.aggregates.count()}, ["key"], TYPES, "ts")
    schema = pa.schema([pa.field("key", pa.string()), *op.output_fields()])
    table = KeyedStateTable(["key", WINDOW_START], [pa.string(), pa.int64()], op.state_descriptors())
    df = pd.DataFrame({"key": ["a", "a", "b"], "value": [1, 2, 3], "ts": [5_000, 253_402_300_799_000, 1_000]})
    keys = np.asarray(df["key"], dtype=object)
    res = run_windows(op, table, 0, 127, pa.Table.from_pandas(df), [keys], np.zeros(3, np.int32), 1_999, schema, limit_ms=10_000)
    assert res.late.column("ts").to_pylist() == [253_402_300_799_000, 1_000]
    assert (res.late_records, res.too_far_ahead) == (1, 1)
    assert sorted(table.key_values(table.rows_in_range(0, 127, live_only=True))[1].tolist()) == [5_000]  # no window at year 9999
