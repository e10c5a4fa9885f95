"""The commit protocol of one batch: docs/design.md, "Commit protocol (local disk and object
stores alike)", step by step.

0. **Epoch.** Claimed at set-up (``JobDir.lock``, from ``driver/runner.py``); checked by every
   commit, in :meth:`JobDir.commit <keyscale.checkpoint.jobdir.JobDir.commit>` (step 5).
1. **Skip** (:func:`run_batch`): a batch with a manifest is skipped; the job directory knows
   its committed batches from one listing at start.
2. **Intent** (:func:`fix_intent`): parallelism per operator (live rescale requests land
   here), batch time, watermark, the source and rules streams' plans; a replay reuses it
   (:func:`replay_intent`). For a Spark source on an object store, Spark's checkpoint of
   the batch is pushed first (the mirror bundle).
3. **Tasks** (``stages.py``): the batch's Spark plan; its tasks report their state files
   through Spark (``job.reports``).
4. **Sink** (:func:`write_sinks`): each sink's write, idempotent for the batch id; the
   first runs the batch's tasks (stage outputs read by several writes are cached). Each
   write commits its output, so the batch's updates are visible when the last returns:
   the end of its records' end-to-end latency (:func:`batch_latency`).
5. **Manifest** (:func:`commit_manifest`): built from the tasks' reports
   (:func:`build_manifest`), created only if absent, then the epoch checked
   (``JobDir.commit``): the commit point. Then the job's state moves on (committed
   manifest, watermark).
6. **Post-commit** (:func:`post_commit`): log sources hear the positions the batch
   committed; then retention deletes what no kept manifest needs (``JobDir.retain``), and
   the batch is recorded (:func:`record`: summary, history, the autoscaler, status), in
   that order in :func:`run_batch`. With asynchronous checkpoints the manifest commits in
   the background and the batch is recorded at once; its post-commit and retention wait for
   :func:`settle` (before the next batch's manifest, a savepoint or the run's end).
7. The caller returns: ``foreachBatch`` ends and Spark marks the batch done, or the
   driver's log loop starts the next batch (``driver/runner.py``).

Runs on the driver, under the batch lock. Reads :class:`~keyscale.runtime.batch.jobstate.JobState`
and advances ``job.committed`` (at the commit), ``job.batch`` (new each batch) and
``job.history`` (the batch's record); ``job.scaling`` moves only through ``parallelism.py``.
What it persists goes through ``job.jobdir`` (intent, manifest, retention, status),
``job.mirror`` (Spark's checkpoint) and the pipeline's sinks (the output).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from keyscale._faults import fault_point
from keyscale._steps import KeyedStep
from keyscale.checkpoint.drain import drain_extra
from keyscale.checkpoint.intent import BatchIntent, SourcePlan
from keyscale.checkpoint.manifest import Manifest, OperatorCheckpoint, live_files
from keyscale.checkpoint.uploads import wait_stored
from keyscale.latency import Latency, at_commit
from keyscale.operators.eventtime import END_OF_TIME, WatermarkState
from keyscale.operators.eventtime import advance as advance_watermark
from keyscale.operators.eventtime import describe as describe_watermark
from keyscale.operators.nonkeyed import broadcast_to_json, lists_state
from keyscale.runtime.batch import malformed, parallelism, stages
from keyscale.runtime.batch import poison as poison_batch
from keyscale.runtime.batch.jobstate import (
    HISTORY,
    BatchRecord,
    BatchScratch,
    JobState,
    PendingCommit,
)
from keyscale.runtime.batch.source_plan import LogRead, plan_source, read_source, source_status
from keyscale.runtime.batch.status import checkpoint_fields, report_counts, status
from keyscale.runtime.task import counters
from keyscale.runtime.task.report import TaskReports
from keyscale.sinks.base import KEPT
from keyscale.sources import reader

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

log = logging.getLogger("keyscale")


@dataclass
class _Clock:
    """When a batch began, the job directory's storage requests until then, and the seconds
    of each step so far (``lap``: the batch's profile, in its history record)."""

    started: float  # perf_counter
    started_wall: float  # time.time
    requests_before: Counter[str]
    steps: dict[str, float]
    last: float = 0.0

    def lap(self, step: str) -> None:
        """The time since the last lap (or the start) goes to ``step``."""
        now = time.perf_counter()
        self.steps[step] = self.steps.get(step, 0.0) + now - (self.last or self.started)
        self.last = now


def run_batch(job: JobState, df: DataFrame | None, batch_id: int, drain: bool = False) -> int:
    """Run and commit one batch; returns the records it read. ``df`` is Spark's batch,
    or None for a log source (read here, by reader tasks, as the intent says)."""
    assert job.pipeline is not None
    # 1. Skip.
    if job.jobdir.has_manifest(batch_id):
        log.info("batch %d is already committed; skipping its replay", batch_id)
        job.history.summary.skipped.append(batch_id)
        return 0
    # The read limit in force carries over until this batch's plan decides its own: the
    # status shows it between two batches' plans, never none while a target holds.
    job.batch = BatchScratch(read_limit=job.batch.read_limit)
    clock = _Clock(time.perf_counter(), time.time(), Counter(job.jobdir.store.requests), job.batch.steps)
    # 2. Intent.
    intent, replayed = fix_intent(job, df, batch_id, drain)
    clock.lap("intent")
    # 3. Tasks: the batch's Spark plan, run by the sink write.
    par: dict[str, int] = dict(intent.parallelism)
    watermark_ms = job.committed.watermark.watermark_ms if intent.watermark_ms is None else intent.watermark_ms
    batch_time_ms = intent.batch_time_ms
    src, side = job.pipeline.log_source, job.pipeline.side_log
    in_stage = None
    if df is None:
        assert src is not None and intent.source_plan is not None
        read = LogRead(src, batch_id, intent.source_plan, batch_time_ms, intent.log_ids.get(src.uid))
        # A small batch is read by its keyed stage's own tasks: no reader tasks, no shuffle.
        reading = stages.reading_stage(job, read, par)
        in_stage = read if reading is not None else None
        df = read_source(job, read) if reading is None else None
        _say_how_read(job, read, reading, par)
    side_df = None
    if side is not None:
        assert intent.side_plan is not None
        side_df = read_source(job, LogRead(side, batch_id, intent.side_plan, batch_time_ms, intent.log_ids.get(side.uid)))
    rules = stages.apply_broadcasts(job, intent.broadcast_plans)
    malformed_letters = None
    if job.malformed is not None and df is not None:
        # Before any stage: a malformed record must not reach one as a row of nulls (a null key).
        df, malformed_letters, bad = malformed.split_malformed(df, job.malformed, job.pipeline.input_policy, batch_id)
        job.batch.input_counts = {malformed.INPUT: bad} if bad else {}
    clock.lap("read")
    plan = stages.plan_stages(job, df, batch_id, batch_time_ms, par, watermark_ms, rules, side_df, malformed_letters, in_stage)
    clock.lap("plan")
    # 4. Sink.
    spark_seconds = write_sinks(job, plan, batch_id)
    # Every sink has committed the batch's output (a Kafka transaction, a Delta or Iceberg
    # commit, a Parquet marker): its updates are visible now, before the manifest (which
    # makes the job's state durable, not its output visible). The latency ends here.
    job.batch.visible_at = time.time()
    if job.fault("after-sink", batch_id):
        fault_point("after-sink", os.getpid())
    clock.lap("sink")
    # At most one checkpoint in flight: the batch before this one commits first.
    removed = settle(job)
    clock.lap("settle")
    # 5. Manifest: the commit point (with asynchronous checkpoints, in the background once
    # the state files it names are stored; a drain's commits at once, its savepoint follows).
    background = job.opts.async_checkpoints and not drain
    records, emitted, reports = commit_manifest(job, batch_id, intent, par, watermark_ms, rules, drain, background)
    clock.lap("manifest")
    if not background:
        # 6. Post-commit: log sources hear the committed positions.
        post_commit(job, batch_id)
        removed += job.jobdir.retain(job.opts.retain)
    clock.lap("post_commit")
    return record(job, batch_id, clock, records, emitted, par, replayed, reports, spark_seconds, removed)


def _say_how_read(job: JobState, read: LogRead, reading: KeyedStep | None, par: Mapping[str, int]) -> None:
    """Note how the batch reads its log (its record in the history); say so when it changes."""
    job.batch.read_in_stage = reading is not None
    last = job.history.batches[-1] if job.history.batches else None
    if last is not None and last.get("read_in_stage") == job.batch.read_in_stage:
        return
    if reading is not None:
        log.info("batch %d: %s offsets to read; the keyed stage '%s' reads them in its own tasks (no reader tasks, no shuffle: "
                 "batches of up to %s offsets at its parallelism)", read.batch_id, f"{read.offsets:,}", reading.uid,
                 f"{stages.STAGE_READS // par[reading.uid]:,}")
    elif last is not None:
        log.info("batch %d: %s offsets to read; %d reader tasks read them, and the stages get them through a shuffle",
                 read.batch_id, f"{read.offsets:,}", len(read.plan))


def settle(job: JobState) -> int:
    """Asynchronous checkpoints: wait until the pending batch is committed (its state files
    stored, its manifest created), then run its post-commit steps (6, retention). Raises the
    commit's error (a file never stored, a newer run's fence). Returns the old state files
    retention removed. Called before the next batch's commit, a savepoint and the run's end.

    The caller holds ``job.batch_lock``: between taking ``job.committed.pending`` and its commit, the
    job's ``committed`` is a manifest that is not committed yet, and a savepoint (which
    settles, then reads ``committed``, under the lock) must not see that in between, nor
    read files that this settle's retention deletes. A ``threading.Lock`` has no owner, so
    what is checked is that someone holds it: every caller takes it around the call."""
    if not job.batch_lock.locked():
        raise RuntimeError("commit.settle called without the batch lock (a keyscale bug: it would race a savepoint)")
    pending = job.committed.pending
    if pending is None:
        return 0
    job.committed.pending = None
    pending.future.result()
    post_commit(job, pending.batch)
    return job.jobdir.retain(job.opts.retain)


def fix_intent(job: JobState, df: DataFrame | None, batch_id: int, drain: bool) -> tuple[BatchIntent, bool]:
    """Step 2: the batch's intent, new or (a replay) as first written; and whether it is a replay."""
    assert job.pipeline is not None
    intent = job.jobdir.read_intent(batch_id)
    replace = False
    if intent is not None and intent.drain and not drain:
        # An interrupted drain: this batch is Spark's, with its input and the job's watermark.
        log.info("batch %d: an interrupted drain used this id; it runs as an ordinary batch", batch_id)
        intent, replace = None, True
    if intent is not None:
        return replay_intent(job, batch_id, intent), True
    parallelism.apply_rescale_requests(job, batch_id)
    batch_time_ms = int(time.time() * 1000)
    src, side = job.pipeline.log_source, job.pipeline.side_log
    plans = [plan_source(job, s, batch_id, job.scaling.parallelism[s.uid], read=not drain) if s is not None else None for s in (src, side)]
    intent = BatchIntent(
        batch_time_ms=batch_time_ms, parallelism=dict(job.scaling.parallelism),
        watermark_ms=END_OF_TIME if drain else job.committed.watermark.watermark_ms, drain=drain, source_plan=plans[0], side_plan=plans[1],
        # Rules streams: what this batch applies is fixed here, so a replay applies the same.
        broadcast_plans={uid: plan_source(job, b.source, batch_id, 1) for uid, b in job.pipeline.broadcasts.items()},
        log_ids=dict(job.batch.log_ids),  # the logs the plans are for: their ids go into the manifest
    )
    if job.mirror is not None and df is not None:
        job.mirror.push(batch_id)  # Spark's offsets of this batch are in the job directory before anything of it
    job.jobdir.write_intent(batch_id, intent, replace=replace)
    return intent, False


def replay_intent(job: JobState, batch_id: int, intent: BatchIntent) -> BatchIntent:
    """A replay's intent: as first written, except a failed batch retried at a new ``-p``,
    unless a sink's committed output of the batch is tied to its plan (``Sink.plan_bound``)."""
    assert job.pipeline is not None
    replan, replanned = poison_batch.replan_intent(intent, job.opts.parallelism, [s.uid for s in job.pipeline.keyed_steps])
    bound = [s.describe() for s in job.pipeline.sinks if replanned and _plan_bound(s, batch_id)]
    if bound:
        log.warning("batch %d: replayed with the parallelism it first ran with (%s), not -p %d: part of its output is already "
                    "committed to %s, task by task of that plan; -p %d applies from the next batch", batch_id,
                    ", ".join(f"'{u}' p={old}" for u, (old, _) in replanned.items()), job.opts.parallelism, ", ".join(bound),
                    job.opts.parallelism)
        return intent
    intent = replan
    if replanned:
        job.jobdir.write_intent(batch_id, intent, replace=True)
        log.info("batch %d: retrying the failed attempt at -p %d (it ran with %s); its time and input stay", batch_id,
                 job.opts.parallelism, ", ".join(f"'{u}' p={old}" for u, (old, _) in replanned.items()))
    else:
        log.info("batch %d: replaying an interrupted attempt with its original parallelism and time", batch_id)
    return intent


def _plan_bound(sink: Any, batch_id: int) -> bool:
    hook = getattr(sink, "plan_bound", None)
    return callable(hook) and bool(hook(batch_id))


def write_sinks(job: JobState, plan: stages.BatchPlan, batch_id: int) -> float:
    """Step 4: each branch's sink, then the side outputs (late rows, dead letters); the
    seconds Spark took (the batch's tasks run here)."""
    spark_started = time.perf_counter()
    try:
        for i, (sink, rows) in enumerate(plan.writes):
            if i == 1 and job.fault("between-sinks", batch_id):
                fault_point("between-sinks", os.getpid())
            if sink.write(rows, batch_id) == KEPT:
                log.info("batch %d: %s already had this batch's output: the earlier write is kept", batch_id, sink.describe())
    finally:
        for staged in plan.cached:
            staged.unpersist()
    return time.perf_counter() - spark_started


def post_commit(job: JobState, batch_id: int) -> None:
    """Step 6, once batch ``batch_id``'s manifest is committed: each log source hears the
    positions it committed. No sink has a step here: each one's output is committed by its
    write (step 4), before the manifest, and a replay keeps it."""
    assert job.pipeline is not None
    for src in job.pipeline.logs:
        if job.committed.manifest is not None and src.uid in job.committed.manifest.operators:
            # For monitoring tools only (a Kafka consumer group's offsets): the job's own
            # positions are the manifest's.
            positions = reader.from_state(job.committed.manifest.operators[src.uid].operator_state) or []
            src.log.positions_committed({p: o for entries in positions for p, o in entries})


def commit_manifest(
    job: JobState, batch_id: int, intent: BatchIntent, par: dict[str, int], watermark_ms: int, rules: dict[str, dict[str, Any]], drain: bool,
    background: bool = False,
) -> tuple[int, int, TaskReports]:
    """Step 5: build the manifest, commit it (epoch check, created only if absent), and move
    the job's state on to it. Returns the batch's records in, rows out and task reports.

    With ``background`` the commit runs in a thread once the state files are stored
    (``job.committed.pending``), and the job's state moves on now: the next batch runs on it."""
    assert job.pipeline is not None
    batch_time_ms = intent.batch_time_ms
    manifest, records, emitted, reports = build_manifest(
        job, batch_id, batch_time_ms, par, intent.source_plan, intent.broadcast_plans, rules, intent.log_ids, intent.side_plan)
    wm = next_watermark(job, reports, batch_time_ms, watermark_ms)
    counts = {**counters.of_reports(reports), **job.batch.input_counts}  # late, too far ahead, dropped...: totals survive retention and restarts
    totals = counters.add(counters.from_extra(job.committed.manifest.extra if job.committed.manifest else None), counts)
    manifest = replace(manifest, watermark_ms=wm.watermark_ms, extra={
        **manifest.extra, "watermark": wm.to_json(), counters.MANIFEST_KEY: totals, "lineage": job.lineage.to_json(),
        **(drain_extra(job.committed.watermark.to_json(), batch_id) if drain else {})})
    if background:
        job.committed.pending = PendingCommit(batch_id, manifest, _in_background(_commit_in_background, job, manifest), job.committed.manifest)
    else:
        _commit_stored(job, manifest)
    job.reports.forget(batch_id)
    job.committed.manifest = manifest
    if wm.watermark_ms != job.committed.watermark.watermark_ms and job.pipeline.watermark is not None:
        log.info("batch %d: watermark advanced to %s", batch_id, describe_watermark(wm.watermark_ms))
    job.committed.watermark = wm
    job.committed.counts = counts
    report_counts(job, batch_id, counts)
    return records, emitted, reports


def _commit_stored(job: JobState, manifest: Manifest) -> None:
    """The commit point of ``manifest``; with asynchronous checkpoints the tasks did not wait
    for their uploads, so first every file it takes from this batch must be in the store."""
    if job.opts.async_checkpoints:
        new = [f for op in manifest.operators.values() for f in op.files if f.batch == manifest.batch]
        wait_stored(job.jobdir.store, new, job.upload_timeout, f"the commit of batch {manifest.batch} waits for it")
    job.jobdir.commit(manifest)


def _commit_in_background(job: JobState, manifest: Manifest) -> None:
    _commit_stored(job, manifest)
    if job.jobdir.is_local and job.committed.status is not None:  # elsewhere the heartbeat writes it
        job.jobdir.write_status({**job.committed.status, **checkpoint_fields(job), "running": True})


def _in_background(fn: Callable[..., None], *args: Any) -> Future[None]:
    """``fn(*args)`` in a thread of its own; its outcome in the future."""
    done: Future[None] = Future()

    def run() -> None:
        try:
            fn(*args)
        except BaseException as e:
            done.set_exception(e)
        else:
            done.set_result(None)

    threading.Thread(target=run, name="keyscale-commit", daemon=True).start()
    return done


def record(
    job: JobState, batch_id: int, clock: _Clock, records: int, emitted: int, par: dict[str, int], replayed: bool,
    reports: TaskReports, spark_seconds: float, removed: int,
) -> int:
    """After the commit: the batch's record (summary, autoscaler, status, log line, the
    ``on_batch`` callback). Returns the records it read."""
    assert job.pipeline is not None
    seconds = time.perf_counter() - clock.started
    requests = Counter(job.jobdir.store.requests) - clock.requests_before
    for rs in reports.values():
        for r in rs:
            requests.update(r.store_requests)
    lat = batch_latency(job, reports, clock.started_wall)
    rec = BatchRecord(batch_id, seconds, records, emitted, par, replayed, dict(requests), lat)
    job.history.summary.batches.append(rec)
    job.history.summary.latency.add(lat)
    if len(job.history.summary.batches) > HISTORY:  # a long run keeps every record: only the recent ones' histograms
        aged = job.history.summary.batches[-HISTORY - 1]
        if aged.latency is not None and aged.latency.buckets:
            aged.latency = replace(aged.latency, buckets={})
    job.history.summary.parallelism = dict(job.scaling.parallelism)
    job.committed.task_reports = reports
    src = job.pipeline.log_source
    source = source_status(job, src) if src is not None else None  # one read of the log's end per batch
    backlog = source.get("lag") if source else None
    clock.lap("source_status")
    job.history.batches.append({
        "batch": batch_id, "time_ms": int(time.time() * 1000), "seconds": round(seconds, 4), "records": records, "emitted": emitted,
        "parallelism": dict(par), "backlog": backlog, "replayed": replayed,
        "checkpoint_bytes": sum(f.bytes for op in job.committed.manifest.operators.values() for f in op.files) if job.committed.manifest else None,
        "latency": lat.to_json() if lat is not None else None,
        "read_limit": job.batch.read_limit.records if job.batch.read_limit is not None else None,  # with a latency target
        "read_in_stage": job.batch.read_in_stage,
        "steps": clock.steps,  # the seconds of each step; the last ones are added below
    })
    if job.autoscaler is not None:
        parallelism.autoscale(job, batch_id, clock.started_wall, seconds, par, reports, backlog, lat)
    job.committed.status = status(job, reports, source)
    if job.jobdir.is_local:  # elsewhere the heartbeat writes it, every few seconds, not every batch
        job.jobdir.write_status({**job.committed.status, **checkpoint_fields(job), "running": True})
    clock.lap("status")
    for step, s in clock.steps.items():
        clock.steps[step] = round(s, 4)
    # Records are counted by the log's readers or the first keyed stage; a job with neither
    # (stateless on a Spark source) would print zeros for rows it did move.
    counted = job.pipeline.log_source is not None or bool(job.pipeline.keyed_steps)
    log.info(
        "batch %d %s in %.2f s (Spark job %.2f s%s): %s%s; %s%s",
        batch_id, "run" if job.committed.pending else "committed", seconds, spark_seconds, "; its checkpoint commits in the background" if job.committed.pending else "",
        f"{records:,} records in, {emitted:,} rows out" if counted else "no stateful stage, so no record counts (Spark's progress has them)",
        f", {lat.words()}" if lat is not None else "",
        ", ".join(f"'{u}' p={p}" for u, p in par.items()),
        f"; {removed} old state files removed" if removed else "",
    )
    if job.on_batch:
        job.on_batch(rec)
    return records


def batch_latency(job: JobState, reports: TaskReports, began: float) -> Latency | None:
    """The batch's end-to-end latency (:mod:`keyscale.latency`): from its records' append
    times to the time its sinks committed (``job.batch.visible_at``), and its lag: its
    oldest record's wait when it began (``began``, the driver's clock). The append times are
    summarised by its log sources' readers, or, for a Spark file source, by the first keyed
    stage's tasks (the files' modification times ride along to it: ``arrival.APPENDED``).
    None when no task measured a record: another Spark source (rate, table, Spark's own
    Kafka reader), a Redis log, a file source with no keyed stage, an empty batch."""
    if job.pipeline is None or job.batch.visible_at is None:
        return None
    summaries = [r.ages for src in job.pipeline.logs if src.uid in reports for r in reports[src.uid]]
    if not any(summaries):
        # Several branches may each start with a keyed stage that saw the files: count once.
        summaries = next(([r.ages for r in reports[s.uid]] for s in job.pipeline.keyed_steps
                          if s.uid in reports and any(r.ages for r in reports[s.uid])), [])
    return at_commit(summaries, job.batch.visible_at, began)


def build_manifest(
    job: JobState, batch_id: int, batch_time_ms: int, par: dict[str, int], source_plan: SourcePlan | None = None,
    broadcast_plans: Mapping[str, SourcePlan] | None = None, rules: dict[str, dict[str, Any]] | None = None,
    log_ids: Mapping[str, str | None] | None = None, side_plan: SourcePlan | None = None,
) -> tuple[Manifest, int, int, TaskReports]:
    """The batch's manifest from its tasks' reports: per operator its state files (keyed),
    lists (non-keyed), offsets (the source: in the same manifest as the state they
    produced) or rules state (broadcasts). Also its records in, rows out and the reports."""
    assert job.pipeline is not None
    ops: dict[str, OperatorCheckpoint] = {}
    records = 0
    all_reports: TaskReports = {}
    src = job.pipeline.log_source
    for log_src, plan in ((src, source_plan), (job.pipeline.side_log, side_plan)):
        if log_src is None or plan is None:
            continue
        p = par[log_src.uid]
        all_reports[log_src.uid] = job.reports.take(log_src.uid, batch_id, p)
        # The offsets advance in the same manifest as the state they produced.
        after = reader.advance(plan)
        prev_src = job.committed.manifest.operators.get(log_src.uid) if job.committed.manifest else None
        reads = [(part, r.start, r.end, r.last_crc) for report in all_reports[log_src.uid] for part, r in (report.partitions or {}).items()]
        last = reader.last_records_after(prev_src.operator_state if prev_src else None, reads)
        ops[log_src.uid] = OperatorCheckpoint(
            uid=log_src.uid, max_parallelism=job.max_parallelism, parallelism=p, key_columns=(), states=(),
            operator_state=reader.to_state(after, (log_ids or {}).get(log_src.uid), last),
        )
    for i, step in enumerate(job.pipeline.keyed_steps):
        p = par[step.uid]
        reports = job.reports.take(step.uid, batch_id, p)
        all_reports[step.uid] = reports
        if i == 0 and src is None:
            records = sum(r.records for r in reports)
        prev = job.committed.manifest.operators.get(step.uid) if job.committed.manifest else None
        new = [f for r in reports for f in r.state_files()]
        files = live_files([*(prev.files if prev else ()), *new], job.max_parallelism)
        ops[step.uid] = OperatorCheckpoint(
            uid=step.uid, max_parallelism=job.max_parallelism, parallelism=p,
            key_columns=tuple((k, str(t)) for k, t in step.state_key_columns),
            states=tuple(d.to_json() for d in step.states), files=tuple(files),
        )
    for nk in job.pipeline.nonkeyed_steps:
        reports = job.reports.take(nk.uid, batch_id, par[nk.uid])
        all_reports[nk.uid] = reports
        ops[nk.uid] = OperatorCheckpoint(
            uid=nk.uid, max_parallelism=job.max_parallelism, parallelism=par[nk.uid], key_columns=(), states=(),
            operator_state=lists_state(nk.lists, [dict(r.lists or {}) for r in reports]),
        )
    for uid, rules_plan in (broadcast_plans or {}).items():
        ops[uid] = OperatorCheckpoint(
            uid=uid, max_parallelism=job.max_parallelism, parallelism=1, key_columns=(), states=(),
            operator_state={
                "broadcast": broadcast_to_json((rules or {}).get(uid, {})),
                **reader.to_state(reader.advance(rules_plan), (log_ids or {}).get(uid)),
            },
        )
    # Rows out: what the last stage of each branch emitted (its sink's rows).
    emitted = sum(r.emitted for uid in job.pipeline.output_uids for r in all_reports.get(uid, []))
    if src is not None and src.uid in all_reports:
        records = sum(r.records for r in all_reports[src.uid])
    extra = {"source_positions": "operator_state"} if src is not None else {}
    manifest = Manifest(job=job.name, batch=batch_id, batch_time_ms=batch_time_ms, operators=ops, created_ms=int(time.time() * 1000), extra=extra)
    return manifest, records, emitted, all_reports


def next_watermark(job: JobState, reports: TaskReports, batch_time_ms: int, ran_with: int) -> WatermarkState:
    """The watermark after this batch, from the event times its first event-time stage saw."""
    spec = job.pipeline.watermark if job.pipeline else None
    now = replace(job.committed.watermark, watermark_ms=max(job.committed.watermark.watermark_ms, ran_with))
    if spec is None or ran_with >= END_OF_TIME:
        return now
    assert job.pipeline is not None
    src = job.pipeline.log_source
    if src is not None and src.uid in reports:  # one input per partition of the log
        seen: dict[str, int | None] = {}
        for r in reports[src.uid]:
            for part, read in (r.partitions or {}).items():
                seen[f"partition-{part}"] = read.max_event_ms
        return advance_watermark(spec, now, seen, batch_time_ms)
    stage = next((s for s in job.pipeline.keyed_steps if s.event_time), None)
    if stage is None:
        return now
    maxima = [r.max_event_ms for r in reports[stage.uid] if r.max_event_ms is not None]
    return advance_watermark(spec, now, {"source": max(maxima) if maxima else None}, batch_time_ms)
