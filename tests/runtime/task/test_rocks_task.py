"""The RocksDB state backend gives the in-memory backend's output, batch by batch, for
every kind of state (value, list, map, TTL), timers, fixed and session windows, across
snapshots, restores at other parallelisms, failed attempts and reused databases."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import keyscale as ks
from keyscale.errors import KeyscaleError
from keyscale.runtime.task import rocks as rocks_task
from keyscale.testing import KeyedHarness

T0 = 1_767_225_600_000


@pytest.fixture(autouse=True)
def _local_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEYSCALE_LOCAL_DIR", str(tmp_path / "local"))


class Everything(ks.KeyedProcessFunction):
    """Value, list and map state, a TTL'd value, event- and processing-time timers."""

    def open(self, ctx: Any) -> None:
        self.n = ctx.value_state("n", "long")
        self.seen = ctx.list_state("seen", "long")
        self.by = ctx.map_state("by", "string", "long")
        self.recent = ctx.value_state("recent", "string", ttl_seconds=20)

    def process_element(self, row: Any, ctx: Any) -> Any:
        n = (self.n.value() or 0) + 1
        self.n.update(n)
        self.seen.add(row.v)
        self.by.put(str(row.v % 3), (self.by.get(str(row.v % 3)) or 0) + row.v)
        last = self.recent.value()
        self.recent.update(f"v{row.v}")
        if n == 1:
            ctx.timer_service.register_processing_time_timer(ctx.processing_time + 15_000)
        ctx.timer_service.register_event_time_timer(row.ts + 5_000)
        return [(row.k, "rec", n, last)]

    def on_timer(self, key: Any, timestamp: int, ctx: Any) -> Any:
        out = [(key, "timer", len(self.seen.get()), str(sorted(self.by.items())))]
        if len(self.seen.get()) > 3:
            self.seen.clear()
            self.n.clear()
            self.by.clear()
        return out


def _everything(p: int, backend: str) -> KeyedHarness:
    return KeyedHarness.of(Everything(), key_by=["k"], input_schema="k string, v long, ts long",
                           output_schema="k string, what string, n long, last string", parallelism=p, event_time="ts", state_backend=backend)


def _drive(make: Callable[[int, str], KeyedHarness], backend: str, batches: list[list[dict[str, Any]]], plan: dict[int, int],
           snapshot_every: int = 0, step: Callable[[KeyedHarness, int], None] | None = None) -> list[list[dict[str, Any]]]:
    h = make(2, backend)
    h.snapshot_every = snapshot_every
    out = []
    for i, records in enumerate(batches):
        if i in plan:
            h = h.snapshot().restore(parallelism=plan[i])
        if step is not None:
            step(h, i)
        out.append(h.process(records))
    return out


def _records(seed: int, n_batches: int, keys: int) -> list[list[dict[str, Any]]]:
    rnd = random.Random(seed)
    return [[{"k": f"k{rnd.randrange(keys)}", "v": rnd.randrange(100), "ts": T0 + b * 4_000 + rnd.randrange(3_000)}
             for _ in range(rnd.randrange(0, 25))] for b in range(n_batches)]


def _clocks(h: KeyedHarness, i: int) -> None:
    h.advance_watermark(T0 + i * 4_000)
    h.advance_processing_time("7 seconds")


@pytest.mark.parametrize("seed", [1, 2])
def test_value_list_map_ttl_and_timers_give_the_same_output_on_rocksdb(seed: int) -> None:
    data = _records(seed, 12, 30)
    plan = {4: 3, 8: 1}
    want = _drive(_everything, "memory", data, plan, 3, _clocks)
    assert any(r["what"] == "timer" for b in want for r in b) and any(r["last"] is None for b in want[6:] for r in b)
    assert _drive(_everything, "rocksdb", data, plan, 3, _clocks) == want


def _windows(assigner: Any) -> Callable[[int, str], KeyedHarness]:
    def make(p: int, backend: str) -> KeyedHarness:
        return KeyedHarness.window(assigner, key_by=["k"], input_schema="k string, v long, ts long", event_time="ts", parallelism=p,
                                   allowed_lateness="5 seconds", n=ks.aggregates.count(), total=ks.aggregates.sum("v"), state_backend=backend)
    return make


