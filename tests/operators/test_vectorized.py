"""Vectorized keyed functions: KeyedBatch helpers, masked/unmasked columns, running aggregates."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keyscale.errors import JobDefinitionError
from keyscale.operators.vectorized import (
    RunningAggregate,
    VectorizedKeyedFunction,
    count,
    masked,
    mean,
    partial_column,
    unmasked,
)
from keyscale.operators.vectorized import max as kmax
from keyscale.operators.vectorized import min as kmin
from keyscale.operators.vectorized import sum as ksum
from keyscale.state.batches import KeyedBatch
from keyscale.state.contexts import RuntimeContext
from keyscale.state.types import StateDescriptor


def keyed_batch(records: pd.DataFrame, key: str, state: dict[str, Any] | None = None, batch_id: int = 0) -> KeyedBatch:
    """Group ``records`` by ``key`` as the task does (keys in order of first record)."""
    codes, uniques = pd.factorize(records[key])
    n = len(uniques)
    order = np.argsort(codes, kind="stable")
    starts = np.concatenate([[0], np.cumsum(np.bincount(codes, minlength=n))]).astype(np.int64)
    return KeyedBatch(
        records=records.reset_index(drop=True), codes=np.asarray(codes, dtype=np.int64),
        keys=pd.DataFrame({key: np.asarray(uniques, dtype=object)}), state=pd.DataFrame(state or {}, index=range(n)),
        order=order, starts=starts, batch_id=batch_id, processing_time=0,
    )


def test_count_and_reduce_per_key() -> None:
    recs = pd.DataFrame({"k": ["b", "a", "b", "c", "b", "a"], "v": [1, 10, 2, 100, 3, 20], "x": [0.5, -1.0, 1.5, 2.0, -0.5, 4.0]})
    kb = keyed_batch(recs, "k")
    assert kb.keys["k"].tolist() == ["b", "a", "c"]
    assert kb.count().tolist() == [3, 2, 1]
    assert kb.reduce("v", "sum").tolist() == [6, 30, 100]
    assert kb.reduce("v", "min").tolist() == [1, 10, 100]
    assert kb.reduce("v", "max").tolist() == [3, 20, 100]
    assert kb.reduce("x", "sum").tolist() == [1.5, 3.0, 2.0]
    assert [recs["v"].iloc[kb.order[kb.starts[j] : kb.starts[j + 1]]].tolist() for j in range(3)] == [[1, 2, 3], [10, 20], [100]]


def test_reduce_of_an_empty_batch() -> None:
    kb = keyed_batch(pd.DataFrame({"k": pd.Series([], dtype=object), "v": pd.Series([], dtype=np.int64)}), "k")
    assert kb.count().tolist() == []
    out = kb.reduce("v", "sum")
    assert len(out) == 0 and out.dtype == np.int64


def test_reduce_sum_of_small_ints_is_exact() -> None:
    recs = pd.DataFrame({"k": ["a", "a"], "v": np.array([2_000_000_000, 2_000_000_000], dtype=np.int32)})
    assert keyed_batch(recs, "k").reduce("v", "sum").tolist() == [4_000_000_000]


@pytest.mark.parametrize(
    ("t", "values", "valid"),
    [
        (pa.int64(), np.array([1, 0, -3]), np.array([True, False, True])),
        (pa.int32(), np.array([1, 0, 2], dtype=np.int32), np.array([False, False, True])),
        (pa.float64(), np.array([0.5, 0.0, 2.0]), np.array([True, False, True])),
        (pa.bool_(), np.array([True, False, False]), np.array([True, True, False])),
    ],
)
def test_masked_unmasked_round_trip_numeric(t: pa.DataType, values: np.ndarray, valid: np.ndarray) -> None:
    col = masked(values, valid, t)
    assert pd.isna(pd.Series(col)).tolist() == (~valid).tolist()
    back, ok = unmasked(pd.Series(col), t)
    assert ok.tolist() == valid.tolist()
    assert back[valid].tolist() == values[valid].tolist()
    assert back.dtype == t.to_pandas_dtype()


def test_masked_unmasked_round_trip_objects() -> None:
    values = np.empty(3, dtype=object)
    values[:] = [["a"], ["stale"], {"k": 1}]
    valid = np.array([True, False, True])
    col = masked(values, valid, pa.list_(pa.string()))
    assert col.tolist() == [["a"], None, {"k": 1}]
    assert values[1] == ["stale"]  # the table's array is not modified
    back, ok = unmasked(col, pa.list_(pa.string()))
    assert ok.tolist() == [True, False, True] and back[0] == ["a"]
    _, ok = unmasked(pd.Series(["x", pd.NA, None], dtype=object), pa.string())
    assert ok.tolist() == [True, False, False]


def test_unmasked_plain_numpy_and_object_columns() -> None:
    vals, ok = unmasked(np.array([1.0, 2.0]), pa.int64())
    assert vals.dtype == np.int64 and vals.tolist() == [1, 2] and ok.all()
    vals, ok = unmasked(np.array([3, None], dtype=object), pa.int64())
    assert vals.tolist() == [3, 0] and ok.tolist() == [True, False]
    vals, ok = unmasked(pd.array([1, None], dtype="Int64"), pa.int64())
    assert vals.tolist() == [1, 0] and ok.tolist() == [True, False]


# -- running aggregates ----------------------------------------------------------------------

TYPES = {"k": pa.string(), "v": pa.int64(), "x": pa.float64(), "s": pa.string()}


def test_running_aggregate_declares_states_and_output() -> None:
    fn = RunningAggregate({"n": count(), "tot": ksum("v"), "fx": ksum("x"), "lo": kmin("v"), "hi": kmax("x"), "avg": mean("v")}, ["k"], TYPES)
    assert fn.state_descriptors() == [
        StateDescriptor("n", "value", pa.int64()),
        StateDescriptor("tot", "value", pa.int64()),
        StateDescriptor("fx", "value", pa.float64()),
        StateDescriptor("lo", "value", pa.int64()),
        StateDescriptor("hi", "value", pa.float64()),
        StateDescriptor("avg_sum", "value", pa.float64()),
        StateDescriptor("avg_count", "value", pa.int64()),
    ]
    assert [(f.name, f.type) for f in fn.output_fields()] == [
        ("n", pa.int64()), ("tot", pa.int64()), ("fx", pa.float64()), ("lo", pa.int64()), ("hi", pa.float64()), ("avg", pa.float64()),
    ]
    ctx = RuntimeContext("agg")
    fn.open(ctx)
    assert list(ctx.descriptors.values()) == fn.state_descriptors()
    assert isinstance(fn, VectorizedKeyedFunction)


def test_running_aggregate_small_int_column_keeps_its_type_for_min_max() -> None:
    fn = RunningAggregate({"lo": kmin("v"), "s": ksum("v")}, ["k"], {"v": pa.int32()})
    assert [(f.name, f.type) for f in fn.output_fields()] == [("lo", pa.int32()), ("s", pa.int64())]


@pytest.mark.parametrize(
    ("aggs", "match"),
    [
        ({}, "needs at least one aggregate"),
        ({"t": ksum("missing")}, "aggregate 't': column 'missing' is not in the stream"),
        ({"t": kmax("s")}, "aggregate 't': column 's' has type string, not a number"),
        ({"t": mean("d")}, r"aggregate 't': column 'd' has type decimal128\(12, 2\), not a number \(mean\(\) of a decimal is not computed "
                           r"here: cast the column to double, or to a long of its smallest unit such as cents, in a step before the aggregate\)"),
    ],
)
def test_running_aggregate_rejects_bad_definitions(aggs: dict[str, Any], match: str) -> None:
    with pytest.raises(JobDefinitionError, match=match):
        RunningAggregate(aggs, ["k"], {**TYPES, "d": pa.decimal128(12, 2)})


def _state(fn: RunningAggregate, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """State columns (with missing values) for keys, from Python values (None = absent)."""
    out = {}
    for d in fn.state_descriptors():
        vals = [r.get(d.name) for r in rows]
        valid = np.array([v is not None for v in vals])
        arr = np.array([0 if v is None else v for v in vals], dtype=d.value_type.to_pandas_dtype())
        out[d.name] = masked(arr, valid, d.value_type)
    return out


def test_running_aggregate_combines_batch_with_state() -> None:
    fn = RunningAggregate({"n": count(), "tot": ksum("v"), "lo": kmin("v"), "hi": kmax("x"), "avg": mean("v")}, ["k"], TYPES)
    recs = pd.DataFrame({"k": ["a", "b", "a", "c"], "v": [5, 1, -2, 7], "x": [0.5, 9.0, 1.5, -1.0]})
    prev = [
        {"n": 2, "tot": 10, "lo": 3, "hi": 2.0, "avg_sum": 10.0, "avg_count": 2},  # a
        {},  # b: new key
        {"n": 1, "tot": 1, "lo": 9, "hi": -5.0, "avg_sum": 1.0, "avg_count": 1},  # c
    ]
    kb = keyed_batch(recs, "k", _state(fn, prev))
    new, out = fn.process_batch(kb)
    assert isinstance(out, pd.DataFrame)
    assert out.to_dict("records") == [
        {"k": "a", "n": 4, "tot": 13, "lo": -2, "hi": 2.0, "avg": 13 / 4},
        {"k": "b", "n": 1, "tot": 1, "lo": 1, "hi": 9.0, "avg": 1.0},
        {"k": "c", "n": 2, "tot": 8, "lo": 7, "hi": -1.0, "avg": 4.0},
    ]
    assert {k: np.asarray(v).tolist() for k, v in new.items()} == {
        "n": [4, 1, 2], "tot": [13, 1, 8], "lo": [-2, 1, 7], "hi": [2.0, 9.0, -1.0],
        "avg_sum": [13.0, 1.0, 8.0], "avg_count": [4, 1, 2],
    }
    for d in fn.state_descriptors():  # what the task stores
        vals, ok = unmasked(new[d.name], d.value_type)
        assert ok.all() and vals.dtype == d.value_type.to_pandas_dtype()


def test_running_aggregate_of_multi_column_keys() -> None:
    fn = RunningAggregate({"n": count()}, ["k", "j"], {"k": pa.string(), "j": pa.int64(), "v": pa.int64()})
    recs = pd.DataFrame({"k": ["a", "a", "b"], "j": [1, 1, 1], "v": [1, 2, 3]})
    codes, mi = pd.MultiIndex.from_frame(recs[["k", "j"]]).factorize()
    starts = np.concatenate([[0], np.cumsum(np.bincount(codes))])
    kb = KeyedBatch(recs, codes, pd.DataFrame({"k": mi.get_level_values(0), "j": mi.get_level_values(1)}),
                    pd.DataFrame(_state(fn, [{}, {"n": 5}])), np.argsort(codes, kind="stable"), starts, 0, 0)
    _, out = fn.process_batch(kb)
    assert out.to_dict("records") == [{"k": "a", "j": 1, "n": 2}, {"k": "b", "j": 1, "n": 6}]


@pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning")
def test_running_aggregate_skips_null_values() -> None:
    fn = RunningAggregate({"n": count(), "tot": ksum("v"), "lo": kmin("v")}, ["k"], TYPES)
    recs = pa.table({"k": ["a", "a", "b"], "v": pa.array([5, None, None], pa.int64())}).to_pandas()
    kb = keyed_batch(recs, "k", _state(fn, [{}, {"n": 1, "tot": 4, "lo": 4}]))
    _, out = fn.process_batch(kb)
    assert out.to_dict("records") == [{"k": "a", "n": 2, "tot": 5, "lo": 5}, {"k": "b", "n": 2, "tot": 4, "lo": 4}]


# -- combine=True: Spark's partials per key, merged ---------------------------------------------

COMBINABLE = {"n": count(), "nv": count("v"), "tot": ksum("v"), "lo": kmin("v"), "hi": kmax("x"), "avg": mean("v")}


def _partials(records: pa.Table, splits: list[int]) -> pa.Table:
    """What Spark's partial aggregation sends on: per map partition (records cut at
    ``splits``) and key, each aggregate's partial (null where all of its values are)."""
    parts = []
    for lo, hi in zip([0, *splits], [*splits, records.num_rows], strict=True):
        g = records.slice(lo, hi - lo).group_by("k", use_threads=False).aggregate(
            [([], "count_all"), ("v", "count"), ("v", "sum"), ("v", "min"), ("x", "max")])
        parts.append(pa.table({
            "k": g["k"], partial_column("n"): g["count_all"], partial_column("nv"): g["v_count"], partial_column("tot"): g["v_sum"],
            partial_column("lo"): g["v_min"], partial_column("hi"): g["x_max"], partial_column("avg", "sum"): g["v_sum"],
            partial_column("avg", "count"): g["v_count"]}))
    return pa.concat_tables(parts)


