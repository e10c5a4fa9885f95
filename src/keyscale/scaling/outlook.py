"""What an SLO adds to a decision: the rate to size for ahead of time, and the guards that
keep the autoscaler from thrashing. Pure; :mod:`keyscale.scaling.policy` runs it when the
job has an SLO (:mod:`keyscale.scaling.slo`) and keeps its state.

:func:`outlook` reads the SLO over the window and asks the forecast
(:mod:`keyscale.scaling.forecast`) twice: over the **lead** (what a rescale takes to pay
off: the next batch, plus the measured extra time of the first batch after a change) and
over the **scale-down horizon** (``forecast_horizon_seconds``). The SLO also sets how fast a
backlog must be worked off: a record may wait one trigger interval for its batch and one
for the batch to run, so ``catch-up = SLO - 2 x trigger interval`` (at least one interval,
at most ``catch_up_seconds``).

:func:`sizing_rate` is the rate the decision sizes for: the load's target rate or the
forecast over the lead, whichever is higher (a predicted rise is met before it comes); when
that leaves the job below its band, the forecast over the scale-down horizon, up to what the
current parallelism carries at the target utilisation (a scale-down goes only as low as the
coming peak allows; the horizon alone never scales up).

:func:`guard` then checks the decision of :func:`keyscale.scaling.decision.decide`, first
match wins:

=====================================================  ===============================
case                                                   decision
=====================================================  ===============================
SLO at risk or missed, but idle and nothing waits      keep, or a scale-up decided by load
SLO at risk, or missed and not recovering; more fits   scale up, beyond the step limit
scale up, rescale cap reached, SLO not missed          keep
scale down, SLO not measured, missed or at risk        keep
scale down would take it above 95% of the target       keep
scale down, a backlog is being worked off              keep
scale down, rescale cap reached                        keep
scale down saves less than 2 rescales cost             keep (hysteresis)
otherwise                                              as decided, the forecast quoted
=====================================================  ===============================

>>> from keyscale.scaling.slo import Slo, SloReading
>>> from keyscale.scaling.forecast import Forecast
>>> from keyscale.scaling.decision import Verdict
>>> from keyscale.scaling.model import AutoscalerConfig
>>> o = Outlook(SloReading(Slo("lag", 30.0), 45.0, 45.0, 5.0, "lag"),
...             Forecast(900.0, 5.0, "current", "900 rec/s"), Forecast(900.0, 600.0, "current", "900 rec/s"), 5.0, 20.0)
>>> g = guard(Verdict("none", 4, "keep 4: u"), o, Context(4, 8, 0.9, 0.0, 0, 0.0, 5.0), AutoscalerConfig())
>>> g.action, g.target, g.reason
('scale_up', 8, 'scale up 4 -> 8: SLO lag=30s missed: lag 45.0 s; by load alone: keep 4: u')
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from keyscale.scaling.decision import Verdict, idles
from keyscale.scaling.forecast import Forecast, RateHistory, forecast
from keyscale.scaling.load import Sample
from keyscale.scaling.model import AutoscalerConfig
from keyscale.scaling.slo import HEADROOM, Slo, SloReading, read_slo

__all__ = ["Context", "Outlook", "guard", "outlook", "sizing_rate", "slo_floor"]


@dataclass(frozen=True)
class Outlook:
    """The SLO's reading, the forecasts over the lead and the scale-down horizon, the lead
    (seconds) and the catch-up time the SLO leaves (seconds)."""

    reading: SloReading
    up: Forecast
    down: Forecast
    lead: float
    catch_up_seconds: float

    def inputs(self) -> dict[str, float]:
        """The decision's ``inputs`` this outlook contributes."""
        out = {"slo_target_seconds": self.reading.slo.seconds, "forecast_input_rate": self.up.rate,
               "forecast_input_rate_horizon": self.down.rate, "lead_seconds": self.lead,
               "slo_catch_up_seconds": self.catch_up_seconds}
        if self.reading.value is not None:
            out["slo_value_seconds"] = self.reading.value
        if self.reading.projected is not None:
            out["slo_projected_seconds"] = self.reading.projected
        return out


def outlook(
    slo: Slo, window: list[Sample], history: RateHistory, now: float, current_rate: float,
    slot: float, rescale_cost: float, cfg: AutoscalerConfig,
) -> Outlook:
    """The :class:`Outlook` at ``now`` (``slot``: the trigger interval, or the batch's
    duration if longer; ``rescale_cost``: what a rescale takes beyond the batch, measured: the
    extra seconds of a first batch after a change, and on a cluster the wait for executors)."""
    lead = slot + rescale_cost
    reading = read_slo(slo, window, lead)
    seasons = (7 * cfg.season_seconds, cfg.season_seconds)
    up = forecast(history, now, current_rate, lead, seasons)
    down = forecast(history, now, current_rate, max(lead, cfg.forecast_horizon_seconds), seasons)
    catch_up = min(cfg.catch_up_seconds, max(slot, slo.seconds - 2 * slot))
    return Outlook(reading, up, down, lead, catch_up)


