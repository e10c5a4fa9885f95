"""One subtask of a keyed stage, without Spark: ``run_subtask`` driven by a simulated driver.

The driver here does what the real one does between batches: it routes records to the
subtask owning their key group, collects their reports (``TaskReport``), keeps the live state files,
and passes them with ``committed=batch`` to the next batch. Worker processes are simulated
by swapping the module-level cache of warm state (``memory._HELD``, the memory backend's).
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

import keyscale.runtime.task.memory as memory
from keyscale.checkpoint.files import read_state_slice
from keyscale.checkpoint.manifest import StateFile, live_files, restore_files
from keyscale.errors import InputDataError, JobDefinitionError
from keyscale.operators.keyed import KeyedProcessFunction, describe_states
from keyscale.operators.vectorized import RunningAggregate, count
from keyscale.operators.vectorized import sum as ksum
from keyscale.runtime.task.keyed import KG, SEQ, StageTask, run_subtask
from keyscale.state.keygroups import KeyGroupRange, key_group_range
from keyscale.state.spark_hash import key_group_of
from keyscale.state.types import arrow_schema
from keyscale.storage import LocalStore

M = 16
SPARK_TYPES = {pa.string(): "string", pa.int64(): "long"}


@pytest.fixture(autouse=True)
def _clear_held() -> Iterator[None]:
    memory._HELD.clear()
    yield
    memory._HELD.clear()


@contextmanager
def worker(cache: dict[Any, Any]) -> Iterator[None]:
    """Run as the worker process whose warm state is ``cache``."""
    saved = memory._HELD
    memory._HELD = cache
    try:
        yield
    finally:
        memory._HELD = saved


# -- functions under test and their pure-Python references -----------------------------------


class Tracker(KeyedProcessFunction):
    """Value, list and map state; value 0 clears the key (a delete)."""

    def open(self, ctx: Any) -> None:
        self.total = ctx.value_state("total", "long")
        self.recent = ctx.list_state("recent", "long")
        self.parity = ctx.map_state("parity", "string", "long")

    def process_element(self, row: Any, ctx: Any) -> Any:
        if row.value == 0:
            self.total.clear()
            self.recent.clear()
            self.parity.clear()
            return [(ctx.key, row.id, None, [], 0)]
        total = (self.total.value() or 0) + row.value
        self.total.update(total)
        recent = [*self.recent.get(), row.id][-3:]
        self.recent.update(recent)
        p = "even" if row.value % 2 == 0 else "odd"
        self.parity.put(p, (self.parity.get(p) or 0) + 1)
        return [(ctx.key, row.id, total, recent, self.parity.get("even", 0))]


TRACKER_OUT = arrow_schema("key string, id long, total long, recent array<long>, evens long")


def tracker_reference(batches: Sequence[Sequence[dict[str, Any]]]) -> list[list[tuple[Any, ...]]]:
    state: dict[Any, dict[str, Any]] = {}
    out = []
    for rows in batches:
        emitted = []
        for r in sorted(rows, key=lambda r: r[SEQ]):
            k = r["key"]
            if r["value"] == 0:
                state.pop(k, None)
                emitted.append((k, r["id"], None, [], 0))
                continue
            s = state.setdefault(k, {"total": 0, "recent": [], "parity": {}})
            s["total"] += r["value"]
            s["recent"] = [*s["recent"], r["id"]][-3:]
            p = "even" if r["value"] % 2 == 0 else "odd"
            s["parity"][p] = s["parity"].get(p, 0) + 1
            emitted.append((k, r["id"], s["total"], list(s["recent"]), s["parity"].get("even", 0)))
        out.append(sorted(emitted, key=repr))
    return out


def aggregate_reference(batches: Sequence[Sequence[dict[str, Any]]], keys: Sequence[str] = ("key",)) -> list[list[tuple[Any, ...]]]:
    state: dict[Any, list[int]] = {}
    out = []
    for rows in batches:
        touched = []
        for r in rows:
            k = tuple(r[c] for c in keys)
            s = state.setdefault(k, [0, 0])
            s[0] += 1
            s[1] += r["value"]
            if k not in touched:
                touched.append(k)
        out.append(sorted(((*k, *state[k]) for k in touched), key=repr))
    return out


# -- input and the simulated driver ----------------------------------------------------------

INPUT = arrow_schema("key string, value long, id long")


def make_batches(n_batches: int, rows: int, keys: int, seed: int = 0, zeros: bool = True) -> list[list[dict[str, Any]]]:
    """Rows with ``__seq`` (global arrival order) and ``__kg`` as Spark computes them."""
    rnd = random.Random(seed)
    seq = 0
    out = []
    for _ in range(n_batches):
        batch = []
        for _ in range(rows):
            key = f"k{rnd.randrange(keys)}"
            value = rnd.randrange(0 if zeros else 1, 10)
            batch.append({"key": key, "value": value, "id": seq, SEQ: seq, KG: key_group_of([key], ["string"], M)})
            seq += 1
        out.append(batch)
    return out


@dataclass
class Driver:
    """What the real driver does around each batch, for one keyed operator."""

    job_dir: Path
    function: Any
    output_schema: pa.Schema
    key_names: tuple[str, ...] = ("key",)
    input_schema: pa.Schema = INPUT
    uid: str = "op"
    run_id: str = "run-1"
    files: list[StateFile] = field(default_factory=list)
    committed: int = -1
    reports: list[list[dict[str, Any]]] = field(default_factory=list)

    def spec(self, batch: int, p: int, compact: Sequence[bool | KeyGroupRange | None] | None = None, function: Any = None) -> StageTask:
        """``compact``: per subtask, the key groups it snapshots (True: its whole range)."""
        fn = function if function is not None else self.function
        states = fn.state_descriptors() if isinstance(fn, RunningAggregate) else describe_states(fn, self.uid)
        return StageTask(
            store=LocalStore(self.job_dir), run_id=self.run_id, uid=self.uid, function=fn,
            key_names=self.key_names,
            key_types=tuple(self.input_schema.field(k).type for k in self.key_names),
            input_schema=self.input_schema, output_schema=self.output_schema, states=tuple(states),
            null_keys="error", max_parallelism=M, parallelism=p, batch_id=batch,
            batch_time_ms=1_700_000_000_000 + batch * 1000, committed=self.committed,
            files=tuple(self.files),
            snapshot=tuple(key_group_range(i, M, p) if c is True else (c or None) for i, c in enumerate(compact or [None] * p)),
        )

    def run(
        self,
        batch: int,
        rows: Sequence[dict[str, Any]],
        p: int,
        compact: Sequence[bool | KeyGroupRange | None] | None = None,
        shuffle: int | None = None,
        workers: dict[int, dict[Any, Any]] | None = None,
        function: Any = None,
    ) -> tuple[list[pa.Table], list[dict[str, Any]]]:
        """Run every subtask of the batch, then commit it as the driver does."""
        spec = self.spec(batch, p, compact, function)
        outs, reps = [], []
        for i in range(p):
            rng = key_group_range(i, M, p)
            mine = [r for r in rows if rng.start <= r[KG] <= rng.end]
            cache = (workers if workers is not None else {}).get(i, memory._HELD)
            with worker(cache):
                out, rep = run_subtask(spec, iter(to_record_batches(mine, self.input_schema, shuffle)), i)
            assert out.schema == self.output_schema
            outs.append(out)
            reps.append(rep)
        reports = reps
        assert [r.subtask for r in reports] == list(range(p))
        new = [f for r in reports for f in r.state_files()]
        self.files = live_files([*self.files, *new], M)
        self.committed = batch
        self.reports.append(reports)
        return outs, reports


def to_record_batches(rows: Sequence[dict[str, Any]], schema: pa.Schema, shuffle: int | None) -> list[pa.RecordBatch]:
    """The subtask's rows as Arrow record batches, shuffled and split when ``shuffle`` is a seed."""
    rows = list(rows)
    full = pa.schema([*schema, pa.field(SEQ, pa.int64()), pa.field(KG, pa.int32())])
    if shuffle is None:
        return [pa.RecordBatch.from_pylist(rows, schema=full)] if rows else []
    rnd = random.Random(shuffle)
    rnd.shuffle(rows)
    cut = sorted(rnd.sample(range(len(rows) + 1), k=min(2, len(rows) + 1)))
    parts = [rows[: cut[0]], rows[cut[0] : cut[-1]], rows[cut[-1] :]]
    return [pa.RecordBatch.from_pylist(part, schema=full) for part in parts]


