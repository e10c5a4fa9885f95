"""What a running job tells: its status (``status.json``, ``GET /status``), the counts of
records a batch did not process normally, and its parallelism in one line.

Runs on the driver. Reads ``JobState`` and writes nothing of it; appends to the job's event log.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from typing import TYPE_CHECKING, Any

from keyscale._steps import JobGraph
from keyscale.checkpoint.manifest import Manifest, summarize_operator_state
from keyscale.operators.eventtime import describe as describe_watermark
from keyscale.operators.windows import WindowAggregate
from keyscale.runtime.batch.jobstate import JobState
from keyscale.runtime.batch.source_plan import source_status
from keyscale.runtime.task import counters
from keyscale.runtime.task.report import TaskReports
from keyscale.state.keygroups import key_group_ranges

if TYPE_CHECKING:
    from pyspark import SparkContext

log = logging.getLogger("keyscale")


def status(job: JobState, reports: TaskReports | None = None, source: dict[str, Any] | None = None) -> dict[str, Any]:
    """The status file's content; ``source``: the log source's status, if already read."""
    ops: dict[str, Any] = {}
    logs = {s.uid: s for s in job.pipeline.logs} if job.pipeline else {}
    operator_state_only = {s.uid for s in job.pipeline.nonkeyed_steps} | set(job.pipeline.broadcasts) if job.pipeline else set()
    for uid, p in job.scaling.parallelism.items():
        if uid in logs:
            driving = job.pipeline is not None and logs[uid] is job.pipeline.log_source
            ops[uid] = source if source is not None and driving else source_status(job, logs[uid])
            continue
        if uid in operator_state_only:
            continue

        entry: dict[str, Any] = {
            "parallelism": p,
            "max_parallelism": job.max_parallelism,
            "ranges": [str(r) for r in key_group_ranges(job.max_parallelism, p)],
        }
        if reports and uid in reports:
            entry["subtasks"] = [
                {"subtask": r.subtask, "records": r.records, "keys": r.keys, "state_keys": r.state_keys, "busy_seconds": r.busy_seconds,
                 "gc_seconds": r.gc_seconds, "warm_key_groups": r.warm_key_groups, "loaded_key_groups": r.loaded_key_groups}
                for r in reports[uid]
            ]
            op = job.committed.manifest.operators.get(uid) if job.committed.manifest else None
            if op is not None and op.parallelism == len(entry["subtasks"]):  # the checkpoint's bytes per subtask's range
                for sub, nbytes in zip(entry["subtasks"], op.state_bytes_per_subtask(), strict=True):
                    sub["state_bytes"] = nbytes
        ops[uid] = entry
    for uid in sorted(operator_state_only):
        committed = job.committed.manifest.operators.get(uid) if job.committed.manifest else None
        ops[uid] = {"parallelism": job.scaling.parallelism.get(uid, 1),  # a broadcast stream is applied by the driver: 1
                    "operator_state": summarize_operator_state(committed.operator_state) if committed else {}}
    return {
        "job": job.name,
        "pid": os.getpid(),
        "state": job.history.state,
        "last_error": job.history.last_error,
        "pending_rescale": job.scaling.pending_rescale,
        "spark": _spark_of(job),
        "scaling": {"mode": job.opts.scaling, "autoscaler": job.opts.autoscaler_mode if job.autoscaler else "off",
                    "last_decisions": job.scaling.decisions, **slo_status(job)},
        **checkpoint_fields(job),
        "watermark": describe_watermark(job.committed.watermark.watermark_ms) if job.pipeline and job.pipeline.watermark else None,
        "watermark_ms": job.committed.watermark.watermark_ms if job.pipeline and job.pipeline.watermark else None,
        "updated_ms": int(time.time() * 1000),
        "operators": ops,
        "outputs": outputs(job.pipeline) if job.pipeline else [],
        "counters": {"last_batch": job.committed.counts, "total": counters.from_extra(job.committed.manifest.extra if job.committed.manifest else None)},
        "latency": last_latency(job),
        # With a latency target (RunOptions.latency_target): the last batch's read limit and why (scaling/batch_size.py ReadLimit).
        "batch_size": job.batch.read_limit.to_json() if job.batch.read_limit is not None else None,
    }


def last_latency(job: JobState) -> dict[str, Any] | None:
    """The end-to-end latency of the last batch that measured any (``batch`` says which: an
    idle input's empty batches measure none): its records, p50, p99, max and min in seconds
    (:mod:`keyscale.latency`). None when no batch of this run measured one: a source
    without append times (a Spark source, a Redis log), or no input yet."""
    for rec in reversed(job.history.summary.batches):
        if rec.latency is not None:
            return {"batch": rec.batch, **rec.latency.to_json()}
    return None


def slo_status(job: JobState) -> dict[str, Any]:
    """The SLO the autoscaler sizes for, and this run's share of batches within it (none without one)."""
    slo = job.autoscaler.slo if job.autoscaler is not None else None
    if slo is None:
        return {}
    n, met = job.scaling.slo_batches, job.scaling.slo_batches_met
    return {"slo": str(slo), "slo_batches": n, "slo_batches_met": met, "slo_attainment": met / n if n else None}


def committing(job: JobState) -> int | None:
    """With asynchronous checkpoints, the batch whose checkpoint is being committed, if any."""
    p = job.committed.pending
    return p.batch if p is not None and p.batch not in job.jobdir.manifest_batches() else None


def last_committed(job: JobState) -> Manifest | None:
    """The newest committed manifest: ``job.committed.manifest``, or the one before it while that one
    commits in the background."""
    return job.committed.pending.previous if committing(job) is not None and job.committed.pending else job.committed.manifest


def checkpoint_fields(job: JobState) -> dict[str, int | None]:
    """``last_checkpoint``, the newest committed batch, and ``checkpoint_committing``."""
    m = last_committed(job)
    return {"last_checkpoint": m.batch if m else None, "checkpoint_committing": committing(job)}


def outputs(pipeline: JobGraph) -> list[dict[str, Any]]:
    """Where the job's rows go: each branch's sink after its last stateful stage ("from"),
    then the side outputs (late records, dead letters)."""
    out = [{"from": b.last_stage, "kind": "output", "sink": b.sink.describe()} for b in pipeline.branches]
    out += [{"from": s.uid, "kind": "late records", "sink": s.late_sink.describe()} for s in pipeline.keyed_steps if s.late_sink is not None]
    if pipeline.dead_letter is not None:
        out.append({"from": None, "kind": "dead letters", "sink": pipeline.dead_letter.describe()})
    return out


def _spark_of(job: JobState) -> dict[str, Any] | None:
    """The Spark application the job runs in (its id, and its web UI if on). Read once per
    Spark context: they are fixed for its life, and each read is calls to the JVM (~7 a
    batch, on the batch's fixed path)."""
    if job.spark is None:
        return None
    sc = job.spark.sparkContext
    if sc not in _applications:
        _applications[sc] = {"application_id": sc.applicationId, "ui": sc.uiWebUrl, "master": sc.master}
    return dict(_applications[sc])


_applications: weakref.WeakKeyDictionary[SparkContext, dict[str, Any]] = weakref.WeakKeyDictionary()


def report_counts(job: JobState, batch_id: int, counts: counters.Counters) -> None:
    """Records a batch diverted, dropped or did not believe: a log line per operator and an event."""
    if not counts or job.pipeline is None:
        return
    job.jobdir.append_event(counters.event(batch_id, counts))
    sources, spec = {s.uid for s in job.pipeline.logs}, job.pipeline.watermark
    windows = {s.uid for s in job.pipeline.keyed_steps if isinstance(s.function, WindowAggregate)}
    for uid, c in counts.items():
        kind = "source" if uid in sources or uid == "input" else "window" if uid in windows else "operator"
        log.warning("%s", counters.describe(batch_id, kind, uid, c, spec.max_ahead_ms if spec else None))


def describe_parallelism(job: JobState) -> str:
    """Each operator's parallelism, for the log line a run starts with."""
    return ", ".join(f"'{u}' at parallelism {p} of {job.max_parallelism} key groups" for u, p in job.scaling.parallelism.items())
