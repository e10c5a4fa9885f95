"""A service-level objective the autoscaler sizes for: ``latency=5s`` or ``lag=30s``.

:func:`parse_slo` reads the text users give (``keyscale run --slo``, ``start(slo=...)``, a
deployment file's ``slo``) into an :class:`Slo`; :func:`read_slo` measures it over the
policy's metrics window and projects it one rescale ahead (:class:`SloReading`). Pure: no
Spark, no clocks, no state.

What each kind measures, and what it relies on:

* ``latency``: the p99 of the end-to-end latency (a record's append to its source, to the
  commit of the batch that processed it) of all records of the window's batches, merged
  with :func:`keyscale.latency.window_quantile` from each batch's histogram. It needs a
  source that keeps append times (a keyscale log, Kafka, files); for a source without them
  it is *estimated* as the lag plus one batch (the oldest unread record still has to be
  read and committed), and the reading says so.
* ``lag``: the age of the oldest record the source has not handed to a batch yet, at the
  end of the latest batch: the batch's duration (what arrived while it ran is unread) plus
  ``backlog / input rate`` (the backlog is the source's own count of unread records;
  dividing by the current input rate assumes the records arrived in order at about that
  rate). Without a backlog from the source the batch's duration alone is the lag.

>>> slo = parse_slo("latency=5s")
>>> slo, slo.seconds, str(parse_slo("lag = 1.5 min"))
(Slo(kind='latency', seconds=5.0), 5.0, 'lag=90s')
>>> parse_slo("latency=fast")
Traceback (most recent call last):
...
keyscale.errors.KeyscaleError: --slo 'latency=fast': 'fast' is not a duration (write it as 5s, 500ms, 2min or 1h)
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from keyscale.errors import KeyscaleError
from keyscale.latency import window_quantile
from keyscale.scaling.load import Sample

__all__ = ["HEADROOM", "KINDS", "Slo", "SloKind", "SloReading", "lag_seconds", "parse_slo", "read_slo"]

SloKind = Literal["latency", "lag"]
KINDS: tuple[SloKind, ...] = ("latency", "lag")

_UNITS = {"ms": 0.001, "s": 1.0, "sec": 1.0, "second": 1.0, "seconds": 1.0, "m": 60.0, "min": 60.0,
          "minute": 60.0, "minutes": 60.0, "h": 3600.0, "hour": 3600.0, "hours": 3600.0}
_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-zA-Z]+)\s*$")

# The share of the target the autoscaler plans to use: a scale-down may leave the SLO's measure
# at most this high (keyscale.scaling.outlook.guard), and the utilisation it sizes for keeps
# a batch's latency under it (keyscale.scaling.room). The load's noise is not in this margin:
# the room module measures it (the window's peak rate over its mean); the rest is for what a
# model of latency as wait + batch time leaves out.
HEADROOM = 0.95


@dataclass(frozen=True)
class Slo:
    """A latency or lag target in seconds; ``str()`` writes it back as :func:`parse_slo` reads it.

    >>> str(Slo("latency", 0.25)), str(Slo("lag", 30.0))
    ('latency=250ms', 'lag=30s')
    """

    kind: SloKind
    seconds: float

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise KeyscaleError(f"--slo: {self.kind!r} is not one of {', '.join(KINDS)}")
        if not (math.isfinite(self.seconds) and self.seconds > 0):
            raise KeyscaleError(f"--slo {self.kind}: the target must be a duration > 0, not {self.seconds!r}")

    def __str__(self) -> str:
        ms = self.seconds * 1000
        if self.seconds < 1 and round(ms) * 0.001 == self.seconds:
            return f"{self.kind}={round(ms)}ms"
        return f"{self.kind}={self.seconds:g}s" if float(f"{self.seconds:g}") == self.seconds else f"{self.kind}={self.seconds!r}s"

    def to_json(self) -> dict[str, Any]:
        """The status's form."""
        return {"kind": self.kind, "seconds": self.seconds, "text": str(self)}


def parse_slo(text: str) -> Slo:
    """``KIND=DURATION``: KIND ``latency`` or ``lag``, DURATION a number with a unit (``ms``,
    ``s``, ``min``, ``h``...). Every error is a :class:`~keyscale.errors.KeyscaleError` naming the text.

    >>> parse_slo("lag=500ms"), parse_slo("latency=2 minutes").seconds
    (Slo(kind='lag', seconds=0.5), 120.0)
    >>> parse_slo("throughput=5s")
    Traceback (most recent call last):
    ...
    keyscale.errors.KeyscaleError: --slo 'throughput=5s': 'throughput' is not an SLO keyscale measures (latency or lag)
    """
    if not isinstance(text, str):
        raise KeyscaleError(f"--slo {text!r}: expected text such as 'latency=5s' or 'lag=30s'")
    kind, sep, raw = text.partition("=")
    kind = kind.strip().lower()
    if not sep:
        raise KeyscaleError(f"--slo {text!r}: expected KIND=DURATION, e.g. 'latency=5s' or 'lag=30s'")
    if kind not in KINDS:
        raise KeyscaleError(f"--slo {text!r}: {kind!r} is not an SLO keyscale measures (latency or lag)")
    m = _DURATION.match(raw)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise KeyscaleError(f"--slo {text!r}: {raw.strip()!r} is not a duration (write it as 5s, 500ms, 2min or 1h)")
    seconds = float(m.group(1)) * _UNITS[unit]
    if not (math.isfinite(seconds) and seconds > 0):
        raise KeyscaleError(f"--slo {text!r}: the target must be longer than 0")
    return Slo(kind, seconds)  # type: ignore[arg-type]  # kind is checked against KINDS above


