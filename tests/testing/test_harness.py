"""keyscale.testing: a keyed stage tested without Spark, through the job's own task code
and state files: the same output at any parallelism and across a snapshot and restore."""

from __future__ import annotations

import datetime as dt
import random
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import keyscale as ks
import keyscale.testing
import keyscale.testing.nonkeyed
from keyscale.errors import JobDefinitionError
from keyscale.testing import KeyedHarness, OperatorHarness


@pytest.fixture(params=["memory", "rocksdb"])
def state_backend(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A test that uses it runs twice: its harnesses on the in-memory and on the RocksDB state backend."""
    monkeypatch.setenv("KEYSCALE_LOCAL_DIR", str(tmp_path / "local"))
    monkeypatch.setattr(KeyedHarness, "default_state_backend", request.param)
    return str(request.param)


MINUTE = 60_000
T0 = 1_767_225_600_000


batches = st.lists(st.lists(st.tuples(st.sampled_from(["a", "b", "c", "dd", "ü"]), st.integers(-5, 5)), max_size=8), min_size=1, max_size=5)


@pytest.mark.usefixtures("state_backend")
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=batches, p=st.integers(1, 4), restore_at=st.integers(0, 4), restore_p=st.integers(1, 5))
def test_an_aggregate_gives_the_same_output_at_any_parallelism_and_across_a_restore(
    data: list[list[tuple[str, int]]], p: int, restore_at: int, restore_p: int,
) -> None:
    def harness(parallelism: int) -> KeyedHarness:
        return KeyedHarness.aggregate(key_by=["k"], input_schema="k string, v long", parallelism=parallelism,
                                      n=ks.aggregates.count(), total=ks.aggregates.sum("v"), top=ks.aggregates.max("v"))

    one, other = harness(1), harness(p)
    for i, rows in enumerate(data):
        if i == restore_at:
            other = other.snapshot().restore(parallelism=restore_p)
        records = [{"k": k, "v": v} for k, v in rows]
        assert other.process(records) == one.process(records)
    for k in {k for rows in data for k, _ in rows}:
        assert other.state(k) == one.state(k)


KEYS_OF_EACH_TYPE = {
    "string": lambda i: f"user-{i}",
    "long": lambda i: i * 7919 - 10_000,
    "date": lambda i: dt.date(2020, 1, 1) + dt.timedelta(days=i),
    "timestamp": lambda i: dt.datetime(2024, 1, 1, tzinfo=dt.UTC) + dt.timedelta(seconds=i),
    "double": lambda i: i / 8 - 100.0,
    "binary": lambda i: i.to_bytes(3, "big"),
    "int": lambda i: i - 1_000,
    "decimal(12,3)": lambda i: Decimal(i) / 8,
    "decimal(30,2)": lambda i: Decimal(10**25 + i) / 4,
    "timestamp_ntz": lambda i: dt.datetime(2024, 1, 1) + dt.timedelta(seconds=i),
}


@pytest.mark.usefixtures("state_backend")
@pytest.mark.parametrize("kind", sorted(KEYS_OF_EACH_TYPE))
def test_an_aggregate_keyed_by_each_type_snapshots_and_restores(kind: str) -> None:
    """More keys than a record batch holds, so the snapshot orders them by sub key and keeps
    fences (a date key once failed there); restored elsewhere, each key's state as it was
    (decimal and timestamp_ntz keys once had no key group at all)."""
    make = KEYS_OF_EACH_TYPE[kind]
    if kind.startswith("decimal") and KeyedHarness.default_state_backend == "rocksdb":  # as a job refuses it
        with pytest.raises(JobDefinitionError, match="operator 'harness': the rocksdb state backend cannot key by column 'k' of type decimal128"):
            KeyedHarness.aggregate(key_by=["k"], input_schema=f"k {kind}, v long", n=ks.aggregates.count())
        return
    h = KeyedHarness.aggregate(key_by=["k"], input_schema=f"k {kind}, v long", parallelism=2, n=ks.aggregates.count())
    h.process([{"k": make(i % 2_500), "v": 1} for i in range(5_000)])
    back = h.snapshot().restore(parallelism=3)
    assert back.process([{"k": make(7), "v": 1}]) == [{"k": make(7), "n": 3}]
    assert [back.state(make(i))["n"] for i in (0, 1_234, 2_499)] == [2, 2, 2]


class SessionTimeout(ks.KeyedProcessFunction):
    """Counts a key's records; a processing-time timer 10 s after the first emits the count."""

    def open(self, ctx: Any) -> None:
        self.n = ctx.value_state("n", "long")

    def process_element(self, row: Any, ctx: Any) -> Any:
        if self.n.value() is None:
            ctx.timer_service.register_processing_time_timer(ctx.processing_time + 10_000)
        self.n.update((self.n.value() or 0) + 1)
        return []

    def on_timer(self, key: Any, timestamp: int, ctx: Any) -> Any:
        n = self.n.value()
        self.n.clear()
        return [(key, n)]


@pytest.mark.usefixtures("state_backend")
def test_processing_time_timers_fire_when_the_clock_moves_also_after_a_restore_elsewhere() -> None:
    h = KeyedHarness.of(SessionTimeout(), key_by=["k"], input_schema="k string", output_schema="k string, n long", parallelism=2)
    assert h.process([{"k": "a"}, {"k": "b"}, {"k": "a"}]) == []
    h.advance_processing_time("5 seconds")
    assert h.process([{"k": "a"}]) == []
    assert h.state("a") == {"n": 3}
    restored = h.snapshot().restore(parallelism=3)
    restored.advance_processing_time("6 seconds")
    assert restored.process() == [{"k": "a", "n": 3}, {"k": "b", "n": 1}]
    assert restored.state("a") is None


@pytest.mark.usefixtures("state_backend")
def test_a_tumbling_window_fires_at_the_watermark_and_sends_late_records_aside() -> None:
    def run(restore: bool) -> tuple[list[list[dict[str, Any]]], list[dict[str, Any]]]:
        h = KeyedHarness.window(ks.windows.TumblingWindows("1 minute"), key_by=["user"], input_schema="user string, ts long, v long",
                                event_time="ts", parallelism=2, clicks=ks.aggregates.count(), total=ks.aggregates.sum("v"))
        out = [h.process([{"user": "ann", "ts": T0 + 1_000, "v": 1}, {"user": "bob", "ts": T0 + 2_000, "v": 2},
                          {"user": "ann", "ts": T0 + MINUTE + 5, "v": 4}])]
        assert h.state("ann") == {T0: {"clicks": 1, "total": 1}, T0 + MINUTE: {"clicks": 1, "total": 4}}
        if restore:
            h = h.snapshot().restore(parallelism=4)
        h.advance_watermark(T0 + MINUTE)  # the first minute is complete
        out.append(h.process([{"user": "ann", "ts": T0 + 3_000, "v": 8}]))  # too late: the watermark passed its window
        return out, h.late

    out, late = run(restore=False)
    assert out[0] == []
    assert [(r["user"], r["window_start"], r["clicks"], r["total"]) for r in out[1]] == [("ann", T0, 1, 1), ("bob", T0, 1, 2)]
    assert late == [{"user": "ann", "ts": T0 + 3_000, "v": 8}]
    assert run(restore=True) == (out, late)


class Doubler(ks.VectorizedKeyedFunction):
    """A vectorized running sum of twice the values."""

    def __init__(self) -> None:
        self.input_columns = ["v"]

    def open(self, ctx: Any) -> None:
        ctx.value_state("s", "long")

    def process_batch(self, batch: Any) -> Any:
        import pandas as pd

        assert list(batch.records.columns) == ["v"]  # only what it declared
        s = batch.state["s"].fillna(0).to_numpy() + 2 * batch.reduce("v", "sum")
        return {"s": s}, pd.DataFrame({"k": batch.keys["k"], "s": s})


@pytest.mark.usefixtures("state_backend")
def test_a_vectorized_function_keeps_its_state_across_parallelism_changes() -> None:
    rnd = random.Random(3)
    rows = [[{"k": f"k{rnd.randrange(20)}", "v": rnd.randrange(10)} for _ in range(50)] for _ in range(4)]
    steady = KeyedHarness.of(Doubler(), key_by=["k"], input_schema="k string, v long", output_schema="k string, s long")
    moving = KeyedHarness.of(Doubler(), key_by=["k"], input_schema="k string, v long", output_schema="k string, s long", parallelism=3)
    for i, batch in enumerate(rows):
        assert moving.process(batch) == steady.process(batch)
        moving = moving.snapshot().restore(parallelism=[2, 5, 1, 4][i])
    totals: dict[str, int] = {}
    for batch in rows:
        for r in batch:
            totals[r["k"]] = totals.get(r["k"], 0) + 2 * r["v"]
    assert {k: moving.state(k) for k in totals} == {k: {"s": v} for k, v in totals.items()}


class Rules(ks.ProcessFunction):
    """Union state: every subtask holds all the rules; split/merge: each its share of the ids."""

    def open(self, ctx: Any) -> None:
        self.rules = ctx.list_state("rules", mode="union")
        self.ids = ctx.list_state("ids")

    def process(self, records: Any, ctx: Any) -> Any:
        if ctx.batch_id == 0:
            self.rules.update(["r1", "r2"] if ctx.subtask_index == 0 else [])
        self.ids.update([*self.ids.get(), *records["id"].tolist()])
        return [(ctx.subtask_index, len(self.rules.get()))]


@pytest.mark.parametrize("to", [1, 2, 5])
def test_a_process_function_keeps_split_merge_entries_and_unions_across_a_restore(to: int) -> None:
    h = OperatorHarness(Rules(), input_schema="id long", output_schema="subtask int, rules long", parallelism=3)
    h.process([{"id": i} for i in range(7)])
    restored = h.snapshot().restore(parallelism=to)
    lists = restored.lists()
    assert lists["rules"] == [["r1", "r2"]] * to  # union: each subtask gets all of them
    assert sorted(i for share in lists["ids"] for i in share) == list(range(7)) and len(lists["ids"]) == to  # split/merge: each once
    assert restored.process([{"id": 7}]) == [{"subtask": i, "rules": 2} for i in range(to)]  # every subtask runs each batch


def test_advance_watermark_takes_a_datetime_as_the_event_time_column_holds_it() -> None:
    import datetime as dt

    import numpy as np
    import pandas as pd

    from keyscale.errors import JobDefinitionError

    def fired(to: Any) -> list[dict[str, Any]]:
        h = KeyedHarness.window(ks.windows.TumblingWindows("1 minute"), key_by=["user"], input_schema="user string, ts timestamp",
                                event_time="ts", clicks=ks.aggregates.count())
        h.process([{"user": "ann", "ts": dt.datetime(2026, 1, 1, 0, 0, 30)}])
        h.advance_watermark(to)
        return h.process()

    # the first minute (naive: UTC, as the records' naive datetimes) is complete at 00:01, not before
    assert fired(dt.datetime(2026, 1, 1, 0, 0, 59)) == []
    for done in (dt.datetime(2026, 1, 1, 0, 1), dt.datetime(2026, 1, 1, 1, 1, tzinfo=dt.timezone(dt.timedelta(hours=1))),
                 pd.Timestamp("2026-01-01T00:01Z"), np.datetime64("2026-01-01T00:01"), T0 + MINUTE):
        assert [r["clicks"] for r in fired(done)] == [1], done
    h = KeyedHarness.aggregate(key_by=["k"], input_schema="k string", n=ks.aggregates.count())
    for wrong in ("2026-01-01", dt.date(2026, 1, 1), 1.5e12):
        with pytest.raises(JobDefinitionError, match=r"watermark .* is not an event time: give epoch milliseconds"):
            h.advance_watermark(wrong)
