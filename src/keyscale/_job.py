"""A complete job: :class:`Pipeline` (the job graph a sink ends, and ``start``) and
:func:`pipeline`, which joins branches into one job.

Apart from the stream types (:mod:`keyscale._stream`) because a pipeline is what they end
in, not one of them: the graph is finished here, its sinks and poison-record policies
checked, and nothing here builds a stream. The stream types import this module (``sink``
returns a :class:`Pipeline`); it imports none of them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from keyscale._keywords import checked_keywords
from keyscale._steps import JobGraph, Step, TransformStep
from keyscale.errors import JobDefinitionError
from keyscale.operators.poison import ErrorPolicy

if TYPE_CHECKING:
    from keyscale.runtime.control.handle import JobHandle


@dataclass(frozen=True)
class Pipeline(JobGraph):
    """A complete job: one source, its stages, and one sink per branch (the job graph,
    :class:`keyscale._steps.JobGraph`, which the runtime runs), and :meth:`start`."""

    def start(self, job_dir: str, parallelism: int | None = None, *, name: str | None = None, **options: Any) -> JobHandle:
        """Run this pipeline on the SparkSession it was built on, in a background thread of
        this process, with its state in ``job_dir``; returns a :class:`keyscale.JobHandle`
        (``status()``, ``rescale(n)``, ``savepoint()``, ``stop(savepoint=True)``,
        ``await_termination()``) once the job is set up.

        ``name`` is the job's name (default: the job directory's last part); a job
        directory remembers it, so a later start in the same directory resumes from its
        checkpoint. ``options`` are :class:`~keyscale.runtime.batch.jobstate.RunOptions` fields:
        ``until_idle=True`` (end when the input is read), ``trigger_interval="1 second"`` (a log
        source's batches run back to back while records wait, and at least once an interval;
        ``wait_for_trigger=True``: one per interval at most), ``latency_target="1s"`` (a log
        source's batches sized for that end-to-end latency, never below what keeps up with
        the input nor above the source's own ``max_records_per_batch``; the status's ``batch_size``),
        ``max_parallelism``, ``from_savepoint``, ``scaling="fixed"|"reactive"|"auto"`` (with ``"auto"``:
        ``autoscaler_mode="recommend"|"active"``, ``slo="latency=5s"`` or ``"lag=30s"``, the target it sizes for),
        ``retain``, ``drain_at_end``, ``state_backend="memory"|"rocksdb"`` (the keyed stages'
        default; a stage's own ``state_backend=`` wins), ``control_host="0.0.0.0"`` and
        ``control_port=9464`` (where the control API listens; default 127.0.0.1, any port),
        ``metrics_token_file=`` or ``metrics_unauthenticated=True`` (who may read ``/metrics``;
        default: the per-run secret)... keyscale changes none of the session's settings.
        """
        from keyscale.runtime.control.handle import start_job

        return start_job(self, job_dir, parallelism, name, **options)



@checked_keywords
def pipeline(*branches: Pipeline) -> Pipeline:
    """One job with several sinks: each argument ends one branch (``stream.sink(...)``), and
    all start from the same ``ks.stream(...)``. A batch runs each stage once, however many
    branches read it, and each sink gets the batch exactly once.

    Branch after any stage: ``events.key_by("user").window(...).aggregate(...)`` and
    ``events.key_by("page").aggregate(...)`` read the same ``events``; or send one stage's
    rows to two sinks::

        events = ks.stream(df).with_watermark("ts", "10 seconds")
        sessions = events.key_by("user").window(ks.windows.SessionWindows("30 minutes")).aggregate(uid="sessions", clicks=ks.aggregates.count())
        pages = events.key_by("page").aggregate(uid="page_counts", views=ks.aggregates.count())
        return ks.pipeline(sessions.sink(ks.sinks.ParquetSink(a)), pages.sink(ks.sinks.ParquetSink(b)), pages.sink(ks.sinks.ConsoleSink()))
    """
    if not branches:
        raise JobDefinitionError("keyscale.pipeline() needs at least one branch: stream.sink(...)")
    wrong = next((b for b in branches if not isinstance(b, Pipeline)), None)
    if wrong is not None:
        raise JobDefinitionError(f"keyscale.pipeline() takes branches ending in .sink(...), not {type(wrong).__name__}")
    first = branches[0]
    if any(b.source is not first.source for b in branches):
        raise JobDefinitionError("the branches of keyscale.pipeline() start from different streams: branch one ks.stream(...) instead")
    if any(b.watermark != first.watermark for b in branches):
        raise JobDefinitionError("the branches of keyscale.pipeline() have different watermarks: call with_watermark() once, before branching")
    merged = Pipeline(first.source, tuple(br for b in branches for br in b.branches), first.watermark)
    by_uid: dict[str, Step] = {}
    for s in merged.steps:
        if not isinstance(s, TransformStep) and by_uid.setdefault(s.uid, s) is not s:
            raise JobDefinitionError(f"two stages have the uid '{s.uid}'; each stateful stage needs its own")
    policies: dict[str, ErrorPolicy] = {}
    for b in branches:
        for uid, p in b.policies.items():
            if policies.setdefault(uid, p) != p:
                raise JobDefinitionError(f"operator '{uid}' is in two branches whose sink(on_error=..., max_errors_per_batch=...) differ: give them the same")
    dead = {id(b.dead_letter): b.dead_letter for b in branches if b.dead_letter is not None}
    if len(dead) > 1:
        raise JobDefinitionError("the branches of keyscale.pipeline() have different dead-letter sinks: a job has one; give it on one branch")
    # The job's own policy (malformed input): the strictest of the branches' (fail, then dead_letter).
    inputs = sorted((b.input_policy for b in branches), key=lambda p: ("fail", "dead_letter", "skip").index(p.on_error))
    return check_sinks(replace(merged, policies=policies, dead_letter=next(iter(dead.values()), None), input_policy=inputs[0]))


def check_sinks(p: Pipeline) -> Pipeline:
    """Two outputs into one exactly-once sink would lose rows: a batch's second write finds
    the first one's output and, as a replay does, keeps it."""
    seen: set[str] = set()
    for sink in p.sinks:
        where = sink.describe()
        if sink.exactly_once and where in seen:
            raise JobDefinitionError(f"two outputs of the pipeline write to {where}: each needs a sink of its own")
        seen.add(where)
    return p

