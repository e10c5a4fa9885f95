"""A job started from Python on the caller's own SparkSession, and the handle that controls it
(driver process, the caller's).

:meth:`keyscale.Pipeline.start` calls :func:`start_job`, which builds a
:class:`~keyscale.runtime.driver.runner.JobRunner` for a pipeline the caller built (no job
file, no session of keyscale's own), served by the control API (:func:`.server.control_api`),
and runs it in a background thread of the caller's process; the returned :class:`JobHandle`
does what the control API does, in-process, through the same protocol
(:class:`.running.RunningJob`). The control API runs as well, so ``keyscale status``,
``keyscale rescale`` and ``keyscale stop`` work on such a job from a terminal. Only
:func:`start_job` names the runner: it wires the floors below together.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any

from keyscale._keywords import unknown_keyword
from keyscale.errors import KeyscaleError
from keyscale.runtime.batch.jobstate import RunOptions, RunSummary
from keyscale.runtime.control.server import control_api

if TYPE_CHECKING:
    from keyscale._steps import JobGraph
    from keyscale.runtime.control.running import RunningJob

__all__ = ["JobHandle", "start_job"]

_SET_BY_START = {"job_file", "job_dir", "parallelism", "fault"}


def start_job(pipeline: JobGraph, job_dir: str, parallelism: int | None = None, name: str | None = None,
              startup_timeout: float = 600, **options: Any) -> JobHandle:
    """Start ``pipeline`` (see :meth:`keyscale.Pipeline.start`); returns once its first
    batch may run (state restored, control API up), or raises the set-up's error."""
    from keyscale.runtime.driver.runner import JobRunner
    from keyscale.runtime.driver.session import user_session

    known = {f.name for f in dataclasses.fields(RunOptions)} - _SET_BY_START
    unknown = sorted(set(options) - known)
    if unknown:
        raise unknown_keyword("Pipeline.start()", unknown[0], [*sorted(known), "parallelism", "name"])
    opts = RunOptions(job_file="", job_dir=str(job_dir), parallelism=parallelism, **options)
    job_name = name or PurePosixPath(str(job_dir).rstrip("/")).name or "job"
    # The caller's session, found in the caller's thread: Spark's active session is per
    # thread, and a pipeline on a log source holds no DataFrame that would name it.
    session = user_session(pipeline)
    runner = JobRunner(opts, pipeline=pipeline, name=job_name, serve=control_api(opts), session=session)
    handle = JobHandle(runner, f"keyscale-job-{opts.job_dir}")
    handle._wait_started(startup_timeout)
    return handle


class JobHandle:
    """A running (or finished) job started with :meth:`keyscale.Pipeline.start`.

    >>> import keyscale as ks
    >>> [m for m in ("status", "state", "rescale", "savepoint", "stop", "await_termination") if hasattr(ks.JobHandle, m)]
    ['status', 'state', 'rescale', 'savepoint', 'stop', 'await_termination']
    """

    def __init__(self, job: RunningJob, thread_name: str = "keyscale-job"):
        self._job = job
        self._summary: RunSummary | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._summary = self._job.run()
        except BaseException as e:  # kept for await_termination / stop, which raise it in the caller's thread
            self._error = e

    def _wait_started(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self._job.state == "starting" and self._thread.is_alive():
            if time.monotonic() > deadline:
                raise KeyscaleError(f"the job in {self.job_dir} did not start within {timeout:.0f} s")
            time.sleep(0.05)
        if self._job.state == "failed":
            # The run says "failed" before its error has unwound to this handle's thread.
            self._thread.join(max(1.0, deadline - time.monotonic()))
        if self._error is not None:
            raise self._error

    # -- what it is ----------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self._job.name

    @property
    def job_dir(self) -> str:
        return self._job.jobdir.uri

    @property
    def is_active(self) -> bool:
        """Whether the job still runs."""
        return self._thread.is_alive()

    @property
    def summary(self) -> RunSummary:
        """Batches run so far (their records, parallelism, rescales)."""
        return self._summary or self._job.summary

    def status(self) -> dict[str, Any]:
        """What ``keyscale status --json`` / ``GET /status`` say: ``state`` (running, draining,
        stopped, failed), ``last_error``, ``pending_rescale``, operators, checkpoint, watermark."""
        if self.is_active:
            return self._job.live_status()
        return {**self._job.last_status(), "running": False}

    def state(self, uid: str, key: Any) -> dict[str, Any]:
        """What ``key`` of keyed operator ``uid`` holds at the last committed checkpoint, as
        ``keyscale state get`` and ``GET /state/<uid>?key=...`` answer: ``batch`` (the
        checkpoint), ``uid``, ``key``, ``key_group``, ``found``, ``state`` (by state name,
        list and map states as JSON arrays and objects), and ``timers`` and ``ttl`` when the
        key has them (:mod:`keyscale.state_processor.lookup`). ``key`` is the key's value
        (a tuple for several key columns), or text parsed as the key's type. Works while the
        job runs and after it ended; reads the checkpoint's files, never the tasks' memory."""
        return self._job.lookup_state(uid, [key])[0]

    # -- control -------------------------------------------------------------------------
    def rescale(self, parallelism: int, operator: str | None = None) -> None:
        """Rescale live between two batches (every keyed operator, or ``operator``): at the
        next batch, a scale-up once the Python workers it needs started; returns at once (the
        status shows it pending until a batch applies it)."""
        self._require_active("rescale")
        self._job.request_rescale(parallelism, operator)

    def savepoint(self, dest: str | None = None) -> str:
        """A savepoint of the last committed batch, taken between two batches; its path."""
        self._require_active("take a savepoint of")
        return self._job.take_savepoint(dest)

    def stop(self, savepoint: bool = False, dest: str | None = None, timeout: float | None = None) -> str | None:
        """Stop after the current batch (with ``savepoint``: after a final savepoint, whose
        path is returned) and wait for the job to end; raises the job's error if it failed."""
        path = None
        if self.is_active:
            if savepoint:
                path = self._job.take_savepoint(dest, then_stop=True)
            else:
                self._job.stop()
        self.await_termination(timeout)
        return path

    def await_termination(self, timeout: float | None = None) -> bool:
        """Wait for the job to end (a job with ``until_idle`` ends by itself); True if it
        ended within ``timeout``. Raises the job's error (its own traceback) if it failed."""
        self._thread.join(timeout)
        if self._error is not None:
            raise self._error
        return not self._thread.is_alive()

    def _require_active(self, what: str) -> None:
        if not self.is_active:
            raise KeyscaleError(f"cannot {what} job '{self.name}': it is not running ({self.status().get('state')})")

    def __repr__(self) -> str:
        return f"JobHandle(name={self.name!r}, job_dir={self.job_dir!r}, state={self._job.state!r})"
