"""The task's one interface to its state backends: both implementations, driven as a task
drives them (load, the table, write back, snapshot, finish), hold the same state."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from keyscale.checkpoint.manifest import StateFile
from keyscale.operators.vectorized import RunningAggregate, count
from keyscale.runtime.task import memory
from keyscale.runtime.task.backend import TaskStateBackend
from keyscale.runtime.task.keyed import KG, SEQ, StageTask, open_backend, run_subtask
from keyscale.runtime.task.memory import MemoryBackend
from keyscale.state.keygroups import KeyGroupRange, key_group_range
from keyscale.state.spark_hash import key_group_of
from keyscale.storage import LocalStore

M = 8
INPUT = pa.schema([("key", pa.int64())])
BACKENDS = ["memory", "rocksdb"]


@pytest.fixture(autouse=True)
def _fresh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("KEYSCALE_LOCAL_DIR", str(tmp_path / "local"))
    memory._HELD.clear()
    yield
    memory._HELD.clear()


def _spec(job: Path, backend: str, batch: int, files: tuple[StateFile, ...] = (), compact: bool = False) -> StageTask:
    fn = RunningAggregate({"n": count()}, ["key"], {"key": pa.int64()})
    return StageTask(
        store=LocalStore(job), run_id="run", uid="op", function=fn, key_names=("key",), key_types=(pa.int64(),),
        input_schema=INPUT, output_schema=pa.schema([("key", pa.int64()), *fn.output_fields()]),
        states=tuple(fn.state_descriptors()), null_keys="error", max_parallelism=M, parallelism=1, batch_id=batch,
        batch_time_ms=1_700_000_000_000, committed=batch - 1, files=files,
        snapshot=(KeyGroupRange(0, M - 1) if compact else None,), state_backend=backend,
    )


def _records(keys: list[int]) -> pa.Table:
    return pa.table({
        "key": pa.array(keys, pa.int64()),
        SEQ: pa.array(range(len(keys)), pa.int64()),
        KG: pa.array([key_group_of([k], ["long"], M) for k in keys], pa.int32()),
    })


def _first_batch(job: Path, backend: str) -> StateFile:
    _, report = run_subtask(_spec(job, backend, 0), iter(_records([1, 2, 3, 3]).to_batches()), 0)
    assert report.file is not None
    return report.file


def _counts(parts: Any) -> dict[int, int]:
    t = pa.concat_tables(list(parts))
    return dict(zip(t.column("key").to_pylist(), t.column("n").to_pylist(), strict=True))


@pytest.mark.parametrize("backend", BACKENDS)
def test_both_backends_hold_the_same_state_through_the_interface(tmp_path: Path, backend: str) -> None:
    job = tmp_path / "job"
    spec = _spec(job, backend, 1, files=(_first_batch(job, backend),), compact=True)
    rng = key_group_range(0, M, 1)
    records = _records([3])
    b: TaskStateBackend = open_backend(spec, rng, 0, lambda: records)
    assert isinstance(b, MemoryBackend) == (backend == "memory")
    try:
        stats = b.load(lambda: records)
        assert stats["files_read"] == 0  # held at the committed batch: in the worker, in the database
        assert len(b.table) == (3 if backend == "memory" else 1)  # the whole range, or the batch's working set
        b.write_back(np.empty(0, dtype=np.intp))
        assert _counts(b.snapshot(np.empty(0, dtype=np.intp), rng)) == {1: 1, 2: 1, 3: 2}
        some = KeyGroupRange(key_group_of([3], ["long"], M), M - 1)  # part of the range: a slice's snapshot
        want = {k: n for k, n in {1: 1, 2: 1, 3: 2}.items() if key_group_of([k], ["long"], M) in some}
        assert 0 < len(want) < 3 and _counts(b.snapshot(np.empty(0, dtype=np.intp), some)) == want
        b.finish(1)
        assert b.state_keys() == 3
    finally:
        b.close()


def test_the_memory_backend_claims_no_version_until_it_finishes(tmp_path: Path) -> None:
    """A task that fails between load and finish leaves the worker's copy of its range
    unusable: the next attempt reloads it instead of trusting a half-applied batch."""
    job = tmp_path / "job"
    spec = _spec(job, "memory", 1, files=(_first_batch(job, "memory"),))
    rng = key_group_range(0, M, 1)
    b = MemoryBackend(spec, rng)
    b.load(lambda: pa.table({}))
    (held,) = memory._HELD.values()
    assert (held.version == -1).all()
    b.finish(1)
    assert (held.version == 1).all() and b.state_keys() == 3
