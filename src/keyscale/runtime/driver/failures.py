"""When a run fails (driver process): the error the user sees, the record the status keeps,
the background commit let finish, and damaged state reported for the next start.

A task's failure reaches the driver wrapped by Spark and Py4J; :func:`translate` turns it back
into the keyscale error it started as (or names what the workers lack), so the user reads
their own error and not a Java stack. The rest runs once, on the way out of
:meth:`~keyscale.runtime.driver.runner.JobRunner.run`.
"""

from __future__ import annotations

import logging
import time
import traceback
from typing import Any

from keyscale.errors import KeyscaleError, StateError, decode_error
from keyscale.operators.poison import input_error
from keyscale.runtime.batch import commit
from keyscale.runtime.batch.jobstate import JobState
from keyscale.runtime.driver.session import crashed_worker, missing_keyscale
from keyscale.runtime.driver.shipping import unimportable_module

log = logging.getLogger("keyscale")


class StopRequested(Exception):
    """Raised by a batch that begins after a stop request: Spark must not commit it."""


def translate(exc: BaseException) -> BaseException:
    """Turn a Spark-wrapped task failure back into the keyscale error it started as."""
    from keyscale import errors

    if isinstance(exc, KeyscaleError):
        return exc
    text = str(exc)
    found = decode_error(text)
    if found:
        cls = getattr(errors, found[0], KeyscaleError)
        return cls(found[1])  # type: ignore[no-any-return]
    no_keyscale = missing_keyscale(text, _python_of_workers())
    if no_keyscale:
        return errors.KeyscaleError(no_keyscale)
    unimportable = unimportable_module(text, _python_of_workers())
    if unimportable:
        log.debug("the workers' error:\n%s", text)
        return errors.KeyscaleError(unimportable)
    crashed = crashed_worker(text)
    if crashed:
        return errors.KeyscaleError(crashed)
    unreadable = input_error(text)
    if unreadable:
        log.debug("Spark's error reading the input:\n%s", text)
        return errors.InputDataError(unreadable)
    return exc


def _python_of_workers() -> str:
    from pyspark import SparkContext

    sc = SparkContext._active_spark_context
    return str(sc.pythonExec) if sc is not None else "python3"


def failure_record(job: JobState, exc: BaseException) -> dict[str, Any]:
    """What the status shows of a failed run until the next start: the error, its
    traceback, the batch it failed in and when."""
    return {
        "message": f"{type(exc).__name__}: {exc}" if not isinstance(exc, KeyscaleError) else str(exc),
        "traceback": "".join(traceback.format_exception(exc)),
        "batch": job.committed.manifest.batch + 1 if job.committed.manifest else 0,
        "time_ms": int(time.time() * 1000),
    }


def settle_after_failure(job: JobState) -> None:
    """A batch failed while the one before it commits in the background: let that commit
    finish, so the next start need not replay it."""
    # Under the batch lock, as every settle. Whoever holds it now (a savepoint; a batch
    # still running after Ctrl-C) settles the pending commit itself before it goes on:
    # waiting here briefly is enough, and never for a whole batch.
    if not job.batch_lock.acquire(timeout=5):
        waiting = job.committed.pending  # read once: the holder may take it meanwhile
        if waiting is not None:
            log.info("the checkpoint of batch %d commits in the batch or savepoint still running (else the next start replays it)",
                     waiting.batch)
        return
    pending = job.committed.pending
    try:
        commit.settle(job)
    except Exception:  # the job's own error is what to report
        assert pending is not None
        log.warning("the checkpoint of batch %d did not commit either; the next start replays that batch", pending.batch)
    finally:
        job.batch_lock.release()


def report_damage(job: JobState, exc: BaseException) -> None:
    """A task found a state file damaged in place (recovery on an object store checks sizes
    only): the next start then checks every state file in full, so it falls back to the
    newest intact checkpoint (or refuses) instead of failing on the same file again."""
    if not (isinstance(exc, StateError) and str(exc).startswith("state file ") and not job.jobdir.is_local):
        return
    try:
        job.jobdir.report_damage(str(exc))
        log.warning("the next start checks every state file of the checkpoints in full and resumes from the newest intact one")
    except Exception as report_failed:  # the store failing now: the job's own error is what to report
        log.warning("could not record the damage for the next start (%s)", report_failed)
