"""Event-time windows on keyed streams: tumbling, sliding and session windows.

A window operator keeps one row of keyed state per (key, window): the window's end, its
accumulators and whether it has fired. The state is keyed by the stream's key columns plus
``window_start`` but stored in the key group of the key alone, so windows move with their
keys on rescale like any other state. Firing follows the event-time timer rule: a window
``[start, end)`` fires in the first batch whose watermark is at least ``end - 1`` (that is,
once no on-time record can still fall into it).

Per batch (watermark ``W``, allowed lateness ``L``), vectorized with numpy:

1. each record is assigned its window(s); a record whose every window ended at or before
   ``W - L`` is too late, and one whose event time is beyond the batch's bound
   (``max_ahead`` after the batch time) is not believed: both go to the late side output
   (if any) and are otherwise dropped;
2. the records are reduced per (key, window) and merged into the stored accumulators;
   session windows of a key that now overlap or touch are merged into one;
3. every window that is due (``end <= W + 1``) and has not fired, or has fired and was
   updated by this batch's (late) records, emits one row with its current result;
4. windows with ``end <= W - L + 1`` are purged: later records for them are too late.

So a window emits once when the watermark passes it, and again for every batch of late
records within the allowed lateness: the last row of a window is its final result.

>>> from keyscale.operators.windows import TumblingWindows
>>> TumblingWindows("1 minute").assign(np.array([59_999, 60_000]))[1].tolist()
[0, 60000]
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from keyscale._keywords import checked_keywords
from keyscale.errors import JobDefinitionError
from keyscale.operators.eventtime import (
    NO_WATERMARK,
    Duration,
    event_time_ms,
    parse_duration_ms,
    too_far_ahead,
)
from keyscale.operators.vectorized import Agg, result_type
from keyscale.state.factorize import factorize_keys, make_index
from keyscale.state.table import KeyedStateTable
from keyscale.state.types import StateDescriptor

WINDOW_START = "window_start"
WINDOW_END = "window_end"
FIRED = "fired"


# -- assigners -------------------------------------------------------------------------------


@dataclass(frozen=True)
class TumblingWindows:
    """Fixed-size, non-overlapping windows ``[k*size + offset, (k+1)*size + offset)``."""

    size_ms: int
    offset_ms: int = 0

    @checked_keywords
    def __init__(self, size: Duration, offset: Duration = 0):
        object.__setattr__(self, "size_ms", parse_duration_ms(size, "window size"))
        object.__setattr__(self, "offset_ms", parse_duration_ms(offset, "window offset"))
        if self.size_ms <= 0:
            raise JobDefinitionError("a tumbling window needs a positive size")

    def assign(self, ts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(record index, window start) of every window a record falls into."""
        starts = ts - np.mod(ts - self.offset_ms, self.size_ms)
        return np.arange(len(ts)), starts

    def end(self, starts: np.ndarray) -> np.ndarray:
        return starts + self.size_ms


