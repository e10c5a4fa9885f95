"""The autoscaler policy: per-batch metrics in, a target parallelism out.

This module is pure: no Spark, no clocks, no I/O. The runtime (or the simulation
harness in :mod:`keyscale.scaling.simulate`) feeds it one :class:`BatchMetrics` per
keyed operator per micro-batch and gets a :class:`Decision` back, with the inputs
it used and a sentence explaining it.

It is three pieces, each pure and tested alone, that this module runs in turn per batch
and keeps the state of (the metrics window, the last change, a pending scale-down):
:mod:`keyscale.scaling.load` (what the batches measured: input rate, backlog, the target
rate), :mod:`keyscale.scaling.capacity` (what one subtask processes, so what each
parallelism can do) and :mod:`keyscale.scaling.decision` (the rule that picks, as a table
of cases, with its reason in words).

With an SLO (``Autoscaler(config, slo=parse_slo("latency=5s"))``, :mod:`keyscale.scaling.slo`)
a fourth piece, :mod:`keyscale.scaling.outlook`, takes part: the backlog is sized to be
worked off within what the SLO leaves, the rate sized for includes the forecast
(:mod:`keyscale.scaling.forecast`, from the operator's input-rate history, which the policy
keeps in ``histories`` for the caller to save), and its guards check the decision (a missed
SLO scales up, a scale-down needs the SLO met with room for its longer batches, no backlog, room under the
rescale cap, and savings above the cost of a rescale). Without an SLO none of this runs.

The policy follows the ideas of Flink's Kubernetes operator autoscaler
(``ScalingMetricEvaluator`` / ``JobVertexScaler``), adapted to micro-batches that
can be rescaled live, between two batches, at near-zero cost:

* **True processing rate.** How many records one subtask handles per second of
  busy time: ``records / busy seconds``, aggregated over a metrics window. It is a
  property of the code and the hardware, not of the load, so it can be measured
  at any load level. Busy seconds are net of the Python garbage collector's pauses
  (``BatchMetrics.gc_seconds``, :func:`keyscale.scaling.load.net_busy`): GC pressure is
  not read as load.
* **Skew.** A micro-batch ends when its slowest task ends, so the *hottest*
  subtask bounds the job's throughput. The job's capacity at parallelism ``P`` is
  ``records / busy seconds of the busiest subtask`` (summed over the window), and
  the effective rate of one subtask is that divided by ``P``. With evenly spread
  key groups this equals the plain mean rate; with skew it is lower, and the
  policy assumes the skew (the hottest subtask's share relative to a fair share)
  persists at the new parallelism.
* **Target rate.** ``input rate + (backlog + input rate * restart time) / catch-up
  duration``: the job must keep up with the input *and* work off what is queued.
* **Target parallelism.** ``ceil(target rate / (rate per subtask * target
  utilisation))``, limited per step (``scale_up_max_factor`` /
  ``scale_down_max_factor``), bounded (``min_parallelism`` / ``max_parallelism``,
  never above the number of key groups), and aligned to key groups: the smallest
  ``P >= target`` that divides ``max_parallelism`` gives every subtask the same
  number of key groups (docs/design.md, "Parallelism aligned to key groups").
* **No-action band.** ``utilisation = target rate / current capacity``. Nothing
  happens while it stays within ``target_utilization ± utilization_band`` (the
  upper edge is capped at 1.0: running above capacity always means a growing
  backlog). This is Flink's ``target.utilization.boundary``.
* **Scale-down delay.** A scale-down happens only after below-band evaluations
  have persisted for ``scale_down_delay_seconds`` without interruption; it then
  goes to the *highest* target seen during the delay (Flink's
  ``scale-down.interval``). Scale-ups are immediate: for a live rescale they cost
  almost nothing, and a backlog costs latency.
* **Busy guard.** A job that is behind while its busiest subtask mostly idles
  is limited by something else (typically a per-batch read limit such as
  ``maxOffsetsPerTrigger``): the policy does not scale up and says why.
* **Bounds.** A parallelism outside ``[min_parallelism, max_parallelism]`` (set
  by hand, or the bounds changed) goes to the nearest aligned parallelism within
  them at the first decision after stabilisation, whatever the load and without
  the scale-down delay.
* **Stabilisation.** After every parallelism change (seen in the metrics) and
  after every scaling decision, no new decision is made for
  ``stabilization_seconds``; metrics from before the change are discarded, and
  the first ``warmup_batches`` batches after it (which include state movement)
  are not used to estimate the processing rate.

Modes (handled by the caller; the policy itself never acts):

* ``"off"``: the caller does not feed metrics; nothing is computed or recorded.
* ``"recommend"``: the caller feeds every batch and records every decision
  (``keyscale status``, the events file) but never changes parallelism. Because a
  scaling decision starts a stabilisation period, recommendations repeat at most
  once per ``stabilization_seconds``.
* ``"active"``: as ``recommend``, and a ``scale_up`` / ``scale_down`` decision is
  applied as a live rescale before the next batch.

Example:

Two subtasks that each process 1,000 records per busy second, 5 s trigger; the
input quadruples from 1,000 to 4,000 rec/s:

>>> scaler = Autoscaler(AutoscalerConfig(stabilization_seconds=5, warmup_batches=0))
>>> def batch(t: float, rate: float) -> BatchMetrics:
...     recs = int(rate * 5)                 # records that arrived in 5 s
...     busy = recs / 2 / 1000               # seconds each subtask works
...     return BatchMetrics(time=t, uid="count", parallelism=2, max_parallelism=128,
...                         input_records=recs, batch_seconds=busy,
...                         trigger_interval_seconds=5.0, busy_seconds=(busy, busy),
...                         records=(recs // 2, recs - recs // 2))
>>> scaler.observe(batch(0.0, 1000.0)).action  # stabilising after job start
'none'
>>> d = scaler.observe(batch(5.0, 4000.0))
>>> d.action, d.current_parallelism, d.target_parallelism
('scale_up', 2, 8)
>>> d.inputs["true_rate_per_subtask"]
1000.0
>>> print(d.reason)  # doctest: +NORMALIZE_WHITESPACE
scale up 2 -> 8: utilisation 2.17 vs band 0.50-0.90; input 4,000 rec/s + backlog
20,000 over 60 s catch-up needs 4,333 rec/s; one subtask processes 1,000 rec/s at
70% target utilisation -> 7 subtasks, aligned to 8 (divides 128)
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace

from keyscale.scaling.capacity import Unmeasured, measure_capacity, needed_parallelism
from keyscale.scaling.decision import (
    Case,
    PendingDown,
    Verdict,
    decide,
    nearest_in_bounds,
    sized_target,
    stabilising,
)
from keyscale.scaling.forecast import RateHistory
from keyscale.scaling.load import Load, Sample, arrival_period, batch_sample, measure_load
from keyscale.scaling.model import MODES, Action, AutoscalerConfig, BatchMetrics, Decision, Mode
from keyscale.scaling.outlook import Context, Outlook, guard, outlook, sizing_rate, slo_floor
from keyscale.scaling.room import Band, catch_up_given_back, peak_ratio, slo_band
from keyscale.scaling.slo import Slo

# Re-exported: the autoscaler's key-group alignment is the key-group module's rule.
from keyscale.state.keygroups import aligned_parallelism

__all__ = [
    "MODES",
    "Action",
    "Autoscaler",
    "AutoscalerConfig",
    "BatchMetrics",
    "Decision",
    "Mode",
    "aligned_parallelism",
]


@dataclass
class _OperatorState:
    parallelism: int = 0
    last_time: float | None = None
    change_time: float = 0.0
    last_action_time: float | None = None
    batches_since_change: int = 0
    window: deque[Sample] = field(default_factory=deque)
    known_rate_per_subtask: float | None = None
    pending_down: PendingDown | None = None
    changes: deque[float] = field(default_factory=deque)  # times of parallelism changes, the last hour
    rescale_cost: float = 0.0  # extra seconds the last first batch after a change took (measured)
    last_backlog: int | None = None  # the previous batch's backlog: its growth is input too
    sized_for_backlog: bool = False  # the last scale-up was sized to work off a backlog too (with an SLO)


class Autoscaler:
    """Stateful, pure autoscaling policy for any number of keyed operators.

    Feed one :class:`BatchMetrics` per operator per batch, in time order, to
    :meth:`observe`. The state kept per operator uid is the metrics window, the
    time of the last change, and a pending scale-down.

    Parallelism changes are detected from the metrics (``m.parallelism``
    differing from the previous batch), whoever made them: this policy in active
    mode, reactive mode, or a user.

    When there is no reliable measurement of the processing rate (no records, or
    the busiest subtask's busy time in the window below ``min_busy_seconds``),
    the policy falls back on the rate per subtask measured in an earlier window
    (it describes the code and the hardware, so it survives a rescale); if there
    never was one, it keeps the current parallelism and says so. It never turns
    "nothing measured" into "scale to the minimum". An idle source (zero input,
    no backlog) with a known rate is real evidence, so it does lead to a
    scale-down, through the delay and the step limit like any other.

    >>> scaler = Autoscaler()
    >>> m = BatchMetrics(time=0.0, uid="op", parallelism=4, max_parallelism=128,
    ...                  input_records=0, batch_seconds=0.0,
    ...                  trigger_interval_seconds=5.0, busy_seconds=(0.0,) * 4,
    ...                  records=(0,) * 4)
    >>> scaler.observe(m).reason
    'stabilising: 0 s since parallelism 4 took effect, no decision before 30 s'
    """

    def __init__(
        self, config: AutoscalerConfig | None = None, slo: Slo | None = None,
        histories: dict[str, RateHistory] | None = None,
    ) -> None:
        self.config = config if config is not None else AutoscalerConfig()
        self.slo = slo
        # Per operator, its input rate's history (the forecast's; kept only with an SLO):
        # what the caller loaded from the job directory, and saves when `dirty` says so.
        self.histories: dict[str, RateHistory] = dict(histories or {})
        self.dirty: set[str] = set()
        self._ops: dict[str, _OperatorState] = {}

    def observe(self, m: BatchMetrics) -> Decision:
        """Take one batch's metrics into account and decide.

        A parallelism outside the bounds (``config.bounds``: set by hand, or the bounds
        changed) is brought to the nearest parallelism within them at the first decision
        after stabilisation, whatever the load, with no scale-down delay: a scale-up to
        the smallest aligned parallelism ``>= lower``, a scale-down to the largest aligned
        one ``<= upper`` (the bound itself when no divisor of the key groups fits). A
        load-driven scale-up from below the lower bound goes further if the load needs it.

        >>> scaler = Autoscaler(AutoscalerConfig(min_parallelism=3, stabilization_seconds=0))
        >>> d = scaler.observe(BatchMetrics(time=0.0, uid="op", parallelism=1, max_parallelism=128,
        ...     input_records=10, batch_seconds=0.1, trigger_interval_seconds=5.0,
        ...     busy_seconds=(0.1,), records=(10,)))
        >>> d.action, d.target_parallelism
        ('scale_up', 4)
        >>> print(d.reason.split(";")[0])
        scale up 1 -> 4: parallelism 1 is below the lower bound 3, so it goes to the nearest
        parallelism within [3, 128], aligned to 4 (divides 128)
        """
        d = self._evaluate(m)
        P = m.parallelism
        lower, upper = self.config.bounds(m.max_parallelism)
        if lower <= P <= upper or d.changes:
            # (A change from outside the bounds always lands within them, moving inwards.)
            return d
        st = self._ops[m.uid]
        since = (
            st.change_time
            if st.last_action_time is None
            else max(st.change_time, st.last_action_time)
        )
        if d.time - since < self.config.stabilization_seconds:
            return d
        target, aligned = nearest_in_bounds(
            P, m.max_parallelism, lower, upper, self.config.align_to_key_groups
        )
        below = m.parallelism < lower
        plain = lower if below else upper
        action: Action = "scale_up" if below else "scale_down"
        reason = (
            f"scale {'up' if below else 'down'} {P} -> {target}: parallelism {P} is "
            f"{'below the lower' if below else 'above the upper'} bound {plain}, so it goes to "
            f"the nearest parallelism within [{lower}, {upper}]"
            + (
                f", aligned to {target} (divides {m.max_parallelism})"
                if aligned and target != plain
                else ""
            )
            + f"; by load alone: {d.reason}"
        )
        st.pending_down = None
        st.last_action_time = d.time
        inputs = dict(d.inputs, lower_bound=float(lower), upper_bound=float(upper))
        return Decision(d.time, m.uid, P, target, action, reason, inputs)

    def _evaluate(self, m: BatchMetrics) -> Decision:
        """The decision by load (bounds clamp its target, but an out-of-bounds P may stay):
        the window updated, then load, capacity and the decision's table in turn."""
        cfg = self.config
        st, sample = self._record(m)
        # Decisions are made when the batch's metrics are complete: at its end.
        now = m.time + m.batch_seconds
        # Keep at least the latest batch, however long it ran.
        while len(st.window) > 1 and st.window[0].time < now - cfg.metrics_window_seconds:
            st.window.popleft()
        P = m.parallelism
        lower, upper = cfg.bounds(m.max_parallelism)
        since = (
            st.change_time
            if st.last_action_time is None
            else max(st.change_time, st.last_action_time)
        )
        inputs: dict[str, float] = {
            "seconds_since_change": now - since,
            "window_batches": float(len(st.window)),
        }
        slot = max(m.batch_seconds, m.trigger_interval_seconds or m.batch_seconds)
        # A scale-up on a cluster also waits for its executors: the lead counts that wait too.
        ahead = None if self.slo is None else outlook(
            self.slo, list(st.window), self.histories[m.uid], now, sample.input_rate, slot,
            st.rescale_cost + m.executor_start_seconds, cfg,
        )  # fmt: skip
        waiting = stabilising(now, since, st.change_time, P, cfg)
        if waiting is not None:
            if ahead is None:
                return Decision(now, m.uid, P, P, "none", waiting, inputs)
            # The SLO is measured every batch: the status and its attainment count these too.
            return Decision(now, m.uid, P, P, "none", f"{waiting}; {ahead.reading.text()}", inputs | ahead.inputs(),
                            ahead.reading.to_dict(), ahead.up.to_dict())  # fmt: skip
        cfg, band = self._slo_config(ahead, st, m, slot, inputs)
        load = measure_load(m, st.window, sample.input_rate, cfg)
        inputs.update(load.inputs())
        # The rate is from busy time net of GC pauses (the window's samples: load.net_busy); the
        # busy ratio is the whole busy time, since a subtask in a GC pause is not idle either.
        capacity = measure_capacity(
            st.window, P, max(m.busy_seconds), slot, st.known_rate_per_subtask, cfg.min_busy_seconds
        )
        if isinstance(capacity, Unmeasured):
            return Decision(now, m.uid, P, P, "none", (
                f"no reliable processing-rate measurement yet ({capacity.records:,} records, "
                f"{capacity.busy_hot:.2f} s busy time net of GC pauses in the window): keeping {P} rather than guessing"
            ), inputs)  # fmt: skip
        st.known_rate_per_subtask = capacity.rate_per_subtask
        rate, ahead_text = (load.target_rate, "") if ahead is None else sizing_rate(ahead, load.target_rate, capacity.total, cfg)
        inputs.update(capacity.inputs(rate))
        utilization = capacity.utilization(rate)
        up = utilization > cfg.scale_up_threshold
        U = cfg.target_utilization if band is None or up else band.settle
        raw = needed_parallelism(rate, capacity.rate_per_subtask, U, lower)
        inputs["raw_target_parallelism"] = float(raw)

        target, steps = sized_target(raw, P, up, m.max_parallelism, (lower, upper), cfg)
        load_text = load.text(cfg)
        band_text = "" if band is None else f" ({band.text()})"
        sizing = (
            f"{load_text}{ahead_text}; {capacity.text()} at {U:.0%} target utilisation{band_text} -> {raw} subtasks"
            + ("".join(", " + s for s in steps))
        )
        util_text = f"utilisation {utilization:.2f} vs band {cfg.scale_down_threshold:.2f}-{cfg.scale_up_threshold:.2f}"
        idle = self.config.scale_down_threshold
        case = Case(P, utilization, capacity.busy_ratio, target, now, util_text, load_text, sizing, capacity.total, capacity.gc_text(), idle,
                    None if rate == load.target_rate else capacity.utilization(load.target_rate))
        v = decide(case, st.pending_down, cfg) if ahead is None else self._slo_verdict(case, ahead, st, m, load, raw, inputs, cfg)
        st.pending_down = v.pending
        if v.pending_since is not None:
            inputs["scale_down_pending_since"] = v.pending_since
        if v.action != "none":
            st.last_action_time = now
        if ahead is None:
            return Decision(now, m.uid, P, v.target, v.action, v.reason, inputs)
        used = ahead.down if v.action == "scale_down" or utilization < cfg.scale_down_threshold else ahead.up
        return Decision(now, m.uid, P, v.target, v.action, v.reason, inputs, ahead.reading.to_dict(), used.to_dict())

    def _slo_config(
        self, ahead: Outlook | None, st: _OperatorState, m: BatchMetrics, slot: float, inputs: dict[str, float],
    ) -> tuple[AutoscalerConfig, Band | None]:
        """With an SLO, the backlog is to be worked off within what the SLO leaves, and the
        utilisation to run at is the SLO's too (keyscale.scaling.room), not a fixed band."""
        if ahead is None:
            return self.config, None
        # The slot of a batch that keeps up: a batch that overran is what the band prevents.
        band = slo_band(ahead.reading.slo, m.trigger_interval_seconds or slot, peak_ratio(list(st.window)))
        inputs.update(band.inputs())
        return band.config(replace(self.config, catch_up_seconds=ahead.catch_up_seconds)), band

    def _slo_verdict(
        self, case: Case, ahead: Outlook, st: _OperatorState, m: BatchMetrics, load: Load, raw: int,
        inputs: dict[str, float], cfg: AutoscalerConfig,
    ) -> Verdict:
        """The decision with an SLO: the table's, no scale-down delay for capacity that was for
        a backlog now worked off (keyscale.scaling.room), then the SLO's guards."""
        r = ahead.reading
        given_back = catch_up_given_back(st.sized_for_backlog, _excess(load, m), r.value is not None and not (r.missed or r.at_risk))
        v = decide(case, st.pending_down, cfg if given_back is None else replace(cfg, scale_down_delay_seconds=0.0))
        v = self._guard(v, ahead, st, m, load, case.busy_ratio, raw, inputs, cfg)
        if v.action == "scale_down" and given_back is not None:
            v = replace(v, reason=f"{v.reason}; {given_back}")
        if v.action != "none":
            st.sized_for_backlog = v.action == "scale_up" and load.catch_up_rate > 0
        return v

    def _guard(
        self, v: Verdict, ahead: Outlook, st: _OperatorState, m: BatchMetrics, load: Load,
        busy_ratio: float, raw: int, inputs: dict[str, float], cfg: AutoscalerConfig,
    ) -> Verdict:
        """The SLO's and the anti-thrash guards over the decision (keyscale.scaling.outlook),
        with ``cfg`` the SLO's band (keyscale.scaling.room)."""
        P = m.parallelism
        lower, upper = cfg.bounds(m.max_parallelism)
        no_step_limit = replace(cfg, scale_up_max_factor=max(cfg.scale_up_max_factor, upper / P + 1))
        floor, _ = sized_target(slo_floor(ahead.reading, P, raw), P, True, m.max_parallelism, (lower, upper), no_step_limit)
        while st.changes and st.changes[0] < m.time - 3600:
            st.changes.popleft()
        slot = max(m.batch_seconds, m.trigger_interval_seconds or m.batch_seconds)
        excess = _excess(load, m)
        inputs.update(ahead.inputs())
        inputs.update(rescale_cost_seconds=st.rescale_cost, rescales_last_hour=float(len(st.changes)))
        c = Context(P, floor, busy_ratio, max(0.0, excess), len(st.changes), st.rescale_cost, slot, self.config.scale_down_threshold)
        return guard(v, ahead, c, cfg)

    def _record(self, m: BatchMetrics) -> tuple[_OperatorState, Sample]:
        """Take batch ``m`` into its operator's state and window: a parallelism change (or
        the job's start) empties the window and voids a pending scale-down."""
        st = self._ops.get(m.uid)
        if st is None:
            st = self._ops[m.uid] = _OperatorState()
        if st.last_time is not None and m.time < st.last_time:
            raise ValueError(
                f"metrics for {m.uid!r} went back in time: {m.time} after {st.last_time}"
            )
        period = arrival_period(m, st.last_time)
        if st.last_time is not None and m.parallelism != st.parallelism:
            st.changes.append(m.time)
        if st.last_time is None or m.parallelism != st.parallelism:
            # Metrics from before the change describe another parallelism.
            st.parallelism = m.parallelism
            st.change_time = m.time
            st.batches_since_change = 0
            st.window.clear()
            st.pending_down = None
        st.last_time = m.time
        st.batches_since_change += 1
        sample = batch_sample(
            m, period, warmup=st.batches_since_change <= self.config.warmup_batches,
            last_backlog=st.last_backlog,
        )
        st.last_backlog = m.backlog_records
        st.window.append(sample)
        if self.slo is not None:
            self._learn(m, st, sample)
        return st, sample

    def _learn(self, m: BatchMetrics, st: _OperatorState, sample: Sample) -> None:
        """With an SLO: the input rate into the operator's history, and the cost of a rescale
        from the first batch after a change (its busiest subtask's time, net of GC pauses as the
        known rate is, beyond what its records take at that rate: state moved, caches warmed)."""
        history = self.histories.get(m.uid)
        if history is None or history.bucket_seconds != self.config.forecast_bucket_seconds:
            history = self.histories[m.uid] = RateHistory(self.config.forecast_bucket_seconds)
        if history.add(m.time, sample.input_rate, sample.period):
            self.dirty.add(m.uid)
        known = st.known_rate_per_subtask
        if st.changes and st.batches_since_change == 1 and known:
            st.rescale_cost = max(0.0, sample.busy_hot - sum(m.records) / (known * m.parallelism))


def _excess(load: Load, m: BatchMetrics) -> float:
    """The backlog beyond what one batch leaves unread as a matter of course (the input of
    its own run), in records."""
    return load.backlog - load.rate * max(m.batch_seconds, m.trigger_interval_seconds or 0.0)
