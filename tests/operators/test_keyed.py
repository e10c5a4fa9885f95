"""Keyed process functions: state handles, state declaration, per-key calls, output rows."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from keyscale.errors import JobDefinitionError, RecordError
from keyscale.operators.keyed import (
    KeyedProcessFunction,
    describe_states,
    rows_to_arrow,
)
from keyscale.operators.poison import FAIL, ErrorCollector, run_guarded
from keyscale.state.contexts import Context, RuntimeContext
from keyscale.state.types import StateDescriptor, arrow_schema


def run(fn: KeyedProcessFunction, keys: list[Any], records: list[tuple[Any, Any]], columns: dict[str, list[Any]]) -> tuple[list[Any], list[bool]]:
    """Call ``fn`` per key over ``records`` = [(key, row), ...] in arrival order, as the task does."""
    ctx = RuntimeContext("op", 0, 1, 8)
    fn.open(ctx)
    codes = np.array([keys.index(k) for k, _ in records], dtype=np.int64)
    order = np.argsort(codes, kind="stable")
    starts = np.concatenate([[0], np.cumsum(np.bincount(codes, minlength=len(keys)))])
    errors = ErrorCollector(FAIL, "op", 3, 0)
    out = list(run_guarded(fn, ctx._cursor, Context(3, 1234, 0), keys, np.arange(len(keys)), order, starts,
                           [r for _, r in records], columns, None, errors, lambda p: {"row": records[p][1]}))
    return out, list(ctx._cursor.dirty)


class Handles(KeyedProcessFunction):
    """Applies the operations named by each row to its key's states and emits what it reads."""

    def open(self, ctx: RuntimeContext) -> None:
        self.v = ctx.value_state("v", "long")
        self.l = ctx.list_state("l", "string")
        self.m = ctx.map_state("m", "string", "double")

    def process_element(self, row: Any, ctx: Context) -> Any:
        op, *args = row
        getattr(self, "op_" + op)(*args)
        yield (ctx.key, op, self.v.value(), self.l.get(), self.m.items())

    def op_read(self) -> None:
        pass

    def op_vset(self, x: Any) -> None:
        self.v.update(x)

    def op_vclear(self) -> None:
        self.v.clear()

    def op_ladd(self, x: str) -> None:
        self.l.add(x)

    def op_laddall(self, *xs: str) -> None:
        self.l.add_all(xs)

    def op_lset(self, *xs: str) -> None:
        self.l.update(xs)

    def op_lclear(self) -> None:
        self.l.clear()

    def op_mput(self, k: str, x: float) -> None:
        self.m.put(k, x)

    def op_mputall(self, d: dict[str, float]) -> None:
        self.m.put_all(d)

    def op_mremove(self, k: str) -> None:
        self.m.remove(k)

    def op_mclear(self) -> None:
        self.m.clear()


def test_value_state_defaults_to_none_and_updates() -> None:
    cols: dict[str, list[Any]] = {"v": [None, 5], "l": [None, None], "m": [None, None]}
    out, dirty = run(Handles(), ["a", "b"], [("a", ("read",)), ("b", ("read",))], cols)
    assert [o[2] for o in out] == [None, 5]
    assert dirty == [False, False] and cols["v"] == [None, 5]
    out, dirty = run(Handles(), ["a", "b"], [("a", ("vset", 0)), ("b", ("vclear",)), ("a", ("read",))], cols)
    assert [(o[0], o[2]) for o in out] == [("a", 0), ("a", 0), ("b", None)]  # 0 is a value, not absent
    assert cols["v"] == [0, None] and dirty == [True, True]