def _run_batches(fn: RunningAggregate, batches: list[pa.Table]) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """Batches through ``fn`` with the state carried by key; (each batch's output rows sorted by key, final state)."""
    fn.open(RuntimeContext("agg"))
    state: dict[str, dict[str, Any]] = {}
    outs = []
    for b in batches:
        recs = b.to_pandas()
        kb = keyed_batch(recs, "k")
        kb = keyed_batch(recs, "k", _state(fn, [state.get(k, {}) for k in kb.keys["k"]]))
        new, out = fn.process_batch(kb)
        for j, k in enumerate(kb.keys["k"]):
            state[k] = {n: (None if pd.isna(v[j]) else v[j].item() if hasattr(v[j], "item") else v[j]) for n, v in
                        ((n, pd.Series(col)) for n, col in new.items())}
        outs.extend(sorted(pd.DataFrame(out).astype(object).where(pd.DataFrame(out).notna(), None).to_dict("records"), key=lambda r: r["k"]))
    return outs, state


@given(
    st.lists(st.lists(st.tuples(st.sampled_from("abcde"), st.one_of(st.none(), st.integers(-10**12, 10**12)),
                                st.one_of(st.none(), st.floats(-1e6, 1e6))), min_size=1, max_size=30), min_size=1, max_size=3),
    st.data(),
)
@settings(max_examples=60, deadline=None)
def test_merging_spark_partials_gives_the_state_and_output_of_the_records(batches: list[list[Any]], data: st.DataObject) -> None:
    types = {"k": pa.string(), "v": pa.int64(), "x": pa.float64()}
    tables = [pa.table({"k": pa.array([r[0] for r in b], pa.string()), "v": pa.array([r[1] for r in b], pa.int64()),
                        "x": pa.array([r[2] for r in b], pa.float64())}) for b in batches]
    plain = _run_batches(RunningAggregate(COMBINABLE, ["k"], types), tables)
    partials = [_partials(t, sorted(data.draw(st.lists(st.integers(0, t.num_rows), max_size=3)))) for t in tables]
    merged = _run_batches(RunningAggregate(COMBINABLE, ["k"], types, merging=True), partials)
    assert merged == plain


