"""Poison records in one subtask, without Spark: NaN keys, null event times, a function that
raises for one key, under on_error = fail | skip | dead_letter (keyscale.operators.poison)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from test_task import (  # noqa: F401
    INPUT,
    TRACKER_OUT,
    Driver,
    Tracker,
    _clear_held,
    rows_of,
    to_record_batches,
    tracker_reference,
)

import keyscale.runtime.task.memory as memory
from keyscale.checkpoint.manifest import live_files
from keyscale.errors import InputDataError, JobDefinitionError, RecordError
from keyscale.operators.eventtime import END_OF_TIME, NO_WATERMARK
from keyscale.operators.keyed import KeyedProcessFunction
from keyscale.operators.poison import DEAD_LETTER_SCHEMA, FAIL, ErrorPolicy
from keyscale.operators.vectorized import (
    RunningAggregate,
    VectorizedKeyedFunction,
    count,
)
from keyscale.operators.windows import TumblingWindows, WindowAggregate
from keyscale.runtime.task.keyed import DEAD, KG, MAIN, SEQ, run_subtask
from keyscale.runtime.task.report import TaskReport
from keyscale.runtime.task.spark import make_stage_function
from keyscale.state.batches import TIMER, KeyedBatch
from keyscale.state.keygroups import key_group_range
from keyscale.state.spark_hash import key_group_of
from keyscale.state.types import arrow_schema

M = 16


def _row(key: str, value: int, i: int) -> dict[str, Any]:
    return {"key": key, "value": value, "id": i, SEQ: i, KG: key_group_of([key], ["string"], M)}



def _poisoned(report: TaskReport) -> int:
    """Records of a subtask's report whose processing raised (skipped or dead-lettered)."""
    c = report.counters
    return int(c.get("skipped", 0)) + int(c.get("dead_lettered", 0))

@dataclass
class PolicyDriver(Driver):
    """The test driver with an operator policy; dead letters are split off the stage's output."""

    policy: ErrorPolicy = FAIL
    event_time: str | None = None
    dead: list[dict[str, Any]] | None = None
    watermark_ms: int = NO_WATERMARK

    def run(self, batch: int, rows: Sequence[dict[str, Any]], p: int, **kw: Any) -> tuple[list[pa.Table], list[dict[str, Any]]]:  # type: ignore[override]
        spec = replace(self.spec(batch, p), on_error=self.policy, event_time=self.event_time, watermark_ms=self.watermark_ms)
        outs, self.dead, reports = [], [], []
        for i in range(p):
            rng = key_group_range(i, M, p)
            mine = [r for r in rows if rng.start <= r[KG] <= rng.end]
            out, rep = run_subtask(spec, iter(to_record_batches(mine, self.input_schema, None)), i)
            reports.append(rep)
            if DEAD in out.column_names:
                self.dead += [r for r in out.column(DEAD).to_pylist() if r is not None]
                out = pa.Table.from_pylist([r for r in out.column(MAIN).to_pylist() if r is not None], schema=self.output_schema)
            outs.append(out)
        self.files = live_files([*self.files, *(f for r in reports for f in r.state_files())], M)
        self.committed = batch
        return outs, reports


class Fragile(Tracker):
    """The tracker, but a record with value 13 raises after writing its key's state."""

    def process_element(self, row: Any, ctx: Any) -> Any:
        out = super().process_element(row, ctx)
        if row.value == 13:
            raise ZeroDivisionError("thirteen is unlucky")  # the user's own line
        return out


def _batches() -> list[list[dict[str, Any]]]:
    rows0 = [_row("a", 1, 0), _row("b", 2, 1), _row("a", 13, 2), _row("a", 4, 3), _row("c", 5, 4)]
    rows1 = [_row("a", 6, 5), _row("b", 13, 6), _row("b", 7, 7)]
    return [rows0, rows1]


