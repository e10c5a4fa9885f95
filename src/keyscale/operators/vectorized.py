"""Vectorized keyed functions: one call per subtask and batch, on columns, not per key.

The function sees the batch's records, the distinct keys (in order of first record), the
code of each record's key, and the current state of those keys as columns; it returns the
new state of those keys and the output rows. Built-in running aggregates sit on top.
"""

from __future__ import annotations

import builtins
import decimal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pandas as pd
import pyarrow as pa

from keyscale.errors import JobDefinitionError
from keyscale.state.batches import KeyedBatch
from keyscale.state.contexts import RuntimeContext
from keyscale.state.types import StateDescriptor, is_numeric


class VectorizedKeyedFunction:
    """Base class for vectorized keyed functions; declare state in ``open``.

    ``input_columns``: the columns of ``batch.records`` the function reads (None: all of
    them). Declaring them saves converting the others to pandas every batch.
    ``pandas_records = False``: the function reads ``batch.arrow`` only, and ``batch.records``
    is left empty (no conversion to pandas at all).
    ``event_timers = True``: one event-time timer per key (needs a watermark). The batch
    has each key's ``timer`` and which are ``due``; the returned state's :data:`keyscale.state.TIMER`
    entry sets the keys' timers (missing: none); without it, due timers are spent and the
    others kept. A key whose timer is due is in the batch even with no records.
    """

    input_columns: list[str] | None = None
    pandas_records: bool = True
    event_timers: bool = False

    def open(self, ctx: RuntimeContext) -> None:
        """Declare value states here (``ctx.value_state(name, type)``)."""

    def process_batch(self, batch: KeyedBatch) -> tuple[dict[str, Any], pd.DataFrame | pa.Table]:
        """Return (new state per declared name, aligned with ``batch.keys``; output rows)."""
        raise NotImplementedError


# Integers with nulls stay integers (pandas would make them floats and lose precision).
_NULLABLE = {
    pa.int8(): pd.Int8Dtype(), pa.int16(): pd.Int16Dtype(), pa.int32(): pd.Int32Dtype(), pa.int64(): pd.Int64Dtype(),
    pa.bool_(): pd.BooleanDtype(), pa.float32(): pd.Float32Dtype(), pa.float64(): pd.Float64Dtype(),
}


def to_frame(table: pa.Table) -> pd.DataFrame:
    """Records as pandas, as vectorized functions get them: integers with nulls stay integers."""
    return table.to_pandas(types_mapper=_NULLABLE.get)


def masked(values: np.ndarray, valid: np.ndarray, t: pa.DataType) -> pd.api.extensions.ExtensionArray | np.ndarray:
    """A pandas column with missing values from the state table's form."""
    if pa.types.is_integer(t):
        return pd.arrays.IntegerArray(values.astype(t.to_pandas_dtype(), copy=False), ~valid)
    if pa.types.is_floating(t):
        return pd.arrays.FloatingArray(values.astype(t.to_pandas_dtype(), copy=False), ~valid)
    if pa.types.is_boolean(t):
        return pd.arrays.BooleanArray(values.astype(bool, copy=False), ~valid)
    out = values.copy()
    out[~valid] = None
    return out


def unmasked(column: Any, t: pa.DataType) -> tuple[np.ndarray, np.ndarray]:
    """The state table's (values, valid) form of a returned column."""
    if isinstance(column, pd.Series):
        column = column.array
    if is_numeric(t):
        if isinstance(column, pd.api.extensions.ExtensionArray):
            valid = ~np.asarray(column.isna(), dtype=bool)
            values = np.asarray(column.to_numpy(dtype=t.to_pandas_dtype(), na_value=0))
            return values, valid
        arr = np.asarray(column)
        if arr.dtype == object:
            valid = np.array([v is not None for v in arr], dtype=bool)
            return np.array([v if v is not None else 0 for v in arr], dtype=t.to_pandas_dtype()), valid
        return arr.astype(t.to_pandas_dtype(), copy=False), np.ones(len(arr), dtype=bool)
    arr = np.asarray(column, dtype=object)
    valid = np.array([v is not None and v is not pd.NA for v in arr], dtype=bool)
    return arr, valid


# -- built-in running aggregates ---------------------------------------------------------------

AggKind = Literal["count", "sum", "min", "max", "mean", "reduce", "first", "last"]


@dataclass(frozen=True)
class Agg:
    """An aggregate of one column (or of records, for count); ``fn`` for a custom reduce."""

    kind: AggKind
    column: str | None = None
    fn: Callable[[Any, Any], Any] | None = None