def test_combine_refuses_float_sums_and_means() -> None:
    fn = RunningAggregate({"fx": ksum("x"), "hi": kmax("x")}, ["k"], TYPES)
    with pytest.raises(JobDefinitionError, match=r"operator 'op': combine=True cannot combine sum\('x'\) \(aggregate 'fx'\)"):
        fn.check_combinable("op")
    RunningAggregate({"hi": kmax("x"), "lo": kmin("x"), "n": count("x"), "avg": mean("v")}, ["k"], TYPES).check_combinable("op")


# -- min/max of times, first/last (issue 33, item 8): against a pandas model -----------------------

_T0 = pd.Timestamp("2026-01-01", tz="UTC")


def _model(batches: list[list[tuple[str, Any]]], how: str, vtype: str) -> list[dict[str, Any]]:
    """Per batch, each key of the batch with its running aggregate over every record so far
    (nulls skipped; first/last in arrival order): what pandas says."""
    seen: list[tuple[str, Any]] = []
    out = []
    for rows in batches:
        seen += rows
        values = [v for _, v in seen]
        if vtype in ("timestamp", "date"):
            col = pd.Series(pd.to_datetime(values, utc=True))
        else:
            col = pd.Series(values, dtype="Int64" if vtype == "long" else object)
        agg = col.groupby([k for k, _ in seen], sort=False)
        result = {"min": agg.min, "max": agg.max, "first": agg.first, "last": agg.last}[how]()  # pandas skips nulls
        back = {"timestamp": lambda t: t.to_pydatetime(), "date": lambda t: t.date(), "long": int, "string": str}[vtype]
        out.append({k: (None if pd.isna(result[k]) else back(result[k])) for k in dict.fromkeys(k for k, _ in rows)})
    return out