def _without_poison(batches: list[list[dict[str, Any]]]) -> list[list[dict[str, Any]]]:
    return [[r for r in rows if r["value"] != 13] for rows in batches]


# -- the default: fail, naming everything, on one screen -----------------------------------------


def test_raising_function_fails_with_operator_key_batch_record_and_user_frames(tmp_path: Path) -> None:
    d = PolicyDriver(tmp_path / "job", Fragile(), TRACKER_OUT, uid="alerts")
    with pytest.raises(RecordError) as info:
        d.run(0, _batches()[0], 1)
    msg = str(info.value)
    lines = msg.splitlines()
    assert lines[0] == """operator 'alerts' failed on key "a" in batch 0 (subtask 0): ZeroDivisionError: thirteen is unlucky"""
    assert '"value": 13' in msg and '"id": 2' in msg
    assert "test_poison.py" in msg and 'raise ZeroDivisionError("thirteen is unlucky")' in msg
    assert "keyscale/" not in msg.replace("keyscale/tests", "")  # the user's frames only
    assert lines[-1] == "ZeroDivisionError: thirteen is unlucky"
    assert len(lines) < 20


def test_fail_error_survives_spark_wrapping_with_all_its_lines() -> None:
    from keyscale.errors import decode_error, encode_error

    err = RecordError('operator \'x\' failed on key "a"\n  in your code:\n    raise ValueError("no")\nValueError: no')
    wrapped = f"Traceback (most recent call last):\n  File \"worker.py\"\nRuntimeError: {encode_error(err)}\n\tat org.apache.spark..."
    assert decode_error(wrapped) == ("RecordError", str(err))
    assert decode_error("RuntimeError: KEYSCALE-ERROR InputDataError: an old one-line message") == ("InputDataError", "an old one-line message")


# -- skip and dead letter: the record (only) is set aside ---------------------------------------


@pytest.mark.parametrize("on_error", ["skip", "dead_letter"])
def test_skipped_record_leaves_no_state_and_other_records_apply(tmp_path: Path, on_error: str) -> None:
    batches = _batches()
    want = tracker_reference(_without_poison(batches))
    d = PolicyDriver(tmp_path / "job", Fragile(), TRACKER_OUT, uid="alerts", policy=ErrorPolicy(on_error))
    for b, rows in enumerate(batches):
        outs, reports = d.run(b, rows, 2)
        assert rows_of(outs) == want[b], f"batch {b}"
        assert sum(_poisoned(r) for r in reports) == 1
        assert {k for r in reports for k in r.counters} == {"skipped" if on_error == "skip" else "dead_lettered"}
    # A fresh worker restoring from the checkpoint sees the same state: nothing half-applied was written.
    memory._HELD.clear()
    outs, _ = d.run(2, [_row("a", 1, 8), _row("b", 1, 9)], 2)
    assert rows_of(outs) == tracker_reference([*_without_poison(batches), [_row("a", 1, 8), _row("b", 1, 9)]])[2]


def test_dead_letters_name_operator_key_batch_record_error_and_traceback(tmp_path: Path) -> None:
    d = PolicyDriver(tmp_path / "job", Fragile(), TRACKER_OUT, uid="alerts", policy=ErrorPolicy("dead_letter"))
    d.run(0, _batches()[0], 2)
    assert d.dead is not None and len(d.dead) == 1
    dl = d.dead[0]
    assert set(dl) == set(DEAD_LETTER_SCHEMA.names)
    assert (dl["operator"], json.loads(dl["key"]), dl["batch_id"]) == ("alerts", "a", 0)
    assert json.loads(dl["record"]) == {"key": "a", "value": 13, "id": 2}
    assert dl["error"] == "ZeroDivisionError: thirteen is unlucky"
    assert "test_poison.py" in dl["traceback"] and "pyspark" not in dl["traceback"]
    assert d.dead is not None
    d.run(1, [], 2)
    assert d.dead == []  # dead letters belong to their batch