def count(column: str | None = None) -> Agg:
    """Number of records per key (with ``column``: of records where it is not null)."""
    return Agg("count", column)


def sum(column: str) -> Agg:
    """Running sum of ``column`` per key: a long for integers, a double for floats, and for a
    decimal(p,s) an exact decimal(p+10,s) (at most 38 digits, as Spark's sum; a total past
    them fails the batch, naming the key).

    >>> from decimal import Decimal
    >>> from keyscale.testing import KeyedHarness
    >>> h = KeyedHarness.aggregate(key_by=["user"], input_schema="user string, price decimal(10,2)", spent=sum("price"))
    >>> h.process([{"user": "ann", "price": Decimal("0.10")}, {"user": "ann", "price": Decimal("0.20")}])
    [{'user': 'ann', 'spent': Decimal('0.30')}]
    """
    return Agg("sum", column)


def min(column: str) -> Agg:
    """Running minimum of ``column`` per key: a number (a decimal too), a timestamp or a date (nulls skipped).

    >>> from datetime import datetime
    >>> from keyscale.testing import KeyedHarness
    >>> h = KeyedHarness.aggregate(key_by=["user"], input_schema="user string, ts timestamp", since=min("ts"))
    >>> [r["since"].isoformat() for r in h.process([{"user": "ann", "ts": datetime(2026, 1, 2)}, {"user": "ann", "ts": datetime(2026, 1, 1)}])]
    ['2026-01-01T00:00:00+00:00']
    """
    return Agg("min", column)


def max(column: str) -> Agg:
    """Running maximum of ``column`` per key: a number (a decimal too), a timestamp or a date (nulls skipped).

    >>> from datetime import date
    >>> from keyscale.testing import KeyedHarness
    >>> h = KeyedHarness.aggregate(key_by=["user"], input_schema="user string, day date", latest=max("day"))
    >>> h.process([{"user": "ann", "day": date(2026, 3, 1)}, {"user": "ann", "day": date(2026, 2, 1)}])
    [{'user': 'ann', 'latest': datetime.date(2026, 3, 1)}]
    """
    return Agg("max", column)


def first(column: str) -> Agg:
    """The first non-null value of ``column`` per key, in arrival order: it never changes once set.

    Arrival order is the order keyscale feeds a key's records to the stage (README, "Arrival
    order"): across batches, the batch order; within a batch, for a file source read
    straight into the stage, the files' order (by a hash of their paths) and each file's
    row order, so a replay (after a crash, at another parallelism, on another master)
    gives the same first value. Where the order is Spark's (Kafka through Spark, a union,
    a ``transform`` before the stage) two records of one key in one batch may arrive in
    another order on a replay; order by a column of the records (``min``/``max`` of a
    timestamp) when that matters. Not with ``combine=True``.

    >>> from keyscale.testing import KeyedHarness
    >>> h = KeyedHarness.aggregate(key_by=["user"], input_schema="user string, page string", entry=first("page"))
    >>> h.process([{"user": "ann", "page": None}, {"user": "ann", "page": "/home"}, {"user": "ann", "page": "/buy"}])
    [{'user': 'ann', 'entry': '/home'}]
    """
    return Agg("first", column)


def last(column: str) -> Agg:
    """The last non-null value of ``column`` per key, in arrival order (see :func:`first` for
    what the order is, and when a replay repeats it): a "last seen" column.

    >>> from datetime import datetime
    >>> from keyscale.testing import KeyedHarness
    >>> h = KeyedHarness.aggregate(key_by=["user"], input_schema="user string, ts timestamp", last_seen=last("ts"))
    >>> [r["last_seen"].isoformat() for r in h.process([{"user": "ann", "ts": datetime(2026, 1, 1, 9)}, {"user": "ann", "ts": datetime(2026, 1, 1, 8)}])]
    ['2026-01-01T08:00:00+00:00']
    >>> [r["last_seen"].isoformat() for r in h.process([{"user": "ann", "ts": None}])]  # nulls are skipped: the last value seen stays
    ['2026-01-01T08:00:00+00:00']
    """
    return Agg("last", column)


def _temporal(t: pa.DataType) -> bool:
    return bool(pa.types.is_timestamp(t) or pa.types.is_date(t))


def mean(column: str) -> Agg:
    """Running mean of ``column`` per key."""
    return Agg("mean", column)


