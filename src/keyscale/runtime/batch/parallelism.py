"""Each operator's parallelism: at start, and the scaling decisions between batches.

- at start (:func:`plan_parallelism`): ``-p``, else as checkpointed, else the operator's own,
  after checking the checkpoint's operators and state still fit the job;
- a live rescale asked for (:func:`request_rescale`: the control API, ``JobHandle.rescale``),
  checked and recorded;
- before a batch's intent (:func:`apply_rescale_requests`): live rescale requests (the
  control API, ``keyscale rescale``, the active autoscaler) and reactive mode; a scale-up
  first waits for its executors, then for its Python workers (:func:`awaiting_workers`);
- at set-up (:func:`make_autoscaler`): the autoscaler, its SLO checked, its input-rate
  history read back from the job directory (``autoscaler/rates.json``);
- after a batch (:func:`autoscale`): the autoscaler observes it, records its decision and,
  in active mode, requests a rescale for the next batch; its rate history is saved when a
  new bucket of it begins;
- on a cluster (:func:`size_executors`): executor cores follow parallelism.

Runs on the driver. Writes ``job.scaling`` (parallelism, the pending rescale set and cleared, the
autoscaler's decisions) and ``job.history`` (the summary's rescales, their events); asks
Spark for executors and appends to the job's event log. A batch fixes the parallelism it
runs with in its intent, so nothing here changes a batch that has begun.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from keyscale.checkpoint.manifest import OperatorCheckpoint
from keyscale.errors import JobDefinitionError, KeyscaleError, StateError
from keyscale.latency import Latency
from keyscale.runtime.batch.jobstate import (
    ExecutorsAsked,
    JobState,
    RunOptions,
    WorkerStart,
    seconds,
)
from keyscale.runtime.task.report import TaskReports
from keyscale.scaling.batch_size import WAITING_SECONDS
from keyscale.scaling.forecast import RateHistory
from keyscale.scaling.policy import Autoscaler, AutoscalerConfig, BatchMetrics
from keyscale.scaling.slo import Slo, parse_slo
from keyscale.state.keygroups import check_parallelism

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from keyscale._steps import JobGraph
    from keyscale.checkpoint.jobdir import JobDir

log = logging.getLogger("keyscale")

# After a request for executors, how long Spark is given to start or release them before
# the job compares what it has with what it asked for again: a killed executor stays
# registered for a moment, and is not to be killed twice (a second kill would take a live one).
EXECUTORS_SETTLE_SECONDS = 10.0


def plan_parallelism(job: JobState, pipeline: JobGraph) -> None:
    """Every operator's parallelism at start; refuses a checkpoint the job no longer fits."""
    old = job.committed.manifest.operators if job.committed.manifest else {}
    uids = {s.uid for s in pipeline.keyed_steps}
    for src in pipeline.logs:
        if src.uid in uids:
            raise JobDefinitionError(f"the source and a stage both have the uid '{src.uid}'")
        uids.add(src.uid)
        start_parallelism(job, src.uid, old.get(src.uid), src.parallelism)
    for nk in pipeline.nonkeyed_steps:
        start_parallelism(job, nk.uid, old.get(nk.uid), nk.parallelism)
        uids.add(nk.uid)
    for uid in pipeline.broadcasts:
        if uid in uids:
            raise JobDefinitionError(f"the broadcast stream and another operator both have the uid '{uid}'")
        uids.add(uid)
    orphaned = sorted(set(old) - uids)
    if orphaned and not job.opts.allow_non_restored_state:
        raise StateError(
            f"checkpoint {job.committed.manifest.batch if job.committed.manifest else '?'} has state of operator '{orphaned[0]}', which the job no longer has; "
            "pass --allow-non-restored-state (Pipeline.start: allow_non_restored_state=True) to drop it"
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
        p = start_parallelism(job, step.uid, prev, step.parallelism)
        if prev is not None and prev.parallelism != p:
            log.info("operator '%s': restarting at parallelism %d (was %d); key groups are reassigned, no state is rewritten", step.uid, p, prev.parallelism)
    job.history.summary.parallelism = dict(job.scaling.parallelism)


def start_parallelism(job: JobState, uid: str, prev: OperatorCheckpoint | None, own: int | None) -> int:
    """An operator's parallelism at start: -p, else as checkpointed, else its own default, else 1."""
    p = job.opts.parallelism or (prev.parallelism if prev else None) or own or 1
    check_parallelism(p, job.max_parallelism)
    job.scaling.parallelism[uid] = p
    return p


def follow_cores(job: JobState, batch_id: int) -> None:
    """Reactive mode: parallelism follows the executor cores Spark has now (docs/design.md,
    "Parallelism aligned to key groups")."""
    from keyscale.cluster import executor_cores
    from keyscale.scaling.reactive import reactive_parallelism

    cores = executor_cores(job.spark)
    hi = job.opts.scaling_max or job.max_parallelism
    target = reactive_parallelism(cores, job.opts.scaling_min, min(hi, job.max_parallelism), job.max_parallelism)
    changed = {u: p for u, p in job.scaling.parallelism.items() if p != target}
    if not changed:
        return
    log.info("batch %d: reactive: the job has %d executor cores; parallelism %s -> %d", batch_id, cores,
             "/".join(str(p) for p in sorted(set(changed.values()))), target)
    job.jobdir.append_event({"type": "reactive", "batch": batch_id, "executor_cores": cores, "from": changed, "to": target})
    for uid, p in changed.items():
        job.history.summary.rescales.append((batch_id, uid, p, target))
        job.history.note(batch_id, "rescale", f"reactive: the job has {cores} executor cores", operator=uid, **{"from": p, "to": target})
        job.scaling.parallelism[uid] = target


def request_rescale(job: JobState, parallelism: int, operator: str | None = None) -> None:
    """A live rescale asked for (the control API, ``JobHandle.rescale``): recorded in the job
    directory (where ``keyscale rescale`` leaves its requests too) and shown as pending until
    :func:`apply_rescale_requests` applies it before the next batch's intent. A parallelism
    the job cannot take, or an operator it does not have, is a KeyscaleError and changes nothing."""
    check_parallelism(parallelism, job.max_parallelism)
    if operator is not None and operator not in job.scaling.parallelism:
        raise KeyscaleError(f"the job has no keyed operator '{operator}' (it has {', '.join(job.scaling.parallelism)})")
    job.jobdir.request_rescale(parallelism, operator)
    pending = dict((job.scaling.pending_rescale or {}).get("parallelism", {}))
    pending[operator or "*"] = parallelism
    job.scaling.pending_rescale = {"parallelism": pending, "requested_ms": int(time.time() * 1000)}


def apply_rescale_requests(job: JobState, batch_id: int) -> None:
    """Before a new batch's intent: reactive mode, then the pending rescale requests."""
    if job.opts.scaling == "reactive":
        follow_cores(job, batch_id)
    reqs = job.jobdir.read_rescale_requests()
    if not reqs:
        return
    # New executors start cold (their JVMs too): starting workers on them first moves the time
    # until batches run at speed, it does not shorten it (docs/benchmarks.md, "Executors
    # warmed before the rescale"), so a scale-up that waited for executors applies when they came.
    waited = job.scaling.executors_asked is not None
    if awaiting_executors(job, batch_id) or (not waited and awaiting_workers(job, batch_id, max(after_requests(job.scaling.parallelism, reqs).values()))):
        return
    job.jobdir.clear_rescale_requests()
    job.scaling.pending_rescale = None
    for uid in list(job.scaling.parallelism):
        want = reqs.get(uid, reqs.get("*"))
        if want is None or want == job.scaling.parallelism[uid]:
            continue
        try:
            check_parallelism(want, job.max_parallelism)
        except KeyscaleError as e:
            log.error("rescale of '%s' refused: %s", uid, e)
            continue
        log.info("batch %d: rescaling '%s' live from %d to %d subtasks (no restart; key groups reassigned)", batch_id, uid, job.scaling.parallelism[uid], want)
        job.history.summary.rescales.append((batch_id, uid, job.scaling.parallelism[uid], want))
        job.history.note(batch_id, "rescale", "requested (control API, keyscale rescale or the active autoscaler)", operator=uid,
                 **{"from": job.scaling.parallelism[uid], "to": want})
        job.scaling.parallelism[uid] = want


#: Where the autoscaler keeps its input-rate history (the forecast's), per operator.
RATES_KEY = "autoscaler/rates.json"


def make_autoscaler(opts: RunOptions, jobdir: JobDir) -> Autoscaler | None:
    """The job's autoscaler (None: scaling is not ``auto`` or the autoscaler is off), with its SLO
    and the rate history an earlier run of the job left. An SLO keyscale cannot serve is an error:
    without ``--scaling auto`` and an autoscaler that records or acts, or a latency SLO no longer
    than the trigger interval (a record can wait that long for its batch, whatever the parallelism)."""
    slo = opts.slo if isinstance(opts.slo, Slo) or opts.slo is None else parse_slo(opts.slo)
    if opts.scaling not in ("fixed", "auto", "reactive"):
        raise KeyscaleError(f"scaling must be fixed, reactive or auto, not {opts.scaling!r}")
    if opts.scaling == "auto" and opts.autoscaler_mode not in ("off", "recommend", "active"):
        raise KeyscaleError(f"autoscaler mode must be off, recommend or active, not {opts.autoscaler_mode!r}")
    if slo is not None and (opts.scaling != "auto" or opts.autoscaler_mode == "off"):
        raise KeyscaleError(f"--slo {slo}: only the autoscaler sizes for an SLO; add --scaling auto (and --autoscaler recommend or active)")
    if opts.scaling != "auto" or opts.autoscaler_mode == "off":
        return None
    interval = None if opts.until_idle else seconds(opts.trigger_interval)
    if slo is not None and interval is not None and slo.seconds <= interval:
        raise KeyscaleError(f"--slo {slo}: the trigger interval is {opts.trigger_interval}, and a record can wait that long "
                            "for its batch whatever the parallelism; give a target longer than the interval")
    histories: dict[str, RateHistory] = {}
    if slo is not None:
        for uid, d in jobdir.read_json(RATES_KEY).get("operators", {}).items():
            try:
                histories[str(uid)] = RateHistory.from_json(d)
            except ValueError as e:  # a damaged or newer history: the forecast starts over, the job runs
                log.warning("autoscaler: the input-rate history of '%s' in %s is not usable (%s); starting a new one", uid, RATES_KEY, e)
    cfg = opts.autoscaler or AutoscalerConfig(min_parallelism=opts.scaling_min, max_parallelism=opts.scaling_max)
    return Autoscaler(cfg, slo, histories)


def save_rate_history(job: JobState) -> None:
    """The autoscaler's input-rate histories into the job directory, when one began a new bucket."""
    scaler = job.autoscaler
    if scaler is None or not scaler.dirty:
        return
    scaler.dirty.clear()
    doc = {"version": 1, "operators": {uid: h.to_json() for uid, h in scaler.histories.items()}}
    job.jobdir.write_json(RATES_KEY, doc, durable=False)  # losing the latest bucket in a crash costs little


def autoscale(
    job: JobState, batch_id: int, started: float, batch_seconds: float, par: dict[str, int], reports: TaskReports, backlog: int | None,
    latency: Latency | None = None,
) -> None:
    """Feed the batch's metrics to the autoscaler; record, and in active mode apply, its decision."""
    assert job.autoscaler is not None
    mode = job.opts.autoscaler_mode
    interval = None if job.opts.until_idle else seconds(job.opts.trigger_interval)
    decided = False
    for uid, rs in reports.items():
        m = BatchMetrics(
            time=started, uid=uid, parallelism=par[uid], max_parallelism=job.max_parallelism,
            input_records=sum(r.records for r in rs), batch_seconds=batch_seconds, trigger_interval_seconds=interval,
            busy_seconds=tuple(float(r.busy_seconds) for r in rs), records=tuple(r.records for r in rs),
            gc_seconds=tuple(float(r.gc_seconds) for r in rs),  # of the busy time, GC pauses: rates are net of them
            backlog_records=backlog,  # what the source has not read yet: every operator must process it
            latency=latency,  # the batch's end-to-end latency: the same for every operator
            executor_start_seconds=job.scaling.executor_start_seconds,
        )
        d = job.autoscaler.observe(m)
        event = {"type": "autoscaler", "mode": mode, "batch": batch_id, **d.to_dict()}
        job.scaling.decisions[uid] = event
        job.jobdir.append_event(event)
        if d.changes:
            job.history.note(batch_id, "autoscaler", d.reason, operator=uid, mode=mode, **{"from": d.current_parallelism, "to": d.target_parallelism})
        if d.changes:
            decided = True
            if mode == "active":
                log.info("autoscaler: %s", d.reason)
                job.jobdir.request_rescale(d.target_parallelism, uid)
                more = size_executors(job, after_requests(job.scaling.parallelism, job.jobdir.read_rescale_requests()))
                asked = job.scaling.executors_asked
                if more and (asked is None or more > asked.cores):  # a wait already under way for as many goes on
                    job.scaling.executors_asked = ExecutorsAsked(more, time.monotonic())
            else:
                log.info("autoscaler recommends (not applied): %s", d.reason)
    settled = time.monotonic() - job.scaling.executors_sized_at >= EXECUTORS_SETTLE_SECONDS
    if mode == "active" and job.scaling.executors_asked is None and not decided and settled:
        # Nothing decided, nothing awaited: the executors should match the parallelism. They
        # may not: at start Spark can launch one on every worker before the first request
        # reaches the master (the request saw none registered), or an executor was lost.
        size_executors(job, after_requests(job.scaling.parallelism, job.jobdir.read_rescale_requests()))
    slo = event.get("slo") if reports else None
    if isinstance(slo, dict) and slo.get("value_seconds") is not None:  # the SLO is the job's: counted once a batch
        job.scaling.slo_batches += 1
        job.scaling.slo_batches_met += slo["state"] != "missed"
    save_rate_history(job)


def after_requests(parallelism: dict[str, int], requests: dict[str, int]) -> dict[str, int]:
    """Each operator's parallelism once the pending rescale requests (``"*"``: every
    operator) apply: what executors are sized for, so that one operator's decision does not
    release the executors another's pending scale-up is waiting for.

    >>> after_requests({"reader": 1, "totals": 1}, {"totals": 4}), after_requests({"a": 1, "b": 2}, {"*": 3, "a": 1})
    ({'reader': 1, 'totals': 4}, {'a': 1, 'b': 3})
    """
    return {uid: requests.get(uid, requests.get("*", p)) for uid, p in parallelism.items()}


def size_executors(job: JobState, parallelism: dict[str, int]) -> int | None:
    """Compute follows parallelism: on a cluster, ask for as many executor cores as the
    widest operator has subtasks (more when it grows, fewer when it shrinks). Key groups
    that land on a new executor are restored there from the checkpoint. Returns the executor
    cores asked for when they are more than the job has (None otherwise)."""
    from keyscale.cluster.executors import executor_cores, request_executors, sizes_executors

    if not sizes_executors(job.opts.master):
        return None

    per = int(job.spark.sparkContext.getConf().get("spark.executor.cores", "1"))
    want = -(-max(parallelism.values()) // per)
    have = executor_cores(job.spark) // per
    pending = job.committed.pending
    if want < have and pending is not None and not pending.future.done():
        # Asynchronous checkpoints: the last batch's state files may still be uploading from
        # the executors about to go (their tasks ended, their Python workers upload on, so
        # Spark sees them idle), and a killed executor's uploads never arrive: the commit
        # would wait for them until KEYSCALE_UPLOAD_TIMEOUT and fail. Release them once the
        # files are stored; an upload's error is settle's to raise, before the next commit.
        waited = time.monotonic()
        pending.future.exception()
        log.info("batch %d's state files stored (%.1f s) before executors are released", pending.batch, time.monotonic() - waited)
    if want != have and request_executors(job.spark, want):
        job.scaling.executors_sized_at = time.monotonic()
        log.info("asked Spark for %d executors of %d cores (had %d) for parallelism %d", want, per, have, max(parallelism.values()))
        job.jobdir.append_event({"type": "executors", "requested": want, "had": have, "cores_per_executor": per})
        # Fewer executors: Spark released idle ones between two batches, their uploads done,
        # and schedules no task on them (countFailures off). More take seconds to start: a
        # scale-up waits for them.
        return want * per if want > have else None
    return None


def executor_wait(have: int, wanted: int, waited: float, bound: float) -> str:
    """What a scale-up that asked for ``wanted`` executor cores does, with ``have`` there
    after ``waited`` seconds: ``go`` (they came), ``late`` (not within ``bound`` seconds: go on
    with the cores there are, tasks beyond them queue) or ``wait`` (the batch runs at the old
    parallelism: a batch at the new one on too few cores would run its tasks in waves).

    >>> executor_wait(2, 4, 3.0, 30.0), executor_wait(4, 4, 3.0, 30.0), executor_wait(2, 4, 30.0, 30.0)
    ('wait', 'go', 'late')
    """
    if have >= wanted:
        return "go"
    return "late" if waited >= bound else "wait"


def awaiting_executors(job: JobState, batch_id: int) -> bool:
    """Whether the pending rescale waits (this batch too) for the executors the autoscaler
    asked Spark for; said in the log once, and in the events when the wait ends."""
    if job.scaling.executors_asked is None or job.autoscaler is None:
        return False
    from keyscale.cluster import executor_cores

    asked, bound = job.scaling.executors_asked, job.autoscaler.config.executor_wait_seconds
    wanted, have, waited = asked.cores, executor_cores(job.spark), time.monotonic() - asked.asked_at
    verdict = executor_wait(have, wanted, waited, bound)
    if verdict == "wait":
        if not asked.said:
            asked.said = True
            log.info("batch %d: the scale-up waits for its executors (%d of %d cores; at most %.0f s), running at the old parallelism "
                     "meanwhile, in batches of about %.0f s so that it rescales soon after they come", batch_id, have, wanted, bound, WAITING_SECONDS)
        return True
    job.scaling.executors_asked = None
    job.scaling.executor_waits.append(waited)
    said = "came" if verdict == "go" else f"did not all come within {bound:.0f} s; rescaling on the cores there are"
    log.info("batch %d: executors for the scale-up %s (%d of %d cores after %.1f s)", batch_id, said, have, wanted, waited)
    job.jobdir.append_event({"type": "executors_" + ("ready" if verdict == "go" else "late"), "batch": batch_id, "cores": have,
                             "wanted": wanted, "waited_seconds": round(waited, 1)})
    return False


# --------------------------------------------------------------------------- Python workers for a scale-up
#
# A batch at a higher parallelism runs more Python tasks at once, and a Python worker Spark
# starts for one imports pyarrow, pandas and keyscale's task side before its task begins:
# 0.55 s on a quiet machine, more beside a running job. That start was most of a scale-up's
# first batch (1.4-1.9 s against 0.2-0.4 s for the batches around it, at 5,000 records/s:
# docs/benchmarks.md, "Python workers started before a scale-up"), and every record of the
# batch waited for it.
#
# So a scale-up that runs more tasks at once (not one whose extra subtasks queue for the
# cores there are, nor one that waited for new executors: apply_rescale_requests) first
# runs a small Spark job, beside the batches at the old parallelism, with a task for each
# subtask of the new one (``runtime/task/spark.py`` ``start_worker``): the tasks land on
# the free cores, each in a worker it starts. Spark reuses an idle worker
# (``spark.python.worker.reuse``, keyscale's default) and stops idle ones only after a
# minute with no task at all, so the rescale, applied at the first batch after that job,
# finds them started. A job that does not end within ``WARMUP_BOUND_SECONDS`` (or fails)
# does not hold the rescale up longer: it applies without. With worker reuse turned off
# there is nothing to keep, and no such job.

#: How long a scale-up waits for its workers to start before it applies without them.
WARMUP_BOUND_SECONDS = 30.0


def start_workers(spark: SparkSession, parallelism: int) -> WorkerStart:
    """Run, on a thread of its own, a Spark job of ``parallelism`` tasks, each starting a
    Python worker (when none is idle) and holding it a moment."""
    from keyscale._spark_map import map_in_arrow
    from keyscale.runtime.task.spark import start_worker

    w = WorkerStart(parallelism)

    def run() -> None:
        try:
            spark.sparkContext.setLocalProperty("spark.job.description", f"keyscale: starting Python workers for {parallelism} subtasks")
            map_in_arrow(spark.range(0, parallelism, 1, parallelism), start_worker, "id long").collect()
        except Exception as e:  # the rescale goes on without: its first batch starts what it needs
            w.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        finally:
            w.done.set()

    threading.Thread(target=run, name="keyscale-worker-start", daemon=True).start()
    return w


def more_at_once(current: int, wanted: int, cores: int) -> bool:
    """Whether a rescale from ``current`` to ``wanted`` subtasks runs more tasks at once on
    ``cores`` executor cores (beyond them, tasks queue for a core and reuse its worker).

    >>> more_at_once(1, 2, 2), more_at_once(2, 3, 2), more_at_once(2, 1, 2), more_at_once(1, 4, 4)
    (True, False, False, True)
    """
    return min(wanted, cores) > min(current, cores)


def awaiting_workers(job: JobState, batch_id: int, wanted: int) -> bool:
    """Whether a pending rescale to ``wanted`` subtasks (the widest operator's) waits, this
    batch too, for the Python workers it starts first: a scale-up that runs more tasks at
    once does, once."""
    from keyscale.cluster import executor_cores

    current = max(job.scaling.parallelism.values(), default=1)
    w = job.scaling.worker_start
    if not more_at_once(current, wanted, executor_cores(job.spark)) or _reuse_off(job.spark):
        job.scaling.worker_start = None
        return False
    if w is None or w.parallelism != wanted:
        job.scaling.worker_start = start_workers(job.spark, wanted)
        log.info("batch %d: starting Python workers for %d subtasks before the rescale (a worker's start would otherwise "
                 "hold up its first batch); batches run at the old parallelism meanwhile", batch_id, wanted)
        return True
    waited = time.monotonic() - w.started
    if not w.done.is_set():
        if waited < WARMUP_BOUND_SECONDS:
            return True
        log.warning("batch %d: Python workers for %d subtasks not started within %.0f s; rescaling without them", batch_id, wanted, waited)
    elif w.error is not None:
        log.warning("batch %d: starting Python workers for %d subtasks failed (%s); rescaling without them", batch_id, wanted, w.error)
    else:
        log.info("batch %d: Python workers for %d subtasks started in %.1f s", batch_id, wanted, waited)
    job.scaling.worker_start = None
    return False


def _reuse_off(spark: SparkSession) -> bool:
    return spark.sparkContext.getConf().get("spark.python.worker.reuse", "true").strip().lower() == "false"