def test_skip_has_no_side_output(tmp_path: Path) -> None:
    d = PolicyDriver(tmp_path / "job", Fragile(), TRACKER_OUT, policy=ErrorPolicy("skip"))
    outs, _ = d.run(0, _batches()[0], 1)
    assert outs[0].schema == TRACKER_OUT and d.dead == []


def test_bound_fails_the_batch_beyond_max_errors(tmp_path: Path) -> None:
    rows = [_row(f"k{i}", 13, i) for i in range(4)]
    ok = PolicyDriver(tmp_path / "a", Fragile(), TRACKER_OUT, uid="alerts", policy=ErrorPolicy("skip", 4))
    _, reports = ok.run(0, rows, 1)
    assert _poisoned(reports[0]) == 4
    over = PolicyDriver(tmp_path / "b", Fragile(), TRACKER_OUT, uid="alerts", policy=ErrorPolicy("dead_letter", 3))
    with pytest.raises(RecordError, match=r"operator 'alerts': more than max_errors_per_batch=3 poison records in batch 0") as info:
        over.run(0, rows, 1)
    assert str(info.value).splitlines()[-1] == "ZeroDivisionError: thirteen is unlucky"


class WholeKey(KeyedProcessFunction):
    """Overrides process(): the key's records of the batch are one unit."""

    def open(self, ctx: Any) -> None:
        self.total = ctx.value_state("total", "long")

    def process(self, key: Any, rows: Sequence[Any], ctx: Any) -> Any:
        for r in rows:
            self.total.update((self.total.value() or 0) + r.value)
            if r.value == 13:
                raise ValueError("no thirteen")
        return [(key, self.total.value())]


def test_overridden_process_rolls_back_the_keys_records_of_the_batch(tmp_path: Path) -> None:
    out = arrow_schema("key string, total long")
    d = PolicyDriver(tmp_path / "job", WholeKey(), out, policy=ErrorPolicy("dead_letter"))
    outs, reports = d.run(0, [_row("a", 1, 0), _row("a", 13, 1), _row("b", 2, 2)], 1)
    assert rows_of(outs) == [("b", 2)]
    assert _poisoned(reports[0]) == 2  # both of a's records of the batch
    assert d.dead is not None and sorted(json.loads(r["record"])["id"] for r in d.dead) == [0, 1]
    outs, _ = d.run(1, [_row("a", 5, 3)], 1)
    assert rows_of(outs) == [("a", 5)]  # a's state is as before batch 0


class TimerBomb(KeyedProcessFunction):
    """A processing-time timer whose firing raises after changing state."""

    def open(self, ctx: Any) -> None:
        self.n = ctx.value_state("n", "long")

    def process_element(self, row: Any, ctx: Any) -> Any:
        self.n.update((self.n.value() or 0) + 1)
        ctx.timer_service.register_processing_time_timer(ctx.processing_time + 1000)
        return [(ctx.key, self.n.value())]

    def on_timer(self, key: Any, timestamp: int, ctx: Any) -> Any:
        self.n.update(1000)
        raise RuntimeError(f"timer of {key}")


def test_failing_timer_is_rolled_back_and_dropped(tmp_path: Path) -> None:
    out = arrow_schema("key string, n long")
    d = PolicyDriver(tmp_path / "job", TimerBomb(), out, policy=ErrorPolicy("dead_letter"))
    d.run(0, [_row("a", 1, 0)], 1)
    outs, reports = d.run(1, [_row("a", 1, 1)], 1)  # the timer is due: it raises, then the record applies
    assert rows_of(outs) == [("a", 2)]
    assert _poisoned(reports[0]) == 1
    assert d.dead is not None and d.dead[0]["record"] is None and "timer of a" in d.dead[0]["error"]
    failing = PolicyDriver(tmp_path / "j2", TimerBomb(), out)
    failing.run(0, [_row("a", 1, 0)], 1)
    with pytest.raises(RecordError, match=r'(?s)failed on key "a" in batch 1.*on_timer for the processing_time timer'):
        failing.run(1, [], 1)


