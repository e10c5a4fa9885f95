"""The autoscaler policy: per-batch metrics in, a target parallelism out.

This module is pure: no Spark, no clocks, no I/O. The runtime (or the simulation
harness in :mod:`keyscale.scaling.simulate`) feeds it one :class:`BatchMetrics` per
keyed operator per micro-batch and gets a :class:`Decision` back, with the inputs
it used and a sentence explaining it.

The policy follows the ideas of Flink's Kubernetes operator autoscaler
(``ScalingMetricEvaluator`` / ``JobVertexScaler``), adapted to micro-batches that
can be rescaled live, between two batches, at near-zero cost:

* **True processing rate.** How many records one subtask handles per second of
  busy time: ``records / busy seconds``, aggregated over a metrics window. It is a
  property of the code and the hardware, not of the load, so it can be measured
  at any load level.
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

import math
from collections import deque
from dataclasses import dataclass, field

from keyscale.scaling.model import MODES, Action, AutoscalerConfig, BatchMetrics, Decision, Mode

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



@dataclass(frozen=True)
class _Sample:
    time: float
    period: float  # seconds the input of this batch arrived over
    input_rate: float
    records: int  # sum over subtasks
    busy_total: float  # sum over subtasks
    busy_hot: float  # busiest subtask
    warmup: bool


@dataclass
class _OperatorState:
    parallelism: int = 0
    last_time: float | None = None
    change_time: float = 0.0
    last_action_time: float | None = None
    batches_since_change: int = 0
    window: deque[_Sample] = field(default_factory=deque)
    known_rate_per_subtask: float | None = None
    down_since: float | None = None
    down_target: int | None = None


def _fmt(x: float) -> str:
    return f"{x:,.0f}"


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

    def __init__(self, config: AutoscalerConfig | None = None) -> None:
        self.config = config if config is not None else AutoscalerConfig()
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
        since = st.change_time if st.last_action_time is None else max(st.change_time, st.last_action_time)
        if d.time - since < self.config.stabilization_seconds:
            return d
        target, aligned = self._nearest_in_bounds(P, m.max_parallelism, lower, upper)
        below = m.parallelism < lower
        plain = lower if below else upper
        action: Action = "scale_up" if below else "scale_down"
        reason = (
            f"scale {'up' if below else 'down'} {P} -> {target}: parallelism {P} is "
            f"{'below the lower' if below else 'above the upper'} bound {plain}, so it goes to "
            f"the nearest parallelism within [{lower}, {upper}]"
            + (f", aligned to {target} (divides {m.max_parallelism})" if aligned and target != plain else "")
            + f"; by load alone: {d.reason}"
        )
        st.down_since = st.down_target = None
        st.last_action_time = d.time
        inputs = dict(d.inputs, lower_bound=float(lower), upper_bound=float(upper))
        return Decision(d.time, m.uid, P, target, action, reason, inputs)

    def _nearest_in_bounds(self, p: int, key_groups: int, lower: int, upper: int) -> tuple[int, bool]:
        """The parallelism in ``[lower, upper]`` nearest to ``p`` (outside them), aligned if
        possible; and whether it divides ``key_groups`` (with alignment on)."""
        align = self.config.align_to_key_groups
        if p < lower:
            target = aligned_parallelism(lower, key_groups, lower, upper) if align else lower
        else:
            divisors = [q for q in range(upper, lower - 1, -1) if key_groups % q == 0] if align else []
            target = divisors[0] if divisors else upper
        return target, align and key_groups % target == 0

    def _evaluate(self, m: BatchMetrics) -> Decision:
        """The decision by load (bounds clamp its target, but an out-of-bounds P may stay)."""
        cfg = self.config
        st = self._ops.get(m.uid)
        if st is None:
            st = self._ops[m.uid] = _OperatorState()
        if st.last_time is not None and m.time < st.last_time:
            raise ValueError(
                f"metrics for {m.uid!r} went back in time: {m.time} after {st.last_time}"
            )

        period = self._period(m, st.last_time)
        if st.last_time is None or m.parallelism != st.parallelism:
            # A change took effect (or the job started): metrics from before it
            # describe another parallelism, and a pending scale-down is void.
            st.parallelism = m.parallelism
            st.change_time = m.time
            st.batches_since_change = 0
            st.window.clear()
            st.down_since = st.down_target = None
        st.last_time = m.time
        st.batches_since_change += 1

        input_rate = (
            m.input_rate
            if m.input_rate is not None
            else (m.input_records / period if period > 0 else 0.0)
        )
        st.window.append(
            _Sample(
                time=m.time,
                period=period,
                input_rate=input_rate,
                records=sum(m.records),
                busy_total=sum(m.busy_seconds),
                busy_hot=max(m.busy_seconds),
                warmup=st.batches_since_change <= cfg.warmup_batches,
            )
        )
        # Decisions are made when the batch's metrics are complete: at its end.
        now = m.time + m.batch_seconds
        # Keep at least the latest batch, however long it ran.
        while len(st.window) > 1 and st.window[0].time < now - cfg.metrics_window_seconds:
            st.window.popleft()
        P = m.parallelism
        lower, upper = cfg.bounds(m.max_parallelism)
        since = st.change_time
        if st.last_action_time is not None:
            since = max(since, st.last_action_time)
        inputs: dict[str, float] = {
            "seconds_since_change": now - since,
            "window_batches": float(len(st.window)),
        }

        def none(reason: str) -> Decision:
            return Decision(now, m.uid, P, P, "none", reason, inputs)

        if now - since < cfg.stabilization_seconds:
            what = (
                f"parallelism {P} took effect"
                if since == st.change_time
                else "the last scaling decision"
            )
            return none(
                f"stabilising: {now - since:.0f} s since {what}, "
                f"no decision before {cfg.stabilization_seconds:.0f} s"
            )

        # --- load: input rate, backlog, target rate -----------------------------
        total_period = sum(s.period for s in st.window)
        rate_window = (
            sum(s.input_rate * s.period for s in st.window) / total_period
            if total_period > 0
            else input_rate
        )
        # Size for the load of the latest batch, not the window's average: a scale-up
        # should follow a load step at once (a live rescale costs almost nothing),
        # and a scale-down needs the lower target to hold for the whole scale-down
        # delay and then goes to the highest target seen meanwhile, which smooths
        # more robustly than an average would. The window average is reported.
        rate = input_rate
        backlog = float(m.backlog_records or 0)
        if m.trigger_interval_seconds is not None:
            # A batch that overran its trigger interval leaves the records that
            # arrived during the overrun for the next batch, on top of the one
            # interval's worth that is normal for micro-batches.
            backlog += input_rate * max(0.0, m.batch_seconds - m.trigger_interval_seconds)
        catch_up_rate = (backlog + rate * cfg.restart_seconds) / cfg.catch_up_seconds
        target_rate = rate + catch_up_rate
        inputs.update(
            input_rate=rate,
            input_rate_window=rate_window,
            input_rate_recent=input_rate,
            backlog=backlog,
            catch_up_rate=catch_up_rate,
            target_rate=target_rate,
        )

        # --- capacity: true processing rate per subtask -------------------------
        measured = [s for s in st.window if not s.warmup]
        records = sum(s.records for s in measured)
        busy_hot = sum(s.busy_hot for s in measured)
        busy_total = sum(s.busy_total for s in measured)
        from_history = False
        if records > 0 and busy_hot >= cfg.min_busy_seconds:
            # The batch waits for its slowest task, so the job's throughput at P is
            # bounded by the busiest subtask: all records / the hottest subtask's
            # busy time. Per subtask that is divided by P. Without skew this is the
            # plain mean rate; with skew it is lower by the skew factor, and sizing
            # with it keeps the hottest subtask at the target utilisation (assuming
            # the skew persists at the new parallelism).
            rate_per_subtask = records / busy_hot / P
            mean_rate = records / busy_total if busy_total > 0 else rate_per_subtask
            inputs["mean_rate_per_subtask"] = mean_rate
            inputs["skew"] = mean_rate / rate_per_subtask
            st.known_rate_per_subtask = rate_per_subtask
        elif st.known_rate_per_subtask is not None:
            rate_per_subtask = st.known_rate_per_subtask
            from_history = True
            inputs["rate_from_history"] = 1.0
        else:
            return none(
                f"no reliable processing-rate measurement yet ({records:,} records, "
                f"{busy_hot:.2f} s busy time in the window): keeping {P} rather than guessing"
            )

        # How busy the hottest subtask was in the latest batch's slot (the trigger
        # interval, or the batch's duration when it overran).
        slot = max(m.batch_seconds, m.trigger_interval_seconds or m.batch_seconds)
        busy_ratio = max(m.busy_seconds) / slot if slot > 0 else 0.0
        inputs["busy_ratio"] = busy_ratio
        capacity = rate_per_subtask * P
        utilization = target_rate / capacity
        inputs.update(
            true_rate_per_subtask=rate_per_subtask,
            capacity=capacity,
            utilization=utilization,
        )
        U = cfg.target_utilization
        raw = math.ceil(target_rate / (rate_per_subtask * U)) if target_rate > 0 else lower
        raw = max(raw, 1)
        inputs["raw_target_parallelism"] = float(raw)

        load_text = f"input {_fmt(rate)} rec/s"
        if catch_up_rate > 0:
            load_text += (
                f" + backlog {_fmt(backlog)}"
                + (f" (+{cfg.restart_seconds:.0f} s restart)" if cfg.restart_seconds else "")
                + f" over {cfg.catch_up_seconds:.0f} s catch-up needs {_fmt(target_rate)} rec/s"
            )
        else:
            load_text += " needs " + _fmt(target_rate) + " rec/s"
        skew = inputs.get("skew", 1.0)
        rate_text = (
            f"one subtask processes {_fmt(rate_per_subtask)} rec/s"
            + (" (measured earlier)" if from_history else "")
            + (f" (hottest subtask, skew {skew:.2f}x)" if skew > 1.05 else "")
        )
        util_text = (
            f"utilisation {utilization:.2f} vs band "
            f"{cfg.scale_down_threshold:.2f}-{cfg.scale_up_threshold:.2f}"
        )

        if cfg.scale_down_threshold <= utilization <= cfg.scale_up_threshold:
            st.down_since = st.down_target = None
            return none(f"keep {P}: {util_text}; {load_text}; capacity {_fmt(capacity)} rec/s")

        up = utilization > cfg.scale_up_threshold
        target = max(lower, min(raw, upper))
        steps: list[str] = []
        if up:
            cap = max(P + 1, math.floor(P * cfg.scale_up_max_factor))
            if target > cap:
                steps.append(f"capped at {cfg.scale_up_max_factor:g}x step to {cap}")
                target = cap
        else:
            cap = max(1, math.ceil(P / cfg.scale_down_max_factor))
            if target < cap:
                steps.append(f"limited to a {cfg.scale_down_max_factor:g}x step down to {cap}")
                target = cap
        if cfg.align_to_key_groups:
            aligned = aligned_parallelism(target, m.max_parallelism, lower, upper)
            if aligned != target:
                steps.append(f"aligned to {aligned} (divides {m.max_parallelism})")
            target = aligned
        target = max(lower, min(target, upper))
        if target != raw and not steps:
            steps.append(f"bounded to [{lower}, {upper}]")
        sizing = f"{load_text}; {rate_text} at {U:.0%} target utilisation -> {raw} subtasks" + (
            "".join(", " + s for s in steps)
        )

        if up:
            st.down_since = st.down_target = None
            if busy_ratio < cfg.scale_down_threshold:
                # Behind, yet the busiest subtask mostly idles: something other than
                # parallelism bounds throughput (typically a per-batch read limit
                # such as maxOffsetsPerTrigger). More subtasks would not help.
                return none(
                    f"keep {P}: {util_text}, but the busiest subtask was only "
                    f"{busy_ratio:.0%} busy in the last batch, so parallelism is not what "
                    f"limits throughput (check the source's per-batch limit, e.g. "
                    f"maxOffsetsPerTrigger); {load_text}"
                )
            if target <= P:
                return none(f"keep {P}: {util_text} but {P} is the upper bound; {sizing}")
            st.last_action_time = now
            return Decision(
                now, m.uid, P, target, "scale_up",
                f"scale up {P} -> {target}: {util_text}; {sizing}", inputs,
            )  # fmt: skip

        if target >= P:
            st.down_since = st.down_target = None
            return none(f"keep {P}: {util_text} but no smaller parallelism fits; {sizing}")
        if st.down_since is None or st.down_target is None:
            st.down_since, st.down_target = now, target
        else:
            st.down_target = max(st.down_target, target)
        inputs["scale_down_pending_since"] = st.down_since
        held = now - st.down_since
        if held < cfg.scale_down_delay_seconds:
            return none(
                f"keep {P} for now: a lower target ({st.down_target}) has held {held:.0f} s "
                f"of the {cfg.scale_down_delay_seconds:.0f} s scale-down delay; {util_text}; "
                f"{sizing}"
            )
        target = st.down_target
        st.down_since = st.down_target = None
        st.last_action_time = now
        return Decision(
            now, m.uid, P, target, "scale_down",
            f"scale down {P} -> {target}: below band for {held:.0f} s "
            f"(delay {cfg.scale_down_delay_seconds:.0f} s), highest target in that time "
            f"{target}; {util_text}; {sizing}",
            inputs,
        )  # fmt: skip

    @staticmethod
    def _period(m: BatchMetrics, last_time: float | None) -> float:
        """Seconds over which this batch's input arrived."""
        if last_time is not None and m.time > last_time:
            return m.time - last_time
        return max(m.batch_seconds, m.trigger_interval_seconds or 0.0)