_VALUES = {
    "timestamp": st.one_of(st.none(), st.integers(-10**6, 10**6).map(lambda s: (_T0 + pd.Timedelta(microseconds=s * 997)).to_pydatetime())),
    "date": st.one_of(st.none(), st.integers(-3000, 3000).map(lambda d: (_T0 + pd.Timedelta(days=d)).date())),
    "long": st.one_of(st.none(), st.integers(-(2**62), 2**62)),
    "string": st.one_of(st.none(), st.text("abcé", max_size=3)),
}


@given(data=st.data(), parallelism=st.integers(1, 3), restore_after=st.integers(0, 3))
@settings(max_examples=60, deadline=None)
def test_min_max_first_last_equal_pandas_at_any_parallelism_and_across_a_restore(data: st.DataObject, parallelism: int, restore_after: int) -> None:
    from keyscale.operators.vectorized import first as kfirst
    from keyscale.operators.vectorized import last as klast
    from keyscale.testing import KeyedHarness

    how = data.draw(st.sampled_from(["min", "max", "first", "last"]))
    vtype = data.draw(st.sampled_from(["timestamp", "date", "long"] + (["string"] if how in ("first", "last") else [])))
    batches = data.draw(st.lists(st.lists(st.tuples(st.sampled_from(["a", "b", "c", "d"]), _VALUES[vtype]), max_size=8), min_size=1, max_size=4))
    agg = {"min": kmin, "max": kmax, "first": kfirst, "last": klast}[how]("v")
    h = KeyedHarness.aggregate(key_by=["k"], input_schema=f"k string, v {vtype}", parallelism=parallelism, r=agg)
    got = []
    for i, rows in enumerate(batches):
        if i == restore_after:
            h = h.snapshot().restore(parallelism=4 - parallelism)
        got.append({r["k"]: r["r"] for r in h.process([{"k": k, "v": v} for k, v in rows])})
    assert got == _model(batches, how, vtype)


