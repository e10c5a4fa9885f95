"""End-to-end latency: from a record's append to its source to the commit that makes its
update visible. Pure (numbers in, numbers out: no Spark, no clock); the runtime's plumbing
is in ``runtime/task/reader.py`` (executors) and ``runtime/batch/commit.py`` (driver).

An executor cannot know when its batch will commit, so each reader task summarises the
append times of the records it read as :class:`Ages`: their ages when the task ended
(``ended - appended``, on the task's wall clock) in fixed, log-spaced buckets, plus the
oldest and newest append time. The driver takes the commit time (its wall clock) and turns
the batch's :class:`Ages` into a :class:`Latency` (:func:`at_commit`): each bucket's
records are ``commit - ended`` older than their age at the task's end.

Why buckets, not a fixed number of quantiles: quantiles of several tasks do not merge
(the p99 of two tasks is not a function of their p99s), bucket counts add. The buckets are
DDSketch's (Masson, Rim and Lee, VLDB 2019): bucket ``i`` holds ages in
``(GAMMA**(i-1), GAMMA**i]`` and stands for ``2 GAMMA**i / (GAMMA + 1)``, which is within
:data:`ALPHA` (2 %) of any age in it; ages of at most :data:`MIN_AGE` share bucket
:data:`ZERO`. Only buckets with records are sent: a batch whose ages span one decade uses
at most 59 of them, whatever its size.

Guarantees (``tests/test_latency.py`` checks them with hypothesis):

- a batch's ``max_seconds`` and ``min_seconds`` are exact (from the oldest and newest
  append times), and so is its ``lag_seconds``: how long its oldest record had waited when
  the batch began, which is the job's lag then (the age of its oldest unread record) for a
  source read in append order (a Kafka partition or a log from its committed offset, files
  oldest first);
- its ``p50_seconds`` and ``p99_seconds`` are within ``ALPHA * true + MIN_AGE`` of the
  nearest-rank quantiles of the true latencies;
- :func:`window_quantile` over several batches (the autoscaler's SLO window) is within
  ``(1 + ALPHA)**2 - 1`` (4 %) plus ``2 * MIN_AGE``: a batch's latencies are bucketed again.

>>> import numpy as np
>>> a = ages(np.array([100.0, 100.5, 101.0]), ended=102.0, clock="test")
>>> a.records, a.oldest, a.newest
(3, 100.0, 101.0)
>>> lat = at_commit([a], committed=103.0, began=101.5)
>>> lat.records, lat.max_seconds, lat.min_seconds, lat.lag_seconds
(3, 3.0, 2.0, 1.5)
>>> abs(lat.p50_seconds - 2.5) <= ALPHA * 2.5 + MIN_AGE
True
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "ALPHA",
    "GAMMA",
    "MIN_AGE",
    "PROMETHEUS_BUCKETS",
    "ZERO",
    "Ages",
    "Latency",
    "LatencyTotals",
    "ages",
    "at_commit",
    "bucket_of",
    "merge_ages",
    "quantile",
    "representative",
    "seconds_words",
    "window_quantile",
]

ALPHA = 0.02  # relative accuracy of a bucket's representative value
GAMMA = (1 + ALPHA) / (1 - ALPHA)
_LOG_GAMMA = math.log(GAMMA)
MIN_AGE = 0.001  # seconds: ages at or below it are all "at once" (bucket ZERO)
ZERO = -(10**6)  # the bucket of ages <= MIN_AGE (below any log bucket: log(MIN_AGE) / log(GAMMA) ~ -173)

#: The ``le`` bounds of ``keyscale_end_to_end_latency_seconds`` (seconds): from 50 ms (a
#: record processed within its batch's commit) to 5 minutes (a job far behind its input).
PROMETHEUS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def bucket_of(age: float) -> int:
    """The bucket of an age in seconds (negative ages, a clock behind another, count as 0).

    >>> bucket_of(0.0) == ZERO, bucket_of(1.0), bucket_of(GAMMA), bucket_of(GAMMA * 1.0001)
    (True, 0, 1, 2)
    """
    if not age > MIN_AGE:
        return ZERO
    return math.ceil(math.log(age) / _LOG_GAMMA - 1e-12)


def representative(bucket: int) -> float:
    """The age that stands for a bucket's records: within ALPHA of any of them (ZERO: half
    of MIN_AGE, within MIN_AGE / 2 of any of them)."""
    if bucket == ZERO:
        return MIN_AGE / 2
    return 2 * GAMMA**bucket / (GAMMA + 1)


def _buckets(values: np.ndarray[Any, Any]) -> dict[int, int]:
    """Bucket counts of an array of ages (seconds)."""
    if values.size == 0:
        return {}
    v = np.asarray(values, dtype=np.float64)
    idx = np.full(v.shape, ZERO, dtype=np.int64)
    pos = v > MIN_AGE
    idx[pos] = np.ceil(np.log(v[pos]) / _LOG_GAMMA - 1e-12).astype(np.int64)
    keys, counts = np.unique(idx, return_counts=True)
    return {int(k): int(n) for k, n in zip(keys, counts, strict=True)}


@dataclass(frozen=True)
class Ages:
    """One task's records: their ages at ``ended`` (Unix seconds, the task's clock) in
    buckets, the oldest and newest append time (Unix seconds), and what the append time is
    (``clock``: ``"kafka LogAppendTime"``, ``"log segment write"``...)."""

    ended: float
    buckets: Mapping[int, int]
    oldest: float
    newest: float
    clock: str

    @property
    def records(self) -> int:
        return sum(self.buckets.values())

    def to_wire(self) -> dict[str, Any]:
        return {"ended": self.ended, "buckets": [[b, n] for b, n in sorted(self.buckets.items())], "oldest": self.oldest,
                "newest": self.newest, "clock": self.clock}

    @staticmethod
    def from_wire(d: Mapping[str, Any]) -> Ages:
        return Ages(float(d["ended"]), {int(b): int(n) for b, n in d["buckets"]}, float(d["oldest"]), float(d["newest"]), str(d["clock"]))


def ages(appended: np.ndarray[Any, Any], ended: float, clock: str) -> Ages | None:
    """The :class:`Ages` of records appended at ``appended`` (Unix seconds) as of ``ended``;
    None for no records. NaN append times (a record without one) are left out."""
    a = np.asarray(appended, dtype=np.float64)
    a = a[~np.isnan(a)]
    if a.size == 0:
        return None
    return Ages(ended, _buckets(ended - a), float(a.min()), float(a.max()), clock)


def merge_ages(a: Ages | None, b: Ages | None) -> Ages | None:
    """Two summaries of one task (same ``ended``) as one; either may be None."""
    if a is None or b is None:
        return a if b is None else b
    if a.ended != b.ended:
        raise ValueError("merge_ages: summaries taken at different times do not merge (at_commit takes a list of them)")
    buckets = dict(a.buckets)
    for k, n in b.buckets.items():
        buckets[k] = buckets.get(k, 0) + n
    clock = a.clock if a.clock == b.clock else ", ".join(sorted({*a.clock.split(", "), *b.clock.split(", ")}))
    return Ages(a.ended, buckets, min(a.oldest, b.oldest), max(a.newest, b.newest), clock)


def quantile(pairs: Iterable[tuple[float, int]], q: float) -> float:
    """The nearest-rank ``q``-quantile of values given as (value, count): the smallest
    value with at least ``ceil(q * n)`` (at least one) values at or below it.

    >>> quantile([(3.0, 1), (1.0, 2), (2.0, 1)], 0.5), quantile([(3.0, 1), (1.0, 2)], 0.99)
    (1.0, 3.0)
    """
    items = sorted((v, n) for v, n in pairs if n > 0)
    total = sum(n for _, n in items)
    if total == 0:
        raise ValueError("quantile of no values")
    rank = max(1, math.ceil(q * total - 1e-9))
    seen = 0
    for v, n in items:
        seen += n
        if seen >= rank:
            return v
    return items[-1][0]


@dataclass(frozen=True)
class Latency:
    """A batch's end-to-end latency: per record, ``committed - appended``, in seconds.

    ``buckets`` is the batch's latency histogram (the same log buckets as :class:`Ages`):
    what :func:`window_quantile` merges over several batches and the Prometheus histogram
    counts. A run keeps it for its last ``HISTORY`` batches (``runtime/batch/jobstate.py``);
    older batch records keep the figures only."""

    records: int
    p50_seconds: float
    p99_seconds: float
    max_seconds: float
    min_seconds: float
    committed: float  # Unix seconds, the driver's clock
    clock: str
    buckets: Mapping[int, int] = field(default_factory=dict)
    # How long the oldest record had waited when the batch began (None: its start not given).
    lag_seconds: float | None = None

    def words(self) -> str:
        """The log's form: ``latency p50 0.412 s, p99 1.050 s, max 1.300 s``, in days where
        the records are that old (a backfill of old files: "p50 1,111 days", not 96 million s).

        >>> Latency(3, 0.4121, 1.05, 1.3, 0.2, 0.0, "test").words()
        'latency p50 0.412 s, p99 1.050 s, max 1.300 s'
        >>> Latency(3, 96_016_202.4, 96_016_203.0, 96_016_203.5, 96_016_202.0, 0.0, "file").words()
        'latency p50 1,111 days, p99 1,111 days, max 1,111 days'
        >>> Latency(3, 0.4121, 1.05, 1.3, 0.2, 0.0, "test", lag_seconds=0.9).words()
        'latency p50 0.412 s, p99 1.050 s, max 1.300 s; 0.900 s behind its input when it began'
        """
        return (f"latency p50 {seconds_words(self.p50_seconds)}, p99 {seconds_words(self.p99_seconds)}, "
                f"max {seconds_words(self.max_seconds)}"
                + ("" if self.lag_seconds is None else f"; {seconds_words(self.lag_seconds)} behind its input when it began"))

    def to_json(self) -> dict[str, Any]:
        """The status's and the dashboard's form (no buckets)."""
        return {"records": self.records, "p50_seconds": round(self.p50_seconds, 4), "p99_seconds": round(self.p99_seconds, 4),
                "max_seconds": round(self.max_seconds, 4), "min_seconds": round(self.min_seconds, 4),
                "committed_ms": int(self.committed * 1000), "append_time": self.clock,
                "lag_seconds": None if self.lag_seconds is None else round(self.lag_seconds, 4)}


def seconds_words(seconds: float) -> str:
    """A latency for people: milliseconds shown under a minute, then minutes, hours, days.

    >>> seconds_words(0.4121), seconds_words(59.9), seconds_words(90), seconds_words(7200), seconds_words(3 * 86_400)
    ('0.412 s', '59.900 s', '1.5 min', '2.0 h', '3 days')
    """
    if seconds < 60:
        return f"{seconds:.3f} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    if seconds < 2 * 86_400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86_400:,.0f} days"


def at_commit(summaries: Iterable[Ages | None], committed: float, began: float | None = None) -> Latency | None:
    """The latency of a batch committed at ``committed`` (Unix seconds) whose tasks reported
    ``summaries``, and its lag if it began at ``began``; None when no task measured a record
    (a source without append times).

    A record of age ``a`` at its task's end ``e`` has latency ``committed - e + a``; a
    negative one (clocks apart) counts as 0, and so does a lag of a record appended after
    ``began`` (a batch fixes its input just after it begins)."""
    tasks = [s for s in summaries if s is not None and s.records > 0]
    if not tasks:
        return None
    pairs: list[tuple[float, int]] = []
    for s in tasks:
        shift = committed - s.ended
        pairs += [(max(0.0, shift + representative(b)), n) for b, n in s.buckets.items()]
    oldest, newest = min(s.oldest for s in tasks), max(s.newest for s in tasks)
    most, least = max(0.0, committed - oldest), max(0.0, committed - newest)

    def clamp(x: float) -> float:
        return min(most, max(least, x))

    buckets: dict[int, int] = {}
    for v, n in pairs:
        b = bucket_of(v)
        buckets[b] = buckets.get(b, 0) + n
    clocks = sorted({c for s in tasks for c in s.clock.split(", ")})
    return Latency(
        records=sum(n for _, n in pairs), p50_seconds=clamp(quantile(pairs, 0.5)), p99_seconds=clamp(quantile(pairs, 0.99)),
        max_seconds=most, min_seconds=least, committed=committed, clock=", ".join(clocks), buckets=buckets,
        lag_seconds=None if began is None else max(0.0, began - oldest),
    )


def window_quantile(batches: Iterable[Latency | None], q: float) -> float | None:
    """The ``q``-quantile of the latencies of all records of ``batches`` (e.g. the p99 of
    the last minute's batches, an SLO's window); None when none measured any. Never above
    the largest batch maximum.

    >>> import numpy as np
    >>> b1 = at_commit([ages(np.array([0.0] * 99), 1.0, "t")], 2.0)
    >>> b2 = at_commit([ages(np.array([0.0]), 1.0, "t")], 10.0)
    >>> round(window_quantile([b1, b2, None], 0.5), 1), round(window_quantile([b1, b2], 1.0), 1)
    (2.0, 10.0)
    """
    got = [b for b in batches if b is not None and b.buckets]  # a run keeps the histograms of its recent batches only
    if not got:
        return None
    pairs = [(representative(k), n) for b in got for k, n in b.buckets.items()]
    return min(max(b.max_seconds for b in got), max(min(b.min_seconds for b in got), quantile(pairs, q)))


@dataclass
class LatencyTotals:
    """The run's latency histogram in :data:`PROMETHEUS_BUCKETS` (what
    ``keyscale_end_to_end_latency_seconds`` serves): per bucket the records whose latency
    is at most its bound and above the one before (the last: above every bound), their
    count and the sum of their latencies. Each batch adds its buckets' records at their
    representative latency, so a record near a bound may count in the bucket next to it
    (within ALPHA)."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(PROMETHEUS_BUCKETS) + 1))
    total: int = 0
    sum_seconds: float = 0.0

    def add(self, latency: Latency | None) -> None:
        if latency is None:
            return
        for b, n in latency.buckets.items():
            v = representative(b)
            self.counts[bisect_left(PROMETHEUS_BUCKETS, v)] += n
            self.total += n
            self.sum_seconds += v * n

    def cumulative(self) -> Sequence[tuple[str, int]]:
        """(``le``, records at or below it) for Prometheus, ending with ``+Inf``."""
        out, seen = [], 0
        for bound, n in zip([*map(_le, PROMETHEUS_BUCKETS), "+Inf"], self.counts, strict=True):
            seen += n
            out.append((bound, seen))
        return out


def _le(bound: float) -> str:
    return repr(float(bound))