def result_type(what: str, agg: Agg, input_types: dict[str, pa.DataType], running: bool = False) -> pa.DataType:
    """The type of an aggregate's result; the column must exist, and be a number where it must.
    ``running``: for ``aggregate()``, which also takes min/max of times and first/last."""
    if agg.kind == "count" and agg.column is None:
        return pa.int64()
    if agg.column not in input_types:
        raise JobDefinitionError(f"{what}: column '{agg.column}' is not in the stream (columns: {', '.join(input_types)})")
    t = input_types[agg.column]
    if agg.kind == "count":
        return pa.int64()
    if agg.kind == "reduce":
        return t
    if agg.kind in ("first", "last"):
        if not running:
            raise JobDefinitionError(f"{what}: {agg.kind}() is a running aggregate (aggregate()), not a window aggregate")
        if not (is_numeric(t) or _temporal(t) or pa.types.is_string(t) or pa.types.is_large_string(t)):
            raise JobDefinitionError(f"{what}: {agg.kind}() takes a number, a string, a timestamp or a date; column '{agg.column}' has type {t}")
        return t
    if running and agg.kind in ("min", "max") and _temporal(t):
        return t
    if running and agg.kind in ("sum", "min", "max") and pa.types.is_decimal(t):
        # Exact, as Spark's: a sum gets 10 more digits (at most 38), the scale stays.
        return pa.decimal128(builtins.min(38, t.precision + 10), t.scale) if agg.kind == "sum" else t
    if not (pa.types.is_integer(t) or pa.types.is_floating(t)):
        times = " or a time (timestamp, date)" if running and agg.kind in ("min", "max") else ""
        # Only the running sum, min and max take decimals (exactly, in Arrow's decimal
        # arithmetic): say what to do for the others.
        hint = (f" ({agg.kind}() of a decimal is not computed here{'' if running else ' in a window'}: cast the column to double,"
                " or to a long of its smallest unit such as cents, in a step before the aggregate)") if pa.types.is_decimal(t) else ""
        raise JobDefinitionError(f"{what}: column '{agg.column}' has type {t}, not a number{times}{hint}")
    if agg.kind == "sum":
        return pa.int64() if pa.types.is_integer(t) else pa.float64()
    return pa.float64() if agg.kind == "mean" else t


def partial_column(name: str, part: str = "") -> str:
    """The column of aggregate ``name``'s partial (``part``: "sum" or "count" of a mean) in a
    combined batch (see :meth:`RunningAggregate.merging`)."""
    return f"__partial_{name}{'_' + part if part else ''}"