def test_list_state_add_get_update_clear() -> None:
    cols: dict[str, list[Any]] = {"v": [None], "l": [None], "m": [None]}
    rows = [("ladd", "x"), ("ladd", "y"), ("laddall", "z", "w"), ("lset", "q"), ("lclear",), ("ladd", "r"), ("lset",)]
    out, dirty = run(Handles(), ["a"], [("a", r) for r in rows], cols)
    assert [o[3] for o in out] == [["x"], ["x", "y"], ["x", "y", "z", "w"], ["q"], [], ["r"], []]
    assert cols["l"] == [None]  # an empty list is no state
    assert dirty == [True]


def test_list_state_get_returns_a_copy() -> None:
    class Mutate(KeyedProcessFunction):
        def open(self, ctx: RuntimeContext) -> None:
            self.l = ctx.list_state("l", "long")

        def process(self, key: Any, rows: Sequence[Any], ctx: Context) -> Any:
            self.l.get().append(99)
            return [self.l.get()]

    cols: dict[str, list[Any]] = {"l": [[1]]}
    out, dirty = run(Mutate(), ["a"], [("a", None)], cols)
    assert out == [[1]] and cols["l"] == [[1]] and dirty == [False]


def test_map_state_put_get_remove_contains_items() -> None:
    class Maps(KeyedProcessFunction):
        def open(self, ctx: RuntimeContext) -> None:
            self.m = ctx.map_state("m", "string", "double")

        def process(self, key: Any, rows: Sequence[Any], ctx: Context) -> Any:
            m = self.m
            seen = [m.is_empty(), m.get("x"), m.get("x", -1.0), m.contains("x")]
            m.put("x", 1.5)
            m.put("y", 2.0)
            m.put("x", 3.0)
            seen += [m.get("x"), m.contains("x"), m.contains("z"), m.keys(), m.values(), m.items(), m.is_empty()]
            m.remove("x")
            m.remove("absent")
            seen += [m.items()]
            m.put_all({"a": 0.0, "b": 1.0})
            seen += [sorted(m.keys())]
            return [seen]

    cols: dict[str, list[Any]] = {"m": [None, {"x": 7.0}]}
    out, dirty = run(Maps(), ["k1", "k2"], [("k1", None), ("k2", None)], cols)
    assert out[0] == [True, None, -1.0, False, 3.0, True, False, ["x", "y"], [3.0, 2.0], [("x", 3.0), ("y", 2.0)], False,
                      [("y", 2.0)], ["a", "b", "y"]]
    assert out[1][:4] == [False, 7.0, 7.0, True]
    assert cols["m"] == [{"y": 2.0, "a": 0.0, "b": 1.0}, {"y": 2.0, "a": 0.0, "b": 1.0}]
    assert dirty == [True, True]


def test_map_state_removing_the_last_entry_or_clear_deletes_it() -> None:
    cols: dict[str, list[Any]] = {"v": [None], "l": [None], "m": [{"x": 1.0}]}
    out, _ = run(Handles(), ["a"], [("a", ("mremove", "x"))], cols)
    assert out[0][4] == [] and cols["m"] == [None]
    out, _ = run(Handles(), ["a"], [("a", ("mput", "y", 2.0)), ("a", ("mclear",)), ("a", ("mputall", {}))], cols)
    assert [o[4] for o in out] == [[("y", 2.0)], [], []] and cols["m"] == [None]


def test_map_state_does_not_mutate_the_stored_dict_in_place() -> None:
    stored = {"x": 1.0}
    cols: dict[str, list[Any]] = {"v": [None], "l": [None], "m": [stored]}
    run(Handles(), ["a"], [("a", ("mput", "y", 2.0))], cols)
    assert stored == {"x": 1.0} and cols["m"] == [{"x": 1.0, "y": 2.0}]