_DECIMALS = st.decimals(min_value="-99999999.99", max_value="99999999.99", places=2, allow_nan=False, allow_infinity=False)  # decimal(10,2)


@given(batches=st.lists(st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.one_of(st.none(), _DECIMALS)), max_size=8), min_size=1, max_size=4),
       parallelism=st.integers(1, 3), restore_after=st.integers(0, 3), backend=st.sampled_from(["memory", "rocksdb"]))
@settings(max_examples=40, deadline=None)
def test_decimal_sums_minima_and_maxima_are_exact_at_any_parallelism_and_across_a_restore(
    batches: list[list[tuple[str, Any]]], parallelism: int, restore_after: int, backend: str,
) -> None:
    """sum, min and max of a decimal(10,2) column: Python's exact decimals over every record
    so far (nulls skipped), typed as Spark types them (a sum with 10 more digits)."""
    from decimal import Decimal

    from keyscale.testing import KeyedHarness

    h = KeyedHarness.aggregate(key_by=["k"], input_schema="k string, v decimal(10,2)", parallelism=parallelism, state_backend=backend,
                               total=ksum("v"), lo=kmin("v"), hi=kmax("v"))
    typed = RunningAggregate({"total": ksum("v"), "lo": kmin("v")}, ["k"], {"k": pa.string(), "v": pa.decimal128(10, 2)}).output_fields()
    assert [(f.name, f.type) for f in typed] == [("total", pa.decimal128(20, 2)), ("lo", pa.decimal128(10, 2))]
    seen: dict[str, list[Decimal]] = {}
    for i, rows in enumerate(batches):
        if i == restore_after:
            h = h.snapshot().restore(parallelism=4 - parallelism)
        got = {r["k"]: (r["total"], r["lo"], r["hi"]) for r in h.process([{"k": k, "v": v} for k, v in rows])}
        for k, v in rows:
            seen.setdefault(k, []).extend([] if v is None else [v])
        want = {k: (sum(seen[k], Decimal(0)), min(seen[k]), max(seen[k])) if seen[k] else (None, None, None) for k, _ in rows}
        assert got == want


