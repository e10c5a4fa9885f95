"""The autoscaler's decision: the rule that picks a parallelism, with its reason in words.

Given the load and the capacity (:mod:`keyscale.scaling.load`,
:mod:`keyscale.scaling.capacity`), :func:`sized_target` turns the parallelism the load
needs into a step the policy may take (limited per step, bounded, aligned to key
groups), and :func:`decide` picks the action from a table of cases, first match wins:

=====================================  =============================================
case                                   decision
=====================================  =============================================
utilisation within the band            keep; a pending scale-down is dropped
above the band by the load now,        keep: something else limits (a read limit)
  busiest subtask idles
above the band, no larger target fits  keep: at the upper bound
above the band                         scale up at once
below the band, no smaller target      keep
below the band, delay not yet served   keep for now; remember the highest target
below the band for the whole delay     scale down to the highest target seen
=====================================  =============================================

Pure: the pending scale-down goes in as :class:`PendingDown` and comes back in the
:class:`Verdict`; :mod:`keyscale.scaling.policy` keeps it per operator.

>>> from keyscale.scaling.model import AutoscalerConfig
>>> cfg = AutoscalerConfig()
>>> v = decide(Case(parallelism=4, utilization=0.7, busy_ratio=0.7, target=4, now=0.0,
...                 util_text="u", load_text="l", sizing="s", capacity=100.0), None, cfg)
>>> v.action, v.target, v.reason
('none', 4, 'keep 4: u; l; capacity 100 rec/s')
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from keyscale.scaling.load import fmt
from keyscale.scaling.model import Action, AutoscalerConfig
from keyscale.state.keygroups import aligned_parallelism

__all__ = [
    "Case",
    "PendingDown",
    "Verdict",
    "decide",
    "nearest_in_bounds",
    "sized_target",
    "stabilising",
]


def stabilising(
    now: float, since: float, change_time: float, parallelism: int, cfg: AutoscalerConfig
) -> str | None:
    """Why no decision is made yet (``since``: the last change or scaling decision), or None.

    >>> stabilising(10.0, 0.0, 0.0, 2, AutoscalerConfig(stabilization_seconds=30))
    'stabilising: 10 s since parallelism 2 took effect, no decision before 30 s'
    """
    if now - since >= cfg.stabilization_seconds:
        return None
    what = (
        f"parallelism {parallelism} took effect"
        if since == change_time
        else "the last scaling decision"
    )
    return f"stabilising: {now - since:.0f} s since {what}, no decision before {cfg.stabilization_seconds:.0f} s"


def sized_target(
    raw: int,
    parallelism: int,
    up: bool,
    key_groups: int,
    bounds: tuple[int, int],
    cfg: AutoscalerConfig,
) -> tuple[int, list[str]]:
    """The parallelism to move to when the load needs ``raw`` subtasks, and what changed it
    on the way (in words): a step limit, the key-group alignment, the bounds.

    >>> sized_target(40, 2, True, 128, (1, 128), AutoscalerConfig())
    (16, ['capped at 8x step to 16'])
    """
    lower, upper = bounds
    target = max(lower, min(raw, upper))
    steps: list[str] = []
    if up:
        cap = max(parallelism + 1, math.floor(parallelism * cfg.scale_up_max_factor))
        if target > cap:
            steps.append(f"capped at {cfg.scale_up_max_factor:g}x step to {cap}")
            target = cap
    else:
        cap = max(1, math.ceil(parallelism / cfg.scale_down_max_factor))
        if target < cap:
            steps.append(f"limited to a {cfg.scale_down_max_factor:g}x step down to {cap}")
            target = cap
    if cfg.align_to_key_groups:
        aligned = aligned_parallelism(target, key_groups, lower, upper)
        if aligned != target:
            steps.append(f"aligned to {aligned} (divides {key_groups})")
        target = aligned
    target = max(lower, min(target, upper))
    if target != raw and not steps:
        steps.append(f"bounded to [{lower}, {upper}]")
    return target, steps


def nearest_in_bounds(
    p: int, key_groups: int, lower: int, upper: int, align: bool
) -> tuple[int, bool]:
    """The parallelism in ``[lower, upper]`` nearest to ``p`` (outside them), aligned if
    ``align`` and possible; and whether it divides ``key_groups`` (with alignment on).

    >>> nearest_in_bounds(1, 128, 3, 128, True), nearest_in_bounds(9, 128, 1, 6, True)
    ((4, True), (4, True))
    """
    if p < lower:
        target = aligned_parallelism(lower, key_groups, lower, upper) if align else lower
    else:
        divisors = [q for q in range(upper, lower - 1, -1) if key_groups % q == 0] if align else []
        target = divisors[0] if divisors else upper
    return target, align and key_groups % target == 0


@dataclass(frozen=True)
class PendingDown:
    """A scale-down waiting out its delay: below the band since ``since``, the highest target seen."""

    since: float
    target: int


@dataclass(frozen=True)
class Case:
    """What :func:`decide` decides on, the numbers and the words its reasons quote."""

    parallelism: int
    utilization: float
    busy_ratio: float  # the busiest subtask's busy share of the latest batch's slot
    target: int  # from :func:`sized_target`
    now: float
    util_text: str
    load_text: str
    sizing: str
    capacity: float
    gc_text: str = ""  # the GC pauses the rate leaves out, in words when notable (Capacity.gc_text)
    # The busiest subtask's busy share below which it counts as idle (None: the band's lower
    # edge). An SLO's band (keyscale.scaling.room) can sit high: idle stays the configured one.
    idle_below: float | None = None
    # The utilisation by the load now, when the rate sized for is a forecast above it (None:
    # ``utilization`` is the load's own). An idle subtask says nothing about a rise to come.
    load_utilization: float | None = None


@dataclass(frozen=True)
class Verdict:
    """The decision, and the pending scale-down it leaves (None: none)."""

    action: Action
    target: int
    reason: str
    pending: PendingDown | None = None
    pending_since: float | None = None  # reported in the inputs while a scale-down is considered


def idles(busy_ratio: float, idle_below: float | None, cfg: AutoscalerConfig) -> bool:
    """Whether the busiest subtask, ``busy_ratio`` busy, mostly idles: below ``idle_below``
    (an SLO's, :mod:`keyscale.scaling.room`) or, without one, the band's lower edge."""
    return busy_ratio < (cfg.scale_down_threshold if idle_below is None else idle_below)


def decide(c: Case, pending: PendingDown | None, cfg: AutoscalerConfig) -> Verdict:
    """The table of cases in the module docstring, in its order."""
    P = c.parallelism

    def keep(reason: str) -> Verdict:
        return Verdict("none", P, f"keep {P}{reason}")

    if cfg.scale_down_threshold <= c.utilization <= cfg.scale_up_threshold:
        return keep(f": {c.util_text}; {c.load_text}; capacity {fmt(c.capacity)} rec/s{c.gc_text}")
    if c.utilization > cfg.scale_up_threshold:
        behind_now = c.load_utilization is None or c.load_utilization > cfg.scale_up_threshold
        if behind_now and idles(c.busy_ratio, c.idle_below, cfg):
            # Behind, yet the busiest subtask mostly idles: something other than
            # parallelism bounds throughput. More subtasks would not help. (Not so when
            # only a forecast rise puts the job above the band: that load has not come.)
            return keep(
                f": {c.util_text}, but the busiest subtask was only {c.busy_ratio:.0%} busy in "
                f"the last batch, so parallelism is not what limits throughput (check the source's "
                f"per-batch limit, e.g. maxOffsetsPerTrigger); {c.load_text}"
            )
        if c.target <= P:
            return keep(f": {c.util_text} but {P} is the upper bound; {c.sizing}")
        return Verdict(
            "scale_up", c.target, f"scale up {P} -> {c.target}: {c.util_text}; {c.sizing}"
        )
    if c.target >= P:
        return keep(f": {c.util_text} but no smaller parallelism fits; {c.sizing}")
    pending = (
        PendingDown(c.now, c.target)
        if pending is None
        else PendingDown(pending.since, max(pending.target, c.target))
    )
    held = c.now - pending.since
    if held < cfg.scale_down_delay_seconds:
        return Verdict(
            "none", P,
            f"keep {P} for now: a lower target ({pending.target}) has held {held:.0f} s of the "
            f"{cfg.scale_down_delay_seconds:.0f} s scale-down delay; {c.util_text}; {c.sizing}",
            pending, pending.since,
        )  # fmt: skip
    return Verdict(
        "scale_down", pending.target,
        f"scale down {P} -> {pending.target}: below band for {held:.0f} s "
        f"(delay {cfg.scale_down_delay_seconds:.0f} s), highest target in that time "
        f"{pending.target}; {c.util_text}; {c.sizing}",
        None, pending.since,
    )  # fmt: skip
