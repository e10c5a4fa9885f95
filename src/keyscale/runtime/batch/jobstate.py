"""What a running job knows between batches, shared by the driver's modules (driver process).

:class:`JobState` holds the run's own facts, a few caches of the query's Spark session, and
the job's changing state in four parts, split by how long what they hold lives. Who writes
what (every assignment to ``job.<field>`` or ``job.<part>.<field>`` under ``src/keyscale``,
and every change in place of its lists and dicts) is listed here only; the classes point here:

- the run's facts, fixed once set-up is done: ``driver/runner.py`` (``opts``, ``jobdir``,
  ``run_id``, ``history``, ``on_batch`` and ``autoscaler`` as it makes the state; ``name`` and
  ``upload_timeout`` at set-up), ``driver/setup.py`` (``max_parallelism``, ``mirror``,
  ``reports``, ``spark``, ``pipeline``, ``lineage``) and ``driver/query.py`` (``malformed``,
  as it builds a Spark source's query, the same each time);
- the caches: ``batch/stages.py`` (``markers``), ``batch/source_plan.py`` (``plans``, and
  ``log_ends``, which ``driver/runner.py`` empties after the caller's ``on_batch``);
- :class:`Committed`: what the last committed checkpoint says (manifest, watermark);
  written by ``driver/setup.py`` at set-up (the recovered or restored manifest, its
  watermark) and by ``batch/commit.py`` at each commit and ``settle`` (manifest, watermark,
  counts, the pending commit, task reports, status);
- :class:`Scaling`: each operator's parallelism for the next batch, a rescale pending;
  written by ``batch/parallelism.py`` only (the parallelism at start, a live rescale request,
  which ``JobRunner.request_rescale`` passes on to it, and its application before a batch's
  intent; reactive mode, the autoscaler's decisions, executors and workers awaited, the
  SLO's tally);
- :class:`BatchScratch`: the running batch's scratch, new each batch; written by
  ``batch/commit.py`` (made new in ``run_batch``; the malformed records the driver counted,
  each step's seconds, when the output became visible, whether a keyed stage reads the
  log), ``batch/source_plan.py`` (``log_ids``: the logs its plans are for) and
  ``batch/sizing.py`` (``read_limit``);
- :class:`History`: what the status and dashboard show of the run (state, error, summary,
  timelines); written by ``driver/runner.py`` (state, error, savepoints; the summary's job
  name and Spark's trigger times), ``driver/setup.py`` (the summary's recovered and
  discarded checkpoints), ``batch/commit.py`` (each batch's record, the batches skipped, the
  summary's parallelism) and ``batch/parallelism.py`` (rescales and the autoscaler's
  decisions, as events; the summary's parallelism at start).

The other modules given a ``JobState`` (``batch/status.py``, ``driver/failures.py``) only
read it. Plain records: no I/O, nothing of Spark's but the session's type.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from keyscale._faults import armed
from keyscale.checkpoint.jobdir import JobDir
from keyscale.checkpoint.lineage import Lineage
from keyscale.checkpoint.manifest import Manifest
from keyscale.latency import Latency, LatencyTotals
from keyscale.operators.eventtime import WatermarkState, ahead_limit_ms
from keyscale.runtime.task import counters
from keyscale.runtime.task.report import Reports, TaskReports
from keyscale.scaling.policy import Autoscaler, AutoscalerConfig
from keyscale.scaling.slo import Slo

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from keyscale._steps import JobGraph
    from keyscale.checkpoint.sparkmirror import SparkMirror
    from keyscale.runtime.batch.malformed import Watched
    from keyscale.scaling.batch_size import ReadLimit


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
    # A log source's batches (driver/runner.py): False, the next batch starts as soon as the last one
    # committed when records wait in the log, and an idle job starts one when records arrive (checked
    # every IDLE_POLL_SECONDS in source_plan.py) or after the trigger interval; True, one batch per trigger interval at most.
    wait_for_trigger: bool = False
    # A log source's read limit per batch from a latency target ("1s": runtime/batch/sizing.py); None: its own limit only.
    latency_target: str | None = None
    retain: int = 3
    max_chain: int = 8
    max_file_age: int = 32  # a subtask snapshots when its oldest state file is this many batches old
    spark_conf: dict[str, str] = field(default_factory=dict)
    scaling: str = "fixed"  # "fixed" | "auto"
    autoscaler_mode: str = "recommend"  # with scaling "auto": "off" | "recommend" | "active"
    autoscaler: AutoscalerConfig | None = None
    # With scaling "auto": the latency or lag the autoscaler sizes for ("latency=5s", "lag=30s"
    # or a keyscale.scaling.slo.Slo); None sizes for utilisation alone.
    slo: str | Slo | None = None
    from_savepoint: str | None = None
    allow_non_restored_state: bool = False
    allow_empty_restart: bool = False  # no intact checkpoint left: start with empty state, re-read the input
    drain_at_end: bool = False  # with until_idle: end with a drain (every event-time timer and window fires)
    scaling_min: int = 1  # bounds of reactive mode and the autoscaler
    scaling_max: int | None = None  # None: the number of key groups
    state_backend: str = "memory"  # keyed stages' default: "memory" | "rocksdb" (a stage's own state_backend= wins)
    # A batch's state files upload while the next batch runs; its manifest commits once they are stored.
    async_checkpoints: bool = False
    # The control API (keyscale.runtime.control.settings): None takes the environment variable
    # of the same setting, else the default (127.0.0.1, any free port, /metrics with the secret).
    control_host: str | None = None
    control_port: int | None = None
    metrics_token_file: str | None = None
    metrics_unauthenticated: bool | None = None
    # test-only: "<point>:<batch>", point mid-batch, mid-upload, between-sinks, after-sink, in-compaction,
    # and with asynchronous checkpoints slow-upload, fail-upload, worker-dies-mid-upload
    fault: str | None = None


@dataclass
class BatchRecord:
    batch: int
    seconds: float
    records: int
    emitted: int
    parallelism: dict[str, int]
    replayed: bool = False
    requests: dict[str, int] = field(default_factory=dict)  # storage requests of the batch, driver and tasks, per kind
    # End-to-end latency of its records (keyscale.latency; None: its source keeps no append times).
    latency: Latency | None = None


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
    # Every measured record's end-to-end latency, in the buckets of keyscale_end_to_end_latency_seconds.
    latency: LatencyTotals = field(default_factory=LatencyTotals)

    @property
    def records(self) -> int:
        return sum(b.records for b in self.batches)


HISTORY = 720  # batches (and events) the dashboard's timelines show


@dataclass(frozen=True)
class PendingCommit:
    """A batch run and not yet committed: its manifest, built, commits in ``future`` once
    the state files it names are stored (runtime/batch/commit.py, ``settle``)."""

    batch: int
    manifest: Manifest
    future: Future[None]
    previous: Manifest | None  # the manifest committed before it


@dataclass
class Committed:
    """What the last committed checkpoint says, and what moves on with each commit: its
    manifest, the watermark, the status and task reports as of that commit. Who writes it:
    the module's docstring."""

    # The last committed batch's manifest (or the pending one's: see ``pending``).
    manifest: Manifest | None = None
    watermark: WatermarkState = field(default_factory=WatermarkState)
    # Asynchronous checkpoints: the batch whose manifest commits in the background (at most one).
    pending: PendingCommit | None = None
    status: dict[str, Any] | None = None  # the status as of the last commit (what a heartbeat writes)
    task_reports: TaskReports | None = None  # the last batch's task reports, per operator
    counts: counters.Counters = field(default_factory=dict)  # the last batch's counts of records not processed normally


