"""The driver's side of poison records and failed batches, kept apart from the modules that
call it: ``batch/commit.py`` (a failed batch's retry at another parallelism),
``driver/setup.py`` (Spark's task-failure logging quieted) and ``driver/runner.py`` (a
failure's full trace kept).

- Dead letters: each keyed stage under ``on_error="dead_letter"`` returns its poison
  records as a side output of its Spark stage (like late records); the batch plan
  (runtime/batch/stages.py) unions them and writes them with the pipeline's dead-letter sink in the same batch, before the
  manifest commit, so they are exactly-once like any output.
- Counts: each subtask reports its poison records as named counters (``skipped``,
  ``dead_lettered``), logged, shown and totalled with the other counters (runtime/task/counters.py).
- Retry at another parallelism: a batch that failed left an intent (parallelism, time,
  source plan) and no manifest. Restarted with an explicit ``-p`` that differs, the
  intent's keyed stages are re-planned at that parallelism (its time and source plan
  stay): a batch that failed for want of memory can be retried wider. A keyed stage's
  output per key does not depend on its parallelism, so if the failed attempt had already
  written the sink's output, the retry computes the same rows. A sink whose committed part
  of the batch is tied to the batch's tasks (``Sink.plan_bound``: the Kafka sink) keeps
  the retry at its first plan instead (``commit.replay_intent``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from keyscale.checkpoint.intent import BatchIntent
from keyscale.errors import KeyscaleError

if TYPE_CHECKING:
    from keyscale.checkpoint.jobdir import JobDir

log = logging.getLogger("keyscale")


def replan_intent(intent: BatchIntent, parallelism: int | None, keyed: Iterable[str]) -> tuple[BatchIntent, dict[str, tuple[int, int]]]:
    """The intent of an uncommitted batch with its keyed stages at ``parallelism`` (an
    explicit ``-p``); the batch time, the watermark, the source plan (and so the source
    readers' parallelism) and non-keyed stages stay. Returns (intent, {uid: (old, new)})."""
    if parallelism is None:
        return intent, {}
    par = dict(intent.parallelism)
    changed = {uid: (par[uid], parallelism) for uid in keyed if uid in par and par[uid] != parallelism}
    if not changed:
        return intent, {}
    for uid in changed:
        par[uid] = parallelism
    return replace(intent, parallelism=par, replanned_from={u: old for u, (old, _) in changed.items()}), changed


#: Spark loggers that print a failed task's whole trace (200-570 lines, several times) at
#: ERROR level. keyscale reports the failure itself, in one screen; the full text goes to
#: keyscale's log at debug level and to ``JOB_DIR/last-error.txt``.
TASK_FAILURE_LOGGERS = (
    "org.apache.spark.executor.Executor",
    "org.apache.spark.scheduler.TaskSetManager",
    "org.apache.spark.util.Utils",
    "org.apache.spark.sql.execution.datasources.FileFormatWriter",
    "org.apache.spark.sql.execution.streaming.runtime.MicroBatchExecution",
    "org.apache.spark.sql.execution.streaming.MicroBatchExecution",
)


def quiet_task_failures(spark: Any) -> None:
    """Silence Spark's own reports of failed tasks and queries, unless Spark's log was asked
    to be verbose (``keyscale -v``, KEYSCALE_SPARK_LOG_LEVEL other than ERROR/OFF/FATAL)."""
    import os

    if os.environ.get("KEYSCALE_SPARK_LOG_LEVEL", "ERROR").upper() not in ("ERROR", "OFF", "FATAL"):
        return
    try:
        jvm = spark.sparkContext._jvm
        configurator = jvm.org.apache.logging.log4j.core.config.Configurator
        off = jvm.org.apache.logging.log4j.Level.OFF
        for name in TASK_FAILURE_LOGGERS:
            configurator.setLevel(name, off)
    except Exception as e:  # a different logging backend: Spark stays as loud as it was
        log.debug("could not quiet Spark's task-failure logging: %s", e)


def keep_trace(jobdir: JobDir, exc: BaseException) -> None:
    """The full text of a failure (Spark's wrapping included) in the job directory and the
    debug log, while the user sees keyscale's own short error."""
    text = f"{type(exc).__name__}: {exc}"
    log.debug("the batch failed:\n%s", text)
    with contextlib.suppress(OSError, KeyscaleError):
        jobdir.store.put("last-error.txt", (text + "\n").encode(), durable=False)