@dataclass(frozen=True)
class SlidingWindows:
    """Windows of ``size`` starting every ``slide``: a record falls into ``ceil(size / slide)`` of them."""

    size_ms: int
    slide_ms: int
    offset_ms: int = 0

    @checked_keywords
    def __init__(self, size: Duration, slide: Duration, offset: Duration = 0):
        object.__setattr__(self, "size_ms", parse_duration_ms(size, "window size"))
        object.__setattr__(self, "slide_ms", parse_duration_ms(slide, "window slide"))
        object.__setattr__(self, "offset_ms", parse_duration_ms(offset, "window offset"))
        if self.size_ms <= 0 or self.slide_ms <= 0:
            raise JobDefinitionError("a sliding window needs a positive size and slide")

    def assign(self, ts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        last = ts - np.mod(ts - self.offset_ms, self.slide_ms)
        n = -(-self.size_ms // self.slide_ms)
        idx = np.repeat(np.arange(len(ts)), n)
        starts = np.repeat(last, n) - np.tile(np.arange(n, dtype=np.int64) * self.slide_ms, len(ts))
        keep = starts + self.size_ms > ts[idx]
        return idx[keep], starts[keep]

    def end(self, starts: np.ndarray) -> np.ndarray:
        return starts + self.size_ms


@dataclass(frozen=True)
class SessionWindows:
    """Per-key sessions: records closer than ``gap`` (event time) belong to one session
    ``[first record, last record + gap)``; sessions that come to overlap or touch merge."""

    gap_ms: int

    @checked_keywords
    def __init__(self, gap: Duration):
        object.__setattr__(self, "gap_ms", parse_duration_ms(gap, "session gap"))
        if self.gap_ms <= 0:
            raise JobDefinitionError("a session window needs a positive gap")

    def assign(self, ts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return np.arange(len(ts)), ts

    def end(self, starts: np.ndarray) -> np.ndarray:
        return starts + self.gap_ms


Assigner = TumblingWindows | SlidingWindows | SessionWindows


def reduce(column: str, fn: Callable[[Any, Any], Any]) -> Agg:
    """A custom reduction of ``column`` per window: ``fn(a, b)`` must be associative and
    commutative (values are combined in no guaranteed order); nulls are skipped.

    ``reduce("amount", lambda a, b: a if a > b else b)`` is a max.
    """
    return Agg("reduce", column, fn)


# -- accumulators ----------------------------------------------------------------------------

Column = tuple[np.ndarray, np.ndarray]  # values, valid


def _combine(kind: str, parts: Column, gid: np.ndarray, n: int, fn: Callable[[Any, Any], Any] | None = None) -> Column:
    """Reduce partial accumulators by group id (``n`` groups, every group non-empty); nulls skipped."""
    vals, ok = parts
    has = np.bincount(gid, weights=ok.astype(np.float64), minlength=n) > 0
    if kind in ("count", "count_part"):  # exact: counts stay far below 2**53
        return np.bincount(gid, weights=np.where(ok, vals, 0).astype(np.float64), minlength=n).astype(np.int64), np.ones(n, dtype=bool)
    if kind in ("sum", "sum_part") and vals.dtype.kind == "f":
        return np.bincount(gid, weights=np.where(ok, vals, 0.0), minlength=n), has
    order = np.argsort(gid, kind="stable")
    starts = np.searchsorted(gid[order], np.arange(n))
    if kind in ("sum", "sum_part"):  # integers: exact
        return (np.add.reduceat(np.where(ok, vals, 0)[order], starts) if len(gid) else vals[:0]).astype(vals.dtype, copy=False), has
    if kind in ("min", "max"):
        fill: Any
        if vals.dtype.kind == "f":
            fill = np.inf if kind == "min" else -np.inf
        elif vals.dtype.kind == "b":
            fill = kind == "min"
        else:
            info = np.iinfo(vals.dtype)
            fill = info.max if kind == "min" else info.min
        op = np.minimum if kind == "min" else np.maximum
        filled = np.where(ok, vals, fill).astype(vals.dtype, copy=False)
        return (op.reduceat(filled[order], starts) if len(gid) else filled[:0]), has
    if kind != "reduce" or fn is None:
        raise JobDefinitionError(f"unknown window aggregate kind {kind!r}")
    out = np.empty(n, dtype=object)
    sv, sok = vals[order], ok[order]
    bounds = [*starts.tolist(), len(gid)]
    for g in range(n):
        items = [v for v, o in zip(sv[bounds[g] : bounds[g + 1]], sok[bounds[g] : bounds[g + 1]], strict=True) if o]
        out[g] = functools.reduce(fn, items) if items else None
    return out, has


@dataclass
class WindowAggregate:
    """The function of a window operator (built by ``KeyedStream.window(...).aggregate(...)``)."""

    assigner: Assigner
    aggs: dict[str, Agg]
    key_names: list[str]
    input_types: dict[str, pa.DataType]
    event_time: str
    allowed_lateness_ms: int = 0
    types: dict[str, pa.DataType] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.aggs:
            raise JobDefinitionError("a window needs at least one aggregate, e.g. aggregate(uid='per_minute', n=keyscale.aggregates.count())")
        for name, agg in self.aggs.items():
            if name in (*self.key_names, WINDOW_START, WINDOW_END):
                raise JobDefinitionError(f"window aggregate '{name}' has the name of a key or window column")
            self.types[name] = result_type(f"window aggregate '{name}'", agg, self.input_types)

    def open(self, ctx: Any) -> None:
        """Nothing to declare: the operator's state is fixed by its aggregates."""

    @property
    def input_columns(self) -> list[str]:
        """The columns its aggregates read: only these, the keys and the event time cross the
        shuffle and Arrow to the tasks (``runtime.batch.stages.task_input``)."""
        return sorted({a.column for a in self.aggs.values() if a.column is not None})

    @property
    def event_time_type(self) -> pa.DataType:
        return self.input_types[self.event_time]

    def state_descriptors(self) -> list[StateDescriptor]:
        out = [StateDescriptor(WINDOW_END, "value", pa.int64()), StateDescriptor(FIRED, "value", pa.bool_())]
        for name, agg in self.aggs.items():
            if agg.kind == "mean":
                out += [StateDescriptor(f"{name}_sum", "value", pa.float64()), StateDescriptor(f"{name}_count", "value", pa.int64())]
            else:
                out.append(StateDescriptor(name, "value", self.types[name]))
        return out

    def output_fields(self) -> list[pa.Field[Any]]:
        t = self.event_time_type
        ts = t if pa.types.is_timestamp(t) else pa.int64()
        return [pa.field(WINDOW_START, ts), pa.field(WINDOW_END, ts), *(pa.field(n, self.types[n]) for n in self.aggs)]

    # The accumulator columns: (state name, how it combines, the agg it belongs to).
    def _parts(self) -> list[tuple[str, str, Agg]]:
        out = []
        for name, agg in self.aggs.items():
            if agg.kind == "mean":
                out += [(f"{name}_sum", "sum_part", agg), (f"{name}_count", "count_part", agg)]
            else:
                out.append((name, agg.kind, agg))
        return out

    def _record_parts(self, records: pd.DataFrame, idx: np.ndarray) -> dict[str, Column]:
        """Each (record, window) pair's own partial accumulators."""
        out: dict[str, Column] = {}
        n = len(idx)
        for state, how, agg in self._parts():
            if agg.column is None:
                out[state] = (np.ones(n, dtype=np.int64), np.ones(n, dtype=bool))
                continue
            col = records[agg.column]
            ok = col.notna().to_numpy(dtype=bool)[idx]
            if how in ("count", "count_part"):
                out[state] = (ok.astype(np.int64), np.ones(n, dtype=bool))
                continue
            if how == "reduce":
                vals = np.asarray(col.astype(object).where(col.notna(), None).to_numpy(), dtype=object)[idx]
            else:  # sum, min, max: the state is named as the aggregate
                dtype = np.float64 if how == "sum_part" else self.types[state].to_pandas_dtype()
                vals = col.to_numpy(dtype=dtype, na_value=0)[idx]
            out[state] = (vals, ok)
        return out


def _threshold(watermark: int, delta: int) -> int:
    """``watermark + delta`` clamped to int64 (the watermark may be at either end of time)."""
    return int(min(max(watermark + delta, NO_WATERMARK), 2**63 - 1))


@dataclass
class WindowResult:
    output: pa.Table
    late: pa.Table
    changed_rows: np.ndarray
    late_records: int  # behind the watermark by more than the allowed lateness
    fired: int
    purged: int
    too_far_ahead: int = 0  # event time beyond the batch's bound (in ``late`` too)


def run_windows(
    op: WindowAggregate,
    table: KeyedStateTable,
    start: int,
    end: int,
    records: pa.Table,
    key_arrays: list[np.ndarray],
    key_groups: np.ndarray,
    watermark: int,
    output_schema: pa.Schema,
    limit_ms: int | None = None,
) -> WindowResult:
    """One batch of a window operator over the key groups ``start..end`` (see module doc).

    ``records`` are the batch's records (user columns, arrival order), ``key_arrays`` their
    key columns as numpy arrays and ``key_groups`` their key groups; ``table`` holds the
    window state keyed by (keys..., window_start). Records with an event time after
    ``limit_ms`` are treated as late (never assigned to a window).
    """
    # Flink's rules: [s, e) is due once W >= e - 1, and closed once W >= e - 1 + lateness.
    due_upto = _threshold(watermark, 1)
    closed_upto = _threshold(watermark, 1 - op.allowed_lateness_ms)
    ts = event_time_ms(records, op.event_time) if records.num_rows else np.empty(0, dtype=np.int64)
    ahead = too_far_ahead(ts, limit_ms)
    idx, starts = op.assigner.assign(ts)
    ends = op.assigner.end(starts)
    on_time = (ends > closed_upto) & ~ahead[idx]
    late_mask = np.ones(records.num_rows, dtype=bool)
    late_mask[idx[on_time]] = False
    idx, starts, ends = idx[on_time], starts[on_time], ends[on_time]

    updated = np.empty(0, dtype=np.intp)
    if len(idx):
        frame = pd.DataFrame(records.select([c for c in {a.column for a in op.aggs.values()} if c is not None]).to_pandas()) if op.aggs else pd.DataFrame()
        parts = op._record_parts(frame, idx)
        if isinstance(op.assigner, SessionWindows):
            updated = _merge_sessions(op, table, start, end, key_arrays, key_groups, idx, starts, ends, parts)
        else:
            updated = _merge_fixed(op, table, key_arrays, key_groups, idx, starts, ends, parts)

    # Fire what is due, then purge what is closed.
    rows = table.rows_in_range(start, end)
    alive = table.valid[WINDOW_END][rows]
    w_end = table.values[WINDOW_END][rows]
    fired = table.valid[FIRED][rows] & table.values[FIRED][rows]
    updated_mask = np.zeros(len(table), dtype=bool)
    updated_mask[updated] = True
    is_updated = updated_mask[rows]
    due = alive & (w_end <= due_upto) & (~fired | is_updated)
    emit_rows = rows[due]
    table.values[FIRED][emit_rows] = True
    table.valid[FIRED][emit_rows] = True
    output = _emit(op, table, emit_rows, output_schema)
    purge = rows[alive & (w_end <= closed_upto)]
    for name in table.values:
        table.valid[name][purge] = False
        if table.values[name].dtype == object:
            table.values[name][purge] = None
    changed = table.rows_union(updated, emit_rows, purge)
    late = records.filter(pa.array(late_mask)) if records.num_rows else records
    n_ahead = int(ahead.sum())
    return WindowResult(output, late, changed, int(late_mask.sum()) - n_ahead, len(emit_rows), len(purge), n_ahead)


def _group(key_arrays: list[np.ndarray], key_groups: np.ndarray, idx: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, int, np.ndarray]:
    """Group id per (record, window) pair by (key, window start); and each group's first pair."""
    codes = [pd.factorize(k[idx])[0] for k in key_arrays] + [pd.factorize(starts)[0]]
    if len(codes) == 2:
        combined = codes[0].astype(np.int64) * (int(codes[1].max()) + 1) + codes[1]
        gid, _ = pd.factorize(combined)
    else:
        gid = factorize_keys(codes)[0]
    gid = np.asarray(gid, dtype=np.int64)
    n = int(gid.max()) + 1 if len(gid) else 0
    _, first = np.unique(gid, return_index=True)
    return gid, n, first


def _merge_fixed(
    op: WindowAggregate, table: KeyedStateTable, key_arrays: list[np.ndarray], key_groups: np.ndarray,
    idx: np.ndarray, starts: np.ndarray, ends: np.ndarray, parts: dict[str, Column],
) -> np.ndarray:
    gid, n, first = _group(key_arrays, key_groups, idx, starts)
    gkeys = [k[idx[first]] for k in key_arrays] + [starts[first]]
    pos = table.positions(gkeys)
    new_parts: dict[str, Column] = {}
    for state, how, agg in op._parts():
        new_parts[state] = _combine(how, parts[state], gid, n, agg.fn)
    updates: dict[str, Column] = {}
    for state, how, agg in op._parts():
        old_v, old_ok = table.gather(state, pos)
        nv, nok = new_parts[state]
        both = np.concatenate([np.arange(n), np.arange(n)])
        v = np.concatenate([old_v.astype(nv.dtype, copy=False) if nv.dtype != object else old_v.astype(object), nv])
        ok = np.concatenate([old_ok, nok])
        updates[state] = _combine(how, (v, ok), both, n, agg.fn)
    updates[WINDOW_END] = (ends[first].astype(np.int64), np.ones(n, dtype=bool))
    fired_v, fired_ok = table.gather(FIRED, pos)
    updates[FIRED] = (fired_v & fired_ok, np.ones(n, dtype=bool))
    return table.upsert(gkeys, key_groups[idx[first]].astype(np.int32), updates, pos=pos)


def _merge_sessions(
    op: WindowAggregate, table: KeyedStateTable, start: int, end: int, key_arrays: list[np.ndarray], key_groups: np.ndarray,
    idx: np.ndarray, starts: np.ndarray, ends: np.ndarray, parts: dict[str, Column],
) -> np.ndarray:
    """Merge the batch's one-record sessions with the stored sessions of the same keys."""
    nk = len(key_arrays)
    rec_keys = [k[idx] for k in key_arrays]
    rows = table.rows_in_range(start, end)
    rows = rows[table.valid[WINDOW_END][rows]]
    stored = table.key_values(rows)
    if len(rows):
        mine = np.asarray(make_index(stored[:nk]).isin(make_index(rec_keys)), dtype=bool)
        rows, stored = rows[mine], [c[mine] for c in stored]
    # One interval per record and per stored session: key, start, end, accumulators.
    all_keys = [np.concatenate([r, t.astype(r.dtype, copy=False)]) for r, t in zip(rec_keys, stored[:nk], strict=True)]
    kcode = factorize_keys(all_keys)[0]  # by hashing: a MultiIndex's factorize builds a tuple per row
    s = np.concatenate([starts, stored[nk].astype(np.int64)])
    e = np.concatenate([ends, table.values[WINDOW_END][rows]])
    kg = np.concatenate([key_groups[idx], table.kg[rows]]).astype(np.int32)
    fired_in = np.concatenate([np.zeros(len(idx), dtype=bool), table.valid[FIRED][rows] & table.values[FIRED][rows]])
    order = np.lexsort((s, kcode))
    ks, ss, es = kcode[order], s[order], e[order]
    # A session starts where the key changes or an interval starts after all before it ended
    # (intervals that touch merge, as in Flink).
    run_end = pd.Series(es).groupby(ks).cummax().to_numpy()
    new_session = np.concatenate([[True], (ks[1:] != ks[:-1]) | (ss[1:] > run_end[:-1])])
    bounds = np.flatnonzero(new_session)
    sid = np.empty(len(order), dtype=np.int64)
    sid[order] = np.cumsum(new_session) - 1
    n = len(bounds)
    m_start = ss[bounds]
    m_end = np.maximum.reduceat(es, bounds)
    first = order[bounds]
    updates: dict[str, Column] = {}
    for state, how, agg in op._parts():
        rv, rok = parts[state]
        tv, tok = table.values[state][rows], table.valid[state][rows]
        v = np.concatenate([rv, tv.astype(rv.dtype, copy=False) if rv.dtype != object else tv.astype(object)])
        updates[state] = _combine(how, (v, np.concatenate([rok, tok])), sid, n, agg.fn)
    # Fired stays set: a grown session that was emitted is re-emitted with its new result.
    updates[FIRED] = (np.logical_or.reduceat(fired_in[order], bounds), np.ones(n, dtype=bool))
    updates[WINDOW_END] = (m_end, np.ones(n, dtype=bool))
    # Stored sessions absorbed into a session with another start are deleted.
    stored_sid = sid[len(idx) :]
    gone = rows[m_start[stored_sid] != s[len(idx) :]]
    for name in table.values:
        table.valid[name][gone] = False
        if table.values[name].dtype == object:
            table.values[name][gone] = None
    gkeys = [k[first] for k in all_keys] + [m_start]
    return table.rows_union(table.upsert(gkeys, kg[first], updates), gone)


def _emit(op: WindowAggregate, table: KeyedStateTable, rows: np.ndarray, schema: pa.Schema) -> pa.Table:
    if not len(rows):
        return schema.empty_table()
    nk = len(op.key_names)
    cols: dict[str, Any] = {}
    for i, name in enumerate(op.key_names):
        cols[name] = table.key_arrow(i, rows)
    start = np.asarray(table.key_arrow(nk, rows).to_numpy(), dtype=np.int64)
    end = table.values[WINDOW_END][rows]
    ts_type = schema.field(WINDOW_START).type
    for name, v in ((WINDOW_START, start), (WINDOW_END, end)):
        arr = pa.array(v, type=pa.int64())
        cols[name] = arr.cast(pa.timestamp("ms", tz=ts_type.tz)).cast(ts_type) if pa.types.is_timestamp(ts_type) else arr
    for name, agg in op.aggs.items():
        t = op.types[name]
        if agg.kind == "mean":
            s, sok = table.values[f"{name}_sum"][rows], table.valid[f"{name}_sum"][rows]
            c = table.values[f"{name}_count"][rows]
            ok = sok & (c > 0)
            with np.errstate(invalid="ignore", divide="ignore"):
                cols[name] = pa.array(s / np.maximum(c, 1), type=t, mask=~ok)
            continue
        v, ok = table.values[name][rows], table.valid[name][rows]
        cols[name] = pa.array(v.tolist(), type=t, mask=~ok) if v.dtype == object else pa.array(v, type=t, mask=~ok)
    return pa.table(cols, schema=schema)
