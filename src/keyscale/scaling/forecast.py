"""The input rate ahead: a job's own rate history in, the highest rate expected soon out.

The model, in one sentence: **the rate one season ago (a week, else a day) over the coming
horizon, scaled by how today's level compares with that season's level just before; without
a season of history, a recent rise extrapolated; without that, the current rate.** It is
seasonal-naive with a level correction (a Holt-Winters forecast with its smoothing reduced
to "the last season" and "the last minutes"): simple enough that every decision can quote
the numbers it used (:attr:`Forecast.text`).

:class:`RateHistory` keeps the mean input rate per bucket (``bucket_seconds``) over the
last ``keep_seconds`` (eight days by default: a weekly season and a day to spare). It is a
versioned JSON object (:meth:`RateHistory.to_json` / :meth:`RateHistory.from_json`) the
runtime writes to the job directory (``autoscaler/rates.json``), so a restarted job keeps
what it learnt. Pure: :func:`forecast` reads a history and a time, nothing else.

>>> h = RateHistory(bucket_seconds=60.0)
>>> for t in range(0, 7200, 5):            # two "days" of one hour: a rise at minute 30
...     _ = h.add(float(t), 4000.0 if t % 3600 >= 1800 else 1000.0, 5.0)
>>> f = forecast(h, now=3600 + 1780.0, current_rate=1000.0, horizon=60.0, seasons=(3600.0,))
>>> f.method, round(f.rate)
('seasonal', 4000)
>>> print(f.text)  # doctest: +NORMALIZE_WHITESPACE
up to 4,000 rec/s in the next 60 s: 1 h ago the rate went from 1,000 to 4,000 rec/s
over the same 60 s, and now it is 1,000 rec/s (1.00x that level)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from keyscale.scaling.load import fmt

__all__ = ["DAY", "VERSION", "WEEK", "Forecast", "RateHistory", "forecast"]

VERSION = 1
DAY = 86400.0
WEEK = 7 * DAY

# How far a level may have moved since the season it is compared with before the season
# is no longer trusted to describe today (then the trend is used instead).
_MAX_LEVEL_RATIO = 4.0


@dataclass
class RateHistory:
    """Mean input rate per time bucket: bucket ``i`` covers ``[i * bucket_seconds, (i + 1) * bucket_seconds)``.

    ``buckets`` maps a bucket to ``[records, seconds]`` seen in it (a weighted mean, so
    batches of any length add up). Buckets older than ``keep_seconds`` before the newest
    are dropped as new ones come.

    >>> h = RateHistory(bucket_seconds=10.0)
    >>> h.add(0.0, 100.0, 5.0), h.add(5.0, 300.0, 5.0)  # the first opens a bucket
    (True, False)
    >>> h.mean(0.0, 10.0), RateHistory.from_json(h.to_json()) == h
    (200.0, True)
    """

    bucket_seconds: float = 300.0
    keep_seconds: float = WEEK + DAY
    buckets: dict[int, list[float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.bucket_seconds) and self.bucket_seconds > 0):
            raise ValueError(f"bucket_seconds must be > 0, got {self.bucket_seconds}")
        if not self.keep_seconds >= self.bucket_seconds:
            raise ValueError("keep_seconds must be at least one bucket")

    def add(self, time: float, rate: float, period: float) -> bool:
        """Record that records arrived at ``rate`` over ``period`` seconds up to ``time``
        (counted in ``time``'s bucket); True when this opened a new bucket (the moment to save)."""
        if not (math.isfinite(rate) and rate >= 0 and period > 0):
            return False
        b = math.floor(time / self.bucket_seconds)
        new = b not in self.buckets
        cell = self.buckets.setdefault(b, [0.0, 0.0])
        cell[0] += rate * period
        cell[1] += period
        if new:
            oldest = b - math.ceil(self.keep_seconds / self.bucket_seconds)
            for k in [k for k in self.buckets if k < oldest]:
                del self.buckets[k]
        return new

    def mean(self, start: float, end: float) -> float | None:
        """The mean rate over the buckets overlapping ``[start, end)``; None if none has data."""
        cells = self._cells(start, end)
        seconds = sum(c[1] for c in cells)
        return sum(c[0] for c in cells) / seconds if seconds > 0 else None

    def peak(self, start: float, end: float) -> float | None:
        """The highest bucket mean among those overlapping ``[start, end)``; None if none has data."""
        means = [c[0] / c[1] for c in self._cells(start, end) if c[1] > 0]
        return max(means) if means else None

    def points(self, start: float, end: float) -> list[tuple[float, float]]:
        """(bucket middle, mean rate) of the buckets overlapping ``[start, end)``, in time order."""
        first, last = self._range(start, end)
        return [((b + 0.5) * self.bucket_seconds, c[0] / c[1]) for b in range(first, last + 1)
                if (c := self.buckets.get(b)) is not None and c[1] > 0]

    def _range(self, start: float, end: float) -> tuple[int, int]:
        return math.floor(start / self.bucket_seconds), math.ceil(end / self.bucket_seconds) - 1

    def _cells(self, start: float, end: float) -> list[list[float]]:
        first, last = self._range(start, end)
        if last - first > len(self.buckets):
            return [c for b, c in self.buckets.items() if first <= b <= last]
        return [c for b in range(first, last + 1) if (c := self.buckets.get(b)) is not None]

    def to_json(self) -> dict[str, Any]:
        """The job directory's form (``version`` first: a reader refuses what it does not know)."""
        return {"version": VERSION, "bucket_seconds": self.bucket_seconds, "keep_seconds": self.keep_seconds,
                "buckets": [[b, round(c[0], 3), round(c[1], 3)] for b, c in sorted(self.buckets.items())]}

    @staticmethod
    def from_json(d: dict[str, Any]) -> RateHistory:
        """The inverse of :meth:`to_json`; a ValueError for another version or a malformed object."""
        if d.get("version") != VERSION:
            raise ValueError(f"rate history version {d.get('version')!r} is not {VERSION}")
        try:
            buckets = {int(b): [float(r), float(s)] for b, r, s in d["buckets"]}
            return RateHistory(float(d["bucket_seconds"]), float(d["keep_seconds"]), buckets)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed rate history: {e}") from None


@dataclass(frozen=True)
class Forecast:
    """The highest input rate expected in ``(now, now + horizon]``, how it was found, in words."""

    rate: float
    horizon: float
    method: str  # "seasonal", "trend" or "current"
    text: str

    def to_dict(self) -> dict[str, Any]:
        """The decision's ``forecast`` field (events, status)."""
        return {"input_rate": round(self.rate, 3), "horizon_seconds": self.horizon, "method": self.method, "text": self.text}


def _slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (t, v) points."""
    n = len(points)
    mt, mv = sum(t for t, _ in points) / n, sum(v for _, v in points) / n
    den = sum((t - mt) ** 2 for t, _ in points)
    return sum((t - mt) * (v - mv) for t, v in points) / den if den > 0 else 0.0


def _season_name(s: float) -> str:
    for unit, n in (("week", WEEK), ("d", DAY), ("h", 3600.0), ("min", 60.0)):
        if s >= n and s % n == 0:
            return f"{s / n:g} {unit}"
    return f"{s:g} s"


def forecast(
    history: RateHistory,
    now: float,
    current_rate: float,
    horizon: float,
    seasons: tuple[float, ...] = (WEEK, DAY),
    trend_seconds: float = 1800.0,
) -> Forecast:
    """The highest rate expected in the next ``horizon`` seconds (never below ``current_rate``).

    Seasonal, with the longest season the history covers: ``peak a season ago over the
    horizon x (level now / level a season ago)``, the levels being the mean rate of the
    ``2 * bucket`` seconds before (now, and a season ago); used when that ratio is within 4x
    either way. Else a rising trend: the slope of a least-squares line through the bucket
    means of the last ``trend_seconds`` (at least three buckets), or of the last three
    buckets if lower, from today's level to the horizon's end; only while both rise. Else the
    current rate.

    >>> h = RateHistory(bucket_seconds=60.0)
    >>> for t in range(0, 600, 5):
    ...     _ = h.add(float(t), 1000.0 + t, 5.0)      # rising 1 rec/s per second
    >>> f = forecast(h, now=600.0, current_rate=1600.0, horizon=120.0)
    >>> f.method, round(f.rate, -1)
    ('trend', 1660.0)
    """
    b = history.bucket_seconds
    level_span = 2 * b
    level = history.mean(now - level_span, now)
    for season in sorted(seasons, reverse=True):
        before = history.mean(now - season - level_span, now - season)
        ahead = history.peak(now - season, now - season + horizon)
        if level is None or before is None or ahead is None or before <= 0:
            continue
        ratio = level / before
        if not 1 / _MAX_LEVEL_RATIO <= ratio <= _MAX_LEVEL_RATIO:
            continue
        rate = max(current_rate, ahead * ratio)
        return Forecast(rate, horizon, "seasonal", (
            f"up to {fmt(rate)} rec/s in the next {horizon:.0f} s: {_season_name(season)} ago the rate went from "
            f"{fmt(before)} to {fmt(ahead)} rec/s over the same {horizon:.0f} s, and now it is {fmt(level)} rec/s "
            f"({ratio:.2f}x that level)"))  # fmt: skip
    points = history.points(now - trend_seconds, now)
    if len(points) >= 3:
        # A rise counts only while it still holds in the last three buckets: a step inside the
        # span tilts a line through all of them, and would be extrapolated as a trend for as
        # long as it stays in the span.
        slope = min(_slope(points), _slope(points[-3:]))
        if slope > 0:
            end = (level if level is not None else points[-1][1]) + slope * horizon
            rate = max(current_rate, end)
            return Forecast(rate, horizon, "trend", (
                f"up to {fmt(rate)} rec/s in the next {horizon:.0f} s: no season of history yet, and the last "
                f"{(points[-1][0] - points[0][0] + b) / 60:.0f} min rise {slope * 60:+,.0f} rec/s per minute"))  # fmt: skip
        return Forecast(current_rate, horizon, "current",
                        f"{fmt(current_rate)} rec/s, the current rate: no season of history yet, and no rise that holds")
    return Forecast(current_rate, horizon, "current",
                    f"{fmt(current_rate)} rec/s, the current rate: too little history to forecast")
