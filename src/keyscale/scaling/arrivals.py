"""The simulated job's unread records, oldest first, and the end-to-end latency of a batch
that reads some of them. Pure arithmetic, no Spark, no clock.

The simulator (:mod:`keyscale.scaling.jobmodel`) only knows how many records arrive in an
interval, so it keeps the unread ones as *segments*: ``count`` records that arrived evenly
spread over ``[start, end)``. A batch reads the oldest records first (a log read in offset
order), so it takes whole segments from the front and part of the next one.

The latency model: a record that arrived at ``a`` and is read by a batch that starts at
``t``, runs ``d`` seconds and commits at ``c = t + d`` has latency ``c - a``:

* the wait for its batch (``t - a``): up to one trigger interval when the job keeps up;
  more when it arrived while a backlog was queued (the backlog's drain) or while the job
  was down for a restart;
* the batch time ``d``: the busiest subtask's busy time.

:func:`batch_latency` turns the records a batch read into a :class:`keyscale.latency.Latency`
with the histogram :func:`keyscale.latency.window_quantile` merges, so a policy that reads
``BatchMetrics.latency`` sees what a real job's commit would report, and a benchmark can
take a minute's p99 over its batches. Each segment's records are spread over
:data:`SLICES` equal slices (each counted at its midpoint), so a bucket's count is exact
to within one slice's width of arrival time.

>>> q = ArrivalQueue()
>>> q.push(0.0, 5.0, 500.0)
>>> q.push(5.0, 10.0, 500.0)
>>> read = q.pop(600)
>>> [(s.start, s.end, s.count) for s in read]
[(0.0, 5.0, 500.0), (5.0, 6.0, 100.0)]
>>> q.records, q.oldest
(400.0, 6.0)
>>> lat = batch_latency(read, committed=12.0)
>>> lat.records, lat.max_seconds, lat.min_seconds
(600, 12.0, 6.0)
>>> 11.0 < lat.p99_seconds <= 12.0
True
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from keyscale.latency import Latency, bucket_of, quantile, representative

__all__ = ["SLICES", "ArrivalQueue", "Segment", "batch_latency"]

SLICES = 16
"""Slices per segment when a batch's latencies are bucketed."""

#: What the simulated latencies are measured from (Latency.clock).
CLOCK = "simulated arrival"


@dataclass(frozen=True)
class Segment:
    """``count`` records arrived evenly spread over ``[start, end)`` (``start == end``: at once)."""

    start: float
    end: float
    count: float

    def split(self, n: float) -> tuple[Segment, Segment]:
        """The first ``n`` records (the oldest) and the rest.

        >>> Segment(0.0, 10.0, 100.0).split(30.0)
        (Segment(start=0.0, end=3.0, count=30.0), Segment(start=3.0, end=10.0, count=70.0))
        """
        cut = self.start + (self.end - self.start) * (n / self.count)
        return Segment(self.start, cut, n), Segment(cut, self.end, self.count - n)


class ArrivalQueue:
    """Unread records, oldest first, as :class:`Segment` s."""

    def __init__(self) -> None:
        self._segments: deque[Segment] = deque()
        self._records = 0.0

    @property
    def records(self) -> float:
        """Records queued."""
        return self._records

    @property
    def oldest(self) -> float | None:
        """Arrival time of the oldest queued record (``None``: none queued)."""
        return self._segments[0].start if self._segments else None

    def push(self, start: float, end: float, count: float) -> None:
        """``count`` records arrived over ``[start, end)``."""
        if count > 0:
            self._segments.append(Segment(start, end, count))
            self._records += count

    def pop(self, n: float) -> list[Segment]:
        """Take the ``n`` oldest records (all of them when fewer are queued)."""
        out: list[Segment] = []
        left = n
        while left > 1e-9 and self._segments:
            head = self._segments[0]
            if head.count <= left + 1e-9:
                out.append(self._segments.popleft())
                left -= head.count
            else:
                first, rest = head.split(left)
                self._segments[0] = rest
                out.append(first)
                left = 0.0
        self._records = max(0.0, self._records - sum(s.count for s in out))
        if not self._segments:
            self._records = 0.0
        return out


def batch_latency(read: Sequence[Segment], committed: float) -> Latency | None:
    """The latency of the records ``read`` by a batch that committed at ``committed``:
    per record ``committed - arrival``; ``None`` when it read none.

    ``max_seconds`` and ``min_seconds`` are exact (the oldest and newest arrival); the
    quantiles come from the histogram, as for a real batch (:mod:`keyscale.latency`).

    >>> lat = batch_latency([Segment(0.0, 10.0, 1000.0)], committed=10.0)
    >>> lat.records, round(lat.p50_seconds)
    (1000, 5)
    >>> batch_latency([], committed=1.0) is None
    True
    """
    segments = [s for s in read if s.count > 0]
    total = round(sum(s.count for s in segments))
    if total <= 0:
        return None
    pairs: list[tuple[float, float]] = []  # (latency, records)
    for s in segments:
        width = (s.end - s.start) / SLICES
        pairs += [
            (committed - (s.start + (i + 0.5) * width), s.count / SLICES) for i in range(SLICES)
        ]
    buckets = _integer_buckets(pairs, total)
    most = max(0.0, committed - min(s.start for s in segments))
    least = max(0.0, committed - max(s.end for s in segments))
    values = [(representative(b), n) for b, n in buckets.items()]

    def clamp(x: float) -> float:
        return min(most, max(least, x))

    return Latency(
        records=total,
        p50_seconds=clamp(quantile(values, 0.5)),
        p99_seconds=clamp(quantile(values, 0.99)),
        max_seconds=most,
        min_seconds=least,
        committed=committed,
        clock=CLOCK,
        buckets=buckets,
    )


def _integer_buckets(pairs: list[tuple[float, float]], total: int) -> dict[int, int]:
    """Fractional record counts per latency as whole records per bucket, adding up to
    ``total`` (largest remainder: a bucket's count is off by less than one record)."""
    exact: dict[int, float] = {}
    for latency, n in pairs:
        b = bucket_of(latency)
        exact[b] = exact.get(b, 0.0) + n
    scale = total / sum(exact.values())
    whole = {b: math.floor(n * scale) for b, n in exact.items()}
    by_remainder = sorted(exact, key=lambda b: whole[b] - exact[b] * scale)
    for b in by_remainder[: total - sum(whole.values())]:
        whole[b] += 1
    return {b: n for b, n in whole.items() if n > 0}
