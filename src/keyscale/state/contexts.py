"""The contexts a function's methods are given: they declare state, and say where and when it runs.

- :class:`RuntimeContext`, given to ``open`` of a keyed function: declares keyed state and
  hands out its handles (:mod:`keyscale.state.handles`);
- :class:`Context`, given to ``process`` and ``on_timer``: the current key, the batch's times,
  the key's :class:`TimerService`, the broadcast state;
- :class:`OperatorContext`, given to ``open`` and ``process`` of a non-keyed function:
  declares operator state.

The task makes them (``runtime/task/``); the functions that receive them are in ``operators/``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from types import MappingProxyType
from typing import Any

from keyscale.errors import JobDefinitionError
from keyscale.state.handles import (
    TIMER_STATES,
    Cursor,
    ListState,
    MapState,
    OperatorListState,
    ValueState,
)
from keyscale.state.types import StateDescriptor, TypeLike, arrow_type

#: No watermark yet: nothing is late, no event-time timer is due. (Defined here, where a
#: context reads it before the first batch; the watermark's rules are in operators/eventtime.py.)
NO_WATERMARK = -(2**63)


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
        self._cursor = Cursor()

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


def _with_ttl(desc: StateDescriptor, ttl_seconds: float | None, refresh: str, uid: str) -> StateDescriptor:
    if ttl_seconds is None:
        return desc
    if not ttl_seconds > 0:
        raise JobDefinitionError(f"operator '{uid}', state '{desc.name}': ttl_seconds must be positive, not {ttl_seconds!r}")
    if refresh not in ("on_write", "on_read_and_write"):
        raise JobDefinitionError(f"operator '{uid}', state '{desc.name}': ttl_refresh must be 'on_write' or 'on_read_and_write', not {refresh!r}")
    return replace(desc, ttl_seconds=float(ttl_seconds), ttl_refresh=refresh)


class TimerService:
    """Timers of the current key (Flink's ``TimerService``), reached as ``ctx.timer_service``.

    Timers are keyed state: stored with their key, by key group, so they move with the key
    on rescale and survive restart and restore. Registering the same timestamp twice makes
    one timer. Event-time timers fire once the watermark reaches them, processing-time
    timers once the batch time does; both call ``on_timer`` at the start of a batch, per
    key in timestamp order (event time first).
    """

    __slots__ = ("_ctx", "_cursor")

    def __init__(self, cursor: Cursor, ctx: Context):
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




#: How an operator list state is redistributed on rescale (keyscale.state.redistribution).
MODES = ("split_merge", "union")


class OperatorContext:
    """Given to ``open`` and ``process`` of a :class:`ProcessFunction`."""

    def __init__(self, uid: str, subtask: int = 0, parallelism: int = 1, batch_id: int = -1, processing_time: int = 0,
                 broadcast: Mapping[str, Any] | None = None):
        self.uid = uid
        self.subtask_index = subtask
        self.parallelism = parallelism
        self.batch_id = batch_id
        self.processing_time = processing_time
        self.lists: dict[str, OperatorListState] = {}
        #: The broadcast state (read-only), when the stage has a broadcast input.
        self.broadcast_state: Mapping[str, Any] = MappingProxyType(dict(broadcast or {}))

    def list_state(self, name: str, mode: str = "split_merge") -> OperatorListState:
        """Declare a list of entries of this subtask, redistributed on rescale by ``mode``."""
        if mode not in MODES:
            raise JobDefinitionError(f"operator '{self.uid}': list state '{name}' has mode {mode!r}; use 'split_merge' or 'union'")
        old = self.lists.get(name)
        if old is not None and old.mode != mode:
            raise JobDefinitionError(f"operator '{self.uid}': list state '{name}' declared twice with different modes")
        self.lists[name] = old or OperatorListState(name, mode)
        return self.lists[name]