def test_states_are_per_key_and_records_in_arrival_order() -> None:
    cols: dict[str, list[Any]] = {"v": [None, None], "l": [None, None], "m": [None, None]}
    recs = [("b", ("ladd", "1")), ("a", ("ladd", "2")), ("b", ("ladd", "3")), ("a", ("ladd", "4")), ("b", ("vset", 9))]
    out, dirty = run(Handles(), ["b", "a"], recs, cols)
    assert [(o[0], o[3]) for o in out] == [("b", ["1"]), ("b", ["1", "3"]), ("b", ["1", "3"]), ("a", ["2"]), ("a", ["2", "4"])]
    assert cols["l"] == [["1", "3"], ["2", "4"]] and cols["v"] == [9, None] and dirty == [True, True]


def test_context_names_the_key_and_batch() -> None:
    class Ctx(KeyedProcessFunction):
        def process(self, key: Any, rows: Sequence[Any], ctx: Context) -> Any:
            return [(key, ctx.key, ctx.key_group, ctx.batch_id, ctx.processing_time, ctx.subtask_index, len(rows))]

    out, _ = run(Ctx(), ["a", "b"], [("a", 1), ("b", 2), ("a", 3)], {})
    assert out == [("a", "a", 0, 3, 1234, 0, 2), ("b", "b", 1, 3, 1234, 0, 1)]


def test_process_returning_none_emits_nothing() -> None:
    class Quiet(KeyedProcessFunction):
        def process_element(self, row: Any, ctx: Context) -> Any:
            return None

    out, _ = run(Quiet(), ["a"], [("a", 1), ("a", 2)], {})
    assert out == []


def test_function_without_process_says_what_to_override() -> None:
    with pytest.raises(RecordError, match="must override process"):
        run(KeyedProcessFunction(), ["a"], [("a", 1)], {})


def test_state_used_outside_process_raises() -> None:
    ctx = RuntimeContext("op")
    v = ctx.value_state("v", "long")
    with pytest.raises(RuntimeError, match="state 'v' used outside of process"):
        v.value()
    with pytest.raises(RuntimeError, match="outside of process"):
        v.update(1)


# -- declaring state -------------------------------------------------------------------------


class Declares(KeyedProcessFunction):
    def __init__(self) -> None:
        self.opened = 0

    def open(self, ctx: RuntimeContext) -> None:
        self.opened += 1
        self.total = ctx.value_state("total", "long")
        self.hist = ctx.list_state("hist", "double", ttl_seconds=60)
        self.seen = ctx.map_state("seen", "string", "array<long>")


def test_describe_states() -> None:
    fn = Declares()
    states = describe_states(fn, "op")
    assert states == [
        StateDescriptor("total", "value", pa.int64()),
        StateDescriptor("hist", "list", pa.float64(), ttl_seconds=60),
        StateDescriptor("seen", "map", pa.list_(pa.int64()), map_key_type=pa.string()),
        StateDescriptor("__ttl_hist", "value", pa.int64()),  # when 'hist' was last written, per key
    ]
    assert [s.column_type for s in states[:3]] == [pa.int64(), pa.list_(pa.float64()), pa.map_(pa.string(), pa.list_(pa.int64()))]
    assert states[1].to_json() == {"name": "hist", "kind": "list", "type": "list<item: double>", "ttl_seconds": 60, "ttl_refresh": "on_write"}
    assert fn.opened == 0 and not hasattr(fn, "total")  # open ran on a copy


def test_describe_states_of_a_stateless_function() -> None:
    assert describe_states(KeyedProcessFunction(), "op") == []


@pytest.mark.parametrize("name", ["", "__kg", "__x"])
def test_reserved_state_names_are_rejected(name: str) -> None:
    ctx = RuntimeContext("alerts")
    with pytest.raises(JobDefinitionError, match=r"operator 'alerts': state .* is reserved or empty"):
        ctx.value_state(name, "long")


def test_state_declared_twice() -> None:
    ctx = RuntimeContext("alerts")
    ctx.value_state("n", "long")
    ctx.value_state("n", "long")  # the same declaration again is fine
    with pytest.raises(JobDefinitionError, match=r"operator 'alerts': state 'n' declared twice with different types"):
        ctx.value_state("n", "int")
    with pytest.raises(JobDefinitionError, match="declared twice"):
        ctx.list_state("n", "long")