# -- whole-batch functions ---------------------------------------------------------------------------


class Boom(VectorizedKeyedFunction):
    def open(self, ctx: Any) -> None:
        ctx.value_state("n", "long")

    def process_batch(self, batch: KeyedBatch) -> Any:
        return {"n": np.asarray(batch.records["value"]) + undefined_name}, None  # type: ignore[name-defined]  # noqa: F821


def test_vectorized_function_error_names_operator_batch_and_user_frames(tmp_path: Path) -> None:
    d = PolicyDriver(tmp_path / "job", Boom(), arrow_schema("key string, n long"), uid="vec")
    with pytest.raises(RecordError) as info:
        d.run(3, [_row("a", 1, 0)], 1)
    lines = str(info.value).splitlines()
    assert lines[0].startswith("operator 'vec' failed in batch 3 (subtask 0): NameError")
    assert any("test_poison.py" in ln for ln in lines) and lines[-1].startswith("NameError: name 'undefined_name'")


# -- NaN keys are null keys; null event times -------------------------------------------------------


FLOAT_IN = arrow_schema("key double, value long, id long")


def _float_rows(keys: list[float]) -> list[dict[str, Any]]:
    return [{"key": k, "value": 1, "id": i, SEQ: i, KG: 3} for i, k in enumerate(keys)]


def _float_driver(tmp_path: Path, null_keys: str = "error") -> PolicyDriver:
    fn = RunningAggregate({"n": count()}, ["key"], {f.name: f.type for f in FLOAT_IN})
    out = pa.schema([FLOAT_IN.field("key"), *fn.output_fields()])
    d = PolicyDriver(tmp_path / "job", fn, out, input_schema=FLOAT_IN, uid="floats")
    if null_keys != "error":
        base = d.spec
        d.spec = lambda *a, **kw: replace(base(*a, **kw), null_keys=null_keys)  # type: ignore[method-assign]
    return d


def test_nan_key_is_a_null_key(tmp_path: Path) -> None:
    with pytest.raises(InputDataError, match=r"null key in column 'key' of operator 'floats' \(batch 0, 2 records\) \(NaN counts as a null key\)"):
        _float_driver(tmp_path).run(0, _float_rows([1.5, float("nan"), 2.5, float("nan")]), 1)


def test_nan_keys_are_dropped_like_null_keys(tmp_path: Path) -> None:
    outs, _ = _float_driver(tmp_path, "drop").run(0, _float_rows([1.5, float("nan"), 1.5]), 1)
    assert rows_of(outs) == [(1.5, 2)]


TS_IN = arrow_schema("key string, value long, id long, ts long")


def _ts_rows(ts: list[int | None]) -> list[dict[str, Any]]:
    return [{"key": "a", "value": 1, "id": i, "ts": t, SEQ: i, KG: key_group_of(["a"], ["string"], M)} for i, t in enumerate(ts)]


def _window_driver(tmp_path: Path, policy: ErrorPolicy = FAIL) -> PolicyDriver:
    types = {f.name: f.type for f in TS_IN}
    fn = WindowAggregate(TumblingWindows("1 second"), {"n": count()}, ["key"], types, "ts")
    out = pa.schema([TS_IN.field("key"), *fn.output_fields()])
    d = PolicyDriver(tmp_path / "job", fn, out, input_schema=TS_IN, uid="per_second", policy=policy, event_time="ts")
    base = d.spec
    d.spec = lambda *a, **kw: replace(  # type: ignore[method-assign]
        base(*a, **kw, function=Tracker()), function=fn, states=tuple(fn.state_descriptors()), extra_keys=(("window_start", pa.int64()),),
        watermark_ms=NO_WATERMARK,
    )
    return d