@pytest.mark.parametrize("assigner", [ks.windows.TumblingWindows("10 seconds"), ks.windows.SlidingWindows("10 seconds", "5 seconds"), ks.windows.SessionWindows("3 seconds")],
                         ids=["tumbling", "sliding", "session"])
def test_windows_give_the_same_output_on_rocksdb(assigner: Any) -> None:
    data = _records(5, 12, 6)
    plan = {5: 4, 9: 2}
    want = _drive(_windows(assigner), "memory", data, plan, 4, _clocks)
    assert sum(len(b) for b in want) > 5
    assert _drive(_windows(assigner), "rocksdb", data, plan, 4, _clocks) == want


class FailOnce(ks.KeyedProcessFunction):
    """A running count that raises at the first record with v == 13 (after changing state)."""

    failed = False

    def open(self, ctx: Any) -> None:
        self.n = ctx.value_state("n", "long")

    def process_element(self, row: Any, ctx: Any) -> Any:
        self.n.update((self.n.value() or 0) + 1)
        if row.v == 13 and not FailOnce.failed:
            FailOnce.failed = True
            raise RuntimeError("crash mid-batch")
        return [(row.k, self.n.value())]


def test_a_failed_attempt_leaves_nothing_the_retry_sees() -> None:
    def run(backend: str) -> list[list[dict[str, Any]]]:
        FailOnce.failed = False
        h = KeyedHarness.of(FailOnce(), key_by=["k"], input_schema="k string, v long", output_schema="k string, n long",
                            parallelism=2, state_backend=backend)
        out = [h.process([{"k": f"k{i % 5}", "v": i} for i in range(10)])]
        batch = [{"k": f"k{i % 5}", "v": i} for i in range(10, 20)]
        with pytest.raises(KeyscaleError, match="crash mid-batch"):
            h.process(batch)  # subtask(s) wrote to their state before the failure
        out.append(h.process(batch))  # the retry of the same batch
        out.append(h.process(batch))
        return out

    want = run("memory")
    assert run("rocksdb") == want
    assert [r["n"] for r in want[1] if r["k"] == "k0"] == [3, 4]


def test_a_database_ahead_of_the_committed_checkpoint_is_reloaded_not_reused() -> None:
    """An attempt whose batch did not commit leaves a database at that batch: the next
    run of the batch (from the checkpoint before it) must not see its writes."""
    h = KeyedHarness.aggregate(key_by=["k"], input_schema="k long", n=ks.aggregates.count(), state_backend="rocksdb")
    h.process([{"k": 1}, {"k": 2}])
    before = h.snapshot()
    assert h.process([{"k": 1}]) == [{"k": 1, "n": 2}]  # batch 1 ran: the database is at batch 1
    again = before.restore()  # ... but batch 1 is not committed: it runs again from batch 0
    assert again.process([{"k": 1}, {"k": 1}]) == [{"k": 1, "n": 3}]
    assert again.process([{"k": 2}]) == [{"k": 2, "n": 2}]


@pytest.mark.parametrize("snapshot_every", [0, 2])
def test_a_task_killed_after_writing_its_rows_but_before_recording_its_batch_is_reloaded(
    monkeypatch: pytest.MonkeyPatch, snapshot_every: int,
) -> None:
    """The database has the failed attempt's rows but its range is marked unusable: the
    retry reloads from the files instead of counting the attempt's records twice."""
    h = KeyedHarness.aggregate(key_by=["k"], input_schema="k long", parallelism=2, n=ks.aggregates.count(), state_backend="rocksdb")
    h.snapshot_every = snapshot_every
    h.process([{"k": k} for k in range(6)])
    finish = rocks_task.RocksSession.finish

    def dies(self: rocks_task.RocksSession, batch: int) -> None:
        raise SystemExit("killed")

    monkeypatch.setattr(rocks_task.RocksSession, "finish", dies)
    with pytest.raises(SystemExit):
        h.process([{"k": k} for k in range(6)])
    monkeypatch.setattr(rocks_task.RocksSession, "finish", finish)
    assert h.process([{"k": k} for k in range(6)]) == [{"k": k, "n": 2} for k in range(6)]
    assert h.process([{"k": 0}]) == [{"k": 0, "n": 3}]


