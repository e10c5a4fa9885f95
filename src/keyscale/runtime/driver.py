"""The driver: runs a job's micro-batches and commits each one exactly once.

For batch ``b`` (DESIGN.md §3):

1. skip it if its manifest exists (Spark replays a batch it had not marked done);
2. fix its parallelism and time in an intent file (a replay reuses them, so it computes
   exactly what the first attempt did) — live rescale requests land here;
3. build the batch's Spark plan: per keyed stage, key group and arrival sequence columns,
   an exact shuffle to one partition per subtask, and ``mapInArrow`` running the subtask;
4. write the sink (the batch's one Spark action), idempotently for ``b``;
5. commit the manifest (by rename); only then does Spark mark ``b`` done.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from keyscale._pipeline import JobContext, KeyedStep, NonKeyedStep, Pipeline, TransformStep
from keyscale.checkpoint.drain import drain_extra
from keyscale.checkpoint.jobdir import JobDir
from keyscale.checkpoint.lineage import Lineage, start_lineage
from keyscale.checkpoint.manifest import (
    Manifest,
    OperatorCheckpoint,
    StateFile,
    chain_length,
    live_files,
    oldest_chain_file,
    summarize_operator_state,
)
from keyscale.checkpoint.retention import should_snapshot
from keyscale.checkpoint.sparkmirror import SparkMirror
from keyscale.errors import JobDefinitionError, JobDirError, KeyscaleError, StateError, decode_error
from keyscale.operators.eventtime import END_OF_TIME, NO_WATERMARK, WatermarkState, ahead_limit_ms
from keyscale.operators.eventtime import advance as advance_watermark
from keyscale.operators.eventtime import describe as describe_watermark
from keyscale.operators.nonkeyed import (
    broadcast_from_json,
    broadcast_to_json,
    lists_for,
    lists_state,
)
from keyscale.operators.poison import DEAD_LETTER_SCHEMA, FAIL, input_error
from keyscale.operators.windows import WindowAggregate
from keyscale.runtime import counters, poison_batch
from keyscale.runtime.control import ControlServer
from keyscale.runtime.heartbeat import Heartbeat
from keyscale.runtime.jobfile import load_job
from keyscale.runtime.recovery import replay_spark_batches
from keyscale.runtime.reports import Reports
from keyscale.runtime.session import spark_session
from keyscale.runtime.task import (
    DEAD,
    KG,
    LATE,
    MAIN,
    SEQ,
    NonKeyedTask,
    StageTask,
    make_nonkeyed_function,
    make_stage_function,
    side_output_schema,
)
from keyscale.scaling.policy import Autoscaler, AutoscalerConfig, BatchMetrics
from keyscale.sinks.base import SinkContext
from keyscale.sources import reader
from keyscale.sources.reader import LogSource
from keyscale.state.keygroups import (
    check_parallelism,
    default_max_parallelism,
    key_group_range,
    key_group_ranges,
)
from keyscale.state.spark_hash import routing_values
from keyscale.storage import local_path

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.streaming.query import StreamingQuery

    from keyscale.sinks.base import Sink

log = logging.getLogger("keyscale")


@dataclass
class RunOptions:
    """What ``keyscale run`` was asked to do."""

    job_file: str
    job_dir: str
    parallelism: int | None = None
    max_parallelism: int | None = None
    master: str = "local[2]"
    until_idle: bool = False
    args: dict[str, str] = field(default_factory=dict)
    trigger_interval: str = "1 second"
    retain: int = 3
    max_chain: int = 8
    max_file_age: int = 32  # a subtask snapshots when its oldest state file is this many batches old
    spark_conf: dict[str, str] = field(default_factory=dict)
    scaling: str = "fixed"  # "fixed" | "auto"
    autoscaler_mode: str = "recommend"  # with scaling "auto": "off" | "recommend" | "active"
    autoscaler: AutoscalerConfig | None = None
    from_savepoint: str | None = None
    allow_non_restored_state: bool = False
    allow_empty_restart: bool = False  # no intact checkpoint left: start with empty state, re-read the input
    drain_at_end: bool = False  # with until_idle: end with a drain (every event-time timer and window fires)
    scaling_min: int = 1  # bounds of reactive mode and the autoscaler
    scaling_max: int | None = None  # None: the number of key groups
    fault: str | None = None  # test-only: "<mid-batch|after-sink|in-compaction>:<batch>"


@dataclass
class BatchRecord:
    batch: int
    seconds: float
    records: int
    emitted: int
    parallelism: dict[str, int]
    replayed: bool = False
    requests: dict[str, int] = field(default_factory=dict)  # storage requests of the batch, driver and tasks, per kind


@dataclass
class RunSummary:
    job: str
    job_dir: str
    batches: list[BatchRecord] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    rescales: list[tuple[int, str, int, int]] = field(default_factory=list)  # (batch, uid, from, to)
    recovered_from: int | None = None
    discarded: tuple[str, ...] = ()
    parallelism: dict[str, int] = field(default_factory=dict)
    # Spark's own measure of each batch with input (durationMs.triggerExecution), in seconds.
    trigger_seconds: list[float] = field(default_factory=list)

    @property
    def records(self) -> int:
        return sum(b.records for b in self.batches)


def _seconds(interval: str) -> float | None:
    """Seconds of a Spark trigger interval such as "1 second" or "200 milliseconds"."""
    number, _, unit = interval.strip().partition(" ")
    try:
        value = float(number)
    except ValueError:
        return None
    scale = {"ms": 0.001, "millisecond": 0.001, "milliseconds": 0.001, "minute": 60.0, "minutes": 60.0}.get(unit.strip().lower(), 1.0)
    return value * scale


def _watermark_of(m: Manifest | None) -> WatermarkState:
    if m is None:
        return WatermarkState()
    state = WatermarkState.from_json(m.extra.get("watermark"))
    if m.watermark_ms is not None and m.watermark_ms > state.watermark_ms:
        state = replace(state, watermark_ms=m.watermark_ms)
    return state


def _describe_assignment(a: reader.Assignment) -> str:
    return "; ".join(f"reader {i}: {', '.join(str(p) for p, _ in e) or 'none'}" for i, e in enumerate(a))


class _StopRequested(Exception):
    """Raised by a batch that begins after a stop request: Spark must not commit it."""


def _translate(exc: BaseException) -> BaseException:
    """Turn a Spark-wrapped task failure back into the keyscale error it started as."""
    from keyscale import errors

    if isinstance(exc, KeyscaleError):
        return exc
    text = str(exc)
    found = decode_error(text)
    if found:
        cls = getattr(errors, found[0], KeyscaleError)
        return cls(found[1])  # type: ignore[no-any-return]
    unreadable = input_error(text)
    if unreadable:
        log.debug("Spark's error reading the input:\n%s", text)
        return errors.InputDataError(unreadable)
    return exc


class JobRunner:
    """Runs one job in one job directory until idle, stopped, or failed."""

    def __init__(self, opts: RunOptions, on_batch: Callable[[BatchRecord], None] | None = None):
        self.opts = opts
        self.jobdir = JobDir(opts.job_dir)
        self.run_id = uuid.uuid4().hex
        self.summary = RunSummary(job="", job_dir=self.jobdir.uri)
        self._on_batch_cb = on_batch
        self._error: BaseException | None = None
        self._stop = threading.Event()
        # Held while a batch runs: savepoints are taken between batches, and retention
        # (end of a batch) never deletes files a savepoint is still reading.
        self._batch_lock = threading.Lock()
        self._query: StreamingQuery | None = None
        self._locked = False
        self._last_reports: dict[str, list[dict[str, Any]]] | None = None
        self._autoscaler: Autoscaler | None = None
        if opts.scaling == "auto" and opts.autoscaler_mode != "off":
            if opts.autoscaler_mode not in ("recommend", "active"):
                raise KeyscaleError(f"autoscaler mode must be off, recommend or active, not {opts.autoscaler_mode!r}")
            self._autoscaler = Autoscaler(opts.autoscaler or AutoscalerConfig(min_parallelism=opts.scaling_min, max_parallelism=opts.scaling_max))
        elif opts.scaling not in ("fixed", "auto", "reactive"):
            raise KeyscaleError(f"scaling must be fixed, reactive or auto, not {opts.scaling!r}")
        self._decisions: dict[str, dict[str, Any]] = {}
        self.pipeline: Pipeline | None = None
        self.committed: Manifest | None = None
        self.parallelism: dict[str, int] = {}
        self.max_parallelism = 0
        self.name = ""
        self.watermark = WatermarkState()
        self._counts: counters.Counters = {}  # the last batch's counts of records not processed normally
        self._log_ids: dict[str, str | None] = {}  # per log source or rules stream: the id of the log its last plan is for
        self.lineage = Lineage("")  # set by _prepare: the job's lineage (sinks' output belongs to it)
        self._spark: SparkSession = None  # type: ignore[assignment]  # set by _prepare
        self._drain = threading.Event()
        self._drain_dest: str | None = None
        self._drained: Future[Path | None] = Future()
        self._reports = Reports()  # tasks' reports: through Spark once the session is there
        self._heartbeat: Heartbeat | None = None
        self._mirror: SparkMirror | None = None

    # -- set-up --------------------------------------------------------------------------
    def _prepare(self) -> SparkSession:
        opts = self.opts
        self.name, build, _ = load_job(opts.job_file)
        self.summary.job = self.name
        if opts.parallelism is not None and opts.parallelism < 1:
            raise KeyscaleError(f"parallelism {opts.parallelism} must be at least 1")
        default_m = default_max_parallelism(opts.parallelism or 1)
        if opts.from_savepoint and opts.max_parallelism is None:
            # A job restored from a savepoint keeps the savepoint's key groups.
            from keyscale.checkpoint.savepoint import read_savepoint

            default_m = read_savepoint(opts.from_savepoint, verify=False).max_parallelism or default_m
        if opts.max_parallelism is not None:
            check_parallelism(opts.parallelism or 1, opts.max_parallelism)
        ident = self.jobdir.claim(self.name, opts.max_parallelism, default_m)
        self.max_parallelism = ident.max_parallelism
        if opts.parallelism is not None:
            check_parallelism(opts.parallelism, self.max_parallelism)
        self.jobdir.lock()
        self._locked = True
        if not self.jobdir.is_local:  # Spark's checkpoint is local: rebuild it from the job directory
            self._mirror = SparkMirror(self.jobdir.store, self.jobdir.spark_checkpoint)
            self._mirror.pull()
        self._record_run_options()
        rec = self.jobdir.recover(allow_empty_restart=opts.allow_empty_restart)
        for why in rec.discarded:
            log.warning("%s; set it aside", why)
        if rec.empty_restart:
            log.warning(
                "no intact checkpoint is left: --allow-empty-restart given, so job '%s' starts again with empty state and reads "
                "its input again from the beginning%s", self.name, f" (Spark's old checkpoint is kept as {rec.spark_set_aside})" if rec.spark_set_aside else "",
            )
        self.committed = rec.manifest
        self.summary.discarded = rec.discarded
        if rec.manifest is not None and rec.manifest.extra.get("drained"):
            raise JobDirError(
                f"job '{self.name}' in {self.jobdir.uri} was drained (stopped with --drain): its event time is at the end, "
                "so it cannot resume; start a new job directory from its savepoint with --from-savepoint"
            )
        if rec.manifest is not None:
            self.summary.recovered_from = rec.manifest.batch
            fell_back = " (the newer ones were damaged)" if rec.discarded else ""
            log.info("resuming job '%s' from checkpoint %d%s", self.name, rec.manifest.batch, fell_back)
        else:
            log.info("starting job '%s' with empty state in %s", self.name, self.jobdir.uri)
        # keyscale's defaults (those of a standalone cluster on spark://), then the user's --conf.
        spark = spark_session(opts.master, f"keyscale-{self.name}", opts.spark_conf)
        self._reports = Reports(spark)
        poison_batch.quiet_task_failures(spark)
        self._spark = spark
        pipeline = build(JobContext(spark, dict(opts.args)))
        if not isinstance(pipeline, Pipeline):
            raise JobDefinitionError(f"build() in {opts.job_file} returned {type(pipeline).__name__}, not a keyscale Pipeline (end it with .sink(...))")
        self.pipeline = pipeline
        if opts.from_savepoint:
            self._restore_savepoint(pipeline, opts.from_savepoint)
        self._plan_parallelism(pipeline)
        self.watermark = _watermark_of(self.committed)
        nxt = self.committed.batch + 1 if self.committed else 0
        interrupted_drain = bool((self.jobdir.read_intent(nxt) or {}).get("drain")) and not self.jobdir.has_manifest(nxt)
        self.lineage = start_lineage(self.jobdir, self.committed, anew=interrupted_drain)
        if pipeline.watermark is not None and self.watermark.watermark_ms > NO_WATERMARK:
            log.info("event time resumes at watermark %s", describe_watermark(self.watermark.watermark_ms))
        return spark

    def _restore_savepoint(self, pipeline: Pipeline, savepoint: str) -> None:
        from keyscale.checkpoint.savepoint import OperatorSpec, restore_savepoint, text_progress

        if self.committed is not None:
            raise JobDirError(
                f"job directory {self.jobdir.uri} already has checkpoint {self.committed.batch}; "
                "--from-savepoint starts a new job directory (or drop the flag to resume from the checkpoint)"
            )
        specs = {s.uid: OperatorSpec(s.state_key_columns, s.states) for s in pipeline.keyed_steps}
        # Operators with operator state only: the source's offsets, lists, broadcast state.
        for uid in [*(s.uid for s in pipeline.nonkeyed_steps), *pipeline.broadcasts, *([pipeline.log_source.uid] if pipeline.log_source else [])]:
            specs[uid] = OperatorSpec((), ())
        log.info("restoring from savepoint %s", savepoint)
        self.committed = restore_savepoint(
            Path(savepoint), self.jobdir, self.name, specs,
            allow_non_restored_state=self.opts.allow_non_restored_state, progress=text_progress("restore"),
        )
        self.summary.recovered_from = self.committed.batch
        log.info("restored savepoint of batch %d: operators %s", self.committed.batch, ", ".join(sorted(self.committed.operators)) or "none")

    def _record_run_options(self) -> None:
        """How this job was started, so that `keyscale rescale --restart` can start it again."""
        o = self.opts
        self.jobdir.write_json("run.json", {
            "job_file": str(Path(o.job_file).absolute()), "args": o.args, "master": o.master, "until_idle": o.until_idle,
            "trigger_interval": o.trigger_interval, "retain": o.retain, "compaction_chain": o.max_chain,
            "spark_conf": o.spark_conf,
        }, durable=False)

    def _plan_parallelism(self, pipeline: Pipeline) -> None:
        old = self.committed.operators if self.committed else {}
        uids = {s.uid for s in pipeline.keyed_steps}
        src = pipeline.log_source
        if src is not None:
            if src.uid in uids:
                raise JobDefinitionError(f"the source and a stage both have the uid '{src.uid}'")
            uids.add(src.uid)
            self._start_parallelism(src.uid, old.get(src.uid), src.parallelism)
        for nk in pipeline.nonkeyed_steps:
            self._start_parallelism(nk.uid, old.get(nk.uid), nk.parallelism)
            uids.add(nk.uid)
        for uid in pipeline.broadcasts:
            if uid in uids:
                raise JobDefinitionError(f"the broadcast stream and another operator both have the uid '{uid}'")
            uids.add(uid)
        orphaned = sorted(set(old) - uids)
        if orphaned and not self.opts.allow_non_restored_state:
            raise StateError(
                f"checkpoint {self.committed.batch if self.committed else '?'} has state of operator '{orphaned[0]}', which the job no longer has; "
                "pass --allow-non-restored-state to drop it"
            )
        for step in pipeline.keyed_steps:
            prev = old.get(step.uid)
            if prev is not None:
                want_keys = tuple((k, str(t)) for k, t in step.state_key_columns)
                if prev.key_columns != want_keys:
                    raise StateError(f"operator '{step.uid}': its state is keyed by {list(prev.key_columns)}, the job now keys by {list(want_keys)}")
                # Added states start absent and dropped ones are ignored; a changed type needs
                # the schema evolution a savepoint restore applies.
                now = {d.name: d.to_json() for d in step.states}
                for old_state in prev.states:
                    new_state = now.get(old_state["name"])
                    if new_state is not None and (new_state["kind"], new_state["type"]) != (old_state["kind"], old_state["type"]):
                        raise StateError(
                            f"operator '{step.uid}', state '{old_state['name']}': checkpointed as {old_state['kind']} {old_state['type']}, "
                            f"the job now declares {new_state['kind']} {new_state['type']}; take a savepoint and restore it with --from-savepoint to evolve the schema"
                        )
            p = self._start_parallelism(step.uid, prev, step.parallelism)
            if prev is not None and prev.parallelism != p:
                log.info("operator '%s': restarting at parallelism %d (was %d); key groups are reassigned, no state is rewritten", step.uid, p, prev.parallelism)
        self.summary.parallelism = dict(self.parallelism)

    def _start_parallelism(self, uid: str, prev: OperatorCheckpoint | None, own: int | None) -> int:
        """An operator's parallelism at start: -p, else as checkpointed, else its own default, else 1."""
        p = self.opts.parallelism or (prev.parallelism if prev else None) or own or 1
        check_parallelism(p, self.max_parallelism)
        self.parallelism[uid] = p
        return p

    # -- running -------------------------------------------------------------------------
    def run(self) -> RunSummary:
        """Run until idle (``until_idle``) or until :meth:`stop`; raise on failure."""
        try:
            spark = self._prepare()
            assert self.pipeline is not None
            # Sinks learn the job's lineage before the first batch (output of another
            # lineage is refused now, not at its batch); others only clean up.
            ctx = SinkContext(self.lineage, self.name, self.jobdir.uri, self.run_id, self.committed.batch if self.committed else -1)
            for sink in self.pipeline.sinks:
                sink_open, sink_cleanup = getattr(sink, "open", None), getattr(sink, "cleanup", None)
                if callable(sink_open):
                    sink_open(ctx)
                elif callable(sink_cleanup):
                    sink_cleanup()
            log.info("running '%s': %s; output to %s", self.name, self._describe_parallelism(), self.pipeline.sink.describe())
            if not self.pipeline.sink.exactly_once:
                log.warning("this sink is not exactly-once: a batch replayed after a crash writes its output again")
            if not self.jobdir.is_local:
                # Before the control API: a client that finds its address must find the job running too.
                self._heartbeat = Heartbeat(self.jobdir, lambda: self._status(self._last_reports))
            control = ControlServer(self)
            if self._autoscaler is not None and self.opts.autoscaler_mode == "active":
                self._size_executors(self.parallelism)  # from the start: cores follow parallelism
            try:
                if self.pipeline.log_source is not None:
                    self._run_log_loop()
                else:
                    replay_spark_batches(self.jobdir, self.committed.batch if self.committed else -1, self._run_spark_once, self._stop.is_set)
                    if not self._stop.is_set():
                        self._query = self._spark_writer().start()
                        self._wait()
                if self._drain.is_set() or (self.opts.drain_at_end and self._error is None):
                    self._run_drain(spark)
            except BaseException as e:
                if not self._drained.done():
                    self._drained.set_exception(e)
                if isinstance(e, StateError) and str(e).startswith("state file ") and not self.jobdir.is_local:
                    # A task found a state file damaged in place (recovery on an object store checks
                    # sizes only): the restart checks every state file in full, so it falls back to
                    # the newest intact checkpoint (or refuses) instead of failing on the same file again.
                    try:
                        self.jobdir.report_damage(str(e))
                        log.warning("the next start checks every state file of the checkpoints in full and resumes from the newest intact one")
                    except Exception as report_failed:  # the store failing now: the job's own error is what to report
                        log.warning("could not record the damage for the next start (%s)", report_failed)
                raise
            finally:
                control.close()
        finally:
            if self._heartbeat is not None:
                self._heartbeat.close()
            if self._locked:
                self.jobdir.write_status({**self._status(self._last_reports), "running": False})
                self.jobdir.unlock()
                self._locked = False
        return self.summary

    def _run_spark_once(self) -> None:
        """A query that runs one batch (the one Spark's offsets log ends with) and stops."""
        self._query = self._spark_writer(once=True).start()
        self._wait()

    def _spark_writer(self, once: bool = False) -> Any:
        assert self.pipeline is not None
        source = self.pipeline.source
        assert not isinstance(source, LogSource)
        writer = (
            source.writeStream.foreachBatch(self._on_batch)
            .option("checkpointLocation", str(self.jobdir.spark_checkpoint))
            .queryName(f"keyscale_{self.name}_{self.run_id[:6]}")
        )
        if once:
            return writer.trigger(once=True)
        return writer.trigger(availableNow=True) if self.opts.until_idle else writer.trigger(processingTime=self.opts.trigger_interval)

    def _run_log_loop(self) -> None:
        """Micro-batches driven by keyscale: one every trigger interval, also without new
        records (timers, idleness and windows move with time); until idle with ``until_idle``."""
        interval = _seconds(self.opts.trigger_interval) or 1.0
        while not self._stop.is_set():
            started = time.monotonic()
            before = self.watermark.watermark_ms
            with self._batch_lock:
                if self._stop.is_set():
                    break
                batch_id = self.committed.batch + 1 if self.committed else 0
                try:
                    records = self._run_batch_locked(None, batch_id)
                except BaseException as e:
                    poison_batch.keep_trace(self.jobdir, e)
                    raise _translate(e) from None
            replayed = bool(self.summary.batches) and self.summary.batches[-1].replayed  # its intent fixed its input
            if self.opts.until_idle and records == 0 and self.watermark.watermark_ms == before and not replayed:
                break
            if not self.opts.until_idle:
                self._stop.wait(max(0.0, interval - (time.monotonic() - started)))

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
                raise (self._error or _translate(e)) from None
            # else: a batch refused to start after the stop request; a clean stop
        self.summary.trigger_seconds = [
            p.durationMs.get("triggerExecution", 0) / 1000 for p in sorted(q.recentProgress, key=lambda p: p.batchId) if p.numInputRows > 0
        ]
        if self._error is not None:
            raise self._error
        exc = q.exception()
        if exc is not None and not self._stop.is_set():
            raise _translate(exc)

    def stop(self) -> None:
        """Ask the job to stop after the current batch (safe from any thread)."""
        self._stop.set()

    def drain(self, dest: str | None = None, timeout: float = 600) -> Path:
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
        assert self.pipeline is not None
        batch_id = self.committed.batch + 1 if self.committed else 0
        log.info("draining: batch %d runs with the watermark at the end of time, so every event-time timer and window fires", batch_id)
        empty = None if self.pipeline.log_source else spark.createDataFrame([], self.pipeline.source_schema)
        with self._batch_lock:
            self._run_batch_locked(empty, batch_id, drain=True)
        path: Path | None = None
        if self._drain.is_set():
            path = self.take_savepoint(self._drain_dest)
        self._drained.set_result(path)

    def take_savepoint(self, dest: str | None = None, then_stop: bool = False) -> Path:
        """A savepoint of the last committed batch, taken between two batches.

        With ``then_stop`` the job stops right after it: no batch commits in between, so
        the savepoint is the job's final state.
        """
        from keyscale.checkpoint.savepoint import text_progress, write_savepoint

        with self._batch_lock:
            m = self.committed
            if m is None:
                raise StateError("the job has not committed a batch yet; nothing to save")
            target = local_path(dest, "savepoint destination") if dest else self.jobdir.path / "savepoints" / f"savepoint-{m.batch:012d}-{int(time.time())}"
            log.info("taking a savepoint of batch %d into %s", m.batch, target)
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                path = write_savepoint(self.jobdir, m, target, progress=text_progress("savepoint"))
            except OSError as e:
                raise StateError(f"savepoint into {target} failed: {e}") from None
            if then_stop:
                self._stop.set()
        log.info("savepoint of batch %d complete: %s", m.batch, path)
        return path

    def live_status(self) -> dict[str, Any]:
        """What ``GET /status`` answers: the status file's content, current."""
        return {**self._status(self._last_reports), "running": True}

    def _describe_parallelism(self) -> str:
        return ", ".join(f"'{u}' at parallelism {p} of {self.max_parallelism} key groups" for u, p in self.parallelism.items())

    # -- one batch -----------------------------------------------------------------------
    def _on_batch(self, df: DataFrame, batch_id: int) -> None:
        try:
            self._run_batch(df, batch_id)
        except _StopRequested:
            raise  # Spark does not commit the batch; the next run replays it
        except BaseException as e:
            poison_batch.keep_trace(self.jobdir, e)
            self._error = _translate(e)
            raise

    def _follow_cores(self, batch_id: int) -> None:
        """Reactive mode: parallelism follows the executor cores Spark has now (DESIGN §7)."""
        from keyscale.cluster import executor_cores
        from keyscale.scaling.reactive import reactive_parallelism

        cores = executor_cores(self._spark)
        hi = self.opts.scaling_max or self.max_parallelism
        target = reactive_parallelism(cores, self.opts.scaling_min, min(hi, self.max_parallelism), self.max_parallelism)
        changed = {u: p for u, p in self.parallelism.items() if p != target}
        if not changed:
            return
        log.info("batch %d: reactive: the job has %d executor cores; parallelism %s -> %d", batch_id, cores,
                 "/".join(str(p) for p in sorted(set(changed.values()))), target)
        self.jobdir.append_event({"type": "reactive", "batch": batch_id, "executor_cores": cores, "from": changed, "to": target})
        for uid, p in changed.items():
            self.summary.rescales.append((batch_id, uid, p, target))
            self.parallelism[uid] = target

    def _apply_rescale_requests(self, batch_id: int) -> None:
        if self.opts.scaling == "reactive":
            self._follow_cores(batch_id)
        reqs = self.jobdir.read_rescale_requests()
        if not reqs:
            return
        self.jobdir.clear_rescale_requests()
        for uid in list(self.parallelism):
            want = reqs.get(uid, reqs.get("*"))
            if want is None or want == self.parallelism[uid]:
                continue
            try:
                check_parallelism(want, self.max_parallelism)
            except KeyscaleError as e:
                log.error("rescale of '%s' refused: %s", uid, e)
                continue
            log.info("batch %d: rescaling '%s' live from %d to %d subtasks (no restart; key groups reassigned)", batch_id, uid, self.parallelism[uid], want)
            self.summary.rescales.append((batch_id, uid, self.parallelism[uid], want))
            self.parallelism[uid] = want

    def _fault(self, point: str, batch_id: int) -> bool:
        return self.opts.fault == f"{point}:{batch_id}"

    def _run_batch(self, df: DataFrame, batch_id: int) -> None:
        with self._batch_lock:
            if self._stop.is_set():
                log.info("batch %d not started: the job is stopping (it runs at the next start)", batch_id)
                raise _StopRequested(batch_id)
            self._run_batch_locked(df, batch_id)

    def _run_batch_locked(self, df: DataFrame | None, batch_id: int, drain: bool = False) -> int:
        """Run and commit one batch; returns the records it read. ``df`` is Spark's batch,
        or None for a log source (read here, by reader tasks, as the intent says)."""
        from pyspark.sql import functions as F

        assert self.pipeline is not None
        if self.jobdir.has_manifest(batch_id):
            log.info("batch %d is already committed; skipping its replay", batch_id)
            self.summary.skipped.append(batch_id)
            return 0
        started = time.perf_counter()
        started_wall = time.time()
        requests_before = Counter(self.jobdir.store.requests)
        intent = self.jobdir.read_intent(batch_id)
        if intent is not None and intent.get("drain") and not drain:
            # An interrupted drain: this batch is Spark's, with its input and the job's watermark.
            log.info("batch %d: an interrupted drain used this id; it runs as an ordinary batch", batch_id)
            intent = None
        replayed = intent is not None
        if intent is None:
            self._apply_rescale_requests(batch_id)
            intent = {
                "batch_time_ms": int(time.time() * 1000), "parallelism": dict(self.parallelism),
                "watermark_ms": END_OF_TIME if drain else self.watermark.watermark_ms, **({"drain": True} if drain else {}),
            }
            src = self.pipeline.log_source
            if src is not None:
                intent["source_plan"] = self._plan_source(src, batch_id, self.parallelism[src.uid], read=not drain)
            # Rules streams: what this batch applies is fixed here, so a replay applies the same.
            intent["broadcast_plans"] = {uid: self._plan_source(b.source, batch_id, 1) for uid, b in self.pipeline.broadcasts.items()}
            intent["log_ids"] = dict(self._log_ids)  # the logs the plans are for: their ids go into the manifest
            if self._mirror is not None and df is not None:
                self._mirror.push(batch_id)  # Spark's offsets of this batch are in the job directory before anything of it
            self.jobdir.write_intent(batch_id, intent)
        else:
            intent, replanned = poison_batch.replan_intent(intent, self.opts.parallelism, [s.uid for s in self.pipeline.keyed_steps])
            if replanned:
                self.jobdir.write_intent(batch_id, intent)
                log.info("batch %d: retrying the failed attempt at -p %d (it ran with %s); its time and input stay", batch_id,
                         self.opts.parallelism, ", ".join(f"'{u}' p={old}" for u, (old, _) in replanned.items()))
            else:
                log.info("batch %d: replaying an interrupted attempt with its original parallelism and time", batch_id)
        par: dict[str, int] = {u: int(p) for u, p in intent["parallelism"].items()}
        watermark_ms = int(intent.get("watermark_ms", self.watermark.watermark_ms))
        if df is None:
            df = self._read_source(batch_id, intent["source_plan"], int(intent["batch_time_ms"]), intent.get("log_ids", {}))

        out = df
        side: list[tuple[Sink, DataFrame, DataFrame]] = []
        dead_letters: list[tuple[DataFrame, DataFrame]] = []
        rules = self._apply_broadcasts(intent.get("broadcast_plans", {}))
        for step in self.pipeline.steps:
            if isinstance(step, TransformStep):
                out = step.fn(out)
                continue
            if isinstance(step, NonKeyedStep):
                out = self._nonkeyed(out, step, batch_id, int(intent["batch_time_ms"]), par[step.uid], rules)
                continue
            out = self._keyed(out, step, batch_id, int(intent["batch_time_ms"]), par[step.uid], watermark_ms, rules)
            dead = self.pipeline.error_policy(step).on_error == "dead_letter"
            if step.late_sink is not None or dead:
                # The stage runs once (cached); its rows split into the main, late and dead-letter streams.
                staged = out.persist()
                out = staged.where(F.col(MAIN).isNotNull()).select(f"{MAIN}.*")
                if step.late_sink is not None:
                    side.append((step.late_sink, staged.where(F.col(LATE).isNotNull()).select(f"{LATE}.*"), staged))
                if dead:
                    dead_letters.append((staged.where(F.col(DEAD).isNotNull()).select(f"{DEAD}.*"), staged))
        side += poison_batch.dead_letter_outputs(self.pipeline.dead_letter, dead_letters)
        spark_started = time.perf_counter()
        try:
            self.pipeline.sink.write(out, batch_id)
            for sink, late_df, _ in side:
                sink.write(late_df, batch_id)
        finally:
            for *_, staged in side:
                staged.unpersist()
        spark_seconds = time.perf_counter() - spark_started
        if self._fault("after-sink", batch_id):
            os.kill(os.getpid(), signal.SIGKILL)

        batch_time_ms = int(intent["batch_time_ms"])
        manifest, records, emitted, reports = self._manifest(
            batch_id, batch_time_ms, par, intent.get("source_plan"), intent.get("broadcast_plans", {}), rules, intent.get("log_ids", {}))
        wm = self._next_watermark(reports, batch_time_ms, watermark_ms)
        counts = counters.of_reports(reports)  # late, too far ahead, dropped...: totals survive retention and restarts
        totals = counters.add(counters.from_extra(self.committed.extra if self.committed else None), counts)
        manifest = replace(manifest, watermark_ms=wm.watermark_ms, extra={
            **manifest.extra, "watermark": wm.to_json(), counters.MANIFEST_KEY: totals, "lineage": self.lineage.to_json(), "epoch": self.jobdir.epoch,
            **(drain_extra(self.watermark.to_json(), batch_id) if drain else {})})
        self.jobdir.commit(manifest)
        self._reports.forget(batch_id)
        self.committed = manifest
        if wm.watermark_ms != self.watermark.watermark_ms and self.pipeline.watermark is not None:
            log.info("batch %d: watermark advanced to %s", batch_id, describe_watermark(wm.watermark_ms))
        self.watermark = wm
        self._report_counts(batch_id, counts)
        removed = self.jobdir.retain(self.opts.retain)
        seconds = time.perf_counter() - started
        requests = Counter(self.jobdir.store.requests) - requests_before
        for rs in reports.values():
            for r in rs:
                requests.update(r.get("store_requests", {}))
        rec = BatchRecord(batch_id, seconds, records, emitted, par, replayed, dict(requests))
        self.summary.batches.append(rec)
        self.summary.parallelism = dict(self.parallelism)
        self._last_reports = reports
        src = self.pipeline.log_source
        source = self._source_status(src) if src is not None else None  # one read of the log's end per batch
        if self._autoscaler is not None:
            self._autoscale(batch_id, started_wall, seconds, par, reports, source.get("lag") if source else None)
        if self.jobdir.is_local:  # elsewhere the heartbeat writes it, every few seconds, not every batch
            self.jobdir.write_status({**self._status(reports, source), "running": True})
        log.info(
            "batch %d committed in %.2f s (Spark job %.2f s): %s records in, %s rows out; %s%s",
            batch_id, seconds, spark_seconds, f"{records:,}", f"{emitted:,}",
            ", ".join(f"'{u}' p={p}" for u, p in par.items()),
            f"; {removed} old state files removed" if removed else "",
        )
        if self._on_batch_cb:
            self._on_batch_cb(rec)
        return records

    def _report_counts(self, batch_id: int, counts: counters.Counters) -> None:
        """Records a batch diverted, dropped or did not believe: a log line per operator and an event."""
        self._counts = counts
        if not counts or self.pipeline is None:
            return
        self.jobdir.append_event(counters.event(batch_id, counts))
        src, spec = self.pipeline.log_source, self.pipeline.watermark
        windows = {s.uid for s in self.pipeline.keyed_steps if isinstance(s.function, WindowAggregate)}
        for uid, c in counts.items():
            kind = "source" if src is not None and uid == src.uid else "window" if uid in windows else "operator"
            log.warning("%s", counters.describe(batch_id, kind, uid, c, spec.max_ahead_ms if spec else None))

    def _event_time_limit(self, batch_time_ms: int) -> int | None:
        """The latest event time a batch believes (with_watermark's max_ahead after its time)."""
        spec = self.pipeline.watermark if self.pipeline else None
        return ahead_limit_ms(spec.max_ahead_ms, batch_time_ms) if spec is not None else None

    def _committed_assignment(self, src: LogSource) -> reader.Assignment | None:
        """The readers' committed partitions and offsets (None before the source's first batch)."""
        prev = self.committed.operators.get(src.uid) if self.committed else None
        return reader.from_state(prev.operator_state) if prev is not None else None

    def _plan_source(self, src: LogSource, batch_id: int, p: int, read: bool = True) -> list[list[list[int]]]:
        current = self._committed_assignment(src)
        ends = src.log.end_offsets()
        log_id = src.log.identity()
        if current is not None:  # a log that shrank or was recreated would be read from the wrong offsets
            state = self.committed.operators[src.uid].operator_state if self.committed else None
            reader.check_positions(src.uid, src.log.uri, current, ends, reader.log_id_of(state), log_id)
            reader.check_last_records(src.uid, src.log, current, reader.last_records_of(state))
        self._log_ids[src.uid] = log_id
        if current is None:
            current = reader.initial_assignment(len(ends), p)
            log.info("source '%s': %d partitions over %d readers: %s", src.uid, len(ends), p, _describe_assignment(current))
        if len(current) != p:
            current = reader.rescale_assignment(current, p)
            log.info("batch %d: source '%s' rescaled to %d readers: partitions %s", batch_id, src.uid, p, _describe_assignment(current))
        # The partitions are those the ends were read for: one view of the log for the whole plan.
        current, added = reader.add_partitions(current, len(ends))
        for part, r in added:
            log.info("batch %d: source '%s': partition %d is new; reader %d reads it from offset 0", batch_id, src.uid, part, r)
        plan = reader.plan_batch(current, ends, src.max_records_per_partition if read else 0)
        return reader.plan_to_json(plan)

    def _read_source(self, batch_id: int, plan_json: list[list[list[int]]], batch_time_ms: int, log_ids: dict[str, str | None]) -> DataFrame:
        from pyspark.sql.pandas.types import to_arrow_schema

        assert self.pipeline is not None and self.pipeline.log_source is not None
        src = self.pipeline.log_source
        plan = reader.plan_from_json(plan_json)
        spark = self._spark
        schema = self.pipeline.source_schema
        target = to_arrow_schema(schema, timezone="UTC", prefers_large_types=False)
        event_time = self.pipeline.watermark.column if self.pipeline.watermark else None
        fn = reader.make_reader_function(
            src.log, src.uid, batch_id, plan, target, event_time, self._event_time_limit(batch_time_ms), log_ids.get(src.uid), self._reports.sender)
        readers = spark.createDataFrame(spark.sparkContext.parallelize([(i,) for i in range(len(plan))], len(plan)), "subtask int")
        return readers.mapInArrow(fn, schema)

    def _next_watermark(self, reports: dict[str, list[dict[str, Any]]], batch_time_ms: int, ran_with: int) -> WatermarkState:
        """The watermark after this batch, from the event times its first event-time stage saw."""
        spec = self.pipeline.watermark if self.pipeline else None
        now = replace(self.watermark, watermark_ms=max(self.watermark.watermark_ms, ran_with))
        if spec is None or ran_with >= END_OF_TIME:
            return now
        assert self.pipeline is not None
        src = self.pipeline.log_source
        if src is not None and src.uid in reports:  # one input per partition of the log
            seen: dict[str, int | None] = {}
            for r in reports[src.uid]:
                for part, info in r["partitions"].items():
                    seen[f"partition-{part}"] = info["max_event_ms"]
            return advance_watermark(spec, now, seen, batch_time_ms)
        stage = next((s for s in self.pipeline.keyed_steps if s.event_time), None)
        if stage is None:
            return now
        maxima = [int(r["max_event_ms"]) for r in reports[stage.uid] if r.get("max_event_ms") is not None]
        return advance_watermark(spec, now, {"source": max(maxima) if maxima else None}, batch_time_ms)

    def _autoscale(
        self, batch_id: int, started: float, seconds: float, par: dict[str, int], reports: dict[str, list[dict[str, Any]]], backlog: int | None,
    ) -> None:
        """Feed the batch's metrics to the autoscaler; record, and in active mode apply, its decision."""
        assert self._autoscaler is not None
        mode = self.opts.autoscaler_mode
        interval = None if self.opts.until_idle else _seconds(self.opts.trigger_interval)
        for uid, rs in reports.items():
            m = BatchMetrics(
                time=started, uid=uid, parallelism=par[uid], max_parallelism=self.max_parallelism,
                input_records=sum(int(r["records"]) for r in rs), batch_seconds=seconds, trigger_interval_seconds=interval,
                busy_seconds=tuple(float(r["busy_seconds"]) for r in rs), records=tuple(int(r["records"]) for r in rs),
                backlog_records=backlog,  # what the source has not read yet: every operator must process it
            )
            d = self._autoscaler.observe(m)
            event = {"type": "autoscaler", "mode": mode, "batch": batch_id, **d.to_dict()}
            self._decisions[uid] = event
            self.jobdir.append_event(event)
            if d.changes:
                if mode == "active":
                    log.info("autoscaler: %s", d.reason)
                    self.jobdir.request_rescale(d.target_parallelism, uid)
                    self._size_executors({**self.parallelism, uid: d.target_parallelism})
                else:
                    log.info("autoscaler recommends (not applied): %s", d.reason)

    def _size_executors(self, parallelism: dict[str, int]) -> None:
        """Compute follows parallelism: on a cluster, ask for as many executor cores as the
        widest operator has subtasks (more when it grows, fewer when it shrinks). Key groups
        that land on a new executor are restored there from the checkpoint."""
        if not self.opts.master.startswith("spark://"):
            return
        from keyscale.cluster import executor_cores, request_executors

        per = int(self._spark.sparkContext.getConf().get("spark.executor.cores", "1"))
        want = -(-max(parallelism.values()) // per)
        have = executor_cores(self._spark) // per
        if want != have and request_executors(self._spark, want):
            log.info("asked Spark for %d executors of %d cores (had %d) for parallelism %d", want, per, have, max(parallelism.values()))
            self.jobdir.append_event({"type": "executors", "requested": want, "had": have, "cores_per_executor": per})

    def _apply_broadcasts(self, plans: dict[str, list[list[list[int]]]]) -> dict[str, dict[str, Any]]:
        """Each rules stream's state for this batch: the committed state with the batch's
        rules records applied on the driver, in partition then offset order."""
        assert self.pipeline is not None
        out = {}
        for uid, b in self.pipeline.broadcasts.items():
            prev = self.committed.operators.get(uid) if self.committed else None
            state = broadcast_from_json(prev.operator_state.get("broadcast") if prev else None)
            for ranges in plans.get(uid, []):
                for part, start, end in sorted(ranges):
                    if end > start:
                        for row in b.source.log.read(part, start, end).to_pylist():
                            b.apply(state, SimpleNamespace(**row))
            try:
                json.dumps(broadcast_to_json(state))
            except (TypeError, ValueError) as e:
                raise JobDefinitionError(f"broadcast state '{uid}': values must be JSON values ({e})") from None
            out[uid] = state
        return out

    def _nonkeyed(self, df: DataFrame, step: NonKeyedStep, batch_id: int, batch_time_ms: int, p: int, rules: dict[str, dict[str, Any]]) -> DataFrame:
        from pyspark.sql.pandas.types import from_arrow_schema

        prev = self.committed.operators.get(step.uid) if self.committed else None
        lists = lists_for(prev.operator_state if prev else {}, step.lists, p, step.uid)
        spec = NonKeyedTask(
            uid=step.uid, function=step.function, output_schema=step.output_schema, parallelism=p,
            batch_id=batch_id, batch_time_ms=batch_time_ms, lists=tuple(lists),
            broadcast_state=rules.get(step.broadcast.uid) if step.broadcast else None, report_to=self._reports.sender,
        )
        # Round robin: a subtask's share, one Spark task per subtask (partition i is subtask i).
        return df.repartition(p).mapInArrow(make_nonkeyed_function(spec), from_arrow_schema(step.output_schema))

    def _keyed(
        self, df: DataFrame, step: KeyedStep, batch_id: int, batch_time_ms: int, p: int, watermark_ms: int, rules: dict[str, dict[str, Any]],
    ) -> DataFrame:
        from pyspark.sql import functions as F
        from pyspark.sql.pandas.types import from_arrow_schema

        m = self.max_parallelism
        prev = self.committed.operators.get(step.uid) if self.committed else None
        files: tuple[StateFile, ...] = prev.files if prev else ()
        ranges = [key_group_range(s, m, p) for s in range(p)]
        compact = tuple(
            should_snapshot(chain_length(files, r, m), oldest_chain_file(files, r, m), batch_id, self.opts.max_chain, self.opts.max_file_age)
            for r in ranges
        )
        fault = None
        if self._fault("in-compaction", batch_id) and any(compact):
            fault = "kill-driver-in-compaction"
        if self._fault("mid-batch", batch_id):
            fault = "kill-driver-mid-batch"
        spec = StageTask(
            store=self.jobdir.store, run_id=self.run_id, uid=step.uid, function=step.function,
            key_names=step.key_names, key_types=step.key_types, input_schema=step.input_schema,
            output_schema=step.output_schema, states=step.states, null_keys=step.null_keys,
            max_parallelism=m, parallelism=p, batch_id=batch_id, batch_time_ms=batch_time_ms,
            committed=self.committed.batch if self.committed else -1, files=files, compact=compact,
            fault=fault, driver_pid=os.getpid(), watermark_ms=watermark_ms, event_time=step.event_time,
            extra_keys=step.extra_state_keys, late_output=step.late_sink is not None,
            broadcast_state=rules.get(step.broadcast.uid) if step.broadcast else None, event_time_limit_ms=self._event_time_limit(batch_time_ms),
            on_error=self.pipeline.error_policy(step) if self.pipeline else FAIL, report_to=self._reports.sender,
        )
        keys = [F.col(k) for k in step.key_names]
        cols = [F.col(c) for c in step.input_schema.names]
        route = F.array(*[F.lit(int(x)).cast("int") for x in routing_values(p)])
        staged = (
            df.select(*cols, F.monotonically_increasing_id().alias(SEQ))
            .withColumn(KG, F.pmod(F.hash(*keys), F.lit(m)).cast("int"))
            # Spark places a row on partition pmod(hash(x), p): route subtask i to partition i.
            .repartition(p, F.element_at(route, F.expr(f"int(({KG} * {p}) div {m}) + 1")))
        )
        dead = spec.on_error.on_error == "dead_letter"
        schema = (
            side_output_schema(step.output_schema, step.input_schema if spec.late_output else None, DEAD_LETTER_SCHEMA if dead else None)
            if spec.late_output or dead else step.output_schema
        )
        return staged.mapInArrow(make_stage_function(spec), from_arrow_schema(schema))

    def _manifest(
        self, batch_id: int, batch_time_ms: int, par: dict[str, int], source_plan: list[list[list[int]]] | None = None,
        broadcast_plans: dict[str, list[list[list[int]]]] | None = None, rules: dict[str, dict[str, Any]] | None = None,
        log_ids: dict[str, str | None] | None = None,
    ) -> tuple[Manifest, int, int, dict[str, list[dict[str, Any]]]]:
        assert self.pipeline is not None
        ops: dict[str, OperatorCheckpoint] = {}
        records = emitted = 0
        all_reports: dict[str, list[dict[str, Any]]] = {}
        src = self.pipeline.log_source
        if src is not None and source_plan is not None:
            p = par[src.uid]
            all_reports[src.uid] = self._reports.take(src.uid, batch_id, p)
            # The offsets advance in the same manifest as the state they produced.
            after = reader.advance(reader.plan_from_json(source_plan))
            prev_src = self.committed.operators.get(src.uid) if self.committed else None
            last = reader.last_records_after(prev_src.operator_state if prev_src else None, all_reports[src.uid])
            ops[src.uid] = OperatorCheckpoint(
                uid=src.uid, max_parallelism=self.max_parallelism, parallelism=p, key_columns=(), states=(),
                operator_state=reader.to_state(after, (log_ids or {}).get(src.uid), last),
            )
        for i, step in enumerate(self.pipeline.keyed_steps):
            p = par[step.uid]
            reports = self._reports.take(step.uid, batch_id, p)
            all_reports[step.uid] = reports
            if i == 0 and src is None:
                records = sum(int(r["records"]) for r in reports)
            emitted = sum(int(r["emitted"]) for r in reports)
            prev = self.committed.operators.get(step.uid) if self.committed else None
            new = [StateFile.from_json(r["file"]) for r in reports if r["file"]]
            files = live_files([*(prev.files if prev else ()), *new], self.max_parallelism)
            ops[step.uid] = OperatorCheckpoint(
                uid=step.uid, max_parallelism=self.max_parallelism, parallelism=p,
                key_columns=tuple((k, str(t)) for k, t in step.state_key_columns),
                states=tuple(d.to_json() for d in step.states), files=tuple(files),
            )
        for nk in self.pipeline.nonkeyed_steps:
            reports = self._reports.take(nk.uid, batch_id, par[nk.uid])
            all_reports[nk.uid] = reports
            ops[nk.uid] = OperatorCheckpoint(
                uid=nk.uid, max_parallelism=self.max_parallelism, parallelism=par[nk.uid], key_columns=(), states=(),
                operator_state=lists_state(nk.lists, [r["lists"] for r in reports]),
            )
        for uid, plan in (broadcast_plans or {}).items():
            ops[uid] = OperatorCheckpoint(
                uid=uid, max_parallelism=self.max_parallelism, parallelism=1, key_columns=(), states=(),
                operator_state={
                    "broadcast": broadcast_to_json((rules or {}).get(uid, {})),
                    **reader.to_state(reader.advance(reader.plan_from_json(plan)), (log_ids or {}).get(uid)),
                },
            )
        if self.pipeline.steps and isinstance(self.pipeline.steps[-1], NonKeyedStep):
            emitted = sum(int(r["emitted"]) for r in all_reports[self.pipeline.steps[-1].uid])
        if src is not None and src.uid in all_reports:
            records = sum(int(r["records"]) for r in all_reports[src.uid])
        extra = {"source_positions": "operator_state"} if src is not None else {}
        manifest = Manifest(job=self.name, batch=batch_id, batch_time_ms=batch_time_ms, operators=ops, created_ms=int(time.time() * 1000), extra=extra)
        return manifest, records, emitted, all_reports

    def _source_status(self, src: LogSource) -> dict[str, Any]:
        """Readers, their partitions and offsets, and the lag behind the log's end."""
        assignment = self._committed_assignment(src) or [[] for _ in range(self.parallelism[src.uid])]
        try:
            ends = src.log.end_offsets()
        except KeyscaleError as e:
            return {"kind": "log", "log": src.log.describe(), "error": str(e)}
        lag = reader.lag(assignment, ends)
        return {
            "kind": "log", "log": src.log.describe(), "parallelism": self.parallelism[src.uid],
            "readers": [{"subtask": i, "partitions": {str(p): {"offset": o, "end": ends[p] if p < len(ends) else None, "lag": lag.get(p)} for p, o in e}}
                        for i, e in enumerate(assignment)],
            "unassigned_partitions": [p for p in range(len(ends)) if p not in lag],
            "lag": sum(lag.values()),
        }

    def _status(self, reports: dict[str, list[dict[str, Any]]] | None = None, source: dict[str, Any] | None = None) -> dict[str, Any]:
        """The status file's content; ``source``: the log source's status, if already read."""
        ops: dict[str, Any] = {}
        src = self.pipeline.log_source if self.pipeline else None
        operator_state_only = {s.uid for s in self.pipeline.nonkeyed_steps} | set(self.pipeline.broadcasts) if self.pipeline else set()
        for uid, p in self.parallelism.items():
            if src is not None and uid == src.uid:
                ops[uid] = source or self._source_status(src)
                continue
            if uid in operator_state_only:
                continue

            entry: dict[str, Any] = {
                "parallelism": p,
                "max_parallelism": self.max_parallelism,
                "ranges": [str(r) for r in key_group_ranges(self.max_parallelism, p)],
            }
            if reports and uid in reports:
                entry["subtasks"] = [
                    {k: r[k] for k in ("subtask", "records", "keys", "state_keys", "busy_seconds", "warm_key_groups", "loaded_key_groups")}
                    for r in reports[uid]
                ]
            ops[uid] = entry
        for uid in sorted(operator_state_only):
            committed = self.committed.operators.get(uid) if self.committed else None
            ops[uid] = {"parallelism": self.parallelism.get(uid, 1),  # a broadcast stream is applied by the driver: 1
                        "operator_state": summarize_operator_state(committed.operator_state) if committed else {}}
        return {
            "job": self.name,
            "pid": os.getpid(),
            "scaling": {"mode": self.opts.scaling, "autoscaler": self.opts.autoscaler_mode if self._autoscaler else "off",
                        "last_decisions": self._decisions},
            "last_checkpoint": self.committed.batch if self.committed else None,
            "watermark": describe_watermark(self.watermark.watermark_ms) if self.pipeline and self.pipeline.watermark else None,
            "watermark_ms": self.watermark.watermark_ms if self.pipeline and self.pipeline.watermark else None,
            "updated_ms": int(time.time() * 1000),
            "operators": ops,
            "counters": {"last_batch": self._counts, "total": counters.from_extra(self.committed.extra if self.committed else None)},
        }