def rows_of(outs: Sequence[pa.Table]) -> list[tuple[Any, ...]]:
    return sorted((tuple(r.values()) for t in outs for r in t.to_pylist()), key=repr)


def aggregate_fn(key_names: Sequence[str] = ("key",), schema: pa.Schema = INPUT) -> tuple[RunningAggregate, pa.Schema]:
    fn = RunningAggregate({"count": count(), "total": ksum("value")}, list(key_names), {f.name: f.type for f in schema})
    out = pa.schema([*(schema.field(k) for k in key_names), *fn.output_fields()])
    return fn, out


def tracker_driver(tmp_path: Path, **kw: Any) -> Driver:
    return Driver(tmp_path / "job", Tracker(), TRACKER_OUT, **kw)


def aggregate_driver(tmp_path: Path, **kw: Any) -> Driver:
    fn, out = aggregate_fn()
    return Driver(tmp_path / "job", fn, out, **kw)


DRIVERS = {"aggregate": (aggregate_driver, aggregate_reference), "process": (tracker_driver, tracker_reference)}


# -- results ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", DRIVERS)
def test_outputs_equal_a_python_reference_over_batches(tmp_path: Path, kind: str) -> None:
    make, reference = DRIVERS[kind]
    batches = make_batches(5, 120, 25, seed=1)
    want = reference(batches)
    d = make(tmp_path)
    for b, rows in enumerate(batches):
        outs, reports = d.run(b, rows, 2, shuffle=b)
        assert rows_of(outs) == want[b], f"batch {b}"
        assert sum(r.records for r in reports) == len(rows)
        assert sum(r.emitted for r in reports) == len(want[b])
        assert [r.range for r in reports] == [(0, 7), (8, 15)]


def test_records_of_a_key_arrive_in_seq_order_even_when_shuffled(tmp_path: Path) -> None:
    # ``id`` is unrelated to arrival order here: arrival order is __seq alone.
    rnd = random.Random(5)
    rows = []
    seqs = rnd.sample(range(10_000), 200)
    for i, seq in enumerate(seqs):
        key = f"k{i % 7}"
        rows.append({"key": key, "value": 1 + i % 9, "id": i, SEQ: seq, KG: key_group_of([key], ["string"], M)})
    d = tracker_driver(tmp_path)
    outs, _ = d.run(0, rows, 2, shuffle=3)
    seq_of = {r["id"]: r[SEQ] for r in rows}
    assert rows_of(outs) == tracker_reference([rows])[0]
    for out in outs:
        per_key: dict[str, list[int]] = {}
        for r in out.to_pylist():
            per_key.setdefault(r["key"], []).append(seq_of[r["id"]])
        for key, order in per_key.items():
            assert order == sorted(order), f"records of {key} out of arrival order"
        # keys in order of their first record
        firsts = [v[0] for v in per_key.values()]
        keys_in_output = list(dict.fromkeys(r["key"] for r in out.to_pylist()))
        assert firsts == [per_key[k][0] for k in keys_in_output] and firsts == sorted(firsts)


