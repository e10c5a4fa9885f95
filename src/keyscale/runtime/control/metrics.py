"""A running job's metrics in Prometheus' text format (``GET /metrics``), and its liveness.

Names follow Flink's metrics in spirit (operator parallelism, records in and out, busy
time, state size per subtask, checkpoint duration and size, source lag), prefixed
``keyscale_`` and labelled by ``job``, ``operator`` and ``subtask``. Everything is read
from the job's status, its last committed manifest and its run summary when Prometheus
scrapes: nothing is counted twice and the job's hot path does not change. Runs on the
control API's threads (driver process); sees the job only through
:class:`~keyscale.runtime.control.running.RunningJob`.

:func:`families` is pure (status, manifest, summary in; metric families out), so it is
tested without Spark:

>>> from keyscale.runtime.batch.jobstate import RunSummary
>>> fams = families({"job": "rc", "state": "running", "operators": {"totals": {"parallelism": 2}}}, None, RunSummary("rc", "d"), 0)
>>> [(s.name, s.labels, float(s.value)) for f in fams if f.name == "keyscale_operator_parallelism" for s in f.samples]
[('keyscale_operator_parallelism', {'job': 'rc', 'operator': 'totals'}, 2.0)]
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry

from keyscale.checkpoint.manifest import Manifest
from keyscale.runtime.batch.jobstate import RunSummary

if TYPE_CHECKING:
    from keyscale.runtime.control.running import RunningJob

__all__ = ["STATES", "families", "health", "registry_for"]

STATES = ("starting", "running", "draining", "stopped", "failed")


def _gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels)


def families(status: dict[str, Any], committed: Manifest | None, summary: RunSummary, now_ms: int) -> list[Metric]:
    """The job's metric families from its status (``GET /status``), last manifest and summary."""
    job = str(status.get("job", summary.job))
    return [*_run_families(job, status, summary), *_latency_families(job, status, summary), *_checkpoint_families(job, committed, now_ms),
            *_operator_families(job, status)]


def _run_families(job: str, status: dict[str, Any], summary: RunSummary) -> list[Metric]:
    """The job's state, and what this run did: batches, records, rescales, the last batch's time."""
    out: list[Metric] = []
    state = _gauge("keyscale_job_state", "1 for the job's current state (starting, running, draining, stopped, failed)", ["job", "state"])
    for s in STATES:
        state.add_metric([job, s], 1.0 if status.get("state") == s else 0.0)
    out.append(state)

    batches = CounterMetricFamily("keyscale_batches", "Batches this run committed", labels=["job"])
    batches.add_metric([job], len(summary.batches))
    records_in = CounterMetricFamily("keyscale_records_in", "Records this run read from its source", labels=["job"])
    records_in.add_metric([job], sum(b.records for b in summary.batches))
    records_out = CounterMetricFamily("keyscale_records_out", "Rows this run wrote to its sink", labels=["job"])
    records_out.add_metric([job], sum(max(b.emitted, 0) for b in summary.batches))
    rescales = CounterMetricFamily("keyscale_rescales", "Live rescales this run applied, per operator", labels=["job", "operator"])
    per_op: dict[str, int] = {}
    for _, uid, _, _ in summary.rescales:
        per_op[uid] = per_op.get(uid, 0) + 1
    for uid, n in sorted(per_op.items()):
        rescales.add_metric([job, uid], n)
    out += [batches, records_in, records_out, rescales]

    if summary.batches:
        last = summary.batches[-1]
        duration = _gauge("keyscale_last_batch_duration_seconds", "Wall time of the last committed batch, from intent to manifest", ["job"])
        duration.add_metric([job], last.seconds)
        out.append(duration)
    return out


def _latency_families(job: str, status: dict[str, Any], summary: RunSummary) -> list[Metric]:
    """End-to-end latency (keyscale.latency): the run's histogram, and the quantiles of the
    last batch that measured any (the status's ``latency``)."""
    out: list[Metric] = []
    if status.get("latency") is not None:
        lat = status["latency"]
        quantiles = _gauge("keyscale_last_batch_latency_seconds", "End-to-end latency of the records of the last batch that measured any, "
                           "from their append to the source to the commit of its output: p50, p99 and max", ["job", "quantile"])
        for q, key in (("0.5", "p50_seconds"), ("0.99", "p99_seconds"), ("1", "max_seconds")):
            quantiles.add_metric([job, q], lat[key])
        out.append(quantiles)
        if lat.get("lag_seconds") is not None:
            lag = _gauge("keyscale_lag_seconds", "How long the oldest record of the last batch that measured any had waited when the "
                         "batch began: the job's lag then, the age of its oldest unread record", ["job"])
            lag.add_metric([job], lat["lag_seconds"])
            out.append(lag)
    # One observation per record measured (a Histogram cannot take a weight: the batches'
    # bucket counts are added up in the run's summary and served as they are).
    latency = HistogramMetricFamily("keyscale_end_to_end_latency_seconds", "End-to-end latency of each record this run measured, from its "
                                    "append to the source (Kafka timestamp, log segment write, file modification time) to the commit of its batch's output", labels=["job"])
    latency.add_metric([job], buckets=list(summary.latency.cumulative()), sum_value=summary.latency.sum_seconds)
    out.append(latency)
    size = status.get("batch_size")
    if size is not None and size.get("records") is not None:  # with a latency target (runtime/batch/sizing.py)
        limit = _gauge("keyscale_batch_read_limit_records", "The most records the last batch could read from the source under the "
                       "job's latency target (or the source's own limit, if smaller: the status's batch_size says which)", ["job"])
        limit.add_metric([job], float(size["records"]))
        meets = _gauge("keyscale_batch_meets_latency_target", "1 if the last batch's size, at the costs measured, keeps a record's "
                       "latency (two batch times) within the job's latency target and keeps up with its input", ["job"])
        meets.add_metric([job], 1.0 if size.get("meets_target") else 0.0)
        out += [limit, meets]
    return out


