"""Keyed process functions: Python called per key with that key's records, reading and
writing named keyed state (Flink's ``KeyedProcessFunction``, batch at a time).

State lives in the task, in Python; a state call is a list access, never a trip to the JVM.

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
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any, Generic, TypeVar

import pyarrow as pa

from keyscale.errors import JobDefinitionError
from keyscale.operators.eventtime import NO_WATERMARK
from keyscale.state.types import StateDescriptor, TypeLike, arrow_type

T = TypeVar("T")
K = TypeVar("K")
V = TypeVar("V")


class _Cursor:
    """Where state handles read and write: the current key's slot in the batch's columns."""

    def __init__(self) -> None:
        self.i = -1
        self.columns: dict[str, list[Any]] = {}
        self.dirty: list[bool] = []
        # States with a TTL: (key index) of every write, and of reads where reads refresh it.
        self.ttl_written: dict[str, set[int]] = {}
        self.ttl_read_refresh: frozenset[str] = frozenset()

    def get(self, name: str) -> Any:
        if self.i < 0:
            raise RuntimeError(f"state '{name}' used outside of process(): there is no current key")
        if name in self.ttl_read_refresh:
            self.ttl_written[name].add(self.i)
        return self.columns[name][self.i]

    def set(self, name: str, value: Any) -> None:
        if self.i < 0:
            raise RuntimeError(f"state '{name}' used outside of process(): there is no current key")
        self.columns[name][self.i] = value
        self.dirty[self.i] = True
        written = self.ttl_written.get(name)
        if written is not None:
            written.add(self.i)


class _State:
    def __init__(self, desc: StateDescriptor, cursor: _Cursor):
        self.descriptor = desc
        self._name = desc.name
        self._cursor = cursor

    def clear(self) -> None:
        """Remove this state for the current key."""
        self._cursor.set(self._name, None)


class ValueState(_State, Generic[T]):
    """One value per key. ``value()`` is None where nothing was stored."""

    def value(self) -> T | None:
        return self._cursor.get(self._name)  # type: ignore[no-any-return]

    def update(self, value: T | None) -> None:
        self._cursor.set(self._name, value)


class ListState(_State, Generic[T]):
    """A list per key (empty where nothing was stored)."""

    def get(self) -> list[T]:
        return list(self._cursor.get(self._name) or ())

    def add(self, value: T) -> None:
        cur = self._cursor.get(self._name)
        self._cursor.set(self._name, [*(cur or ()), value])

    def add_all(self, values: Iterable[T]) -> None:
        cur = self._cursor.get(self._name)
        self._cursor.set(self._name, [*(cur or ()), *values])

    def update(self, values: Iterable[T]) -> None:
        vals = list(values)
        self._cursor.set(self._name, vals or None)


class MapState(_State, Generic[K, V]):
    """A map per key (empty where nothing was stored)."""

    def _map(self) -> dict[K, V]:
        return self._cursor.get(self._name) or {}  # type: ignore[no-any-return]

    def get(self, key: K, default: V | None = None) -> V | None:
        return self._map().get(key, default)

    def put(self, key: K, value: V) -> None:
        m = dict(self._map())
        m[key] = value
        self._cursor.set(self._name, m)

    def put_all(self, items: dict[K, V]) -> None:
        m = dict(self._map())
        m.update(items)
        self._cursor.set(self._name, m or None)

    def remove(self, key: K) -> None:
        m = dict(self._map())
        m.pop(key, None)
        self._cursor.set(self._name, m or None)

    def contains(self, key: K) -> bool:
        return key in self._map()

    def keys(self) -> list[K]:
        return list(self._map().keys())

    def values(self) -> list[V]:
        return list(self._map().values())

    def items(self) -> list[tuple[K, V]]:
        return list(self._map().items())

    def is_empty(self) -> bool:
        return not self._map()


class RuntimeContext:
    """Given to ``open``: declare state, learn where this instance runs.

    State TTL: with ``ttl_seconds`` a key's value of that state expires that long (in
    processing time, the batch's own time) after it was last written, or last read or
    written with ``ttl_refresh="on_read_and_write"``. An expired value reads as absent and
    is removed from memory and from the checkpoint at the next batch of its subtask.
    """

    def __init__(self, uid: str, subtask: int = 0, parallelism: int = 1, max_parallelism: int = 128):
        self.uid = uid
        self.subtask_index = subtask
        self.parallelism = parallelism
        self.max_parallelism = max_parallelism
        self.descriptors: dict[str, StateDescriptor] = {}
        self._cursor = _Cursor()

    def _declare(self, desc: StateDescriptor) -> None:
        if not desc.name or desc.name.startswith("__"):
            raise JobDefinitionError(f"operator '{self.uid}': state name {desc.name!r} is reserved or empty")
        old = self.descriptors.get(desc.name)
        if old is not None and old != desc:
            raise JobDefinitionError(f"operator '{self.uid}': state '{desc.name}' declared twice with different types")
        self.descriptors[desc.name] = desc

    def value_state(self, name: str, type: TypeLike, ttl_seconds: float | None = None, ttl_refresh: str = "on_write") -> ValueState[Any]:
        """Declare a value state (one value per key) of a Spark SQL type such as ``"long"``."""
        desc = _with_ttl(StateDescriptor(name, "value", arrow_type(type)), ttl_seconds, ttl_refresh, self.uid)
        self._declare(desc)
        return ValueState(desc, self._cursor)

    def list_state(self, name: str, element_type: TypeLike, ttl_seconds: float | None = None, ttl_refresh: str = "on_write") -> ListState[Any]:
        """Declare a list state (a list per key) of elements of a Spark SQL type."""
        desc = _with_ttl(StateDescriptor(name, "list", arrow_type(element_type)), ttl_seconds, ttl_refresh, self.uid)
        self._declare(desc)
        return ListState(desc, self._cursor)

    def map_state(self, name: str, key_type: TypeLike, value_type: TypeLike, ttl_seconds: float | None = None, ttl_refresh: str = "on_write") -> MapState[Any, Any]:
        """Declare a map state (a map per key)."""
        desc = _with_ttl(StateDescriptor(name, "map", arrow_type(value_type), map_key_type=arrow_type(key_type)), ttl_seconds, ttl_refresh, self.uid)
        self._declare(desc)
        return MapState(desc, self._cursor)


class TimerService:
    """Timers of the current key (Flink's ``TimerService``), reached as ``ctx.timer_service``.

    Timers are keyed state: stored with their key, by key group, so they move with the key
    on rescale and survive restart and restore. Registering the same timestamp twice makes
    one timer. Event-time timers fire once the watermark reaches them, processing-time
    timers once the batch time does; both call ``on_timer`` at the start of a batch, per
    key in timestamp order (event time first).
    """

    __slots__ = ("_ctx", "_cursor")

    def __init__(self, cursor: _Cursor, ctx: Context):
        self._cursor = cursor
        self._ctx = ctx

    def _change(self, domain: str, ts: int, add: bool) -> None:
        if TIMER_STATES[domain][0] not in self._cursor.columns:
            raise JobDefinitionError("timers need an on_timer() method on the function that registers them")
        lst_name, next_name = TIMER_STATES[domain]
        timers = set(self._cursor.get(lst_name) or ())
        before = len(timers)
        if add:
            timers.add(int(ts))
        else:
            timers.discard(int(ts))
        if len(timers) != before:
            ordered = sorted(timers)
            self._cursor.set(lst_name, ordered or None)
            self._cursor.set(next_name, ordered[0] if ordered else None)

    def register_event_time_timer(self, timestamp: int) -> None:
        """Call ``on_timer`` for this key once the watermark reaches ``timestamp`` (epoch ms)."""
        self._change("event_time", timestamp, True)

    def delete_event_time_timer(self, timestamp: int) -> None:
        self._change("event_time", timestamp, False)

    def register_processing_time_timer(self, timestamp: int) -> None:
        """Call ``on_timer`` for this key at the first batch whose time reaches ``timestamp``."""
        self._change("processing_time", timestamp, True)

    def delete_processing_time_timer(self, timestamp: int) -> None:
        self._change("processing_time", timestamp, False)

    def current_watermark(self) -> int:
        return self._ctx.current_watermark

    def current_processing_time(self) -> int:
        return self._ctx.processing_time


#: The hidden states that hold a key's timers: the sorted timestamps and the next one.
TIMER_STATES = {
    "event_time": ("__timers_event", "__next_event"),
    "processing_time": ("__timers_proc", "__next_proc"),
}


def timer_descriptors() -> list[StateDescriptor]:
    out = []
    for lst, nxt in TIMER_STATES.values():
        out += [StateDescriptor(lst, "list", pa.int64()), StateDescriptor(nxt, "value", pa.int64())]
    return out


def ttl_column(name: str) -> str:
    """The hidden state holding when ``name`` was last written (or read), per key."""
    return f"__ttl_{name}"


def _with_ttl(desc: StateDescriptor, ttl_seconds: float | None, refresh: str, uid: str) -> StateDescriptor:
    if ttl_seconds is None:
        return desc
    if not ttl_seconds > 0:
        raise JobDefinitionError(f"operator '{uid}', state '{desc.name}': ttl_seconds must be positive, not {ttl_seconds!r}")
    if refresh not in ("on_write", "on_read_and_write"):
        raise JobDefinitionError(f"operator '{uid}', state '{desc.name}': ttl_refresh must be 'on_write' or 'on_read_and_write', not {refresh!r}")
    return replace(desc, ttl_seconds=float(ttl_seconds), ttl_refresh=refresh)


class Context:
    """Given to ``process`` and ``on_timer``: the current key, the batch, time and timers.

    ``current_watermark`` is the watermark the batch runs with (epoch ms; very negative
    before the first); ``processing_time`` is the batch's own time. In ``on_timer``,
    ``timestamp`` is the timer's time and ``time_domain`` "event_time" or "processing_time".
    """

    __slots__ = (
        "batch_id", "broadcast_state", "current_watermark", "key", "key_group", "processing_time", "subtask_index", "time_domain",
        "timer_service", "timestamp",
    )

    def __init__(self, batch_id: int, processing_time: int, subtask_index: int, current_watermark: int = NO_WATERMARK):
        self.batch_id = batch_id
        #: The batch's own time in epoch milliseconds, fixed by the driver (a replay sees the same).
        self.processing_time = processing_time
        self.subtask_index = subtask_index
        self.current_watermark = current_watermark
        self.key: Any = None
        self.key_group = -1
        self.timestamp: int | None = None
        self.time_domain: str | None = None
        self.timer_service: TimerService = None  # type: ignore[assignment]  # set by the runner
        #: The stage's broadcast state (read-only), when it has a broadcast input.
        self.broadcast_state: Mapping[str, Any] = {}


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


def _fire_timers(fn: KeyedProcessFunction, cursor: _Cursor, ctx: Context, key: Any) -> Iterator[Any]:
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


