"""The state handles a function reads and writes, and the hidden states keyscale keeps beside them.

Keyed state (:class:`ValueState`, :class:`ListState`, :class:`MapState`) is one value per
key: a handle reads and writes the current key's slot in the batch's state columns through
a :class:`Cursor` that the task moves from key to key. Operator state
(:class:`OperatorListState`) is one list per subtask. Beside a function's own states keyscale
keeps hidden ones, named here: each key's timers (:data:`TIMER_STATES`) and, for a state with
a TTL, when it was last written (:func:`ttl_column`).

Handles are made by the contexts (:mod:`keyscale.state.contexts`), never by a function.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Generic, TypeVar

import pyarrow as pa

from keyscale.state.types import StateDescriptor

T = TypeVar("T")
K = TypeVar("K")
V = TypeVar("V")


class Cursor:
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
    def __init__(self, desc: StateDescriptor, cursor: Cursor):
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


class OperatorListState:
    """A subtask's list of entries (JSON-serialisable values)."""

    def __init__(self, name: str, mode: str):
        self.name = name
        self.mode = mode
        self._entries: list[Any] = []

    def get(self) -> list[Any]:
        return list(self._entries)

    def add(self, entry: Any) -> None:
        self._entries.append(entry)

    def update(self, entries: Iterable[Any]) -> None:
        self._entries = list(entries)

    def clear(self) -> None:
        self._entries = []


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