def test_null_event_time_in_a_window_fails_by_default_naming_column_operator_batch(tmp_path: Path) -> None:
    with pytest.raises(RecordError) as info:
        _window_driver(tmp_path).run(0, _ts_rows([1000, None, 1500, None]), 1)
    lines = str(info.value).splitlines()
    assert lines[0] == """operator 'per_second' failed on key "a" in batch 0 (subtask 0): null event time in column 'ts' (2 records)"""
    assert lines[-1] == "null event time in column 'ts' (2 records)"


def test_null_event_time_in_a_window_follows_on_error(tmp_path: Path) -> None:
    d = _window_driver(tmp_path, ErrorPolicy("dead_letter"))
    _, reports = d.run(0, _ts_rows([1000, None, 1500]), 1)
    assert _poisoned(reports[0]) == 1 and reports[0].max_event_ms == 1500
    assert d.dead is not None and [json.loads(r["record"])["id"] for r in d.dead] == [1]
    assert d.dead[0]["error"] == "null event time in column 'ts'"


def test_null_event_time_outside_windows_never_moves_the_watermark(tmp_path: Path) -> None:
    schema = TS_IN
    d = PolicyDriver(tmp_path / "job", Tracker(), TRACKER_OUT, input_schema=schema, event_time="ts")
    _, reports = d.run(0, [{**r, "value": 2} for r in _ts_rows([None, 700, None])], 1)
    assert reports[0].max_event_ms == 700
    _, reports = d.run(1, _ts_rows([None]), 1)
    assert reports[0].max_event_ms is None


class PickyCount(VectorizedKeyedFunction):
    """A vectorized count that cannot stand the key 'bad' (it sees all keys at once)."""

    def open(self, ctx: Any) -> None:
        ctx.value_state("n", "long")

    def process_batch(self, batch: KeyedBatch) -> Any:
        if (batch.keys["key"] == "bad").any():
            raise KeyError("bad")
        n = batch.state["n"].to_numpy(dtype=np.int64, na_value=0) + batch.count()
        return {"n": n}, pa.table({"key": batch.keys["key"].to_numpy(), "n": n})


@pytest.mark.parametrize("bad_keys", [["bad"], []])
def test_vectorized_failure_is_bisected_to_its_keys_under_dead_letter(tmp_path: Path, bad_keys: list[str]) -> None:
    out = arrow_schema("key string, n long")
    d = PolicyDriver(tmp_path / "job", PickyCount(), out, uid="vec", policy=ErrorPolicy("dead_letter"))
    keys = [f"k{i}" for i in range(9)] + bad_keys
    rows = [_row(k, 1, i) for i, k in enumerate(keys * 2)]
    outs, reports = d.run(0, rows, 1)
    assert rows_of(outs) == sorted(((f"k{i}", 2) for i in range(9)), key=repr)
    assert _poisoned(reports[0]) == 2 * len(bad_keys)
    assert d.dead is not None and sorted(json.loads(r["record"])["id"] for r in d.dead) == ([9, 19] if bad_keys else [])
    outs, _ = d.run(1, [_row("k0", 1, 20), _row("bad", 1, 21)], 1)
    assert rows_of(outs) == [("k0", 3)]  # k0's state kept; bad's never written


class PickyReminder(VectorizedKeyedFunction):
    """Sets a timer at 5 for every key with records; cannot stand the key 'bad'; a firing
    emits the key with its count."""

    event_timers = True

    def open(self, ctx: Any) -> None:
        ctx.value_state("n", "long")

    def process_batch(self, batch: KeyedBatch) -> Any:
        if (batch.keys["key"] == "bad").any():
            raise KeyError("bad")
        assert batch.due is not None
        n = batch.state["n"].to_numpy(dtype=np.int64, na_value=0) + batch.count()
        some = batch.count() > 0
        fired = batch.due
        return ({"n": n, TIMER: pd.Series(np.where(some, 5, 0), dtype="Int64").where(some)},
                pa.table({"key": batch.keys["key"].to_numpy(dtype=object)[fired], "n": n[fired]}))