@dataclass
class ExecutorsAsked:
    """A scale-up's request for executors, which its rescale waits for."""

    cores: int  # the executor cores the new parallelism needs
    asked_at: float  # time.monotonic() of the request
    said: bool = False  # whether the log said that a batch waits for them


@dataclass
class WorkerStart:
    """A Spark job under way that starts Python workers for a scale-up to ``parallelism``
    subtasks, which its rescale waits for (``batch/parallelism.py`` ``awaiting_workers``)."""

    parallelism: int
    started: float = field(default_factory=time.monotonic)
    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None  # why the job failed


EXECUTOR_WAITS_KEPT = 3


@dataclass
class Scaling:
    """Each operator's parallelism for the next batch, and what asks to change it. Who
    writes it: the module's docstring."""

    parallelism: dict[str, int] = field(default_factory=dict)  # per operator uid, for the next batch
    pending_rescale: dict[str, Any] | None = None  # a live rescale asked for and not yet applied: parallelism, requested_ms
    decisions: dict[str, dict[str, Any]] = field(default_factory=dict)  # the autoscaler's last, per operator
    # With an SLO: this run's batches whose SLO reading was measured, and those within the SLO.
    slo_batches: int = 0
    slo_batches_met: int = 0
    # Executor cores asked of Spark for a scale-up: the rescale waits for them
    # (``batch/parallelism.py`` ``awaiting_executors``). None: nothing awaited.
    executors_asked: ExecutorsAsked | None = None
    # How long the last scale-ups waited for their executors (measured; the newest last).
    executor_waits: deque[float] = field(default_factory=lambda: deque(maxlen=EXECUTOR_WAITS_KEPT))
    executors_sized_at: float = 0.0  # time.monotonic() of the last request for executors: none is checked again before they settle
    # Python workers being started for a scale-up (``batch/parallelism.py`` ``awaiting_workers``); None: none.
    worker_start: WorkerStart | None = None

    @property
    def executor_start_seconds(self) -> float:
        """What a scale-up is expected to wait for its executors: the longest of the last
        ``EXECUTOR_WAITS_KEPT`` waits (0 before the first). The autoscaler's lead counts it;
        the last wait alone was too short as often as not (7.8-15.8 s on one local cluster,
        docs/benchmarks.md "Fourth run"), and a lead shorter than the wait meets a forecast
        rise late."""
        return max(self.executor_waits, default=0.0)