def _checkpoint_families(job: str, committed: Manifest | None, now_ms: int) -> list[Metric]:
    """The last committed checkpoint: its batch, age and state's size (none before the first)."""
    if committed is None:
        return []
    batch = _gauge("keyscale_last_checkpoint_batch", "The last committed batch (its checkpoint)", ["job"])
    batch.add_metric([job], committed.batch)
    age = _gauge("keyscale_last_checkpoint_age_seconds", "Seconds since the last checkpoint was committed", ["job"])
    age.add_metric([job], max(0.0, (now_ms - committed.created_ms) / 1000) if committed.created_ms else 0.0)
    size = _gauge("keyscale_checkpoint_size_bytes", "Bytes of state files the last checkpoint names, per operator", ["job", "operator"])
    state_bytes = _gauge("keyscale_subtask_state_bytes", "Bytes of checkpointed state per subtask's key-group range", ["job", "operator", "subtask"])
    for uid, op in sorted(committed.operators.items()):
        if not op.key_columns:
            continue
        size.add_metric([job, uid], sum(f.bytes for f in op.files))
        for i, n in enumerate(op.state_bytes_per_subtask()):
            state_bytes.add_metric([job, uid, str(i)], n)
    return [batch, age, size, state_bytes]


def _operator_families(job: str, status: dict[str, Any]) -> list[Metric]:
    """From the status: the watermark, each operator's subtasks and sources, records not
    processed normally, and the scaling decisions."""
    out: list[Metric] = []
    if status.get("watermark_ms") is not None:
        wm = _gauge("keyscale_watermark_seconds", "The job's event-time watermark (Unix seconds)", ["job"])
        wm.add_metric([job], status["watermark_ms"] / 1000)
        out.append(wm)

    parallelism = _gauge("keyscale_operator_parallelism", "Subtasks of each operator", ["job", "operator"])
    sub_records = _gauge("keyscale_subtask_records_in", "Records each subtask got in the last batch", ["job", "operator", "subtask"])
    busy = _gauge("keyscale_subtask_busy_seconds", "Seconds each subtask worked in the last batch", ["job", "operator", "subtask"])
    gc_pauses = _gauge("keyscale_subtask_gc_seconds", "Of each subtask's busy seconds in the last batch, the Python garbage collector's pauses",
                       ["job", "operator", "subtask"])
    keys = _gauge("keyscale_subtask_state_keys", "Keys each subtask holds in state after the last batch", ["job", "operator", "subtask"])
    lag = _gauge("keyscale_source_lag_records", "Records of each source partition not yet read", ["job", "operator", "partition"])
    for uid, op in sorted(status.get("operators", {}).items()):
        parallelism.add_metric([job, uid], op.get("parallelism", 0))
        for s in op.get("subtasks", []):
            labels = [job, uid, str(s.get("subtask"))]
            for fam, field in ((sub_records, "records"), (busy, "busy_seconds"), (gc_pauses, "gc_seconds"), (keys, "state_keys")):
                if s.get(field) is not None:
                    fam.add_metric(labels, s[field])
        for reader in op.get("readers", []):
            for part, p in sorted(reader.get("partitions", {}).items()):
                if p.get("lag") is not None:
                    lag.add_metric([job, uid, str(part)], p["lag"])
    out += [parallelism, sub_records, busy, gc_pauses, keys, lag]

    not_normal = CounterMetricFamily("keyscale_records_not_processed", "Records not processed normally since the job started, per operator and reason "
                                     "(late, too_far_ahead, to_late_output, dropped, dropped_null_keys, ...)", labels=["job", "operator", "reason"])
    for uid, counts in sorted(status.get("counters", {}).get("total", {}).items()):
        for reason, n in sorted(counts.items()):
            not_normal.add_metric([job, uid, reason], n)
    out.append(not_normal)

    recommended = _gauge("keyscale_autoscaler_recommended_parallelism", "The autoscaler's last decision per operator", ["job", "operator"])
    for uid, d in sorted(status.get("scaling", {}).get("last_decisions", {}).items()):
        if isinstance(d, dict) and d.get("target_parallelism") is not None:
            recommended.add_metric([job, uid], d["target_parallelism"])
    pending = _gauge("keyscale_rescale_pending", "1 while a live rescale asked for is not applied yet", ["job"])
    pending.add_metric([job], 1.0 if status.get("pending_rescale") else 0.0)
    out += [recommended, pending, *_slo_families(job, status.get("scaling", {}))]
    return out