def test_a_decimal_total_past_its_precision_is_an_error_naming_the_key() -> None:
    from decimal import Decimal

    from keyscale.errors import RecordError
    from keyscale.testing import KeyedHarness

    h = KeyedHarness.aggregate(key_by=["k"], input_schema="k string, v decimal(36,0)", total=ksum("v"))
    big = Decimal(10**36 - 1)
    assert h.process([{"k": "a", "v": big}] * 90)[0]["total"] == Decimal(90 * (10**36 - 1))  # 38 digits, none rounded: Spark's cap
    with pytest.raises(RecordError, match=r"operator 'harness' failed in batch 1 .*sum\('v'\) of key 'a' is 109{34}890, more than decimal\(38,0\) holds"):
        h.process([{"k": "a", "v": big}] * 20)
    with pytest.raises(JobDefinitionError, match=r"combine=True does not combine decimals \(sum\('v'\), aggregate 't'\)"):
        RunningAggregate({"t": ksum("v")}, ["k"], {"k": pa.string(), "v": pa.decimal128(10, 2)}).check_combinable("op")


def test_times_and_first_last_are_refused_where_they_cannot_run() -> None:
    from keyscale.operators.vectorized import first as kfirst
    from keyscale.operators.windows import TumblingWindows, WindowAggregate

    types = {"k": pa.string(), "ts": pa.timestamp("us", tz="UTC"), "x": pa.list_(pa.int64())}
    with pytest.raises(JobDefinitionError, match=r"combine=True cannot combine first\('ts'\)"):
        RunningAggregate({"f": kfirst("ts")}, ["k"], types).check_combinable("op")
    with pytest.raises(JobDefinitionError, match=r"first\(\) takes a number, a string, a timestamp or a date; column 'x' has type list<item: int64>"):
        RunningAggregate({"f": kfirst("x")}, ["k"], types)
    with pytest.raises(JobDefinitionError, match=r"first\(\) is a running aggregate"):
        WindowAggregate(TumblingWindows("1 minute"), {"f": kfirst("ts")}, ["k"], types, "ts", 0)
    with pytest.raises(JobDefinitionError, match=r"column 'ts' has type timestamp.*, not a number$"):  # windows: numbers only, as before
        WindowAggregate(TumblingWindows("1 minute"), {"m": kmin("ts")}, ["k"], types, "ts", 0)


def test_a_last_seen_column_through_spark(spark: Any, tmp_path: Any) -> None:
    """min/max/first/last of a timestamp in a real job (Spark's types on the way in and out),
    one file per batch: the running values after the last batch are pandas' over the files in order."""
    from conftest import read_output, run_job, write_events

    write_events(tmp_path / "in", files=3, rows=200, keys=20, seed=5)
    job = tmp_path / "seen.py"
    job.write_text(
        "import keyscale as ks\n"
        "def build(ctx):\n"
        "    df = ctx.spark.readStream.schema('key string, value long, ts timestamp').option('maxFilesPerTrigger', 1).parquet(ctx.arg('input'))\n"
        "    return (ks.stream(df).key_by('key').aggregate(uid='seen', first_seen=ks.aggregates.first('ts'), last_seen=ks.aggregates.last('ts'),\n"
        "            lo=ks.aggregates.min('ts'), hi=ks.aggregates.max('ts'), last_value=ks.aggregates.last('value')).sink(ks.sinks.ParquetSink(ctx.arg('output'))))\n"
    )
    run_job(job, tmp_path / "job", 2, {"input": str(tmp_path / "in"), "output": str(tmp_path / "out")})
    out = read_output(tmp_path / "out").sort_values("batch").groupby("key").last()
    events = pd.concat([pd.read_parquet(p) for p in sorted((tmp_path / "in").glob("part-*.parquet"))], ignore_index=True)
    by = events.groupby("key")
    want = pd.DataFrame({"first_seen": by["ts"].first(), "last_seen": by["ts"].last(), "lo": by["ts"].min(), "hi": by["ts"].max(),
                         "last_value": by["value"].last()})
    got = out[list(want.columns)]
    for c in ("first_seen", "last_seen", "lo", "hi"):
        assert (pd.to_datetime(got[c], utc=True) == pd.to_datetime(want[c], utc=True)).all(), c
    assert (got["last_value"] == want["last_value"]).all()


