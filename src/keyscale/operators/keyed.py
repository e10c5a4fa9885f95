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
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Generic, TypeVar

import numpy as np
import pyarrow as pa

from keyscale.errors import JobDefinitionError
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

    def get(self, name: str) -> Any:
        if self.i < 0:
            raise RuntimeError(f"state '{name}' used outside of process(): there is no current key")
        return self.columns[name][self.i]

    def set(self, name: str, value: Any) -> None:
        if self.i < 0:
            raise RuntimeError(f"state '{name}' used outside of process(): there is no current key")
        self.columns[name][self.i] = value
        self.dirty[self.i] = True


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

    ``ttl_seconds`` is recorded in the state's schema (checkpoints, savepoints) but not
    enforced yet: state does not expire (state TTL comes with event time).
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

    def value_state(self, name: str, type: TypeLike, ttl_seconds: float | None = None) -> ValueState[Any]:
        """Declare a value state (one value per key) of a Spark SQL type such as ``"long"``."""
        desc = StateDescriptor(name, "value", arrow_type(type), ttl_seconds=ttl_seconds)
        self._declare(desc)
        return ValueState(desc, self._cursor)

    def list_state(self, name: str, element_type: TypeLike, ttl_seconds: float | None = None) -> ListState[Any]:
        """Declare a list state (a list per key) of elements of a Spark SQL type."""
        desc = StateDescriptor(name, "list", arrow_type(element_type), ttl_seconds=ttl_seconds)
        self._declare(desc)
        return ListState(desc, self._cursor)

    def map_state(self, name: str, key_type: TypeLike, value_type: TypeLike, ttl_seconds: float | None = None) -> MapState[Any, Any]:
        """Declare a map state (a map per key)."""
        desc = StateDescriptor(name, "map", arrow_type(value_type), map_key_type=arrow_type(key_type), ttl_seconds=ttl_seconds)
        self._declare(desc)
        return MapState(desc, self._cursor)


class Context:
    """Given to ``process``: the current key and the batch it belongs to."""

    __slots__ = ("batch_id", "key", "key_group", "processing_time", "subtask_index")

    def __init__(self, batch_id: int, processing_time: int, subtask_index: int):
        self.batch_id = batch_id
        #: The batch's own time in epoch milliseconds, fixed by the driver (a replay sees the same).
        self.processing_time = processing_time
        self.subtask_index = subtask_index
        self.key: Any = None
        self.key_group = -1


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


def describe_states(fn: Any, uid: str) -> list[StateDescriptor]:
    """The states a function declares in ``open`` (run on a copy, so ``fn`` stays pristine)."""
    ctx = RuntimeContext(uid)
    probe = copy.deepcopy(fn)
    probe.open(ctx)
    return list(ctx.descriptors.values())


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


def run_process_function(
    fn: KeyedProcessFunction,
    cursor: _Cursor,
    ctx: Context,
    keys: list[Any],
    key_groups: np.ndarray,
    order: np.ndarray,
    bounds: np.ndarray,
    records: list[Any],
    columns: dict[str, list[Any]],
) -> Iterator[Any]:
    """Call ``fn.process`` once per key, keys in order of their first record.

    ``order[bounds[j]:bounds[j+1]]`` are the positions (in arrival order) of key j's
    records; ``columns`` hold each state's value per key and are updated in place.
    """
    cursor.columns = columns
    cursor.dirty = [False] * len(keys)
    try:
        for j, key in enumerate(keys):
            cursor.i = j
            ctx.key = key
            ctx.key_group = int(key_groups[j])
            rows = [records[p] for p in order[bounds[j] : bounds[j + 1]]]
            out = fn.process(key, rows, ctx)
            if out is not None:
                yield from out
    finally:
        cursor.i = -1