def sizing_rate(o: Outlook, target_rate: float, capacity: float, cfg: AutoscalerConfig) -> tuple[float, str]:
    """The rate to size for and, when the forecast raised it, why (words for the reason)."""
    up = max(target_rate, o.up.rate)
    if up / capacity >= cfg.scale_down_threshold:
        return up, (f"; forecast {o.up.text}" if o.up.rate > target_rate else "")
    # The horizon's peak holds a scale-down up; a scale-up waits for the lead's forecast
    # (a band whose lower edge sits high would otherwise scale up a horizon early).
    down = max(up, min(o.down.rate, capacity * cfg.target_utilization))
    return down, f"; forecast {o.down.text}"


@dataclass(frozen=True)
class Context:
    """What :func:`guard` needs besides the verdict and the outlook."""

    parallelism: int
    slo_target: int  # the parallelism the SLO asks for when missed (sized and aligned, no step limit)
    busy_ratio: float
    excess_backlog: float  # records beyond what one batch normally leaves unread
    rescales_last_hour: int
    rescale_cost: float  # seconds
    slot: float
    idle_below: float | None = None  # busy share below which the busiest subtask idles (None: the band's lower edge)


def guard(v: Verdict, o: Outlook, c: Context, cfg: AutoscalerConfig) -> Verdict:
    """The table in the module docstring, in its order."""
    P, r = c.parallelism, o.reading
    capped = cfg.max_rescales_per_hour is not None and c.rescales_last_hour >= cfg.max_rescales_per_hour
    cap_text = f"{c.rescales_last_hour} rescales in the last hour reach the cap of {cfg.max_rescales_per_hour}"

    def keep(why: str) -> Verdict:
        return Verdict("none", P, f"keep {P}: {why}; by load alone: {v.reason}")

    if ((r.missed and not r.recovering) or r.at_risk) and c.slo_target > (v.target if v.action == "scale_up" else P):
        if not idles(c.busy_ratio, c.idle_below, cfg) or c.excess_backlog > 0:
            return Verdict("scale_up", c.slo_target, f"scale up {P} -> {c.slo_target}: {r.text()}; by load alone: {v.reason}")
        # Idle with nothing waiting: the SLO adds no subtask (the trigger interval or the
        # source limits it), but a scale-up by load (a forecast rise) stands.
        if v.action != "scale_up":
            return keep(f"{r.text()}, but the busiest subtask was only {c.busy_ratio:.0%} busy and nothing waits: "
                        "parallelism is not what limits it (the trigger interval or the source is)")
    if v.action == "scale_up":
        if capped and not r.missed:
            return keep(f"{cap_text} and the SLO is not missed")
        return Verdict(v.action, v.target, f"{v.reason}; {r.text()}", v.pending, v.pending_since)
    if v.action != "scale_down":
        return Verdict(v.action, v.target, f"{v.reason}; {r.text()}", v.pending, v.pending_since)
    if r.worst is None or r.missed or r.at_risk:
        return keep(f"{r.text()}: no scale-down until it is met")
    # The batches of a smaller parallelism take longer by what the busiest subtask worked
    # times (P / target - 1), and the SLO's measure (latency or lag) with them.
    after = r.worst + c.busy_ratio * c.slot * (P / v.target - 1)
    if after > HEADROOM * r.slo.seconds:
        return keep(f"{r.text()}; at {v.target} subtasks its batches would take {after - r.worst:.1f} s longer, "
                    f"{after:.1f} s: above {HEADROOM:.0%} of the target")
    if c.excess_backlog > 0:
        return keep(f"a backlog of {c.excess_backlog:,.0f} records is being worked off")
    if capped:
        return keep(cap_text)
    saved = (P - v.target) * o.down.horizon
    cost = 2 * P * max(c.rescale_cost, c.slot)
    if saved < cost:
        return keep(f"going to {v.target} saves {saved:,.0f} core-s over the {o.down.horizon:.0f} s the forecast "
                    f"covers, less than the {cost:,.0f} core-s of a rescale and its way back")
    return Verdict(v.action, v.target, f"{v.reason}; {r.text()}; forecast {o.down.text}", v.pending, v.pending_since)


def slo_floor(reading: SloReading, parallelism: int, load_raw: int) -> int:
    """Subtasks the SLO asks for when missed or at risk: what the load needs with the backlog
    worked off within the SLO (``load_raw``), and at least the parallelism times how far the
    (projected) value is over the target, one more at the least (the latency of a batch-bound
    job falls about in proportion to its parallelism). No step limit: a missed SLO is
    what the step limit must not stand in the way of.

    >>> from keyscale.scaling.slo import Slo
    >>> slo_floor(SloReading(Slo("latency", 5.0), 7.5, 9.0, 5.0, "p99"), 4, load_raw=3)
    8
    """
    worst = max(v for v in (reading.value, reading.projected, 0.0) if v is not None)
    return max(load_raw, parallelism + 1, math.ceil(parallelism * worst / reading.slo.seconds))
