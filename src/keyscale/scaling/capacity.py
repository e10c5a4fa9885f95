"""The autoscaler's capacity: what one subtask processes, so what each parallelism can do.

:func:`measure_capacity` reads the **true processing rate** of one subtask from the
metrics window: ``records / busy seconds of the busiest subtask / P`` (a micro-batch
waits for its slowest task, so the hottest subtask bounds the job; with evenly spread key
groups this is the plain mean rate, with skew it is lower by the skew factor). Busy
seconds are net of the garbage collector's pauses (:func:`keyscale.scaling.load.net_busy`);
when those were a notable share of the busy time (over :data:`GC_NOTABLE`) the reason
says so. Batches
right after a change (warm-up) are left out; with too little busy time it falls back on
the rate an earlier window measured, and with none it says so (:class:`Unmeasured`)
rather than guess. :func:`needed_parallelism` is the parallelism that carries a target
rate at the target utilisation. Pure: no Spark, no clocks, no state.

>>> from keyscale.scaling.load import Sample
>>> window = [Sample(0.0, 5.0, 100.0, 1_000, 2.0, 1.0, warmup=False)]
>>> c = measure_capacity(window, parallelism=2, busiest=1.0, slot=5.0, known_rate=None,
...                      min_busy_seconds=0.05)
>>> c.rate_per_subtask, c.total, c.skew
(500.0, 1000.0, 1.0)
>>> needed_parallelism(1_400.0, c.rate_per_subtask, 0.7, lower=1)
4
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from keyscale.scaling.load import Sample, fmt

__all__ = ["GC_NOTABLE", "Capacity", "Unmeasured", "measure_capacity", "needed_parallelism"]

#: The share of the window's busy time in GC pauses above which the reason mentions them.
GC_NOTABLE = 0.1


@dataclass(frozen=True)
class Capacity:
    """What the operator can do at its current parallelism."""

    parallelism: int
    rate_per_subtask: float  # records/s one subtask processes (the hottest subtask's share)
    mean_rate: float | None  # the plain mean per subtask; None when the rate is from history
    busy_ratio: float  # the busiest subtask's busy share of the latest batch's slot
    gc_share: float = 0.0  # of the window's measured busy time, the share in GC pauses (not counted as work)

    @property
    def from_history(self) -> bool:
        """Whether the rate was measured in an earlier window (nothing reliable in this one)."""
        return self.mean_rate is None

    @property
    def skew(self) -> float:
        """The mean rate over the hottest subtask's: 1.0 without skew (or without a measurement)."""
        return 1.0 if self.mean_rate is None else self.mean_rate / self.rate_per_subtask

    @property
    def total(self) -> float:
        """Records/s the operator processes at its parallelism."""
        return self.rate_per_subtask * self.parallelism

    def utilization(self, target_rate: float) -> float:
        """The share of the capacity ``target_rate`` needs."""
        return target_rate / self.total

    def inputs(self, target_rate: float) -> dict[str, float]:
        """The decision's ``inputs`` this capacity contributes, in the order they are reported."""
        measured = (
            {"rate_from_history": 1.0}
            if self.mean_rate is None
            else {"mean_rate_per_subtask": self.mean_rate, "skew": self.skew}
        )
        gc = {"gc_share": self.gc_share} if self.gc_share > 0 else {}
        return measured | gc | {
            "busy_ratio": self.busy_ratio,
            "true_rate_per_subtask": self.rate_per_subtask,
            "capacity": self.total,
            "utilization": self.utilization(target_rate),
        }

    def text(self) -> str:
        """The rate in words, as a reason quotes it."""
        return (
            f"one subtask processes {fmt(self.rate_per_subtask)} rec/s"
            + (" (measured earlier)" if self.from_history else "")
            + (f" (hottest subtask, skew {self.skew:.2f}x)" if self.skew > 1.05 else "")
            + self.gc_text()
        )

    def gc_text(self) -> str:
        """The garbage collector's share in words when it is notable (over :data:`GC_NOTABLE`), else ''."""
        if self.gc_share <= GC_NOTABLE:
            return ""
        return f" (net of garbage-collector pauses: {self.gc_share:.0%} of the busy time, not counted as work)"


@dataclass(frozen=True)
class Unmeasured:
    """No reliable rate in the window and none from before: what the window held."""

    records: int
    busy_hot: float


def measure_capacity(
    window: Iterable[Sample],
    parallelism: int,
    busiest: float,
    slot: float,
    known_rate: float | None,
    min_busy_seconds: float,
) -> Capacity | Unmeasured:
    """The capacity the window's measured (not warm-up) batches show, else the one
    ``known_rate`` (an earlier window's rate per subtask) gives, else :class:`Unmeasured`.

    ``busiest`` is the busiest subtask's busy seconds in the latest batch and ``slot`` the
    latest batch's slot (its trigger interval, or its duration when it overran).
    """
    measured = [s for s in window if not s.warmup]
    records = sum(s.records for s in measured)
    busy_hot = sum(s.busy_hot for s in measured)
    busy_total = sum(s.busy_total for s in measured)
    gc_total = sum(s.gc_total for s in measured)
    busy_ratio = busiest / slot if slot > 0 else 0.0
    if records > 0 and busy_hot >= min_busy_seconds:
        rate = records / busy_hot / parallelism
        mean_rate = records / busy_total if busy_total > 0 else rate
        gc_share = gc_total / (busy_total + gc_total) if gc_total > 0 else 0.0
        return Capacity(parallelism, rate, mean_rate, busy_ratio, gc_share)
    if known_rate is not None:
        return Capacity(parallelism, known_rate, None, busy_ratio)
    return Unmeasured(records, busy_hot)


def needed_parallelism(
    target_rate: float, rate_per_subtask: float, target_utilization: float, lower: int
) -> int:
    """Subtasks that carry ``target_rate`` at ``target_utilization`` (``lower`` for no load;
    at least 1), before any step limit, bound or alignment."""
    if target_rate <= 0:
        return max(lower, 1)
    return max(math.ceil(target_rate / (rate_per_subtask * target_utilization)), 1)