def test_in_a_drain_the_keys_that_went_through_fire_their_timers_when_others_are_set_aside(tmp_path: Path) -> None:
    """A drain (the watermark at the end of time): the first call fails on 'bad', bisection
    sets it aside, and the timers the others set in the drain still fire in it."""
    out = arrow_schema("key string, n long")
    d = PolicyDriver(tmp_path / "job", PickyReminder(), out, uid="vec", policy=ErrorPolicy("dead_letter"), watermark_ms=END_OF_TIME)
    outs, reports = d.run(0, [_row(k, 1, i) for i, k in enumerate(["k0", "k1", "bad", "k2"])], 1)
    assert rows_of(outs) == [("k0", 1), ("k1", 1), ("k2", 1)]
    assert _poisoned(reports[0]) == 1


class Misnamed(VectorizedKeyedFunction):
    def process_batch(self, batch: KeyedBatch) -> Any:
        return {}, pa.table({"key": batch.keys["key"].to_numpy(dtype=object), "count": batch.count()})


def test_an_arrow_output_is_cast_to_the_schema_or_refused_by_name(tmp_path: Path) -> None:
    d = PolicyDriver(tmp_path / "job", PickyReminder(), arrow_schema("key string, n long"), uid="vec", watermark_ms=END_OF_TIME)
    outs, _ = d.run(0, [_row("k0", 1, 0)], 1)  # its output of the first call has no rows: a null-typed key column
    assert outs[0].schema == arrow_schema("key string, n long") and rows_of(outs) == [("k0", 1)]
    bad = PolicyDriver(tmp_path / "bad", Misnamed(), arrow_schema("key string, n long"), uid="vec")
    with pytest.raises(JobDefinitionError, match=r"operator 'vec' returned rows \(key string, count int64\) that do not fit its output schema \(key string, n int64\)"):
        bad.run(0, [_row("k0", 1, 0)], 1)


def test_an_unexpected_error_in_a_spark_task_names_operator_and_batch(tmp_path: Path) -> None:
    from keyscale.errors import decode_error

    d = PolicyDriver(tmp_path / "job", Tracker(), TRACKER_OUT, uid="alerts")
    spec = d.spec(4, 1)
    broken = replace(spec, input_schema=arrow_schema("key string, nothing long"))  # a keyscale-side mismatch, not the user's
    stage = make_stage_function(broken)
    with pytest.raises(RuntimeError) as info:
        list(stage(iter(to_record_batches([_row("a", 1, 0)], INPUT, None))))
    found = decode_error(str(info.value))
    assert found is not None and found[0] == "RecordError"
    assert found[1].startswith("operator 'alerts' failed in batch 4 (subtask 0): ")


def test_pipeline_policies_are_checked_when_the_job_is_built(spark: Any, tmp_path: Path) -> None:
    import keyscale as ks
    from keyscale.errors import JobDefinitionError

    events = spark.readStream.schema("key string, value long, id long").parquet(str(tmp_path))
    keyed = ks.stream(events).key_by("key")
    with pytest.raises(JobDefinitionError, match=r"operator 'alerts' has on_error='dead_letter' but the pipeline has no dead-letter sink"):
        keyed.process(Tracker(), TRACKER_OUT, uid="alerts", on_error="dead_letter").sink(ks.sinks.ConsoleSink())
    with pytest.raises(JobDefinitionError, match=r"operator 'counts': on_error must be one of"):
        keyed.aggregate(uid="counts", on_error="ignore", n=ks.aggregates.count())  # type: ignore[arg-type]
    dead = ks.sinks.ParquetSink(tmp_path / "dead")
    p = keyed.process(Tracker(), TRACKER_OUT, uid="alerts", on_error="skip").sink(ks.sinks.ConsoleSink(), on_error="dead_letter", dead_letter=dead,
                                                                               max_errors_per_batch=5)
    assert p.error_policy(p.keyed_steps[0]) == ErrorPolicy("skip", 5) and p.sinks[-1] is dead
    p = keyed.aggregate(uid="counts", n=ks.aggregates.count()).sink(ks.sinks.ConsoleSink())
    assert p.error_policy(p.keyed_steps[0]) == ErrorPolicy("fail", 1000)


