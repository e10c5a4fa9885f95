"""Keyed process functions: Python called per key with that key's records, reading and
writing named keyed state (Flink's ``KeyedProcessFunction``, batch at a time).

State lives in the task, in Python; a state call is a list access, never a trip to the JVM.
The contexts and state handles a function is given are :mod:`keyscale.state`'s
(``state/contexts.py``, ``state/handles.py``); this module is the function's side.

Example (a per-key running total that alerts when it crosses a threshold)::

    class Alert(keyscale.KeyedProcessFunction):
        def open(self, ctx):
            self.total = ctx.value_state("total", "long")

        def process_element(self, row, ctx):
            before = self.total.value() or 0
            self.total.update(before + row.value)
            if before < 100 <= before + row.value:
                yield (ctx.key, before + row.value)
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import pyarrow as pa

from keyscale.errors import JobDefinitionError
from keyscale.state.contexts import Context, RuntimeContext
from keyscale.state.handles import TIMER_STATES, Cursor, timer_descriptors, ttl_column
from keyscale.state.types import StateDescriptor


class KeyedProcessFunction:
    """Base class for keyed stateful functions.

    Override ``process(key, rows, ctx)`` (all of a key's records of a batch, in arrival
    order) or ``process_element(row, ctx)`` (one record at a time). Both return or yield
    output rows: tuples in the output schema's column order, or dicts.
    """

    def open(self, ctx: RuntimeContext) -> None:
        """Declare state here."""

    def process(self, key: Any, rows: Sequence[Any], ctx: Context) -> Iterable[Any] | None:
        out: list[Any] = []
        for row in rows:
            res = self.process_element(row, ctx)
            if res is not None:
                out.extend(res)
        return out

    def process_element(self, row: Any, ctx: Context) -> Iterable[Any] | None:
        raise NotImplementedError(f"{type(self).__name__} must override process() or process_element()")

    def on_timer(self, key: Any, timestamp: int, ctx: Context) -> Iterable[Any] | None:
        """Called when a timer of ``key`` fires; may use state, emit rows and register timers."""
        return None


def uses_timers(fn: Any) -> bool:
    """A per-key function with ``on_timer``, or a vectorized one with ``event_timers``."""
    if isinstance(fn, KeyedProcessFunction):
        return type(fn).on_timer is not KeyedProcessFunction.on_timer
    return getattr(fn, "event_timers", False) is True


def describe_states(fn: Any, uid: str) -> list[StateDescriptor]:
    """The states a function declares in ``open`` (run on a copy, so ``fn`` stays pristine),
    followed by the hidden ones keyscale keeps for it: timers and TTL clocks."""
    ctx = RuntimeContext(uid)
    probe = copy.deepcopy(fn)
    probe.open(ctx)
    states = list(ctx.descriptors.values())
    hidden = [StateDescriptor(ttl_column(d.name), "value", pa.int64()) for d in states if d.ttl_seconds is not None]
    if uses_timers(fn):
        hidden += timer_descriptors()
    return states + hidden


def rows_to_arrow(rows: list[Any], schema: pa.Schema, uid: str) -> pa.Table:
    """Output rows (tuples or dicts) as an Arrow table of the operator's output schema."""
    if not rows:
        return schema.empty_table()
    try:
        if isinstance(rows[0], dict):
            return pa.Table.from_pylist(rows, schema=schema)
        width = len(schema)
        for r in rows:
            if len(r) != width:
                raise JobDefinitionError(
                    f"operator '{uid}' emitted a row with {len(r)} values, its output schema has {width} ({', '.join(schema.names)})"
                )
        cols = list(zip(*rows, strict=True))
        return pa.Table.from_arrays([pa.array(c, type=f.type) for c, f in zip(cols, schema, strict=True)], schema=schema)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError) as e:
        raise JobDefinitionError(f"operator '{uid}' emitted a row that does not fit its output schema ({e})") from None


def _fire_timers(fn: KeyedProcessFunction, cursor: Cursor, ctx: Context, key: Any) -> Iterator[Any]:
    """Fire the current key's due timers, earliest first; timers they register for an
    already-passed time fire in the same pass (as Flink's timer service does)."""
    for domain, now in (("event_time", ctx.current_watermark), ("processing_time", ctx.processing_time)):
        lst_name, next_name = TIMER_STATES[domain]
        while True:
            nxt = cursor.columns[next_name][cursor.i]
            if nxt is None or nxt > now:
                break
            rest = [t for t in cursor.columns[lst_name][cursor.i] if t != nxt]
            cursor.set(lst_name, rest or None)
            cursor.set(next_name, rest[0] if rest else None)
            ctx.timestamp, ctx.time_domain = int(nxt), domain
            out = fn.on_timer(key, int(nxt), ctx)
            if out is not None:
                yield from out
    ctx.timestamp = ctx.time_domain = None