def lag_seconds(sample: Sample) -> float | None:
    """The lag at the end of the batch ``sample`` describes (see the module docstring); None
    when a backlog is reported but no input arrives (its age cannot be told).

    >>> s = Sample(0.0, 5.0, 100.0, 500, 1.0, 1.0, warmup=False, backlog=600, seconds=2.0)
    >>> lag_seconds(s)
    8.0
    """
    backlog = sample.backlog or 0
    if backlog <= 0:
        return sample.seconds
    if sample.input_rate <= 0:
        return None
    return sample.seconds + backlog / sample.input_rate


@dataclass(frozen=True)
class SloReading:
    """The SLO as the window measured it (``value``, seconds; None: not measurable) and as the
    trend of its latest batches projects it ``horizon`` seconds ahead (``projected``)."""

    slo: Slo
    value: float | None
    projected: float | None
    horizon: float
    how: str  # what the value is, in words
    latest: float | None = None  # the latest batch's own value (a window's p99 lags behind it)

    @property
    def missed(self) -> bool:
        """Above the target now."""
        return self.value is not None and self.value > self.slo.seconds

    @property
    def recovering(self) -> bool:
        """Missed over the window, but the latest batch is back within the target and not rising
        past it: what was done is taking effect, and more would overshoot."""
        return (self.missed and self.latest is not None and self.latest <= self.slo.seconds
                and (self.projected is None or self.value is None or self.projected <= self.value))

    @property
    def at_risk(self) -> bool:
        """Within the target now, above it by the horizon if the trend holds."""
        return not self.missed and self.projected is not None and self.projected > self.slo.seconds

    @property
    def worst(self) -> float | None:
        """The higher of the value and its projection (None: not measured)."""
        return None if self.value is None else max(self.value, self.projected or 0.0)

    @property
    def attainment(self) -> float | None:
        """target / value, capped at 1 (1.0: met; 0.5: twice the target)."""
        if self.value is None:
            return None
        return 1.0 if self.value <= self.slo.seconds else self.slo.seconds / self.value

    def text(self) -> str:
        """The reading in words, as a reason quotes it.

        >>> SloReading(Slo("lag", 30.0), 42.0, 50.0, 5.0, "lag").text()
        'SLO lag=30s missed: lag 42.0 s'
        """
        if self.value is None:
            return f"SLO {self.slo} not measurable yet ({self.how})"
        state = "missed" if self.missed else "about to be missed" if self.at_risk else "met"
        trend = f", {self.projected:.1f} s in {self.horizon:.0f} s by its trend" if self.at_risk and self.projected is not None else ""
        back = f", the latest batch back within it ({self.latest:.1f} s)" if self.recovering and self.latest is not None else ""
        return f"SLO {self.slo} {state}: {self.how} {self.value:.1f} s{trend}{back}"

    def to_dict(self) -> dict[str, Any]:
        """The decision's ``slo`` field (events, status)."""
        return {**self.slo.to_json(), "value_seconds": self.value, "projected_seconds": self.projected,
                "horizon_seconds": self.horizon, "state": "unmeasured" if self.value is None else
                "missed" if self.missed else "at_risk" if self.at_risk else "met",
                "attainment": self.attainment, "measured": self.how, "latest_seconds": self.latest}


def _per_batch(slo: Slo, s: Sample) -> float | None:
    lag = lag_seconds(s)
    if slo.kind == "lag":
        return lag
    if s.latency is not None:
        return s.latency.p99_seconds
    return None if lag is None else lag + s.seconds


def read_slo(slo: Slo, window: Sequence[Sample], horizon: float) -> SloReading:
    """The SLO over ``window`` (oldest first, the latest batch last), projected ``horizon`` s ahead.

    The value is the window's p99 latency (``latency``) or the latest batch's lag (``lag``).
    The projection adds to it the slope of the per-batch values of the latest (up to four)
    batches times ``horizon``, when they rise.

    >>> w = [Sample(t, 5.0, 100.0, 500, 1.0, 1.0, warmup=False, backlog=b, seconds=1.0)
    ...      for t, b in ((0.0, 0), (5.0, 500), (10.0, 1000))]
    >>> r = read_slo(Slo("lag", 12.0), w, horizon=10.0)
    >>> r.value, r.projected, r.at_risk
    (11.0, 21.0, True)
    """
    if not window:
        return SloReading(slo, None, None, horizon, "no batch yet")
    latest = window[-1]
    values = [(s.time, _per_batch(slo, s)) for s in window[-4:]]
    if slo.kind == "lag":
        value, how = lag_seconds(latest), "lag"
        if value is None:
            return SloReading(slo, None, None, horizon, "a backlog but no input: its age is unknown")
    else:
        measured = [s.latency for s in window if s.latency is not None]
        q = window_quantile(measured, 0.99)
        if q is not None:
            value, how = q, f"p99 latency over {len(measured)} batches"
        else:
            value, how = _per_batch(slo, latest), "latency estimated from the lag (no append times)"
            if value is None:
                return SloReading(slo, None, None, horizon, "no append times, and a backlog of unknown age")
    points = [(t, v) for t, v in values if v is not None]
    projected = value
    if len(points) >= 2 and points[-1][0] > points[0][0]:
        slope = _slope(points)
        if slope > 0:
            projected = value + slope * horizon
    return SloReading(slo, value, projected, horizon, how, values[-1][1])


def _slope(points: Sequence[tuple[float, float]]) -> float:
    """Least-squares slope of (t, v) points (at least two distinct times)."""
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    den = sum((t - mt) ** 2 for t, _ in points)
    return sum((t - mt) * (v - mv) for t, v in points) / den if den > 0 else 0.0