class RunningAggregate(VectorizedKeyedFunction):
    """Built-in vectorized running aggregates; emits (key..., aggregates) per updated key.

    With ``merging`` (``aggregate(..., combine=True)``) its records are not the stream's but
    Spark's partial aggregates of them per key (:func:`partial_column`): counts and sums are
    added, minima and maxima taken, the state and output are the same."""

    def __init__(self, aggs: dict[str, Agg], key_names: list[str], input_types: dict[str, pa.DataType], merging: bool = False):
        if not aggs:
            raise JobDefinitionError("aggregate() needs at least one aggregate, e.g. aggregate(uid='counts', n=keyscale.aggregates.count())")
        self.aggs = aggs
        self.key_names = key_names
        self.input_types = input_types
        self.merging = merging
        self.input_columns = sorted({a.column for a in aggs.values() if a.column is not None})
        self.types: dict[str, pa.DataType] = {}
        for name, agg in aggs.items():
            if agg.kind == "reduce":
                raise JobDefinitionError(f"aggregate '{name}': reduce() is for windows; for a running reduce write a KeyedProcessFunction")
            self.types[name] = result_type(f"aggregate '{name}'", agg, input_types, running=True)
        if merging:
            self.input_columns = [partial_column(n, part) for n, a in aggs.items() for part in (("sum", "count") if a.kind == "mean" else ("",))]

    def check_combinable(self, uid: str) -> None:
        """Refuse ``combine=True`` where the partials would not give a bit-identical result:
        a sum or mean of floating-point values depends on the order of its additions, which
        Spark's partial aggregation does not fix (a replayed batch could differ in its last bits)."""
        for name, agg in self.aggs.items():
            if agg.kind in ("first", "last"):
                raise JobDefinitionError(
                    f"operator '{uid}': combine=True cannot combine {agg.kind}('{agg.column}') (aggregate '{name}'): Spark's partial "
                    "aggregation does not keep the records' arrival order; leave combine off")
            if pa.types.is_decimal(self.input_types.get(str(agg.column), pa.null())):
                raise JobDefinitionError(
                    f"operator '{uid}': combine=True does not combine decimals ({agg.kind}('{agg.column}'), aggregate '{name}'): "
                    "leave combine off (the running aggregate sums them exactly)")
            if agg.kind in ("sum", "mean") and pa.types.is_floating(self.input_types[str(agg.column)]):
                raise JobDefinitionError(
                    f"operator '{uid}': combine=True cannot combine {agg.kind}('{agg.column}') (aggregate '{name}'): a sum of "
                    "floating-point values depends on the order of its additions, which Spark's partial aggregation does not fix, "
                    "so a replayed batch could give another result; cast the column to an integer type or leave combine off")

    def state_descriptors(self) -> list[StateDescriptor]:
        out = []
        for name, agg in self.aggs.items():
            if agg.kind == "mean":
                out.append(StateDescriptor(f"{name}_sum", "value", pa.float64()))
                out.append(StateDescriptor(f"{name}_count", "value", pa.int64()))
            else:
                out.append(StateDescriptor(name, "value", self.types[name]))
        return out

    def output_fields(self) -> list[pa.Field[Any]]:
        return [pa.field(name, self.types[name]) for name in self.aggs]

    def open(self, ctx: RuntimeContext) -> None:
        for d in self.state_descriptors():
            ctx.value_state(d.name, d.value_type)

    def process_batch(self, batch: KeyedBatch) -> tuple[dict[str, Any], pd.DataFrame | pa.Table]:
        # Nulls are skipped as in SQL: an aggregate of only nulls so far is null.
        new: dict[str, Any] = {}
        out: dict[str, Any] = {k: batch.keys[k].to_numpy() for k in self.key_names}
        for name, agg in self.aggs.items():
            if agg.kind == "count":
                old = batch.state[name].to_numpy(dtype=np.int64, na_value=0)
                add = batch.reduce(partial_column(name), "sum") if self.merging else batch.count(agg.column)
                new[name] = out[name] = old + add
                continue
            assert agg.column is not None
            column = partial_column(name) if self.merging else agg.column
            if agg.kind == "mean":
                if self.merging:
                    total, seen = batch.reduce(partial_column(name, "sum"), "sum"), batch.reduce(partial_column(name, "count"), "sum")
                else:
                    total, seen = batch.reduce(column, "sum"), batch.count(column)
                s = total.astype(np.float64) + batch.state[f"{name}_sum"].to_numpy(dtype=np.float64, na_value=0.0)
                c = seen + batch.state[f"{name}_count"].to_numpy(dtype=np.int64, na_value=0)
                new[f"{name}_sum"], new[f"{name}_count"] = s, c
                with np.errstate(invalid="ignore", divide="ignore"):
                    out[name] = masked(s / np.maximum(c, 1), c > 0, pa.float64())
                continue
            prev = batch.state[name]
            have = ~np.asarray(prev.isna(), dtype=bool)
            t = self.types[name]
            if agg.kind in ("first", "last") or _temporal(t):
                new[name] = out[name] = _by_position(batch, column, agg.kind, prev, have, t)
                continue
            if pa.types.is_decimal(t):
                new[name] = out[name] = _decimal(batch, column, agg.kind, prev, have, t)
                continue
            dtype = t.to_pandas_dtype()
            old = prev.to_numpy(dtype=dtype, na_value=0)
            seen = batch.count(column)  # a partial is null where all of its records' values were
            cur = batch.reduce(column, agg.kind)  # type: ignore[arg-type]  # reduce refused in __init__.astype(dtype, copy=False)
            fresh = seen > 0
            if agg.kind == "sum":
                val = old + np.where(fresh, cur, 0)
            else:
                pick = np.minimum if agg.kind == "min" else np.maximum
                val = np.where(have & fresh, pick(old, cur), np.where(fresh, cur, old))
            new[name] = out[name] = masked(val, have | fresh, t)
        return new, pd.DataFrame(out)


def _decimal(batch: KeyedBatch, column: str, kind: str, prev: pd.Series, have: np.ndarray, t: pa.DataType) -> np.ndarray:
    """sum, min or max of a decimal column per key, exactly: the batch's in Arrow's decimal
    arithmetic, merged with the state's values as Python decimals (with digits to spare, so
    no rounding); a total past the result type's precision is an error naming the key, as
    in Spark (ANSI mode), never a rounded or wrapped value."""
    assert batch.arrow is not None
    n_keys = len(batch.keys)
    records = pa.table({"k": pa.array(batch.codes, pa.int64()), "v": batch.arrow.column(column).combine_chunks()})
    how: Any = [("v", kind)]  # sum, min or max: pyarrow's hash aggregates take decimals
    part = records.group_by("k", use_threads=False).aggregate(how)
    cur: list[Any] = [None] * n_keys
    for k, v in zip(part["k"].to_numpy(), part[f"v_{kind}"].to_pylist(), strict=True):
        cur[k] = v
    out: list[Any] = []
    with decimal.localcontext(prec=80):
        for o, c, h in zip(prev.tolist(), cur, have, strict=True):
            o = o if h else None
            if c is None or o is None:
                out.append(o if c is None else c)
            elif kind == "sum":
                out.append(o + c)
            else:
                out.append(builtins.min(o, c) if kind == "min" else builtins.max(o, c))
    assert pa.types.is_decimal(t)
    limit = decimal.Decimal(10) ** (t.precision - t.scale)
    for i, v in enumerate(out):
        if v is not None and abs(v) >= limit:
            key = tuple(batch.keys.iloc[i].tolist())
            raise ArithmeticError(f"{kind}('{column}') of key {key[0] if len(key) == 1 else key!r} is {v}, more than "
                                  f"decimal({t.precision},{t.scale}) holds (a decimal total is never rounded, as in Spark)")
    vals = np.empty(n_keys, dtype=object)
    vals[:] = out
    return vals


