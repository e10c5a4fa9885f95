"""The utilisation an SLO leaves the job: with an SLO the autoscaler sizes for it, not for a
fixed utilisation number (issue 36, item 1). Pure: no Spark, no clocks, no state;
:mod:`keyscale.scaling.policy` applies the :class:`Band` to every decision of a job with an SLO.

Why utilisation and latency are one scale: a batch of a job that keeps up runs for
``utilisation x slot`` seconds (the busiest subtask's share of its slot: the trigger
interval, or the batch's duration when it overran), and a record waits up to one slot for
its batch before that. So a batch's p99 latency is about ``slot + utilisation x slot``, and
its lag (what arrived while it ran) about ``utilisation x slot``. The highest utilisation
at which the SLO still holds with :data:`~keyscale.scaling.slo.HEADROOM` to spare is

    ceiling = (HEADROOM x SLO - wait) / slot          wait = slot (latency), 0 (lag)

at most :data:`MAX_BUSY` (a job kept busier than that builds a backlog on the first batch
that reads more than its mean) and at least :data:`MIN_BUSY`. The policy scales up when a
batch's utilisation passes the ceiling, and sizes a scale-up for ``target = ceiling / peak
ratio``, the peak ratio being the window's highest input rate over its mean (the load's
noise, measured; at least 1, at most :data:`MAX_PEAK_RATIO`), so the noise's peaks at the
parallelism it picks stay under the ceiling. A scale-down sizes for :attr:`Band.settle`,
halfway between the target and the ceiling (see there). The band's lower edge, below which
a scale-down is considered, sits as far below the target as the ceiling is above it. The SLO's room replaces the configured utilisation band, which a fixed SLO would
otherwise turn into a fixed 70 %.

>>> from keyscale.scaling.slo import Slo
>>> b = slo_band(Slo("latency", 10.0), slot=5.0, peak_ratio=1.1)
>>> round(b.ceiling, 2), round(b.target, 2), round(b.settle, 2), round(b.lower, 2)
(0.9, 0.82, 0.86, 0.74)
>>> print(b.text())
SLO latency=10s leaves batches 90% of the 5 s slot (95% of the target, after a slot's wait); sized at 82% for the load's peaks (1.10x its mean), a scale-down at 86%
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from keyscale.scaling.load import Sample
from keyscale.scaling.model import AutoscalerConfig
from keyscale.scaling.slo import HEADROOM, Slo

__all__ = ["MAX_BUSY", "MAX_PEAK_RATIO", "MIN_BUSY", "Band", "catch_up_given_back", "peak_ratio", "slo_band"]

#: The most of its slot the policy lets a batch be busy, whatever the SLO allows: above it,
#: a batch that reads more than the mean leaves a backlog behind.
MAX_BUSY = 0.95
#: The most of a window's peak over its mean read as noise: more is a change of level, which
#: the scale-up rule meets, not a margin to keep for good.
MAX_PEAK_RATIO = 1.5
#: The least: an SLO too tight for any utilisation still leaves the job this much to run at
#: (a missed SLO then scales up through the guard, keyscale.scaling.outlook).
MIN_BUSY = 0.1


@dataclass(frozen=True)
class Band:
    """The utilisation band an SLO leaves: scale up above ``ceiling``, size at ``target``,
    scale down below ``lower``."""

    slo: Slo
    slot: float
    peak_ratio: float
    ceiling: float
    target: float

    @property
    def settle(self) -> float:
        """What a scale-down sizes for: halfway between the target and the ceiling. A
        scale-down goes to the highest target of the batches over its delay, so their noise is
        in its rate already; the other half of the margin keeps the next peaks from scaling
        it back up (sized at the ceiling itself, bench/autoscale.py's 24 h diurnal day made 10
        rescales instead of 6)."""
        return (self.ceiling + self.target) / 2

    @property
    def lower(self) -> float:
        """As far below the target as the ceiling is above it."""
        return max(0.0, 2 * self.target - self.ceiling)

    def config(self, cfg: AutoscalerConfig) -> AutoscalerConfig:
        """``cfg`` with this band as its target utilisation and band.

        >>> from keyscale.scaling.slo import Slo
        >>> c = slo_band(Slo("lag", 5.0), slot=5.0, peak_ratio=1.0).config(AutoscalerConfig())
        >>> round(c.scale_up_threshold, 2), round(c.target_utilization, 2)
        (0.95, 0.95)
        """
        return replace(cfg, target_utilization=self.target, utilization_band=self.ceiling - self.target)

    def inputs(self) -> dict[str, float]:
        """The decision's ``inputs`` this band contributes."""
        return {"slo_busy_ceiling": self.ceiling, "slo_target_utilization": self.target,
                "slo_settle_utilization": self.settle, "load_peak_ratio": self.peak_ratio}

    def text(self) -> str:
        """The band in words, as a reason quotes it."""
        wait = ", after a slot's wait" if self.slo.kind == "latency" else ""
        return (f"SLO {self.slo} leaves batches {self.ceiling:.0%} of the {self.slot:g} s slot "
                f"({HEADROOM:.0%} of the target{wait}); sized at {self.target:.0%} for the load's peaks "
                f"({self.peak_ratio:.2f}x its mean), a scale-down at {self.settle:.0%}")