def test_side_outputs_late_and_dead_letters_together() -> None:
    from keyscale.runtime.task.keyed import LATE, side_output_schema, with_side_output

    main = pa.table({"k": ["a", "b"]})
    late = pa.table({"x": pa.array([1], pa.int64())})
    dead = pa.Table.from_pylist([{"operator": "w", "key": '"a"', "batch_id": 1, "subtask": 0, "record": "{}", "error": "E", "traceback": ""}],
                                schema=DEAD_LETTER_SCHEMA)
    t = with_side_output(main, late, dead)
    assert t.schema == side_output_schema(main.schema, late.schema, DEAD_LETTER_SCHEMA)
    assert [sum(v is not None for v in t.column(c).to_pylist()) for c in (MAIN, LATE, DEAD)] == [2, 1, 1]
    assert all(sum(t.column(c)[i].is_valid for c in (MAIN, LATE, DEAD)) == 1 for i in range(t.num_rows))  # one set per row
    only_dead = with_side_output(main, None, dead)
    assert only_dead.column_names == [MAIN, DEAD] and only_dead.num_rows == 3


def test_log_reader_ignores_null_event_times_for_the_watermark(tmp_path: Path) -> None:
    from keyscale.runtime.task.reader import make_reader_function
    from keyscale.runtime.task.report import Reports
    from keyscale.sources import create_log

    log = create_log(tmp_path / "log", "key string, ts long", 1)
    log.append(0, pa.table({"key": ["a", "b", "c"], "ts": pa.array([5, None, 9], pa.int64())}))
    collected = Reports()
    read = make_reader_function(log, "reader", 0, [[(0, 0, 3)]], log.schema, "ts", report_to=collected.sender)
    rows = pa.concat_tables(pa.Table.from_batches([b]) for b in read(iter([pa.record_batch({"subtask": pa.array([0], pa.int32())})])))
    assert rows.num_rows == 3
    assert (collected.take("reader", 0, 1)[0].partitions or {})[0].max_event_ms == 9


def test_the_jobs_own_policy_for_malformed_input_is_the_sinks_and_the_strictest_of_its_branches(spark: Any, tmp_path: Path) -> None:
    import keyscale as ks
    from keyscale.errors import JobDefinitionError

    events = ks.stream(spark.readStream.schema("key string, value long, id long").parquet(str(tmp_path)))
    counts = events.key_by("key").aggregate(uid="counts", on_error="fail", n=ks.aggregates.count())
    dead = ks.sinks.ParquetSink(tmp_path / "dead")
    with pytest.raises(JobDefinitionError, match=r"sink\(on_error='dead_letter'\) needs a dead-letter sink"):
        counts.sink(ks.sinks.ConsoleSink(), on_error="dead_letter")  # no operator uses it, the job's input does
    p = counts.sink(ks.sinks.ConsoleSink(), on_error="dead_letter", dead_letter=dead, max_errors_per_batch=7)
    assert p.input_policy == ErrorPolicy("dead_letter", 7) and p.error_policy(p.keyed_steps[0]) == ErrorPolicy("fail", 7)
    sums = events.key_by("key").aggregate(uid="sums", total=ks.aggregates.sum("value"))
    both = ks.pipeline(counts.sink(ks.sinks.ParquetSink(tmp_path / "a"), on_error="skip"), sums.sink(ks.sinks.ParquetSink(tmp_path / "b")))
    assert both.input_policy.on_error == "fail"  # the strictest: a malformed record is never skipped for a branch that fails
