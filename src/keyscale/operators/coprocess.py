"""Two keyed inputs in one stage: ``KeyedCoProcessFunction`` and the interval join.

``a.connect(b).key_by(ka, kb).process(fn, schema, uid)`` runs ``fn`` over both inputs
keyed alike: records of ``a`` go to ``process_element1``, records of ``b`` to
``process_element2``, with one keyed state and one set of timers per key shared by both
(Flink's ``KeyedCoProcessFunction``). keyscale builds this on its one-input keyed stage:
the two inputs become one stream of rows ``(key..., __side, in1, in2)`` where ``in1`` (or
``in2``) holds the record as it was, so the state is in the same key groups as any other
stage's and rescales, checkpoints, savepoints and restores the same way. This module is
the per-record dispatch, the batch-at-a-time form (:class:`VectorizedKeyedCoProcessFunction`)
and the joins (interval, window); :mod:`keyscale._stream` (``Stream.connect``, the joins) builds the combined stream
(its rows: :mod:`keyscale._connect`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from keyscale.errors import JobDefinitionError
from keyscale.operators.keyed import KeyedProcessFunction
from keyscale.operators.vectorized import VectorizedKeyedFunction, to_frame
from keyscale.state.batches import TIMER, KeyedBatch, KeyedCoBatch
from keyscale.state.contexts import Context, RuntimeContext

# The combined row of a two-input stage: (key..., __side, in1, in2[, __event_time]).
SIDE = "__side"
INPUTS = ("in1", "in2")
EVENT_TIME = "__event_time"


class KeyedCoProcessFunction:
    """Base class for a function over two keyed inputs sharing state and timers.

    Override ``process_element1(row, ctx)`` (a record of the first input, a dict of its
    columns) and ``process_element2(row, ctx)``; optionally ``on_timer(key, timestamp,
    ctx)``. Declare state in ``open(ctx)`` as for :class:`KeyedProcessFunction`. Each
    returns or yields output rows (tuples in the output schema's order, or dicts).

    >>> class Enrich(KeyedCoProcessFunction):
    ...     def open(self, ctx):
    ...         self.name = ctx.value_state("name", "string")
    ...     def process_element1(self, row, ctx):      # a user update
    ...         self.name.update(row["name"])
    ...     def process_element2(self, row, ctx):      # a click
    ...         yield (ctx.key, self.name.value(), row["page"])
    """

    def open(self, ctx: RuntimeContext) -> None:
        """Declare state here."""

    def process_element1(self, row: dict[str, Any], ctx: Context) -> Iterable[Any] | None:
        raise NotImplementedError(f"{type(self).__name__} must override process_element1()")

    def process_element2(self, row: dict[str, Any], ctx: Context) -> Iterable[Any] | None:
        raise NotImplementedError(f"{type(self).__name__} must override process_element2()")

    def on_timer(self, key: Any, timestamp: int, ctx: Context) -> Iterable[Any] | None:
        return None


class CoProcessAdapter(KeyedProcessFunction):
    """The one-input keyed function keyscale runs for a co-process function: each combined
    row goes to the side it came from, as the record it was."""

    def __init__(self, function: KeyedCoProcessFunction, keys: int):
        self.function = function
        self.side = keys  # the combined row: key columns, then __side, in1, in2

    def open(self, ctx: RuntimeContext) -> None:
        self.function.open(ctx)

    def process_element(self, row: Any, ctx: Context) -> Iterable[Any] | None:
        if row[self.side] == 0:
            return self.function.process_element1(_as_dict(row[self.side + 1]), ctx)
        return self.function.process_element2(_as_dict(row[self.side + 2]), ctx)


class CoProcessAdapterWithTimers(CoProcessAdapter):
    """The same for a function with ``on_timer`` (only those get timer state)."""

    def on_timer(self, key: Any, timestamp: int, ctx: Context) -> Iterable[Any] | None:
        return self.function.on_timer(key, timestamp, ctx)


class VectorizedKeyedCoProcessFunction:
    """Two keyed inputs, one call per subtask and batch: the batch-at-a-time form of
    :class:`KeyedCoProcessFunction`, for logic that numpy or pandas can do on columns.

    Declare value states in ``open(ctx)``; ``process_batch(batch)`` gets a
    :class:`KeyedCoBatch` and returns (the new value of each state it changes, aligned with
    ``batch.keys``; the output rows). ``input_columns1``/``input_columns2``: the columns of
    each input it reads (None: all); ``pandas_records = False``: it reads ``arrow1``/``arrow2``
    only (no conversion to pandas); ``event_timers = True``: one event-time timer per key,
    as for :class:`keyscale.VectorizedKeyedFunction` (``batch.timer``, ``batch.due``, and
    the returned state's :data:`keyscale.state.TIMER`).

    >>> import numpy as np, pandas as pd
    >>> class Enrich(VectorizedKeyedCoProcessFunction):   # users (first) name their clicks (second)
    ...     def open(self, ctx):
    ...         self.name = ctx.value_state("name", "string")
    ...     def process_batch(self, b):
    ...         name = b.state["name"].to_numpy(dtype=object).copy()
    ...         name[b.codes1] = b.records1["name"].to_numpy(dtype=object)   # the last one wins
    ...         out = pd.DataFrame({"user": b.keys["id"].to_numpy()[b.codes2], "name": name[b.codes2],
    ...                             "page": b.records2["page"]})
    ...         return {"name": name}, out[out["name"].notna()]
    >>> b = KeyedCoBatch(keys=pd.DataFrame({"id": ["u1", "u2"]}), state=pd.DataFrame({"name": ["Ann", None]}),
    ...                  records1=pd.DataFrame({"name": ["Bo"]}), codes1=np.array([1]), positions1=np.array([0]),
    ...                  records2=pd.DataFrame({"page": ["/a", "/b"]}), codes2=np.array([0, 1]), positions2=np.array([1, 2]),
    ...                  batch_id=0, processing_time=0)
    >>> Enrich().process_batch(b)[1].values.tolist()
    [['u1', 'Ann', '/a'], ['u2', 'Bo', '/b']]
    """

    input_columns1: Sequence[str] | None = None
    input_columns2: Sequence[str] | None = None
    pandas_records: bool = True
    event_timers: bool = False

    def open(self, ctx: RuntimeContext) -> None:
        """Declare value states here (``ctx.value_state(name, type)``)."""

    def process_batch(self, batch: KeyedCoBatch) -> tuple[dict[str, Any], pd.DataFrame | pa.Table]:
        """Return (new state per declared name, aligned with ``batch.keys``; output rows)."""
        raise NotImplementedError(f"{type(self).__name__} must override process_batch()")


class CoBatchAdapter(VectorizedKeyedFunction):
    """The one-input vectorized function keyscale runs for a vectorized co-process function:
    the combined rows are split by side in Arrow, each side's record struct unpacked, and
    only the columns the function reads become pandas."""

    pandas_records = False

    def __init__(self, function: VectorizedKeyedCoProcessFunction):
        self.function = function
        self.input_columns = [SIDE, *INPUTS]
        self.event_timers = function.event_timers

    def open(self, ctx: RuntimeContext) -> None:
        self.function.open(ctx)

    def process_batch(self, batch: KeyedBatch) -> tuple[dict[str, Any], pd.DataFrame | pa.Table]:
        table = batch.arrow
        assert table is not None
        fn = self.function
        side = table.column(SIDE).to_numpy()
        parts = []
        for n, columns in enumerate((fn.input_columns1, fn.input_columns2)):
            positions = np.flatnonzero(side == n)
            rows = pa.Table.from_struct_array(table.column(INPUTS[n]).take(positions))
            rows = rows if columns is None else rows.select(list(columns))
            frame = to_frame(rows) if fn.pandas_records else pd.DataFrame(index=range(rows.num_rows))
            parts.append((frame, batch.codes[positions], positions, rows))
        (r1, c1, p1, a1), (r2, c2, p2, a2) = parts
        return fn.process_batch(KeyedCoBatch(batch.keys, batch.state, r1, c1, p1, r2, c2, p2, batch.batch_id, batch.processing_time,
                                             a1, a2, batch.watermark, batch.timer, batch.due))


def adapt(function: KeyedCoProcessFunction | VectorizedKeyedCoProcessFunction, keys: int) -> KeyedProcessFunction | VectorizedKeyedFunction:
    """The keyed function running ``function`` on rows with ``keys`` key columns first."""
    if isinstance(function, VectorizedKeyedCoProcessFunction):
        return CoBatchAdapter(function)
    if not isinstance(function, KeyedCoProcessFunction):
        raise JobDefinitionError(f"{type(function).__name__} is not a KeyedCoProcessFunction or VectorizedKeyedCoProcessFunction")
    timers = type(function).on_timer is not KeyedCoProcessFunction.on_timer
    return CoProcessAdapterWithTimers(function, keys) if timers else CoProcessAdapter(function, keys)


def _as_dict(record: Any) -> dict[str, Any]:
    return record if isinstance(record, dict) else dict(record.asDict() if hasattr(record, "asDict") else record)


@dataclass(frozen=True)
class _Side:
    """One input of a join in a batch: the rows that wait from earlier batches and are still
    live, then the batch's that are not late, in arrival order."""

    rows: pa.Table
    codes: np.ndarray  # each row's key (an index into the batch's keys)
    times: np.ndarray  # each row's event time, ms
    expiry: np.ndarray  # the watermark at which the row leaves: no partner can come after it
    old: int  # how many of ``rows`` waited from earlier batches


class _Join(VectorizedKeyedCoProcessFunction):
    """What the interval and window joins share: each side's rows in list state, read and
    written a batch at a time, and the key's one event timer at its rows' earliest expiry."""

    pandas_records = False
    event_timers = True

    def __init__(self, time1: str, time2: str, type1: pa.DataType, type2: pa.DataType, names1: list[str], names2: list[str],
                 extra: tuple[pa.Field[Any], ...] = ()):
        self.time1, self.time2 = time1, time2
        self.type1, self.type2 = type1, type2
        self.names1, self.names2 = names1, names2  # output column names per input column
        fields = [[t.field(i) for i in range(t.num_fields)] for t in (type1, type2)]
        self.output = pa.schema([*(f.with_name(n) for f, n in zip(fields[0], names1, strict=True)),
                                 *(f.with_name(n) for f, n in zip(fields[1], names2, strict=True)), *extra])

    def open(self, ctx: RuntimeContext) -> None:
        self.left = ctx.list_state("left", self.type1)
        self.right = ctx.list_state("right", self.type2)

    def _expiry(self, times: np.ndarray, side: int) -> np.ndarray:
        raise NotImplementedError

    def _sides(self, b: KeyedCoBatch, late_at_watermark: bool) -> tuple[_Side, _Side]:
        """Both inputs' live rows: waiting rows whose expiry the watermark has reached leave
        (what per-record timers removed before a batch's records); the batch's rows whose
        expiry is before it (or at it, with ``late_at_watermark``) are late and dropped."""
        assert b.arrow1 is not None and b.arrow2 is not None and b.watermark is not None
        w = b.watermark
        sides = []
        for n, (state, arrow, codes, time, row_type) in enumerate((("left", b.arrow1, b.codes1, self.time1, self.type1),
                                                                   ("right", b.arrow2, b.codes2, self.time2, self.type2))):
            old, old_codes = _unlisted(b.state[state], row_type)
            old_times, new_times = _ms_column(old, time), _ms_column(arrow, time)
            old_expiry, new_expiry = self._expiry(old_times, n), self._expiry(new_times, n)
            keep_old = np.flatnonzero(old_expiry > w)
            keep_new = np.flatnonzero(new_expiry > w if late_at_watermark else new_expiry >= w)
            sides.append(_Side(pa.concat_tables([old.take(keep_old).cast(arrow.schema), arrow.take(keep_new)]),
                               np.concatenate([old_codes[keep_old], codes[keep_new]]),
                               np.concatenate([old_times[keep_old], new_times[keep_new]]),
                               np.concatenate([old_expiry[keep_old], new_expiry[keep_new]]), len(keep_old)))
        return sides[0], sides[1]

    @staticmethod
    def _waiting(n: int, left: _Side, right: _Side) -> dict[str, Any]:
        """The state after the batch: each key's rows per side (the waiting ones first, then
        the batch's in arrival order), and its timer at the earliest expiry among them."""
        state: dict[str, Any] = {}
        expiry = np.full(n, np.iinfo(np.int64).max, dtype=np.int64)
        for name, side in (("left", left), ("right", right)):
            order = np.argsort(side.codes, kind="stable")
            state[name] = pd.Series(_listed(side.rows.take(order), side.codes[order], n), dtype=object)
            np.minimum.at(expiry, side.codes, side.expiry)
        waiting = expiry < np.iinfo(np.int64).max
        state[TIMER] = pd.Series(np.where(waiting, expiry, 0), dtype="Int64").where(waiting)
        return state


class IntervalJoin(_Join):
    """Rows of both inputs with the same key and ``t1 + lower <= t2 <= t1 + upper`` (event
    times, ms), joined: each pair once, in the batch its second row arrives. Each side's rows
    wait in list state until the watermark passes the last time a row of the other side
    could still join them, then the key's event timer (the earliest such time) removes them
    (Flink's interval join). A batch at a time: the batch's new rows of each side are joined
    with the other side's waiting rows and with each other, by key, on Arrow columns.
    """

    def __init__(self, time1: str, time2: str, lower_ms: int, upper_ms: int, type1: pa.DataType, type2: pa.DataType,
                 names1: list[str], names2: list[str]):
        super().__init__(time1, time2, type1, type2, names1, names2)
        self.lower, self.upper = lower_ms, upper_ms

    def _expiry(self, times: np.ndarray, side: int) -> np.ndarray:
        # A left row at t joins right rows up to t + upper, a right row left rows from t - upper.
        return times + self.upper if side == 0 else times - self.lower

    def process_batch(self, b: KeyedCoBatch) -> tuple[dict[str, Any], pa.Table]:
        left, right = self._sides(b, late_at_watermark=False)
        li, ri = _pairs_by_key(left.codes, right.codes)
        t1, t2 = left.times[li], right.times[ri]
        # Pairs with at least one of the batch's rows (the others were emitted before), in range.
        hit = ((li >= left.old) | (ri >= right.old)) & (t1 + self.lower <= t2) & (t2 <= t1 + self.upper)
        li, ri = li[hit], ri[hit]
        out = pa.Table.from_arrays([*left.rows.take(li).columns, *right.rows.take(ri).columns], schema=self.output)
        return self._waiting(len(b.keys), left, right), out


def _ms_column(table: pa.Table, column: str) -> np.ndarray:
    """An event-time column as epoch milliseconds (a timestamp, or a number of ms as with_watermark takes)."""
    col = table.column(column)
    if pa.types.is_timestamp(col.type):
        return np.asarray(col.cast(pa.timestamp("us", tz=col.type.tz)).cast(pa.int64()).to_numpy(zero_copy_only=False)) // 1000
    return np.asarray(col.cast(pa.int64()).to_numpy(zero_copy_only=False))


def _unlisted(column: pd.Series, row_type: pa.DataType) -> tuple[pa.Table, np.ndarray]:
    """A list state's column (a list of rows per key, or none) as one table of the rows, with each row's key."""
    lists = pa.array([v if isinstance(v, list) else (list(v) if isinstance(v, np.ndarray) else None) for v in column], type=pa.list_(row_type))
    codes = np.asarray(pc.list_parent_indices(lists), dtype=np.int64) if len(lists) else np.empty(0, dtype=np.int64)
    return pa.Table.from_struct_array(cast(pa.StructArray, cast("pa.ListArray[Any]", lists).flatten())), codes


def _listed(rows: pa.Table, codes: np.ndarray, n: int) -> list[list[dict[str, Any]] | None]:
    """Rows sorted by key as each key's list (None for a key without rows)."""
    counts = np.bincount(codes, minlength=n)
    offsets = pa.array(np.concatenate([[0], np.cumsum(counts)]), type=pa.int32())
    lists: list[Any] = pa.ListArray.from_arrays(offsets, rows.to_struct_array().combine_chunks()).to_pylist()  # type: ignore[misc]
    return [lst if lst else None for lst in lists]


def _pairs_by_key(left: np.ndarray, right: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every (i, j) with ``left[i] == right[j]``."""
    if not len(left) or not len(right):
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
    pairs = pd.DataFrame({"k": left, "i": np.arange(len(left))}).merge(pd.DataFrame({"k": right, "j": np.arange(len(right))}), on="k")
    return pairs["i"].to_numpy(dtype=np.int64), pairs["j"].to_numpy(dtype=np.int64)


_WINDOW = pa.timestamp("us", tz="UTC")


class WindowJoin(_Join):
    """Rows of both inputs with the same key in the same event-time window (tumbling or
    sliding), joined: each pair once per window they share, with the window's start and end
    (Flink's window join; SQL's join on ``window_start, window_end``). A pair is emitted in
    the batch its second row arrives, not held until the window fires: the same pairs,
    sooner. A row waits in list state until the watermark passes the end of its last window
    (the key's event timer, at the earliest such end, empties a key that gets no more rows);
    a row whose windows have all fired is late and joins nothing. A batch at a time: each
    side's rows as (key, window) rows, the batch's new ones merged with the other side's.
    """

    def __init__(self, assigner: Any, time1: str, time2: str, type1: pa.DataType, type2: pa.DataType,
                 names1: list[str], names2: list[str]):
        super().__init__(time1, time2, type1, type2, names1, names2, (pa.field("window_start", _WINDOW), pa.field("window_end", _WINDOW)))
        self.assigner = assigner

    def _expiry(self, times: np.ndarray, side: int) -> np.ndarray:
        # A window [s, e) fires once the watermark reaches e - 1; a row's last window starts last.
        idx, starts = self.assigner.assign(times)
        last = np.full(len(times), np.iinfo(np.int64).min, dtype=np.int64)
        np.maximum.at(last, idx, self.assigner.end(starts))
        return last - 1

    def process_batch(self, b: KeyedCoBatch) -> tuple[dict[str, Any], pa.Table]:
        left, right = self._sides(b, late_at_watermark=True)
        w = b.watermark
        # Every (row, window) of each side, joined on (key, window): pairs with a new row, in open windows.
        exploded = []
        for side in (left, right):
            idx, starts = self.assigner.assign(side.times)
            exploded.append(pd.DataFrame({"k": side.codes[idx], "s": starts, "i": idx, "new": idx >= side.old}))
        pairs = exploded[0].merge(exploded[1], on=["k", "s"], suffixes=("1", "2"))
        ends = self.assigner.end(pairs["s"].to_numpy(dtype=np.int64))
        pairs = pairs[(pairs["new1"] | pairs["new2"]).to_numpy() & (ends - 1 > w)]
        li, ri = pairs["i1"].to_numpy(dtype=np.int64), pairs["i2"].to_numpy(dtype=np.int64)
        starts = pairs["s"].to_numpy(dtype=np.int64)
        out = pa.Table.from_arrays([*left.rows.take(li).columns, *right.rows.take(ri).columns,
                                    pa.array(starts * 1000, pa.int64()).cast(_WINDOW),
                                    pa.array(self.assigner.end(starts) * 1000, pa.int64()).cast(_WINDOW)], schema=self.output)
        return self._waiting(len(b.keys), left, right), out