def test_a_subtask_whose_database_another_attempt_holds_uses_a_private_copy() -> None:
    """Speculation or a zombie attempt holds the subtask's database (RocksDB's lock): this
    attempt loads its range into a database of its own, which goes when it ends."""
    from keyscale.state.rocksdb import RocksState
    from keyscale.storage import LocalStore
    from keyscale.storage.scratch import scratch_children, scratch_dir

    h = KeyedHarness.aggregate(key_by=["k"], input_schema="k long", n=ks.aggregates.count(), state_backend="rocksdb")
    h.process([{"k": 1}, {"k": 2}])
    run = scratch_dir(rocks_task._plain(LocalStore(h._folder.path).uri), rocks_task._plain("harness"), "harness")
    holder = RocksState(run / "s0-of-1", ["k"], [], [], 128)  # opened by "another attempt"
    try:
        assert h.process([{"k": 1}]) == [{"k": 1, "n": 2}]
        assert [p.name for p in scratch_children(run)] == ["s0-of-1"]  # the private copy is gone
    finally:
        holder.close()
    assert h.process([{"k": 1}, {"k": 2}]) == [{"k": 1, "n": 3}, {"k": 2, "n": 2}]  # reloaded: s0 is behind


def _by_k(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(rows, key=lambda r: r["k"])


def test_a_rescale_copies_the_old_databases_instead_of_loading_the_files(monkeypatch: pytest.MonkeyPatch) -> None:
    """2 -> 4 on one executor: each new subtask's database is a copy (hard links) of the old
    one holding its range, which drops the rest; nothing is read from the state files. Once a
    batch has committed at 4, the old databases are gone."""
    from keyscale.storage import LocalStore
    from keyscale.storage.scratch import scratch_children, scratch_dir

    h = KeyedHarness.aggregate(key_by=["k"], input_schema="k long", parallelism=2, n=ks.aggregates.count(), state_backend="rocksdb")
    h.process([{"k": k} for k in range(200)])
    loads: list[Any] = []
    copies: list[str | None] = []
    load_chunk, obtain = rocks_task.RocksSession._load_chunk, rocks_task.RocksSession.obtain

    def counting_load(self: rocks_task.RocksSession, *a: Any) -> None:
        loads.append(a)
        load_chunk(self, *a)

    def noting_copy(self: rocks_task.RocksSession, records: Any) -> Any:
        copies.append(self.copied_from)
        return obtain(self, records)

    monkeypatch.setattr(rocks_task.RocksSession, "_load_chunk", counting_load)
    monkeypatch.setattr(rocks_task.RocksSession, "obtain", noting_copy)
    h = h.snapshot().restore(parallelism=4)
    assert _by_k(h.process([{"k": k} for k in range(0, 200, 2)])) == [{"k": k, "n": 2} for k in range(0, 200, 2)]
    assert copies == ["s0-of-2", "s0-of-2", "s1-of-2", "s1-of-2"] and not loads
    run = scratch_dir(rocks_task._plain(LocalStore(h._folder.path).uri), rocks_task._plain("harness"), "harness")
    assert h.process([{"k": 1}]) == [{"k": 1, "n": 2}]
    assert sorted(p.name for p in scratch_children(run)) == [f"s{i}-of-4" for i in range(4)]
    h = h.snapshot().restore(parallelism=2)  # back to 2: each copies the one of its two halves it can
    assert _by_k(h.process([{"k": k} for k in range(200)])) == [{"k": k, "n": 3 if k % 2 == 0 or k == 1 else 2} for k in range(200)]
    assert copies[-2:] == ["s0-of-4", "s2-of-4"] and loads  # the other half of each range: from the files


@pytest.mark.parametrize("snapshot_every", [1, 2, 3])
def test_the_snapshots_rocksdb_writes_restore_on_the_memory_backend(snapshot_every: int) -> None:
    """A RocksDB subtask builds its snapshot from the checkpoint's files and the batch's
    changes, not from its database: what it wrote, read back by the in-memory backend (which
    reads nothing but the files), continues exactly as a job that never left memory."""
    data = _records(7, 10, 30)
    want = _drive(_everything, "memory", data, {}, snapshot_every, _clocks)
    h = _everything(2, "rocksdb")
    h.snapshot_every = snapshot_every
    got = []
    for i, records in enumerate(data):
        if i == 6:
            h.state_backend = "memory"
            h = h.snapshot().restore(parallelism=3)
        _clocks(h, i)
        got.append(h.process(records))
    assert got == want