def test_context_of_process(tmp_path: Path) -> None:
    seen: list[tuple[Any, ...]] = []

    class Probe(KeyedProcessFunction):
        def open(self, ctx: Any) -> None:
            self.n = ctx.value_state("n", "long")
            seen.append(("open", ctx.uid, ctx.subtask_index, ctx.parallelism, ctx.max_parallelism))

        def process(self, key: Any, rows: Sequence[Any], ctx: Any) -> Any:
            self.n.update((self.n.value() or 0) + len(rows))
            seen.append((key, ctx.key_group, ctx.subtask_index, ctx.batch_id, ctx.processing_time, [r.id for r in rows]))
            return [(key, self.n.value())]

    batches = make_batches(2, 30, 6, seed=2)
    d = Driver(tmp_path / "job", Probe(), arrow_schema("key string, n long"), uid="probe")
    for b, rows in enumerate(batches):
        d.run(b, rows, 2)
    opens = [s for s in seen if s[0] == "open" and s[3] == 2]  # (describe_states opens a copy at P=1)
    assert opens == [("open", "probe", i, 2, M) for _ in range(2) for i in range(2)]
    calls = [s for s in seen if s[0] != "open"]
    assert len(calls) == sum(len({r["key"] for r in rows}) for rows in batches)
    for key, kg, sub, batch, ptime, ids in calls:
        assert kg == key_group_of([key], ["string"], M)
        assert sub == kg * 2 // M
        assert ptime == 1_700_000_000_000 + batch * 1000
        assert ids == sorted(r["id"] for r in batches[batch] if r["key"] == key)


def test_subtask_without_records_after_the_first_batch(tmp_path: Path) -> None:
    d = tracker_driver(tmp_path)
    batches = make_batches(3, 40, 10, seed=3)
    want = tracker_reference([batches[0], [], batches[2]])
    d.run(0, batches[0], 2)
    outs, reports = d.run(1, [], 2)
    assert all(o.num_rows == 0 and o.schema == TRACKER_OUT for o in outs)
    assert [(r.records, r.keys, r.emitted, r.file) for r in reports] == [(0, 0, 0, None)] * 2
    outs, reports = d.run(2, batches[2], 2)
    assert rows_of(outs) == want[2]
    assert [r.files_read for r in reports] == [0, 0]  # the empty batch kept the state warm


def test_subtask_without_records_in_the_first_batch(tmp_path: Path) -> None:
    d = tracker_driver(tmp_path)
    rows = [r for r in make_batches(1, 40, 10, seed=3)[0] if r[KG] >= 8]  # nothing for subtask 0
    outs, reports = d.run(0, rows, 2)
    assert outs[0].num_rows == 0 and reports[0].file is None
    assert rows_of(outs) == tracker_reference([rows])[0]


# -- warm state, fresh processes, replays --------------------------------------------------


@pytest.mark.parametrize("kind", DRIVERS)
def test_second_batch_in_the_same_process_reads_nothing(tmp_path: Path, kind: str) -> None:
    make, _ = DRIVERS[kind]
    d = make(tmp_path)
    batches = make_batches(3, 80, 20, seed=4)
    _, first = d.run(0, batches[0], 2)
    assert [(r.loaded_key_groups, r.warm_key_groups, r.files_read) for r in first] == [(8, 0, 0)] * 2
    for b in (1, 2):
        _, reports = d.run(b, batches[b], 2)
        assert [(r.loaded_key_groups, r.warm_key_groups, r.files_read) for r in reports] == [(0, 8, 0)] * 2


@pytest.mark.parametrize("kind", DRIVERS)
@pytest.mark.parametrize("fresh", ["new-run-id", "new-process"])
def test_fresh_process_reloads_from_files(tmp_path: Path, kind: str, fresh: str) -> None:
    make, reference = DRIVERS[kind]
    batches = make_batches(5, 100, 20, seed=6)
    want = reference(batches)
    d = make(tmp_path)
    for b in range(3):
        d.run(b, batches[b], 2)
    if fresh == "new-run-id":
        d.run_id = "run-2"  # the driver restarted; the worker's old copy must not be trusted
    else:
        memory._HELD.clear()
    outs, reports = d.run(3, batches[3], 2)
    assert rows_of(outs) == want[3]
    assert [r.loaded_key_groups for r in reports] == [8, 8]
    assert all(r.files_read >= 1 for r in reports)
    outs, reports = d.run(4, batches[4], 2)
    assert rows_of(outs) == want[4]
    assert [r.files_read for r in reports] == [0, 0]