def slo_band(slo: Slo, slot: float, peak_ratio: float) -> Band:
    """The :class:`Band` ``slo`` leaves a job whose batches have ``slot`` seconds (see the
    module docstring); ``peak_ratio``: the load's peak over its mean, read within
    [1, :data:`MAX_PEAK_RATIO`].

    >>> from keyscale.scaling.slo import Slo
    >>> round(slo_band(Slo("latency", 30.0), 5.0, 1.0).ceiling, 2)  # a loose SLO: MAX_BUSY
    0.95
    >>> round(slo_band(Slo("latency", 5.0), 5.0, 1.0).ceiling, 2)   # no room after the wait
    0.1
    """
    if not slot > 0:
        raise ValueError(f"slot must be > 0 seconds, got {slot}")
    wait = slot if slo.kind == "latency" else 0.0
    ceiling = min(MAX_BUSY, max(MIN_BUSY, (HEADROOM * slo.seconds - wait) / slot))
    ratio = min(MAX_PEAK_RATIO, max(1.0, peak_ratio))
    return Band(slo, slot, ratio, ceiling, ceiling / ratio)


def peak_ratio(window: Sequence[Sample]) -> float:
    """The window's highest input rate over its mean input rate (1.0 without input).

    >>> from keyscale.scaling.load import Sample
    >>> w = [Sample(float(t), 5.0, r, 0, 0.0, 0.0, warmup=False) for t, r in enumerate((900.0, 1100.0, 1000.0))]
    >>> peak_ratio(w)
    1.1
    """
    rates = [s.input_rate for s in window]
    mean = sum(rates) / len(rates) if rates else 0.0
    return max(rates) / mean if mean > 0 else 1.0


def catch_up_given_back(sized_for_backlog: bool, excess_backlog: float, slo_met: bool) -> str | None:
    """Why a scale-down need not wait out its delay, or None: the last scale-up was sized to
    work off a backlog as well as to carry the input (an SLO's catch-up), the backlog is
    worked off and the SLO is met. The delay guards against noise read as a lower load; the
    part of the parallelism that was for the backlog was known to be temporary when it was
    asked for (a 10x spike met at 64 subtasks where its input needs 32: 150 s at 64 else).

    >>> catch_up_given_back(True, 0.0, True)
    'the last scale-up was sized to work off a backlog, now worked off: no scale-down delay'
    >>> catch_up_given_back(True, 5_000.0, True) is None, catch_up_given_back(False, 0.0, True) is None
    (True, True)
    """
    if sized_for_backlog and excess_backlog <= 0 and slo_met:
        return "the last scale-up was sized to work off a backlog, now worked off: no scale-down delay"
    return None
