"""Set-up of a run, on the driver: the job directory claimed and recovered, a savepoint
restored, the point the run resumes from, the sinks told the job's lineage.

Functions over the run's :class:`~keyscale.runtime.batch.jobstate.JobState`:
:meth:`keyscale.runtime.driver.runner.JobRunner._prepare` calls :func:`claim`, takes the
directory's lock, then :func:`build` (:func:`recover`, the pipeline built on its Spark
session, :func:`restore_savepoint`, :func:`resume`). They write the run's facts (Spark
session, pipeline, ``max_parallelism``, ``lineage``), ``committed`` (manifest, watermark)
and the summary.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from keyscale._jobcontext import JobArgs, JobContext
from keyscale._steps import JobGraph
from keyscale.checkpoint.lineage import start_lineage
from keyscale.checkpoint.retention import check_compaction
from keyscale.checkpoint.sparkmirror import SparkMirror
from keyscale.errors import JobDefinitionError, JobDirError
from keyscale.operators.eventtime import NO_WATERMARK
from keyscale.operators.eventtime import describe as describe_watermark
from keyscale.runtime.batch import parallelism as scaling
from keyscale.runtime.batch import poison as poison_batch
from keyscale.runtime.batch import sizing
from keyscale.runtime.batch.jobstate import JobState
from keyscale.runtime.batch.jobstate import watermark_of as _watermark_of
from keyscale.runtime.driver.jobargs import check_args_read, kept_args
from keyscale.runtime.driver.session import spark_session, user_session
from keyscale.runtime.driver.shipping import ship_user_code
from keyscale.runtime.task.report import Reports
from keyscale.sinks.base import SinkContext
from keyscale.state.keygroups import check_parallelism, default_max_parallelism

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger("keyscale")


def claim(job: JobState) -> None:
    """The job directory's identity (name, max parallelism), created or checked; first,
    the compaction settings (nothing is written with settings keyscale cannot follow)."""
    opts = job.opts
    check_compaction(opts.max_chain, opts.max_file_age)
    default_m = default_max_parallelism(opts.parallelism or 1)
    if opts.from_savepoint and opts.max_parallelism is None:
        # A job restored from a savepoint keeps the savepoint's key groups.
        from keyscale.checkpoint.savepoint import read_savepoint

        default_m = read_savepoint(opts.from_savepoint, verify=False).max_parallelism or default_m
    if opts.max_parallelism is not None:
        check_parallelism(opts.parallelism or 1, opts.max_parallelism)
    ident = job.jobdir.claim(job.name, opts.max_parallelism, default_m)
    job.max_parallelism = ident.max_parallelism
    if opts.parallelism is not None:
        check_parallelism(opts.parallelism, job.max_parallelism)


def recover(job: JobState) -> None:
    """With the directory locked: Spark's checkpoint mirrored in (object stores), the run's
    options recorded, and the last intact checkpoint found (damaged ones set aside)."""
    opts = job.opts
    if not job.jobdir.is_local:  # Spark's checkpoint is local: rebuild it from the job directory
        job.mirror = SparkMirror(job.jobdir.store, job.jobdir.spark_checkpoint, job.jobdir.fence)
        job.mirror.pull()
    record_run_options(job)
    rec = job.jobdir.recover(allow_empty_restart=opts.allow_empty_restart)
    for why in rec.discarded:
        log.warning("%s; set it aside", why)
    if rec.empty_restart:
        log.warning(
            "no intact checkpoint is left: --allow-empty-restart given, so job '%s' starts again with empty state and reads "
            "its input again from the beginning%s", job.name, f" (Spark's old checkpoint is kept as {rec.spark_set_aside})" if rec.spark_set_aside else "",
        )
    job.committed.manifest = rec.manifest
    job.history.summary.discarded = rec.discarded
    if rec.manifest is not None and rec.manifest.extra.get("drained"):
        raise JobDirError(
            f"job '{job.name}' in {job.jobdir.uri} was drained (stopped with --drain): its event time is at the end, "
            "so it cannot resume; start a new job directory from its savepoint with --from-savepoint"
        )
    if rec.manifest is not None:
        job.history.summary.recovered_from = rec.manifest.batch
        fell_back = " (the newer ones were damaged)" if rec.discarded else ""
        log.info("resuming job '%s' from checkpoint %d%s", job.name, rec.manifest.batch, fell_back)
    else:
        log.info("starting job '%s' with empty state in %s", job.name, job.jobdir.uri)


def build(job: JobState, from_file: Callable[[JobContext], Any] | None, given: JobGraph | None,
          session: SparkSession | None) -> SparkSession:
    """With the directory claimed and locked: recovered, then the pipeline on its session
    (``from_file``, the job file's ``build``, on a session of keyscale's, or the caller's ``given`` pipeline
    on the caller's ``session``), its code shipped to the workers, a savepoint restored, and
    the point the run resumes from."""
    opts = job.opts
    recover(job)
    if from_file is None:  # the caller's pipeline, on the caller's session: its settings are theirs
        assert given is not None
        pipeline = given
        spark = session if session is not None else user_session(pipeline)
    else:
        # keyscale's defaults (those of a standalone cluster on spark://), then the user's --conf.
        spark = spark_session(opts.master, f"keyscale-{job.name}", opts.spark_conf)
    job.reports = Reports(spark)
    poison_batch.quiet_task_failures(spark)
    job.spark = spark
    if from_file is not None:
        ctx = JobContext(spark, dict(opts.args))
        built = from_file(ctx)
        if not isinstance(built, JobGraph):
            raise JobDefinitionError(f"build() in {opts.job_file} returned {type(built).__name__}, not a keyscale Pipeline (end it with .sink(...))")
        pipeline = built
        check_args_read(opts.args, cast(JobArgs, ctx.args).read, kept_args(job.jobdir))
    sizing.check_target(opts.latency_target, pipeline)
    job.pipeline = pipeline
    # Its modules are loaded now (the job file's, the caller's): the workers get them by value.
    shipped = ship_user_code()
    log.debug("the job's own modules, shipped to the workers by value: %s", ", ".join(shipped) or "none")
    if opts.from_savepoint:
        restore_savepoint(job, pipeline, opts.from_savepoint)
    resume(job, pipeline)
    return spark


def restore_savepoint(job: JobState, pipeline: JobGraph, savepoint: str) -> None:
    """``--from-savepoint``: the savepoint's state becomes this new job directory's first checkpoint."""
    from keyscale.checkpoint.savepoint import OperatorSpec, restore_savepoint, text_progress

    if job.committed.manifest is not None:
        raise JobDirError(
            f"job directory {job.jobdir.uri} already has checkpoint {job.committed.manifest.batch}; "
            "--from-savepoint starts a new job directory (or drop the flag to resume from the checkpoint)"
        )
    specs = {s.uid: OperatorSpec(s.state_key_columns, s.states) for s in pipeline.keyed_steps}
    # Operators with operator state only: the source's offsets, lists, broadcast state.
    for uid in [*(s.uid for s in pipeline.nonkeyed_steps), *pipeline.broadcasts, *(src.uid for src in pipeline.logs)]:
        specs[uid] = OperatorSpec((), ())
    log.info("restoring from savepoint %s", savepoint)
    job.committed.manifest = restore_savepoint(
        savepoint, job.jobdir, job.name, specs,
        allow_non_restored_state=job.opts.allow_non_restored_state, progress=text_progress("restore"),
    )
    job.history.summary.recovered_from = job.committed.manifest.batch
    log.info("restored savepoint of batch %d: operators %s", job.committed.manifest.batch, ", ".join(sorted(job.committed.manifest.operators)) or "none")


def resume(job: JobState, pipeline: JobGraph) -> None:
    """Where the run goes on from: each operator's parallelism, the watermark, the lineage
    (a new one after an interrupted drain)."""
    scaling.plan_parallelism(job, pipeline)
    job.committed.watermark = _watermark_of(job.committed.manifest)
    nxt = job.committed.manifest.batch + 1 if job.committed.manifest else 0
    next_intent = job.jobdir.read_intent(nxt)
    interrupted_drain = next_intent is not None and next_intent.drain and not job.jobdir.has_manifest(nxt)
    job.lineage = start_lineage(job.jobdir, job.committed.manifest, anew=interrupted_drain)
    if pipeline.watermark is not None and job.committed.watermark.watermark_ms > NO_WATERMARK:
        log.info("event time resumes at watermark %s", describe_watermark(job.committed.watermark.watermark_ms))


def record_run_options(job: JobState) -> None:
    """How this job was started, so that `keyscale rescale --restart` can start it again."""
    o = job.opts
    job.jobdir.write_json("run.json", {
        "job_file": str(Path(o.job_file).absolute()) if o.job_file else None, "args": o.args, "master": o.master, "until_idle": o.until_idle,
        "trigger_interval": o.trigger_interval, "retain": o.retain, "compaction_chain": o.max_chain,
        "spark_conf": o.spark_conf, "state_backend": o.state_backend, "async_checkpoints": o.async_checkpoints,
        "wait_for_trigger": o.wait_for_trigger, "latency_target": o.latency_target,
        "control_host": o.control_host, "control_port": o.control_port, "metrics_token_file": o.metrics_token_file,
        "metrics_unauthenticated": o.metrics_unauthenticated,
    }, durable=False)


def open_sinks(job: JobState, pipeline: JobGraph) -> None:
    """Sinks with an ``open(ctx)`` (the optional hook of sinks/base.py's ``Sink``) learn the
    job's lineage before the first batch: output of another lineage is refused now, not at
    its batch."""
    ctx = SinkContext(
        job.lineage, job.name, job.jobdir.uri, job.run_id,
        job.committed.manifest.batch if job.committed.manifest else -1, job.opts.fault or "", job.jobdir.fence)
    for sink in pipeline.sinks:
        sink_open = getattr(sink, "open", None)
        if callable(sink_open):
            sink_open(ctx)