@dataclass
class BatchScratch:
    """The running batch's scratch: new for each batch (``batch/commit.py``, ``run_batch``).
    Who writes it: the module's docstring."""

    input_counts: counters.Counters = field(default_factory=dict)  # the batch's malformed records, counted by the driver
    log_ids: dict[str, str | None] = field(default_factory=dict)  # per log source or rules stream: the id of the log its plan is for
    # Seconds of each step of the commit protocol so far (commit.py's ``_Clock.lap``): the batch's profile.
    steps: dict[str, float] = field(default_factory=dict)
    # When the batch's output became visible: every sink's write committed (Unix seconds).
    visible_at: float | None = None
    # With a latency target, the driving log source's read limit in force and why: the last batch's until this one's plan decides (sizing.py; the status's batch_size).
    read_limit: ReadLimit | None = None
    # Whether its log records go straight to its first keyed stage, read by that stage's tasks (stages.py ``reading_stage``).
    read_in_stage: bool = False


@dataclass
class History:
    """What the status and the dashboard show of this run: its state, its error, the run's
    summary, and the recent batches, events and savepoints (``GET /history``; bounded, this
    run only: events.jsonl keeps everything). Who writes it: the module's docstring."""

    summary: RunSummary
    state: str = "starting"  # "starting" | "running" | "draining" | "restarting" | "stopped" | "failed" (status.json, GET /status)
    last_error: dict[str, Any] | None = None  # why the job failed: message, traceback, batch, time_ms
    batches: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=HISTORY))
    events: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=HISTORY))
    savepoints: list[dict[str, Any]] = field(default_factory=list)

    def note(self, batch: int, kind: str, reason: str, **details: Any) -> None:
        """An event the dashboard marks on its timelines (a rescale, an autoscaler decision)."""
        self.events.append({"batch": batch, "time_ms": int(time.time() * 1000), "type": kind, "reason": reason, **details})