def _slo_families(job: str, scaling: dict[str, Any]) -> list[Metric]:
    """With an SLO (``--slo``): its target, each operator's last reading and forecast, and the
    run's share of batches within it.

    >>> d = {"slo": {"seconds": 5.0, "value_seconds": 2.5}, "forecast": {"input_rate": 900.0}}
    >>> fams = _slo_families("j", {"slo": "latency=5s", "slo_attainment": 0.98, "last_decisions": {"op": d}})
    >>> [(s.name, s.labels.get("operator"), s.value) for f in fams for s in f.samples]  # doctest: +NORMALIZE_WHITESPACE
    [('keyscale_autoscaler_forecast_input_rate', 'op', 900.0), ('keyscale_slo_target_seconds', 'op', 5.0),
     ('keyscale_slo_value_seconds', 'op', 2.5), ('keyscale_slo_attainment', None, 0.98)]
    """
    if not scaling.get("slo"):
        return []
    forecast = _gauge("keyscale_autoscaler_forecast_input_rate", "The input rate (records/s) the autoscaler's last decision "
                      "forecast for the coming batches, per operator", ["job", "operator"])
    target = _gauge("keyscale_slo_target_seconds", "The latency or lag the autoscaler sizes for (--slo), per operator", ["job", "operator", "kind"])
    value = _gauge("keyscale_slo_value_seconds", "The SLO's measure at the autoscaler's last decision: p99 latency over the "
                   "metrics window, or the lag", ["job", "operator", "kind"])
    kind = str(scaling["slo"]).partition("=")[0]
    for uid, d in sorted(scaling.get("last_decisions", {}).items()):
        if isinstance(d.get("forecast"), dict):
            forecast.add_metric([job, uid], d["forecast"]["input_rate"])
        if isinstance(d.get("slo"), dict):
            target.add_metric([job, uid, kind], d["slo"]["seconds"])
            if d["slo"].get("value_seconds") is not None:
                value.add_metric([job, uid, kind], d["slo"]["value_seconds"])
    attainment = _gauge("keyscale_slo_attainment", "Share of this run's batches whose SLO reading was within the SLO", ["job"])
    if scaling.get("slo_attainment") is not None:
        attainment.add_metric([job], scaling["slo_attainment"])
    return [forecast, target, value, attainment]


class _JobCollector(Collector):
    def __init__(self, runner: RunningJob):
        self.runner = runner

    def collect(self) -> Iterator[Metric]:
        import time

        r = self.runner
        yield from families(r.live_status(), r.last_committed(), r.summary, int(time.time() * 1000))


def registry_for(runner: RunningJob) -> CollectorRegistry:
    """A registry of its own per job (never Prometheus' global one: one process may run several jobs)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_JobCollector(runner))
    return registry


def health(state: str, query_active: bool | None, committed: Manifest | None = None, now_ms: int = 0,
           stopping: bool = False) -> tuple[int, dict[str, Any]]:
    """``GET /health``, which answers without the secret: 200 while the job runs its batches
    or is ending by itself (a stop or restart asked for), else 503 with the reason. The body
    tells the state, the last committed batch and its age, nothing else (no names, paths or
    errors: the job's status has those, behind the secret).

    The code does not depend on the age: a job whose input is idle commits no batch, and a
    probe must not restart it for that (alert on ``keyscale_last_checkpoint_age_seconds``
    where the input is steady).

    >>> health("running", True)
    (200, {'status': 'ok', 'state': 'running', 'last_checkpoint': None, 'last_checkpoint_age_seconds': None})
    >>> health("running", False)[0], health("failed", None)[1]["reason"]
    (503, 'the job is failed')
    >>> health("running", False, stopping=True)[1]["state"]
    'stopping'
    """
    body: dict[str, Any] = {
        "status": "ok",
        "state": "stopping" if stopping and state in ("running", "draining") else state,
        "last_checkpoint": committed.batch if committed is not None else None,
        "last_checkpoint_age_seconds": round(max(0.0, (now_ms - committed.created_ms) / 1000), 3)
        if committed is not None and committed.created_ms else None,
    }
    if body["state"] in ("stopping", "restarting"):
        return 200, body  # ends (or starts again) by itself: a restart by the probe would cut its savepoint short
    if state not in ("running", "draining"):
        return 503, {**body, "status": "down", "reason": f"the job is {state}"}
    if query_active is False:
        return 503, {**body, "status": "down", "reason": "the job's Spark query is not active"}
    return 200, body