def test_decimal_totals_through_spark(spark: Any, tmp_path: Any) -> None:
    """A money column (decimal(10,2)) summed, its minimum and maximum kept, in a real job at
    parallelism 2, one file per batch: the output is typed as Spark types a sum (decimal(20,2))
    and each key's last row is the exact total of its records."""
    from decimal import Decimal

    import pyarrow.parquet as pq

    from conftest import read_output, run_job

    rng = np.random.default_rng(3)
    (tmp_path / "in").mkdir()
    files = []
    for i in range(3):
        cents = rng.integers(-10**9, 10**9, 300)
        t = pa.table({"key": [f"k{j}" for j in rng.integers(0, 20, 300)],
                      "price": pa.array([Decimal(int(c)).scaleb(-2) for c in cents], pa.decimal128(10, 2))})
        pq.write_table(t, tmp_path / "in" / f"part-{i}.parquet")
        files.append(t.to_pandas())
    job = tmp_path / "money.py"
    job.write_text(
        "import keyscale as ks\n"
        "def build(ctx):\n"
        "    df = ctx.spark.readStream.schema('key string, price decimal(10,2)').option('maxFilesPerTrigger', 1).parquet(ctx.arg('input'))\n"
        "    return (ks.stream(df).key_by('key').aggregate(uid='money', total=ks.aggregates.sum('price'), lo=ks.aggregates.min('price'),\n"
        "            hi=ks.aggregates.max('price')).sink(ks.sinks.ParquetSink(ctx.arg('output'))))\n"
    )
    run_job(job, tmp_path / "job", 2, {"input": str(tmp_path / "in"), "output": str(tmp_path / "out")})
    schema = pq.read_schema(next((tmp_path / "out").rglob("*.parquet")))
    assert (schema.field("total").type, schema.field("lo").type) == (pa.decimal128(20, 2), pa.decimal128(10, 2))
    out = read_output(tmp_path / "out").sort_values("batch").groupby("key").last()
    events = pd.concat(files, ignore_index=True)
    want = {k: (sum(g, Decimal(0)), min(g), max(g)) for k, g in events.groupby("key")["price"]}
    assert {k: (r["total"], r["lo"], r["hi"]) for k, r in out.iterrows()} == want


def test_min_max_of_a_timestamp_with_combine(spark: Any, tmp_path: Any) -> None:
    """combine=True: Spark's partial min/max of a timestamp (a timestamp column) merged by the task."""
    from conftest import read_output, run_job, write_events

    write_events(tmp_path / "in", files=2, rows=200, keys=20, seed=6)
    job = tmp_path / "combined.py"
    job.write_text(
        "import keyscale as ks\n"
        "def build(ctx):\n"
        "    df = ctx.spark.readStream.schema('key string, value long, ts timestamp').option('maxFilesPerTrigger', 1).parquet(ctx.arg('input'))\n"
        "    return (ks.stream(df).key_by('key').aggregate(uid='span', combine=True, lo=ks.aggregates.min('ts'), hi=ks.aggregates.max('ts'))\n"
        "            .sink(ks.sinks.ParquetSink(ctx.arg('output'))))\n"
    )
    run_job(job, tmp_path / "job", 2, {"input": str(tmp_path / "in"), "output": str(tmp_path / "out")})
    out = read_output(tmp_path / "out").sort_values("batch").groupby("key").last()
    ts = pd.concat([pd.read_parquet(p) for p in sorted((tmp_path / "in").glob("part-*.parquet"))]).groupby("key")["ts"]
    assert (pd.to_datetime(out["lo"], utc=True) == ts.min()).all() and (pd.to_datetime(out["hi"], utc=True) == ts.max()).all()