@dataclass(eq=False)
class JobState:
    """One running job's state between batches: the run's own facts, fixed once set-up is
    done, the query session's caches, and four parts by lifetime: :class:`Committed`,
    :class:`Scaling`, :class:`BatchScratch`, :class:`History`. Who writes each field and
    part: the module's docstring."""

    opts: RunOptions
    jobdir: JobDir
    run_id: str
    history: History
    # Called after each batch, before the next one starts: committed, or with asynchronous
    # checkpoints run and committing (a rescale it asks for applies at the next batch either way).
    on_batch: Callable[[BatchRecord], None] | None = None
    name: str = ""
    max_parallelism: int = 0
    pipeline: JobGraph | None = None
    lineage: Lineage = field(default_factory=lambda: Lineage(""))  # the job's lineage (sinks' output belongs to it)
    spark: SparkSession = None  # type: ignore[assignment]  # set at set-up
    reports: Reports = field(default_factory=Reports)  # tasks' reports: through Spark once the session is there
    mirror: SparkMirror | None = None  # Spark's checkpoint mirrored into a job directory on an object store
    autoscaler: Autoscaler | None = None
    malformed: Watched | None = None  # the corrupt-record column of a JSON/CSV source, whose rows on_error handles
    # Per keyed stage, its marker rows in the query's Spark session (stages.routed): a cache, the same every batch.
    markers: dict[str, dict[Any, Any]] = field(default_factory=dict)
    # Parts of a batch's plan that are the same every batch (source_plan.reader_rows), in the job's Spark session.
    plans: dict[Any, Any] = field(default_factory=dict)
    # Per log source uid, its end offsets as last read on the driver and when (time.monotonic()):
    # the next batch's plan when fresh (source_plan.ends_for_plan).
    log_ends: dict[str, tuple[float, list[int]]] = field(default_factory=dict)
    # Asynchronous checkpoints: how long a batch's files may take to appear (KEYSCALE_UPLOAD_TIMEOUT, read at set-up).
    upload_timeout: float = 600.0
    # Held while a batch runs, a savepoint is taken or a pending commit settles (JobRunner's
    # batch lock): savepoints are taken between batches, of committed batches only, and
    # retention never deletes files a savepoint is still reading.
    batch_lock: threading.Lock = field(default_factory=threading.Lock)
    committed: Committed = field(default_factory=Committed)
    scaling: Scaling = field(default_factory=Scaling)
    batch: BatchScratch = field(default_factory=BatchScratch)

    def fault(self, point: str, batch_id: int) -> bool:
        """Whether the test-only fault ``--fault <point>:<batch>`` is asked for here (keyscale/_faults.py)."""
        return armed(self.opts.fault, point, batch_id)

    def event_time_limit(self, batch_time_ms: int) -> int | None:
        """The latest event time a batch believes (with_watermark's max_ahead after its time)."""
        spec = self.pipeline.watermark if self.pipeline else None
        return ahead_limit_ms(spec.max_ahead_ms, batch_time_ms) if spec is not None else None


def seconds(interval: str) -> float | None:
    """Seconds of a Spark trigger interval such as "1 second" or "200 milliseconds"."""
    number, _, unit = interval.strip().partition(" ")
    try:
        value = float(number)
    except ValueError:
        return None
    scale = {"ms": 0.001, "millisecond": 0.001, "milliseconds": 0.001, "minute": 60.0, "minutes": 60.0}.get(unit.strip().lower(), 1.0)
    return value * scale


def watermark_of(m: Manifest | None) -> WatermarkState:
    """The watermark a job resumes with from its last manifest."""
    if m is None:
        return WatermarkState()
    state = WatermarkState.from_json(m.extra.get("watermark"))
    if m.watermark_ms is not None and m.watermark_ms > state.watermark_ms:
        state = replace(state, watermark_ms=m.watermark_ms)
    return state


def session_cache(cache: dict[Any, Any], spark: SparkSession) -> dict[Any, Any]:
    """``cache`` (``JobState.markers``' or ``plans``' DataFrames), emptied first if it was
    filled in another Spark session. PySpark wraps each micro-batch in a new SparkSession
    object around the query's own (Java) session: the cache is that session's (a restarted
    query has a new one)."""
    session = spark._jsparkSession
    # The same Python object is the same session (the log loop's every batch): no call to the JVM.
    if "session" not in cache or (cache["session"] is not session and not cache["session"].equals(session)):
        cache.clear()
        cache["session"] = session
    return cache
