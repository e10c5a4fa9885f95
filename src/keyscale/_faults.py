"""The test fault points: every place keyscale's own code can be told to fail on purpose.

A test arms one with ``keyscale run ... --fault <name>:<batch>`` (``start_job(fault=...)``,
hidden from ``--help``): the run's code asks :func:`armed` at each point, and where it is
armed, :func:`fault_point` does what the table says (SIGKILL of the driver or of this
Python worker, an upload refused, nothing more than the caller's delay). The driver
decides what is armed; a task learns it from what it is shipped (``StageTask.fault``,
the Kafka sink's task arguments), by the same names.

:data:`FAULTS` is the list: each name's place, what it simulates and the tests that arm
it. ``tests/test_faults.py`` checks that every name is called in ``src`` and every call
names an entry. Production runs never arm one (``--fault`` is unset).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Literal

Effect = Literal["kill-driver", "kill-this-process", "refuse-upload", "none"]


@dataclass(frozen=True)
class FaultPoint:
    """One entry of :data:`FAULTS`."""

    where: str  # module and function where fault_point(name) is called
    simulates: str
    effect: Effect  # what fault_point does there
    tests: tuple[str, ...]  # the tests that arm it (with --fault <name>:<batch>)


FAULTS: dict[str, FaultPoint] = {
    "mid-batch": FaultPoint(
        "runtime/task/keyed.py, _process (a keyed subtask, its state loaded, before its records)",
        "the driver dies while a batch's tasks run: no output, no checkpoint of the batch", "kill-driver",
        ("tests/runtime/driver/test_crash.py", "tests/runtime/batch/test_async_checkpoints.py", "tests/runtime/test_event_time.py",
         "tests/sinks/test_spark_log.py", "tests/kafka/test_kafka_jobs.py")),
    "in-compaction": FaultPoint(
        "runtime/task/keyed.py, _write_state_file (a keyed subtask about to write a snapshot; armed only if one does)",
        "the driver dies while a subtask writes a snapshot of its range", "kill-driver",
        ("tests/runtime/driver/test_crash.py",)),
    "mid-upload": FaultPoint(
        "runtime/task/upload.py, Upload (a state file's upload thread; with asynchronous checkpoints 3 s after the task ended)",
        "the driver dies while a state file uploads, the subtask's output streaming on", "kill-driver",
        ("tests/runtime/driver/test_crash.py", "tests/runtime/batch/test_async_checkpoints.py", "tests/storage/test_s3_jobs.py",
         "tests/kafka/test_kafka_jobs.py")),
    "worker-dies-mid-upload": FaultPoint(
        "runtime/task/upload.py, Upload (asynchronous checkpoints: 2 s after the task ended)",
        "the Python worker uploading a state file dies after its task reported: the file never appears", "kill-this-process",
        ("tests/runtime/batch/test_async_checkpoints.py",)),
    "slow-upload": FaultPoint(
        "runtime/task/upload.py, Upload (asynchronous checkpoints: 2 s after the task ended)",
        "a state file appears only after its task reported: the commit and the next batch's readers wait for it", "none",
        ("tests/runtime/batch/test_async_checkpoints.py", "tests/runtime/driver/test_recovery.py")),
    "fail-upload": FaultPoint(
        "runtime/task/upload.py, Upload (asynchronous checkpoints: 2 s after the task ended)",
        "the store refuses a state file after its task reported: its failure record ends the waits", "refuse-upload",
        ("tests/runtime/batch/test_async_checkpoints.py",)),
    "after-sink": FaultPoint(
        "runtime/batch/commit.py, run_batch (after the sinks' writes, before the manifest)",
        "the driver dies with a batch's output written and its checkpoint not committed", "kill-driver",
        ("tests/runtime/driver/test_crash.py", "tests/runtime/batch/test_async_checkpoints.py", "tests/runtime/driver/test_drain_restore.py",
         "tests/sinks/test_lakehouse.py", "tests/sinks/test_spark_log.py", "tests/operators/test_connect.py",
         "tests/operators/test_connect_mixed.py", "tests/storage/test_s3_jobs.py", "tests/cli/test_poison_cli.py",
         "tests/cluster/test_s3_cluster.py")),
    "between-sinks": FaultPoint(
        "runtime/batch/commit.py, write_sinks (after the first branch's sink, before the second's)",
        "the driver dies with one branch's output of a batch written and the other's not", "kill-driver",
        ("tests/runtime/test_branches.py",)),
    "kafka-precommit": FaultPoint(
        "kafka/sink.py, _transaction (task 0, its records flushed, before commit_transaction)",
        "the driver dies with a Kafka transaction pre-committed: its successor must end it", "kill-driver",
        ("tests/kafka/test_kafka_jobs.py",)),
    "kafka-postcommit": FaultPoint(
        "kafka/sink.py, _write_task (task 0, its transaction committed, before the other tasks')",
        "the driver dies with part of a batch's Kafka output committed: the replay must keep its plan", "kill-driver",
        ("tests/kafka/test_kafka_exactly_once.py",)),
}


def _entry(name: str) -> FaultPoint:
    found = FAULTS.get(name)
    if found is None:
        raise KeyError(f"no test fault point named {name!r} (keyscale/_faults.py: FAULTS lists them)")
    return found


def armed(fault: str | None, name: str, batch: int) -> bool:
    """Whether the run's ``--fault`` (``"<name>:<batch>"``, or None) asks for fault point
    ``name`` at batch ``batch``. ``name`` must be in :data:`FAULTS`.

    >>> armed("after-sink:2", "after-sink", 2), armed("after-sink:2", "after-sink", 3), armed(None, "mid-batch", 0)
    (True, False, False)
    """
    _entry(name)
    return fault == f"{name}:{batch}"


def fault_point(name: str, driver_pid: int = 0) -> None:
    """Fault point ``name`` is armed and reached: do what :data:`FAULTS` says. A SIGKILL of
    the driver (``driver_pid``; nothing if 0, e.g. a task run without one) is followed by
    a wait, so that the task goes no further while the kill lands; a SIGKILL of this
    process never returns; a refused upload raises :class:`OSError`."""
    effect = _entry(name).effect
    if effect == "kill-driver":
        if driver_pid:
            os.kill(driver_pid, signal.SIGKILL)
            time.sleep(30)
    elif effect == "kill-this-process":
        os.kill(os.getpid(), signal.SIGKILL)
    elif effect == "refuse-upload":
        raise OSError("the store refused the upload (test fault)")