@pytest.mark.parametrize("fresh", [False, True])
def test_state_keys_count_live_keys(tmp_path: Path, fresh: bool) -> None:
    batches = make_batches(3, 100, 30, seed=7)
    d = tracker_driver(tmp_path)
    for b, rows in enumerate(batches):
        d.run(b, rows, 2)
    if fresh:
        memory._HELD.clear()
    _, reports = d.run(3, [], 2)
    live: set[str] = set()
    for rows in batches:
        for r in sorted(rows, key=lambda r: r[SEQ]):
            (live.discard if r["value"] == 0 else live.add)(r["key"])
    per_subtask = [sum(1 for k in live if key_group_of([k], ["string"], M) * 2 // M == i) for i in range(2)]
    assert [r.state_keys for r in reports] == per_subtask


@pytest.mark.parametrize("kind", DRIVERS)
def test_replayed_batch_computes_the_same(tmp_path: Path, kind: str) -> None:
    """A batch re-run before it was committed (driver failed after the tasks) gives the same output."""
    make, reference = DRIVERS[kind]
    batches = make_batches(3, 80, 15, seed=8)
    want = reference(batches)
    d = make(tmp_path)
    d.run(0, batches[0], 2)
    files, committed = list(d.files), d.committed
    d.run(1, batches[1], 2)  # tasks ran, but the batch is never committed:
    d.files, d.committed = files, committed
    outs, reports = d.run(1, batches[1], 2, shuffle=1)
    assert rows_of(outs) == want[1]
    assert [r.loaded_key_groups for r in reports] == [8, 8]  # held version 1 > committed 0
    outs, _ = d.run(2, batches[2], 2)
    assert rows_of(outs) == want[2]


# -- rescaling -----------------------------------------------------------------------------

SCHEDULE = [2, 2, 2, 1, 4, 4, 3]


def _workers(model: str, batch: int, p: int, pool: dict[int, dict[Any, Any]]) -> dict[int, dict[Any, Any]] | None:
    if model == "one-worker":
        return None
    if model == "worker-per-subtask":
        return {i: pool.setdefault(i, {}) for i in range(p)}
    if model == "rotating":  # key groups bounce between two workers that keep stale copies
        return {i: pool.setdefault((i + batch) % 2, {}) for i in range(p)}
    assert model == "fresh-every-batch"
    return {i: {} for i in range(p)}


@pytest.mark.parametrize("kind", DRIVERS)
@pytest.mark.parametrize("model", ["one-worker", "worker-per-subtask", "rotating", "fresh-every-batch"])
def test_rescale_gives_the_same_outputs_as_p1(tmp_path: Path, kind: str, model: str) -> None:
    make, reference = DRIVERS[kind]
    batches = make_batches(len(SCHEDULE), 90, 30, seed=9)
    want = reference(batches)
    base = make(tmp_path / "p1")
    scaled = make(tmp_path / "scaled")
    pool: dict[int, dict[Any, Any]] = {}
    for b, rows in enumerate(batches):
        ref_outs, _ = base.run(b, rows, 1)
        p = SCHEDULE[b]
        compact = [b == 2 and i == 0 for i in range(p)]  # one subtask compacts before the rescale
        outs, reports = scaled.run(b, rows, p, compact=compact, shuffle=b, workers=_workers(model, b, p, pool))
        assert rows_of(ref_outs) == want[b], f"P=1, batch {b}"
        assert rows_of(outs) == want[b], f"{model}, batch {b} at P={p}"
        assert [r.range for r in reports] == [(r.start, r.end) for r in (key_group_range(i, M, p) for i in range(p))]


def test_rescale_in_one_worker_copies_no_state(tmp_path: Path) -> None:
    d = aggregate_driver(tmp_path)
    batches = make_batches(5, 60, 20, seed=10)
    for b, p in enumerate([2, 2, 2, 1, 4]):
        _, reports = d.run(b, batches[b], p)
        if b > 0:
            assert all(r.files_read == 0 and r.loaded_key_groups == 0 for r in reports), (b, reports)


def test_stale_worker_catches_up_from_deltas(tmp_path: Path) -> None:
    """A worker a few batches behind applies only the deltas since its version."""
    d = aggregate_driver(tmp_path)
    want = aggregate_reference(batches := make_batches(4, 60, 20, seed=11))
    a: dict[Any, Any] = {}
    b_: dict[Any, Any] = {}
    d.run(0, batches[0], 1, workers={0: a})
    d.run(1, batches[1], 1, workers={0: b_})  # b_ loads everything
    d.run(2, batches[2], 1, workers={0: b_})
    outs, reports = d.run(3, batches[3], 1, workers={0: a})  # a holds version 0: needs deltas 1 and 2
    assert rows_of(outs) == want[3]
    assert reports[0].loaded_key_groups == 0 and reports[0].warm_key_groups == M
    assert reports[0].files_read == 2


def _held_key_groups(cache: dict[Any, Any]) -> set[int]:
    return {int(g) for h in cache.values() for g in np.unique(h.table.kg)}


@pytest.mark.parametrize("kind", DRIVERS)
@pytest.mark.parametrize("budget", [0, 1 << 30], ids=["no-stale-copies", "stale-copies-kept"])
def test_subtasks_bouncing_between_two_workers(tmp_path: Path, kind: str, budget: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Subtasks alternate between two workers (as Spark hands tasks to idle workers). With
    no room for stale copies (KEYSCALE_STALE_STATE_MB=0) each worker keeps only the key
    groups it served last and reloads the other range; with room (the default's 256 MB is
    room here), it keeps both and catches up from deltas."""
    monkeypatch.setenv("KEYSCALE_STALE_STATE_MB", str(budget / 2**20))
    make, reference = DRIVERS[kind]
    batches = make_batches(4, 90, 30, seed=12)
    want = reference(batches)
    d = make(tmp_path)
    pool: dict[int, dict[Any, Any]] = {0: {}, 1: {}}
    for b, rows in enumerate(batches):
        outs, reports = d.run(b, rows, 2, workers={i: pool[(i + b) % 2] for i in range(2)})
        assert rows_of(outs) == want[b]
        if not budget:
            assert [r.loaded_key_groups for r in reports] == [8, 8]  # each range comes to the other worker
            for i in range(2):
                rng = key_group_range(i, M, 2)
                assert _held_key_groups(pool[(i + b) % 2]) <= set(range(rng.start, rng.end + 1))
        elif b >= 2:  # both workers hold both ranges, a batch behind
            assert [(r.loaded_key_groups, r.files_read) for r in reports] == [(0, 1), (0, 1)]


@pytest.mark.parametrize("budget", [0, 1 << 30], ids=["no-stale-copies", "stale-copies-kept"])
def test_a_swap_after_many_batches_on_the_same_workers(tmp_path: Path, budget: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reported (docs/benchmarks.md, "Worker swaps at 10M keys"): subtasks stay on the same
    workers for a run of batches, then swap. Within the budget a worker's copy of the other
    range is kept however long ago it served it, so the swap catches up from the deltas
    since; with no budget it reloads."""
    monkeypatch.setenv("KEYSCALE_STALE_STATE_MB", str(budget / 2**20))
    batches = make_batches(8, 90, 30, seed=21)
    want = aggregate_reference(batches)
    d = aggregate_driver(tmp_path)
    w = [{}, {}]  # type: list[dict[Any, Any]]
    swapped = [0, 1, 1, 1, 1, 1, 1, 0]  # batch 1 swaps (each worker gets the other range), batch 7 swaps back
    for b, rows in enumerate(batches):
        outs, reports = d.run(b, rows, 2, workers={i: w[(i + swapped[b]) % 2] for i in range(2)})
        assert rows_of(outs) == want[b]
        if b == 7:
            if budget:  # held at batch 0, six deltas behind
                assert [(r.loaded_key_groups, r.files_read) for r in reports] == [(0, 6), (0, 6)]
            else:
                assert [r.loaded_key_groups for r in reports] == [8, 8]


def test_a_worker_running_several_subtasks_of_a_batch_keeps_them_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One worker, both subtasks of each batch: the second subtask's key groups are not
    stale when the first subtask ends, however small the budget."""
    monkeypatch.setenv("KEYSCALE_STALE_STATE_MB", "0")
    d = aggregate_driver(tmp_path)
    batches = make_batches(3, 80, 20, seed=4)
    want = aggregate_reference(batches)
    for b, rows in enumerate(batches):
        outs, reports = d.run(b, rows, 2)
        assert rows_of(outs) == want[b]
        if b:
            assert [(r.loaded_key_groups, r.files_read) for r in reports] == [(0, 0), (0, 0)]


@pytest.mark.parametrize("kind", DRIVERS)
def test_multi_column_keys(tmp_path: Path, kind: str) -> None:
    schema = arrow_schema("key string, n long, value long, id long")
    rnd = random.Random(12)
    batches = []
    seq = 0
    for _ in range(4):
        rows = []
        for _ in range(80):
            key, n = f"k{rnd.randrange(5)}", rnd.randrange(-2, 3)
            rows.append({"key": key, "n": n, "value": rnd.randrange(1, 9), "id": seq, SEQ: seq,
                         KG: key_group_of([key, n], ["string", "long"], M)})
            seq += 1
        batches.append(rows)
    if kind == "aggregate":
        fn, out = aggregate_fn(("key", "n"), schema)
        want = aggregate_reference(batches, ("key", "n"))
    else:
        class Pairs(KeyedProcessFunction):
            def open(self, ctx: Any) -> None:
                self.ids = ctx.list_state("ids", "long")

            def process(self, key: Any, rows: Sequence[Any], ctx: Any) -> Any:
                self.ids.add_all(r.id for r in rows)
                return [{"key": key[0], "n": key[1], "ids": self.ids.get()}]

        fn, out = Pairs(), arrow_schema("key string, n long, ids array<long>")
        hist: dict[tuple[str, int], list[int]] = {}
        want = []
        for rows in batches:
            touched = {}
            for r in rows:
                k = (r["key"], r["n"])
                hist.setdefault(k, []).append(r["id"])
                touched[k] = None
            want.append(sorted(((k[0], k[1], list(hist[k])) for k in touched), key=repr))
    d = Driver(tmp_path / "job", fn, out, key_names=("key", "n"), input_schema=schema)
    for b, (rows, p) in enumerate(zip(batches, [2, 1, 4, 3], strict=True)):
        if b == 2:
            memory._HELD.clear()
        outs, _ = d.run(b, rows, p, shuffle=b)
        assert rows_of(outs) == want[b], f"batch {b}"


@pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning")
def test_aggregate_over_null_values() -> None:
    from keyscale.testing import KeyedHarness

    h = KeyedHarness.aggregate(key_by=["key"], input_schema=INPUT, count=count(), total=ksum("value"))
    assert h.process([{"key": "a", "value": v, "id": i} for i, v in enumerate([3, None, 4])]) == [{"key": "a", "count": 3, "total": 7}]
    assert h.process([{"key": "b", "value": None, "id": 3}]) == [{"key": "b", "count": 1, "total": None}]  # only nulls: null, as in SQL


# -- compaction ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", DRIVERS)
def test_compaction_writes_a_snapshot_and_restores_from_it(tmp_path: Path, kind: str) -> None:
    make, reference = DRIVERS[kind]
    batches = make_batches(5, 100, 25, seed=13)
    want = reference(batches)
    d = make(tmp_path)
    d.run(0, batches[0], 2)
    d.run(1, batches[1], 2)
    assert {f.kind for f in d.files} == {"delta"} and len(d.files) == 4
    outs, reports = d.run(2, batches[2], 2, compact=[True, True])
    assert rows_of(outs) == want[2]
    snaps = [r.file for r in reports]
    assert [(f.kind, f.batch, f.start, f.end) for f in snaps] == [("snapshot", 2, 0, 7), ("snapshot", 2, 8, 15)]
    assert [f.rows for f in snaps] == [r.state_keys for r in reports]  # deleted keys are not in it
    assert [f.deltas_since for f in snaps] == [0, 0]  # no snapshot before: copies of batch 0 on catch up
    companions = [r.companion for r in reports]
    assert [(f.kind, f.batch, f.range) for f in companions if f] == [("delta", 2, f.range) for f in snaps]
    # A restore needs only the snapshots; the deltas since batch 0 stay for copies that old.
    assert restore_files(d.files, M) == snaps
    assert sorted((f.batch, f.kind) for f in d.files) == [(1, "delta")] * 2 + [(2, "delta")] * 2 + [(2, "snapshot")] * 2
    for f in snaps:  # a snapshot holds no all-null (deleted) rows
        table = read_state_slice(d.job_dir, f, f.range, verify=True)
        states = [c for c in table.column_names if c not in ("key", KG)]
        assert all(any(r[c] is not None for c in states) for r in table.to_pylist())
    memory._HELD.clear()  # a fresh process restores from the snapshots
    outs, reports = d.run(3, batches[3], 2)
    assert rows_of(outs) == want[3]
    assert [r.files_read for r in reports] == [1, 1]
    outs, reports = d.run(4, batches[4], 2, compact=[False, True])
    assert rows_of(outs) == want[4]
    assert [r.file.kind for r in reports] == ["delta", "snapshot"]


@pytest.mark.parametrize("kind", DRIVERS)
@pytest.mark.parametrize("model", ["rotating", "fresh-every-batch"])
def test_snapshots_of_a_slice_a_batch_give_the_models_outputs_and_bound_the_chains(
    tmp_path: Path, kind: str, model: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Compaction as the driver plans it (``retention.snapshot_range``: each batch a slice of
    each subtask's range, in turn; here every key group counts as a large state), through
    rescales and workers that keep, swap or lose their copies: every batch's output is the
    model's, no restore chain grows past ``max_chain`` files, and at a steady parallelism a
    snapshot holds one slice."""
    import keyscale.checkpoint.retention as retention
    from keyscale.checkpoint.manifest import chain_length, chains
    from keyscale.checkpoint.retention import snapshot_range

    monkeypatch.setattr(retention, "SLICE_ROWS", 1)

    make, reference = DRIVERS[kind]
    schedule = [2] * 7 + [3] * 7 + [1] * 6
    batches = make_batches(len(schedule), 90, 30, seed=23)
    want = reference(batches)
    d = make(tmp_path)
    pool: dict[int, dict[Any, Any]] = {}
    max_chain = 4
    for b, (rows, p) in enumerate(zip(batches, schedule, strict=True)):
        ranges = [key_group_range(i, M, p) for i in range(p)]
        plan = [snapshot_range(r, b, chains(d.files, r), max_chain, max_age=32) for r in ranges]
        outs, reports = d.run(b, rows, p, compact=plan, shuffle=b, workers=_workers(model, b, p, pool))
        assert rows_of(outs) == want[b], f"{model}, batch {b} at P={p}"
        assert [(r.file.start, r.file.end) for r, part in zip(reports, plan, strict=True) if part] == [(x.start, x.end) for x in plan if x]
        assert chain_length(d.files, KeyGroupRange(0, M - 1), M) <= max_chain
        if b >= max_chain and set(schedule[b - max_chain : b]) == {p}:  # a slice's turn has come since a rescale moved it
            assert all(len(x) <= -(-len(r) // max_chain) for x, r in zip(plan, ranges, strict=True) if x), (b, plan)


@pytest.mark.parametrize("kind", DRIVERS)
def test_a_stale_worker_catches_up_across_one_snapshot(tmp_path: Path, kind: str) -> None:
    """Reported (docs/benchmarks.md, "Worker swaps at 10M keys"): a worker's copy from before
    a snapshot reloaded the whole range. The snapshot's batch also writes its changes as a
    delta, and the deltas since the snapshot before it stay live: a copy from after that one
    catches up across the snapshot on deltas; a copy older than two snapshots reloads."""
    make, reference = DRIVERS[kind]
    batches = make_batches(7, 80, 20, seed=14)
    want = reference(batches)
    d = make(tmp_path)
    a: dict[Any, Any] = {}
    b_: dict[Any, Any] = {}
    d.run(0, batches[0], 1, workers={0: a})
    d.run(1, batches[1], 1, workers={0: b_}, compact=[True])
    d.run(2, batches[2], 1, workers={0: b_})
    outs, reports = d.run(3, batches[3], 1, workers={0: a})  # a holds batch 0: deltas 1 (the companion), 2
    assert rows_of(outs) == want[3]
    assert (reports[0].loaded_key_groups, reports[0].files_read) == (0, 2)
    d.run(4, batches[4], 1, workers={0: b_}, compact=[True])  # keeps the deltas since the snapshot of batch 1
    outs, reports = d.run(5, batches[5], 1, workers={0: a})  # a holds batch 3: the companion of 4
    assert rows_of(outs) == want[5]
    assert (reports[0].loaded_key_groups, reports[0].files_read) == (0, 1)
    # Two snapshots since a copy: the deltas before the second's deltas_since are gone.
    d2 = make(tmp_path / "two")
    a, b_ = {}, {}
    d2.run(0, batches[0], 1, workers={0: a})
    d2.run(1, batches[1], 1, workers={0: b_}, compact=[True])
    d2.run(2, batches[2], 1, workers={0: b_}, compact=[True])
    assert [f.batch for f in d2.files if f.kind == "delta"] == [2]
    outs, reports = d2.run(3, batches[3], 1, workers={0: a})
    assert rows_of(outs) == want[3]
    assert (reports[0].loaded_key_groups, reports[0].files_read) == (M, 1)


@pytest.mark.parametrize("kind", DRIVERS)
def test_state_files_for_an_object_store_are_compressed_and_restore_alike(
    tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A task writing to an object store LZ4-compresses its deltas and snapshots
    (``encode.compressed_on``; the stores here are local folders told they are not): fewer
    bytes than the same batches uncompressed, and a worker with no copy restores from them
    and from a mix of both kinds to the model's state."""
    import keyscale.runtime.task.keyed as keyed

    make, reference = DRIVERS[kind]
    batches = make_batches(5, 200, 150, seed=21)
    want = reference(batches)
    sizes = {}
    for compressed in (False, True):
        monkeypatch.setattr(keyed, "compressed_on", lambda store, c=compressed: c)
        d = make(tmp_path / str(compressed))
        d.run(0, batches[0], 1, workers={0: {}})
        d.run(1, batches[1], 1, workers={0: {}}, compact=[True])
        sizes[compressed] = sum(f.bytes for f in d.files)
        monkeypatch.setattr(keyed, "compressed_on", lambda store, c=not compressed: c)  # the next file of the other kind
        d.run(2, batches[2], 1, workers={0: {}})
        outs, reports = d.run(3, batches[3], 1, workers={0: {}})  # a new worker: loads the snapshot and the deltas
        assert rows_of(outs) == want[3]
        assert reports[0].loaded_key_groups == M
    assert sizes[True] < 0.8 * sizes[False], sizes


# -- errors --------------------------------------------------------------------------------


def test_null_key_raises_input_data_error_naming_the_column(tmp_path: Path) -> None:
    d = aggregate_driver(tmp_path, uid="counts")
    rows = [{"key": None, "value": 1, "id": 0, SEQ: 0, KG: 0}, {"key": "a", "value": 1, "id": 1, SEQ: 1, KG: 0}]
    with pytest.raises(InputDataError, match=r"null key in column 'key' of operator 'counts'.*1 records"):
        d.run(0, rows, 1)


def test_null_in_second_key_column_names_it(tmp_path: Path) -> None:
    schema = arrow_schema("key string, n long, value long, id long")
    fn, out = aggregate_fn(("key", "n"), schema)
    d = Driver(tmp_path / "job", fn, out, key_names=("key", "n"), input_schema=schema, uid="pairs")
    rows = [{"key": "a", "n": None, "value": 1, "id": 0, SEQ: 0, KG: 3}]
    with pytest.raises(InputDataError, match=r"column 'n' of operator 'pairs'"):
        d.run(0, rows, 1)


class Flaky(Tracker):
    """Emits rows of the wrong width while ``broken``."""

    broken = True

    def process_element(self, row: Any, ctx: Any) -> Any:
        out = super().process_element(row, ctx)
        if self.broken:
            return [(ctx.key, row.id)]
        return out


def test_wrong_width_raises_job_definition_error_naming_the_operator(tmp_path: Path) -> None:
    d = Driver(tmp_path / "job", Flaky(), TRACKER_OUT, uid="alerts")
    with pytest.raises(JobDefinitionError, match=r"operator 'alerts' emitted a row with 2 values, its output schema has 5"):
        d.run(0, make_batches(1, 10, 3)[0], 1)


def test_failed_attempt_leaves_no_warm_state_claiming_its_version(tmp_path: Path) -> None:
    batches = make_batches(3, 80, 15, seed=15)
    want = tracker_reference(batches)
    fn = Flaky()
    fn.broken = False
    d = Driver(tmp_path / "job", fn, TRACKER_OUT)
    d.run(0, batches[0], 2)
    fn.broken = True  # batch 1 fails after its state was updated in memory
    with pytest.raises(JobDefinitionError):
        d.run(1, batches[1], 2)
    fn.broken = False  # the retried attempt (same process) must not see the failed one's updates
    outs, reports = d.run(1, batches[1], 2)
    assert rows_of(outs) == want[1]
    assert reports[0].loaded_key_groups == 8
    outs, _ = d.run(2, batches[2], 2)
    assert rows_of(outs) == want[2]


def test_report_names_the_subtask_and_its_state_file(tmp_path: Path) -> None:
    from keyscale.errors import KeyscaleError
    from keyscale.runtime.task.report import Reports, send

    d = aggregate_driver(tmp_path)
    _, reports = d.run(0, make_batches(1, 30, 5)[0], 2)
    assert [(r.subtask, r.range is not None, r.busy_seconds > 0) for r in reports] == [(0, True, True), (1, True, True)]
    collector = Reports()
    for r in reports:
        send(collector.sender, "op", 0, r.subtask, r)
    assert collector.take("op", 0, 2) == reports
    with pytest.raises(KeyscaleError, match="subtask 2 of operator 'op' did not report for batch 0"):
        collector.take("op", 0, 3)
    collector.forget(0)
    with pytest.raises(KeyscaleError, match="subtask 0 of operator 'op' did not report"):
        collector.take("op", 0, 2)
    f = reports[0].file
    assert (d.job_dir / f.path).exists() and f.range == KeyGroupRange(0, 7)
    assert np.all(read_state_slice(d.job_dir, f, f.range).column(KG).to_numpy() <= 7)


# -- state TTL and processing-time timers (batch time: 1 s per batch in this driver) -----------


class Remember(KeyedProcessFunction):
    """Remembers the last id per key with a 2.5 s TTL; a record with value 0 only reads."""

    def __init__(self, refresh: str = "on_write"):
        self.refresh = refresh

    def open(self, ctx: Any) -> None:
        self.last = ctx.value_state("last", "long", ttl_seconds=2.5, ttl_refresh=self.refresh)

    def process_element(self, row: Any, ctx: Any) -> Any:
        before = self.last.value()
        if row.value:
            self.last.update(row.id)
        return [(ctx.key, row.id, before)]


REMEMBER_OUT = arrow_schema("key string, id long, before long")


def _row(key: str, value: int, i: int) -> dict[str, Any]:
    return {"key": key, "value": value, "id": i, SEQ: i, KG: key_group_of([key], ["string"], M)}


@pytest.mark.parametrize(("refresh", "seen_at_3"), [("on_write", None), ("on_read_and_write", 0)])
def test_ttl_expires_values_for_reads(tmp_path: Path, refresh: str, seen_at_3: int | None) -> None:
    d = Driver(tmp_path, Remember(refresh), REMEMBER_OUT)
    d.run(0, [_row("a", 1, 0)], 1)  # written at t0
    outs, _ = d.run(1, [_row("a", 0, 1)], 1)  # read at t0 + 1 s
    assert rows_of(outs) == [("a", 1, 0)]
    d.run(2, [], 1)
    outs, _ = d.run(3, [_row("a", 0, 3)], 1)  # t0 + 3 s: 2.5 s after the write, 2 s after the read
    assert rows_of(outs) == [("a", 3, seen_at_3)]


def test_expired_state_is_removed_from_memory_and_checkpoint(tmp_path: Path) -> None:
    d = Driver(tmp_path, Remember(), REMEMBER_OUT)
    d.run(0, [_row("a", 1, 0), _row("b", 1, 1)], 2)
    d.run(2, [_row("b", 1, 2)], 2)  # b is written again at t0 + 2 s, a is not
    _, reports = d.run(3, [], 2)  # t0 + 3 s: a expires; nobody read it
    assert sum(r.state_keys for r in reports) == 1
    assert any(r.file for r in reports)  # the expiry is written as a delete, incrementally
    _, reports = d.run(4, [], 2, compact=[True, True])
    snaps = [f for f in d.files if f.kind == "snapshot"]
    keys = [k for f in snaps for k in read_state_slice(d.job_dir, f, f.range).column("key").to_pylist()]
    assert keys == ["b"]  # the snapshot holds no trace of a (the deltas kept beside it for copies do)
    with worker({}):  # a fresh worker restoring from the checkpoint does not see a either
        outs, _ = d.run(5, [_row("a", 0, 9)], 2, workers={0: {}, 1: {}})
    assert rows_of(outs) == [("a", 9, None)]


class Ticker(KeyedProcessFunction):
    """A processing-time timer 2 s after each record; the firing reports the batch time."""

    def process_element(self, row: Any, ctx: Any) -> Any:
        ctx.timer_service.register_processing_time_timer(ctx.processing_time + 2000)
        return []

    def on_timer(self, key: Any, timestamp: int, ctx: Any) -> Any:
        yield (key, timestamp, ctx.processing_time, ctx.time_domain)


def test_processing_time_timers_fire_at_the_first_batch_reaching_them(tmp_path: Path) -> None:
    d = Driver(tmp_path, Ticker(), arrow_schema("key string, at long, now long, domain string"))
    t0 = 1_700_000_000_000
    fired = [rows_of(d.run(b, [_row("a", 1, b)] if b < 2 else [], 2)[0]) for b in range(5)]
    assert fired == [[], [], [("a", t0 + 2000, t0 + 2000, "processing_time")], [("a", t0 + 3000, t0 + 3000, "processing_time")], []]


def test_timers_need_on_timer(tmp_path: Path) -> None:
    class NoHandler(KeyedProcessFunction):
        def process_element(self, row: Any, ctx: Any) -> Any:
            ctx.timer_service.register_event_time_timer(5)
            return []

    d = Driver(tmp_path, NoHandler(), REMEMBER_OUT)
    with pytest.raises(JobDefinitionError, match="on_timer"):
        d.run(0, [_row("a", 1, 0)], 1)


def test_an_event_time_stage_reports_no_far_future_maximum_and_counts_it(tmp_path: Path) -> None:
    """Issue 10, case 7: the first event-time stage's report feeds the watermark (Spark sources)."""
    from dataclasses import replace

    d = aggregate_driver(tmp_path)
    rows = [{"key": k, "value": v, "id": i, SEQ: i, KG: key_group_of([k], ["string"], M)}
            for i, (k, v) in enumerate([("a", 1_000), ("b", 253_402_300_799_000), ("c", 2_000)])]
    spec = replace(d.spec(0, 1), event_time="value", event_time_limit_ms=10_000)
    out, report = run_subtask(spec, iter(to_record_batches(rows, INPUT, None)), 0)
    assert out.num_rows == 3  # a running aggregate still counts every record
    assert report.max_event_ms == 2_000
    assert report.counters == {"too_far_ahead": 1}


def test_dropped_null_keys_are_counted(tmp_path: Path) -> None:
    """``null_keys="drop"`` drops in the task, where the drop is counted (issue 10, case 8)."""
    from dataclasses import replace

    d = aggregate_driver(tmp_path)
    rows = [{"key": k, "value": 1, "id": i, SEQ: i, KG: 0} for i, k in enumerate(["a", None, "a", None])]
    spec = replace(d.spec(0, 1), null_keys="drop")
    out, report = run_subtask(spec, iter(to_record_batches(rows, INPUT, None)), 0)
    assert out.to_pylist() == [{"key": "a", "count": 2, "total": 2}]
    assert report.counters == {"dropped_null_keys": 2} and report.records == 4


# -- two attempts of one subtask (speculation, a zombie task set) --------------------------------


class Sampled(KeyedProcessFunction):
    """Keeps a random sample per key: two attempts of one batch write different state."""

    def open(self, ctx: Any) -> None:
        self.pick = ctx.value_state("pick", "double")

    def process_element(self, row: Any, ctx: Any) -> Any:
        self.pick.update(random.random())
        return [(ctx.key, row.id)]


@pytest.mark.parametrize("last", ["first", "second"])
def test_two_attempts_of_a_subtask_leave_reports_naming_files_that_match(tmp_path: Path, last: str) -> None:
    """Whichever attempt's report the driver takes names a state file that exists with its size and crc."""
    from keyscale.checkpoint.files import verify_state_file
    from keyscale.runtime.task.report import Reports, send

    d = Driver(tmp_path / "job", Sampled(), arrow_schema("key string, id long"))
    batches = make_batches(2, 80, 12, seed=21)
    d.run(0, batches[0], 1)
    spec = d.spec(1, 1)
    # Attempt A and a speculative attempt B of batch 1 run in two workers; both write their
    # state and both report (Spark carries the reports of both successful attempts).
    _, rep_a = run_subtask(spec, iter(to_record_batches(batches[1], d.input_schema, None)), 0)
    with worker({}):
        _, rep_b = run_subtask(spec, iter(to_record_batches(batches[1], d.input_schema, None)), 0)
    assert rep_a.file != rep_b.file  # each attempt its own file
    collector = Reports()
    for rep in ([rep_b, rep_a] if last == "first" else [rep_a, rep_b]):
        send(collector.sender, d.uid, 1, 0, rep)
    survivor = collector.take(d.uid, 1, 1)[0]
    assert survivor.file == (rep_a if last == "first" else rep_b).file
    assert verify_state_file(d.job_dir, survivor.file) is None
    assert verify_state_file(d.job_dir, rep_b.file) is None
