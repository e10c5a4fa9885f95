"""Executors are sized for the parallelism every pending rescale asks for (no Spark)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from keyscale.checkpoint.jobdir import JobDir
from keyscale.runtime.batch.jobstate import Scaling
from keyscale.runtime.batch.parallelism import after_requests, executor_wait, size_executors


def test_a_second_operators_decision_keeps_the_executors_the_first_ones_scale_up_waits_for(tmp_path: Path) -> None:
    """The keyed operator asked for 4 and waits for its executors; then the reader decides 2.
    The executors are sized for 4, not 2 (which released two of the four just started)."""
    jd = JobDir(tmp_path / "job")
    jd.claim("job", 128, 128)
    current = {"reader": 1, "totals": 1}
    jd.request_rescale(4, "totals")
    jd.request_rescale(2, "reader")
    assert max(after_requests(current, jd.read_rescale_requests()).values()) == 4


@given(st.dictionaries(st.sampled_from("abcd"), st.integers(1, 64), min_size=1),
       st.dictionaries(st.sampled_from("abcd*"), st.integers(1, 64)))
def test_after_requests_applies_each_request_and_keeps_the_rest(current: dict[str, int], requests: dict[str, int]) -> None:
    after = after_requests(current, requests)
    assert set(after) == set(current)
    for uid, p in after.items():
        assert p == requests.get(uid, requests.get("*", current[uid]))


def test_a_scale_up_waits_until_its_cores_came_or_the_bound_passed() -> None:
    assert executor_wait(3, 4, 29.9, 30.0) == "wait"
    assert executor_wait(4, 4, 0.0, 30.0) == "go"
    assert executor_wait(3, 4, 30.0, 30.0) == "late"


def test_a_scale_up_is_expected_to_wait_as_long_as_the_longest_of_the_last_three() -> None:
    """The autoscaler's lead counts what a scale-up waits for its executors. On one local
    cluster the waits were 7.8-15.8 s (docs/benchmarks.md): a lead of the last wait alone
    came late when the next wait was longer."""
    s = Scaling()
    assert s.executor_start_seconds == 0.0  # none measured yet
    for waited in (15.6, 7.8, 10.3):
        s.executor_waits.append(waited)
    assert s.executor_start_seconds == 15.6
    s.executor_waits.append(9.0)  # 15.6 s is the fourth wait back now: forgotten
    assert s.executor_start_seconds == 10.3


def _sizing_job(pending: Any, tmp_path: Path) -> Any:
    """Just what size_executors reads of a job on a standalone cluster (no Spark)."""
    jd = JobDir(tmp_path / "job")
    jd.claim("job", 128, 128)
    spark = SimpleNamespace(sparkContext=SimpleNamespace(getConf=lambda: {"spark.executor.cores": "1"}))
    return SimpleNamespace(opts=SimpleNamespace(master="spark://cluster:7077"), spark=spark, jobdir=jd,
                           committed=SimpleNamespace(pending=pending), scaling=Scaling())


def test_a_scale_down_releases_executors_once_the_last_batchs_state_files_are_stored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Asynchronous checkpoints: after a batch its Python workers upload its state files on,
    the executors idle to Spark. A scale-down decided then must not kill them before the
    files are stored (a killed executor's uploads never arrive: the commit would wait until
    the upload timeout and fail the run). A scale-up does not wait."""
    from keyscale.cluster import executors

    asked: list[tuple[int, bool]] = []  # (executors asked for, the last batch's files stored by then)
    future: Future[None] = Future()
    monkeypatch.setattr(executors, "executor_cores", lambda spark: 4)
    monkeypatch.setattr(executors, "request_executors", lambda spark, n: asked.append((n, future.done())) or True)

    def uploads() -> None:
        time.sleep(0.3)
        future.set_result(None)

    threading.Thread(target=uploads, daemon=True).start()
    assert size_executors(_sizing_job(SimpleNamespace(batch=7, future=future), tmp_path), {"totals": 2}) is None
    assert asked == [(2, True)]  # released after the files were stored, not before

    asked.clear()
    future = Future()  # uploads still under way: a scale-up asks at once
    assert size_executors(_sizing_job(SimpleNamespace(batch=8, future=future), tmp_path / "up"), {"totals": 6}) == 6
    assert asked == [(6, False)]
    asked.clear()
    future = Future()
    future.set_exception(OSError("the store refused the upload"))  # settle raises it, before the next commit
    assert size_executors(_sizing_job(SimpleNamespace(batch=9, future=future), tmp_path / "failed"), {"totals": 1}) is None
    assert asked == [(1, True)]