def _as_ints(arr: pa.Array[Any]) -> np.ndarray:
    """A time column's Arrow storage as int64 (nulls as 0: the caller masks them)."""
    import pyarrow.compute as pc

    if pa.types.is_date(arr.type):
        arr = pc.cast(arr, pa.int32() if pa.types.is_date32(arr.type) else pa.int64())
    return np.asarray(pc.cast(arr, pa.int64()).fill_null(0).to_numpy(zero_copy_only=False), dtype=np.int64)


def _by_position(batch: KeyedBatch, column: str, kind: str, prev: pd.Series, have: np.ndarray, t: pa.DataType) -> Any:
    """min/max of a time, first/last of any value: per key, the position (in arrival order)
    of the batch's record that wins, its value taken from Arrow, merged with the state.
    Times are compared as integers (their Arrow storage), so no time zone or unit is
    reinterpreted on the way."""

    assert batch.arrow is not None
    col = batch.arrow.column(column).combine_chunks()
    n_keys = len(batch.keys)
    valid = np.asarray(col.is_valid().to_numpy(zero_copy_only=False), dtype=bool)[batch.order]  # in key-grouped arrival order
    some = np.diff(batch.starts) > 0
    pos = np.full(n_keys, -1, dtype=np.int64)
    starts = batch.starts[:-1][some]
    at = np.arange(len(batch.order), dtype=np.int64)
    if kind in ("first", "last"):
        cand = np.where(valid, at, len(at) if kind == "first" else -1)
        pos[some] = (np.minimum if kind == "first" else np.maximum).reduceat(cand, starts) if len(starts) else []
    else:
        ints = _as_ints(col)[batch.order]
        # the winner's position: lexsort by (key group run, value, position); nulls lose
        run = np.repeat(np.arange(n_keys), np.diff(batch.starts))
        key = ints if kind == "min" else -ints
        order = np.lexsort((at, key, ~valid, run))
        firsts = np.concatenate([[True], run[order][1:] != run[order][:-1]]) if len(order) else np.empty(0, dtype=bool)
        winners = order[firsts]
        pos[run[winners]] = np.where(valid[winners], winners, -1)
    fresh = (pos >= 0) & (pos < len(at))
    taken = col.take(pa.array(batch.order[np.where(fresh, pos, 0)], pa.int64())) if len(at) else pa.nulls(n_keys, col.type)
    cur = np.empty(n_keys, dtype=object)
    cur[:] = taken.to_pylist() if len(at) else [None] * n_keys
    old = np.empty(n_keys, dtype=object)
    # A key without a value so far is NaN (numbers) or NaT (times) in pandas: None for Arrow
    # (a NaT with a time zone cannot become an Arrow timestamp).
    old[:] = [None if v is None or v is pd.NaT or (isinstance(v, float) and v != v) else v for v in prev.tolist()]
    none = np.full(n_keys, None, dtype=object)
    if kind == "first":
        val = np.where(have, old, np.where(fresh, cur, none))
    elif kind == "last":
        val = np.where(fresh, cur, np.where(have, old, none))
    else:
        both = pa.array(np.concatenate([old, cur]).tolist(), t)
        ints_both = _as_ints(both)
        o, c = ints_both[:n_keys], ints_both[n_keys:]
        better = (c < o) if kind == "min" else (c > o)
        val = np.where(have & fresh, np.where(better, cur, old), np.where(fresh, cur, old))
    if is_numeric(t):
        ok = np.array([v is not None for v in val], dtype=bool)
        return masked(np.array([v if v is not None else 0 for v in val], dtype=t.to_pandas_dtype()), ok, t)
    return val