def test_unknown_state_type() -> None:
    with pytest.raises(JobDefinitionError, match="unknown type 'longg'"):
        RuntimeContext("op").value_state("n", "longg")


# -- output rows -----------------------------------------------------------------------------

OUT = arrow_schema("key string, n long, xs array<double>, at timestamp")


def test_rows_to_arrow_from_tuples_and_dicts() -> None:
    import datetime as dt

    at = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
    tuples = [("a", 1, [0.5], at), ("b", None, None, None)]
    t = rows_to_arrow(tuples, OUT, "op")
    assert t.schema == OUT
    assert t.to_pylist() == [{"key": "a", "n": 1, "xs": [0.5], "at": at}, {"key": "b", "n": None, "xs": None, "at": None}]
    dicts = [{"key": "a", "n": 1, "xs": [0.5], "at": at}, {"n": 2, "key": "c", "xs": [], "at": None}]
    t = rows_to_arrow(dicts, OUT, "op")
    assert t.schema == OUT
    assert t.column("key").to_pylist() == ["a", "c"] and t.column("n").to_pylist() == [1, 2]


def test_rows_to_arrow_empty() -> None:
    t = rows_to_arrow([], OUT, "op")
    assert t.num_rows == 0 and t.schema == OUT


def test_rows_to_arrow_lists_work_as_rows() -> None:
    t = rows_to_arrow([["a", 1, [1.0], None]], OUT, "op")
    assert t.to_pylist()[0]["n"] == 1


@pytest.mark.parametrize("bad", [("a", 1, [0.5]), ("a", 1, [0.5], None, "extra")])
def test_rows_to_arrow_wrong_width_names_the_operator(bad: tuple[Any, ...]) -> None:
    with pytest.raises(JobDefinitionError, match=rf"operator 'alerts' emitted a row with {len(bad)} values, its output schema has 4 \(key, n, xs, at\)"):
        rows_to_arrow([("ok", 1, None, None), bad], OUT, "alerts")


@pytest.mark.parametrize("bad", [[("a", "not a number", None, None)], [{"key": 5, "n": 1}], [("a", 1, "x", None)], [None]])
def test_rows_to_arrow_wrong_types_name_the_operator(bad: list[Any]) -> None:
    with pytest.raises(JobDefinitionError, match="operator 'alerts' emitted a row"):
        rows_to_arrow(bad, OUT, "alerts")


class RemindAt(KeyedProcessFunction):
    """An event-time timer at each record's ``at``; the firing emits the key and the time."""

    def process_element(self, row: Any, ctx: Context) -> Any:
        ctx.timer_service.register_event_time_timer(row.at)
        return []

    def on_timer(self, key: Any, timestamp: int, ctx: Context) -> Any:
        yield (key, timestamp)


@pytest.mark.parametrize("backend", ["memory", "rocksdb"])
def test_timers_registered_in_a_drain_fire_in_it(backend: str) -> None:
    """A drain is the last batch: a stage that gets rows in it (from a stage before, whose
    timers fired there) must fire the timers those rows register, there and then."""
    from keyscale.operators.eventtime import END_OF_TIME
    from keyscale.testing import KeyedHarness

    h = KeyedHarness.of(RemindAt(), key_by=["k"], input_schema="k string, at long", output_schema="k string, at long",
                        parallelism=2, state_backend=backend)
    h.advance_watermark(100)
    assert h.process([{"k": "a", "at": 50}, {"k": "b", "at": 500}]) == []  # an ordinary batch: next batch fires a's
    h.advance_watermark(END_OF_TIME)
    assert h.process([{"k": "c", "at": 7}, {"k": "b", "at": 900}]) == [
        {"k": "a", "at": 50}, {"k": "b", "at": 500}, {"k": "b", "at": 900}, {"k": "c", "at": 7}]
