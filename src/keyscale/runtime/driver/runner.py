"""The driver: a job's lifecycle around its micro-batches (driver process).

Set-up (the pipeline built on its Spark session; claiming and recovering the job directory,
a savepoint restored, the resume point: ``setup.py``), the run (Spark's ``foreachBatch``
query, ``query.py``, or keyscale's own loop for a log source), stop, drain, savepoints,
a failure's way out (``failures.py``), and what the control plane asks of a running job (it implements
:class:`keyscale.runtime.control.running.RunningJob`; whoever starts the job passes
``serve``, the control API, which this module never imports). Each batch is committed
exactly once by the commit protocol in ``batch/commit.py`` (docs/design.md, "Commit
protocol"); the batch's Spark stages are in ``stages.py``, a log source's plans in
``source_plan.py``, the scaling decisions in ``parallelism.py``, the status in
``status.py``. What they share, the job's state between batches, is a
:class:`~keyscale.runtime.batch.jobstate.JobState` (``JobRunner.job``): this module makes it
(options, job directory, run id, history, autoscaler), writes the job's name and upload
timeout at set-up, empties ``log_ends`` after the caller's ``on_batch``, and writes
``history`` (state, error, savepoints, the summary's job name and Spark's trigger times);
``setup.py`` writes ``committed`` at set-up, and a rescale request is passed on to
``parallelism.py``, which alone writes ``scaling`` (who writes each part: ``jobstate.py``).

The query, the heartbeat and the control API's requests run on their own threads and share
the batch lock and the stop and drain events, which stay with the one class that owns them.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

from keyscale._steps import JobGraph
from keyscale.checkpoint.jobdir import JobDir
from keyscale.checkpoint.manifest import Manifest
from keyscale.checkpoint.uploads import upload_timeout
from keyscale.errors import (
    FencedError,
    InputDataError,
    KeyColumnMissingError,
    KeyscaleError,
    StateError,
)
from keyscale.runtime.batch import commit, malformed, sizing, status
from keyscale.runtime.batch import parallelism as scaling
from keyscale.runtime.batch import poison as poison_batch
from keyscale.runtime.batch.jobstate import BatchRecord, History, JobState, RunOptions, RunSummary
from keyscale.runtime.batch.jobstate import seconds as _seconds
from keyscale.runtime.batch.source_plan import await_input
from keyscale.runtime.batch.spark_source import explain_missing_key
from keyscale.runtime.driver import setup
from keyscale.runtime.driver.failures import (
    StopRequested,
    failure_record,
    report_damage,
    settle_after_failure,
    translate,
)
from keyscale.runtime.driver.heartbeat import Heartbeat
from keyscale.runtime.driver.jobargs import keep_args
from keyscale.runtime.driver.jobfile import load_job
from keyscale.runtime.driver.query import spark_writer, trigger_seconds
from keyscale.runtime.driver.recovery import replay_spark_batches
from keyscale.runtime.task.profiling import profiled
from keyscale.sources.reader import LogSource
from keyscale.state.backends import check_state_backend
from keyscale.state.keygroups import (
    check_parallelism,
)
from keyscale.storage import open_store

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.streaming.query import StreamingQuery

    from keyscale.state_processor.lookup import StateLookup

__all__ = ["BatchRecord", "JobRunner", "RunOptions", "RunSummary"]

log = logging.getLogger("keyscale")


class Served(Protocol):
    """What serves a job while it runs (the control API, made by whoever starts the job:
    ``keyscale run``, :func:`~keyscale.runtime.control.handle.start_job`)."""

    def reassert(self) -> None:
        """Called by the heartbeat (object stores) once it found this run current."""

    def close(self) -> None:
        """Called once when the run ends, whatever the way."""


class JobRunner:
    """Runs one job in one job directory until idle, stopped, or failed.

    Besides :meth:`run`, what a running job answers to its control API and to a
    :class:`~keyscale.runtime.control.handle.JobHandle` (the protocol
    :class:`keyscale.runtime.control.running.RunningJob`): status, history, liveness,
    rescale, savepoint, drain, restart and stop, each safe from any thread."""

    def __init__(self, opts: RunOptions, on_batch: Callable[[BatchRecord], None] | None = None,
                 pipeline: JobGraph | None = None, name: str | None = None, serve: Callable[[JobRunner], Served] | None = None,
                 session: SparkSession | None = None):
        """``pipeline``: a pipeline built by the caller on their own SparkSession (the Python
        API, :meth:`keyscale.Pipeline.start`), run under ``name`` on ``session`` (found in the
        caller's thread: Spark's active session is per thread, and the run has its own;
        default :func:`~.session.user_session` from the run's thread); without it the runner loads
        ``opts.job_file`` and builds the pipeline on a session of its own. ``serve``: what
        serves the job while it runs (the control API: ``control.server.control_api``), made
        once set-up is done and closed when the run ends; None serves nothing."""
        jobdir = JobDir(opts.job_dir)
        self._given = (pipeline, name) if pipeline is not None else None
        self._session = session
        # What the batch modules share (commit, stages, source_plan, parallelism, status).
        self.job = JobState(opts, jobdir, run_id=uuid.uuid4().hex, history=History(RunSummary(job="", job_dir=jobdir.uri)),
                            on_batch=self._batch_recorded)
        self._serve = serve
        self._user_on_batch = on_batch
        self._args_kept = False
        self._error: BaseException | None = None
        self._stop = threading.Event()
        # Held while a batch runs, a savepoint is taken or a pending commit settles (every
        # commit.settle): savepoints are taken between batches, of committed batches, and
        # retention (end of a batch) never deletes files a savepoint is still reading.
        self._batch_lock = self.job.batch_lock
        self._query: StreamingQuery | None = None
        self._locked = False
        self._empty_batch = False  # the last batch run read no records (see _input_read)
        self._lookup: StateLookup | None = None  # point lookups (lookup_state), made on first use
        self._lookup_lock = threading.Lock()
        self.job.autoscaler = scaling.make_autoscaler(opts, jobdir)
        check_state_backend(opts.state_backend, "the job's option")
        sizing.target_seconds(opts.latency_target)  # a latency target that is not a duration is refused before anything runs
        self._drain = threading.Event()
        self._drain_dest: str | None = None
        self._drained: Future[str | None] = Future()
        # Set by request_restart: the run ends, and `keyscale run` starts the job again in the
        # same process and Spark application (parallelism, job file), from this checkpoint.
        self.restart_request: dict[str, Any] | None = None
        self._heartbeat: Heartbeat | None = None

    def _batch_recorded(self, rec: BatchRecord) -> None:
        """After each batch (its checkpoint committed; with asynchronous checkpoints,
        committing): the first one proves the start, whose arguments are then kept."""
        self._keep_args()
        if self._user_on_batch is not None:
            self._user_on_batch(rec)
            # The caller's code may have appended to the job's log: the next batch reads its
            # end anew rather than plan on the one read at the commit (source_plan.ends_for_plan).
            self.job.log_ends.clear()

    def _keep_args(self) -> None:
        """This start's arguments become the ones a later ``keyscale run`` reuses, once the
        start is a success: its first batch committed, or it ended without an error
        (keyscale.runtime.driver.jobargs). Never for a start that failed."""
        if self._args_kept or self.job.history.state == "failed":
            return
        self._args_kept = True
        try:
            keep_args(self.job.jobdir, self.job.opts.args)
        except (KeyscaleError, OSError) as e:  # the batch is committed: this must not fail it
            log.warning("could not keep this start's arguments for the next run (%s): give them with --set next time", e)

    # -- set-up --------------------------------------------------------------------------
    def _prepare(self) -> SparkSession:
        opts = self.job.opts
        if self._given is not None:
            self.job.name, build = self._given[1] or "job", None
        else:
            self.job.name, build, _ = load_job(opts.job_file)
        self.job.history.summary.job = self.job.name
        if opts.parallelism is not None and opts.parallelism < 1:
            raise KeyscaleError(f"parallelism {opts.parallelism} must be at least 1")
        if opts.async_checkpoints:
            self.job.upload_timeout = upload_timeout()  # a bad KEYSCALE_UPLOAD_TIMEOUT is refused before anything runs
        setup.claim(self.job)
        self.job.jobdir.lock()
        self._locked = True
        return setup.build(self.job, build, self._given[0] if self._given is not None else None, self._session)

    # -- running -------------------------------------------------------------------------
    def run(self) -> RunSummary:
        """Run until idle (``until_idle``) or until :meth:`stop`; raise on failure."""
        try:
            spark = self._prepare()
            assert self.job.pipeline is not None
            setup.open_sinks(self.job, self.job.pipeline)
            outputs = [b.sink for b in self.job.pipeline.branches]
            log.info("running '%s': %s; output to %s", self.job.name, status.describe_parallelism(self.job), ", ".join(s.describe() for s in outputs))
            for sink in self.job.pipeline.sinks:
                if not sink.exactly_once:
                    log.warning("%s is not exactly-once: a batch replayed after a crash writes its output again", sink.describe())
            if not self.job.jobdir.is_local:
                # Before the control API: a client that finds its address must find the job running too.
                self._heartbeat = Heartbeat(self.job.jobdir, self._heartbeat_status)
            served = self._serve(self) if self._serve is not None else None
            if self._heartbeat is not None and served is not None:  # a fenced run's late delete of the control files is undone within a beat
                self._heartbeat.also = served.reassert
            self.job.history.state = "running"
            if self.job.autoscaler is not None and self.job.opts.autoscaler_mode == "active":
                scaling.size_executors(self.job, self.job.scaling.parallelism)  # from the start: cores follow parallelism
            try:
                if self.job.pipeline.log_source is not None:
                    self._run_log_loop()
                else:
                    replay_spark_batches(self.job.jobdir, self.job.committed.manifest.batch if self.job.committed.manifest else -1, self._run_spark_once, self._stop.is_set)
                    if not self._stop.is_set():
                        self._query = spark_writer(self.job, self._on_batch).start()
                        self._wait()
                if self._drain.is_set() or (self.job.opts.drain_at_end and self._error is None):
                    self.job.history.state = "draining"
                    self._run_drain(spark)
                with self._batch_lock:  # a savepoint asked for now waits for this commit
                    commit.settle(self.job)  # the last batch's checkpoint, committing in the background
                if self._error is None:
                    self._keep_args()  # it ended without an error, whether or not a batch ran
            except BaseException as e:
                settle_after_failure(self.job)
                self._record_failure(e)
                if not self._drained.done():
                    self._drained.set_exception(e)
                report_damage(self.job, e)
                raise
            finally:
                if served is not None:
                    served.close()
        except BaseException as e:
            if self.job.history.last_error is None:  # failed before the first batch (set-up, the sink's checks)
                self._record_failure(e)
            raise
        finally:
            if self._heartbeat is not None:
                self._heartbeat.close()
            if self.job.history.state not in ("failed", "restarting"):
                self.job.history.state = "stopped"
            if self._locked:
                try:
                    # Shared with the run that took over, if one did: then not written (FencedError).
                    self.job.jobdir.write_status({**self.last_status(), "running": False})
                except FencedError as e:
                    log.warning("%s", e)
                finally:
                    self.job.jobdir.unlock()
                    self._locked = False
        return self.job.history.summary

    def _record_failure(self, exc: BaseException) -> None:
        """The job failed: its status says so, with the error, until the next start."""
        if isinstance(exc, StopRequested | KeyboardInterrupt):
            return
        self.job.history.state = "failed"
        self.job.history.last_error = failure_record(self.job, exc)

    def _run_spark_once(self) -> None:
        """A query that runs one batch (the one Spark's offsets log ends with) and stops,
        its checkpoint committed: a replay goes on only from a committed batch."""
        self._query = spark_writer(self.job, self._on_batch, once=True).start()
        self._wait()
        with self._batch_lock:
            commit.settle(self.job)

    def _run_log_loop(self) -> None:
        """Micro-batches driven by keyscale: back to back while records wait in the log, at
        least one every trigger interval, also without new records (timers, idleness and
        windows move with time; ``_await_next_batch``); until idle with ``until_idle``."""
        interval = _seconds(self.job.opts.trigger_interval) or 1.0
        while not self._stop.is_set():
            started = time.monotonic()
            before = self.job.committed.watermark.watermark_ms
            with self._batch_lock:
                if self._stop.is_set():
                    break
                batch_id = self.job.committed.manifest.batch + 1 if self.job.committed.manifest else 0
                try:
                    records = self._run_batch_locked(None, batch_id)
                except BaseException as e:
                    poison_batch.keep_trace(self.job.jobdir, e)
                    raise translate(e) from None
            replayed = bool(self.job.history.summary.batches) and self.job.history.summary.batches[-1].replayed  # its intent fixed its input
            if self.job.opts.until_idle and not replayed and self._input_read(records, before):
                break
            if not self.job.opts.until_idle:
                self._await_next_batch(interval, started, batch_id)

    def _await_next_batch(self, interval: float, started: float, batch_id: int) -> None:
        """Between two batches of a log source: ``source_plan.await_input`` (no wait while
        records wait; idle, until records arrive or the interval is up), or with
        ``wait_for_trigger`` one batch per trigger interval at most, as Spark's
        processing-time trigger."""
        left = interval - (time.monotonic() - started)
        if self.job.opts.wait_for_trigger:
            self._stop.wait(max(0.0, left))
            return
        src = self.job.pipeline.log_source if self.job.pipeline is not None else None
        assert src is not None
        await_input(self.job, src, self._stop, batch_id, started, interval)

    def _wait(self) -> None:
        q = self._query
        assert q is not None
        try:
            while q.isActive:
                if self._stop.is_set():
                    # Let a running batch finish (the lock); one that would begin now refuses
                    # to (see _run_batch), so a stop never cuts a batch in half. The lock is
                    # not held while stopping: Spark waits for its batch thread.
                    with self._batch_lock:
                        pass
                    q.stop()
                    break
                q.awaitTermination(1)
        except Exception as e:  # Spark raises its own exception types
            if not (self._stop.is_set() and self._error is None):
                raise (self._error or translate(e)) from None
            # else: a batch refused to start after the stop request; a clean stop
        self.job.history.summary.trigger_seconds = trigger_seconds(q)
        if self._error is not None:
            raise self._error
        exc = q.exception()
        if exc is not None and not self._stop.is_set():
            raise translate(exc)

    def stop(self) -> None:
        """Ask the job to stop after the current batch (safe from any thread)."""
        self._stop.set()

    def stop_requested(self) -> bool:
        """Whether the job was asked to stop (it ends after the current batch)."""
        return self._stop.is_set()

    def request_restart(self, parallelism: int | None, job_file: str | None = None) -> str:
        """Restart without a new JVM: a savepoint (the fallback), then the run ends between two
        batches; the process that runs it (``keyscale run``) starts the job again in the same
        Spark application at ``parallelism`` with ``job_file`` (reloaded: new code). Returns
        the savepoint's path. Only for a job started from a job file."""
        if not self.job.opts.job_file:
            raise KeyscaleError("a job started from Python restarts from Python: handle.stop(), then start it again")
        if parallelism is not None:
            check_parallelism(parallelism, self.job.max_parallelism)
        if job_file is not None:
            load_job(job_file)  # a file that does not load is refused now, while the job still runs
        path = self.take_savepoint(None, then_stop=True)
        self.restart_request = {"parallelism": parallelism, "job_file": job_file, "savepoint": path}
        self.job.history.state = "restarting"
        log.info("restarting in the same Spark application%s%s after the current batch (savepoint %s)",
                 f" at parallelism {parallelism}" if parallelism else "", f" with {job_file}" if job_file else "", path)
        return path

    def drain(self, dest: str | None = None, timeout: float = 600) -> str:
        """Stop with a drain: after the current batch, one last batch runs with the watermark at
        the end of time (every event-time timer and window fires), then the final savepoint.

        Safe from any thread; returns the savepoint's path once it is written.
        """
        self._drain_dest = dest
        self._drain.set()
        self._stop.set()
        path = self._drained.result(timeout)
        assert path is not None
        return path

    def _run_drain(self, spark: SparkSession) -> None:
        assert self.job.pipeline is not None
        batch_id = self.job.committed.manifest.batch + 1 if self.job.committed.manifest else 0
        log.info("draining: batch %d runs with the watermark at the end of time, so every event-time timer and window fires", batch_id)
        empty = None if self.job.pipeline.log_source else spark.createDataFrame([], self.job.pipeline.source_schema)
        with self._batch_lock:
            self._run_batch_locked(empty, batch_id, drain=True)
        path: str | None = None
        if self._drain.is_set():
            path = self.take_savepoint(self._drain_dest)
        self._drained.set_result(path)

    def take_savepoint(self, dest: str | None = None, then_stop: bool = False) -> str:
        """A savepoint of the last committed batch, taken between two batches.

        With ``then_stop`` the job stops right after it: no batch commits in between, so
        the savepoint is the job's final state.
        """
        from keyscale.checkpoint.savepoint import text_progress, write_savepoint

        with self._batch_lock:
            commit.settle(self.job)  # a savepoint of a committed batch only
            m = self.job.committed.manifest
            if m is None:
                raise StateError("the job has not committed a batch yet; nothing to save")
            default = f"savepoints/savepoint-{m.batch:012d}-{int(time.time() * 1000)}"  # ms: two in one second must not collide
            target = open_store(dest, "savepoint destination") if dest else self.job.jobdir.store.sub(default)
            log.info("taking a savepoint of batch %d into %s", m.batch, target.url())
            try:
                path = write_savepoint(self.job.jobdir, m, target, progress=text_progress("savepoint"))
            except OSError as e:
                raise StateError(f"savepoint into {target.url()} failed: {e}") from None
            if then_stop:
                self._stop.set()
        self.job.history.savepoints.append({"batch": m.batch, "path": str(path), "time_ms": int(time.time() * 1000)})
        log.info("savepoint of batch %d complete: %s", m.batch, path)
        return path

    def _heartbeat_status(self) -> dict[str, Any]:
        """What the heartbeat writes: the status as of the last commit, as on local disk
        (written after each commit), with the time of the heartbeat. A status computed
        while a batch runs would pair that batch's new parallelism (a rescale applies at its
        start) with the readers' partitions of the last commit."""
        committed = self.job.committed.status
        if committed is None:
            return self.last_status()
        return {**committed, **status.checkpoint_fields(self.job), "updated_ms": int(time.time() * 1000)}

    def lookup_state(self, uid: str, keys: Sequence[Any]) -> list[dict[str, Any]]:
        """What each key of ``keys`` of keyed operator ``uid`` holds at the last committed
        checkpoint (the control API's ``GET /state/<uid>``, ``JobHandle.state``): read from
        the checkpoint's files by byte range, never from the running tasks' memory, so the
        answer is the committed state and costs the batches nothing but the store's reads."""
        from keyscale.state_processor.lookup import StateLookup

        with self._lookup_lock:
            if self._lookup is None:
                self._lookup = StateLookup(self.job.jobdir, latest=self.last_committed)
            lookup = self._lookup
        return lookup.get_many(uid, keys)

    def query_active(self) -> bool | None:
        """Whether the job's Spark query runs (None: no query, a keyscale-driven source or between queries)."""
        q = self._query
        return None if q is None else bool(q.isActive)

    def live_status(self) -> dict[str, Any]:
        """What ``GET /status`` answers: the status file's content, current."""
        return {**self.last_status(), "running": True}

    def last_status(self) -> dict[str, Any]:
        """The status with the last batch's task reports (without ``running``)."""
        return status.status(self.job, self.job.committed.task_reports)

    # -- what the control API and a JobHandle read (control.running.RunningJob) ----------
    @property
    def jobdir(self) -> JobDir:
        return self.job.jobdir

    @property
    def name(self) -> str:
        return self.job.name

    @property
    def state(self) -> str:
        """``starting``, ``running``, ``draining``, ``restarting``, ``stopped`` or ``failed``."""
        return self.job.history.state

    @property
    def summary(self) -> RunSummary:
        return self.job.history.summary

    def history(self) -> dict[str, Any]:
        """What ``GET /history`` answers: the recent batches, events and savepoints."""
        h = self.job.history
        return {"batches": list(h.batches), "events": list(h.events), "savepoints": h.savepoints}

    def last_committed(self) -> Manifest | None:
        """The newest committed manifest (not one still committing in the background)."""
        return status.last_committed(self.job)

    def request_rescale(self, parallelism: int, operator: str | None = None) -> None:
        """Ask the job to rescale at its next batch (all operators, or ``operator``); it
        shows as pending in the status until then. A parallelism the job cannot take, or an
        operator it does not have, is a KeyscaleError and changes nothing."""
        scaling.request_rescale(self.job, parallelism, operator)


    # -- one batch -----------------------------------------------------------------------
    def _on_batch(self, df: DataFrame, batch_id: int) -> None:
        try:
            self._run_batch(df, batch_id)
        except StopRequested:
            raise  # Spark does not commit the batch; the next run replays it
        except BaseException as e:
            poison_batch.keep_trace(self.job.jobdir, e)
            self._error = translate(e)
            if isinstance(self._error, KeyColumnMissingError) and self.job.pipeline is not None and not isinstance(self.job.pipeline.source, LogSource):
                # Only now, on the way out: the batch, and the input files' own columns, say whether the column is missing.
                self._error = KeyColumnMissingError(explain_missing_key(df, self.job.pipeline.source, str(self._error)))
            elif type(self._error) is InputDataError and self.job.pipeline is not None and not isinstance(self.job.pipeline.source, LogSource):
                self._error = InputDataError(malformed.explain_failfast(self.job.pipeline.source, str(self._error)))
            raise

    def _run_batch(self, df: DataFrame, batch_id: int) -> None:
        with self._batch_lock:
            if self._stop.is_set():
                log.info("batch %d not started: the job is stopping (it runs at the next start)", batch_id)
                raise StopRequested(batch_id)
            before = self.job.committed.watermark.watermark_ms
            records = self._run_batch_locked(df, batch_id)
            if self.job.opts.until_idle and self.job.pipeline is not None and self.job.pipeline.side_log is not None:
                last = self.job.history.summary.batches[-1] if self.job.history.summary.batches else None
                ran = last is not None and last.batch == batch_id and not last.replayed  # not a skipped or replayed batch
                if ran and self._input_read(records, before):
                    log.info("batch %d read nothing new from either input: the input is read", batch_id)
                    self._stop.set()

    def _input_read(self, records: int, watermark_before: int) -> bool:
        """Whether a run until idle ends after the batch just run (``records`` read, the
        watermark at ``watermark_before`` when it began), noting whether it read any: on a
        batch without records that moved nothing, or on the second batch in a row without
        records. Called once per batch that ran (not a replayed one). Once every input is
        idle the watermark follows the clock and moves on every batch; one such batch fired
        what the clock could fire, and waiting for more would never end."""
        empty_before, self._empty_batch = self._empty_batch, records == 0
        return records == 0 and (self.job.committed.watermark.watermark_ms == watermark_before or empty_before)

    def _run_batch_locked(self, df: DataFrame | None, batch_id: int, drain: bool = False) -> int:
        """Run and commit one batch (``commit.run_batch``; the caller holds the batch lock);
        returns the records it read. ``df`` is Spark's batch, or None for a log source."""
        with profiled("driver-batch"):
            return commit.run_batch(self.job, df, batch_id, drain)

