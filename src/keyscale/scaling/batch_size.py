"""How much a batch reads, from a latency target (issue 35, item 3): a pure rule, no I/O.

A batch costs a fixed part ``F`` (planning, task launch, the commit: docs/benchmarks.md,
"The fixed cost of a batch") and a part per record ``c``. With batches back to back, a
record waits for the batch running when it arrives, then for its own: its latency is at
most two batch times. So a latency target ``T`` allows batches of ``T / 2``, which hold
``(T/2 - F) / c`` records: small batches when input is light, and never more than that
when it is heavy (:func:`latency_records`).

Throughput comes first, though: a batch of ``n`` records takes ``F + c n`` seconds, while
``rate (F + c n)`` records arrive; below ``n = rate F / (1 - rate c)`` every batch leaves
more behind than it read and the lag grows without end (:func:`keep_up_records`). The
limit is the larger of the two, the second with ``headroom`` (to drain a backlog), and a
target the job cannot meet at its rate is said so (``meets_target`` False), not hidden.
Where one record costs more than its share of a second (``rate c >= 1``), no size keeps up
(more parallelism does): the limit is lifted.

>>> s = batch_records(target_seconds=1.0, fixed_seconds=0.2, seconds_per_record=1e-5, rate=5000)
>>> s.records, s.meets_target, round(s.batch_seconds, 2)
(30000, True, 0.5)
>>> s = batch_records(target_seconds=0.3, fixed_seconds=0.2, seconds_per_record=1e-5, rate=5000)
>>> s.records, s.meets_target
(1316, False)
>>> batch_records(target_seconds=1.0, fixed_seconds=0.2, seconds_per_record=1e-3, rate=2000).records is None
True
>>> fit_cost([(0, 0.30), (1000, 0.40), (2000, 0.50)])
(0.3, 0.0001)

A running job sizes its next batch with :func:`next_batch`: the costs fitted to its recent
batches, the input rate measured from them (:func:`arrival_rate`), and no more than
``GROWTH`` times the largest batch it measured: the fitted line is a measure of the batch
sizes seen, not of those far beyond them (nor, with batches all of one size, of ``c``).

>>> s = next_batch(1.0, [(0, 0.2), (1000, 0.21), (2000, 0.22)], rate=5000)
>>> s.records, s.meets_target
(8000, True)
>>> arrival_rate([(10.0, 500, 0), (11.0, 5000, 200), (12.0, 5000, 0)])
5000.0
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

HEADROOM = 1.25
"""How much more than the arrivals during it a batch may read at least: what drains a backlog."""
GROWTH = 4
"""How many times the largest batch measured the next one may read at most."""
PROBE_RECORDS = 1000
"""What the growth starts from: the limit before any batch was measured, or after only tiny ones."""


@dataclass(frozen=True)
class BatchSize:
    """A batch's read limit and why.

    Attributes:
        records: the most records the batch reads (all partitions together), or None: no limit.
        batch_seconds: the batch's expected time at that size (``F + c n``; None without a limit).
        meets_target: whether a record's expected latency (two batch times) is within the target.
        reason: one line for the status.
    """

    records: int | None
    batch_seconds: float | None
    meets_target: bool
    reason: str

    def per_partition(self, partitions: int) -> int | None:
        """The limit per partition of a log read in ``partitions`` partitions (what a log
        source's plan caps, ``max_records_per_partition``), rounded up, at least 1."""
        return None if self.records is None else per_partition(self.records, partitions)


def per_partition(records: int, partitions: int) -> int:
    """A limit of ``records`` for a log read in ``partitions`` partitions, per partition:
    rounded up, at least 1.

    >>> per_partition(667, 4), per_partition(0, 4)
    (167, 1)
    """
    return max(1, math.ceil(records / max(1, partitions)))


def meets(batch_seconds: float, target_seconds: float) -> bool:
    """Whether batches of ``batch_seconds`` hold a latency target: a record's expected
    latency is two batch times (within float rounding).

    >>> meets(0.5, 1.0), meets(0.51, 1.0)
    (True, False)
    """
    return 2 * batch_seconds <= target_seconds * (1 + 1e-9)


def latency_records(target_seconds: float, fixed_seconds: float, seconds_per_record: float) -> float:
    """Records a batch of half the target holds (0 when the fixed cost alone is over it;
    infinite when records cost nothing)."""
    room = target_seconds / 2 - fixed_seconds
    if room <= 0:
        return 0.0
    return math.inf if seconds_per_record <= 0 else room / seconds_per_record


def keep_up_records(rate: float, fixed_seconds: float, seconds_per_record: float) -> float:
    """The smallest batch that reads at least what arrives while it runs (infinite when no
    batch does: ``rate c >= 1``)."""
    load = rate * seconds_per_record
    if load >= 1:
        return math.inf
    return rate * fixed_seconds / (1 - load)


def batch_records(
    target_seconds: float, fixed_seconds: float, seconds_per_record: float, rate: float,
    cap: int | None = None, minimum: int = 1, headroom: float = HEADROOM,
) -> BatchSize:
    """The read limit of the next batch for a latency target of ``target_seconds`` (a
    record's append to its batch's commit), from the batch costs (``fixed_seconds``, and
    ``seconds_per_record``: :func:`fit_cost` of recent batches) and the input ``rate``
    (records/s). ``cap``: a limit the job sets anyway (``max_records_per_batch``);
    ``minimum``: the smallest limit worth a batch."""
    if not (target_seconds > 0 and fixed_seconds >= 0 and seconds_per_record >= 0 and rate >= 0 and headroom >= 1 and minimum >= 1):
        raise ValueError("batch_records: the target must be > 0, costs and rate >= 0, headroom >= 1, minimum >= 1")
    by_latency = latency_records(target_seconds, fixed_seconds, seconds_per_record)
    keep_up = keep_up_records(rate, fixed_seconds, seconds_per_record)
    if math.isinf(keep_up):
        return BatchSize(cap, None if cap is None else fixed_seconds + seconds_per_record * cap, False,
                         f"no batch size keeps up with {rate:,.0f} records/s at {seconds_per_record * 1e6:,.1f} µs a record: more parallelism does")
    need = keep_up * headroom
    # Whole records: the latency's share rounded down, keeping up's rounded up.
    limit = max(math.floor(by_latency * (1 + 1e-12)) if math.isfinite(by_latency) else math.inf, math.ceil(need), minimum)
    held = "any number of records (no cost per record measured)" if math.isinf(by_latency) else f"{by_latency:,.0f} records"
    reason = (f"a batch of {target_seconds / 2:.2f} s (half the {target_seconds:.2f} s target) holds {held}"
              if by_latency >= need else
              f"keeping up with {rate:,.0f} records/s needs {need:,.0f} records a batch, more than the target allows ({by_latency:,.0f})")
    if cap is not None and cap < limit:
        limit, reason = cap, f"{reason}; capped at {cap:,} by the job"
    if math.isinf(limit):
        return BatchSize(None, None, True, reason)
    records = int(limit)
    seconds = fixed_seconds + seconds_per_record * records
    return BatchSize(records, seconds, meets(seconds, target_seconds), reason)


def fit_cost(batches: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """``(F, c)``: a batch's fixed seconds and seconds per record from recent batches'
    ``(records, seconds)``, by least squares, neither below 0. With no spread in records,
    the fixed cost is the median time of the batches with the fewest and c is 0."""
    if not batches:
        raise ValueError("fit_cost needs at least one batch")
    xs = [float(n) for n, _ in batches]
    ys = [float(s) for _, s in batches]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return round(max(0.0, statistics.median(ys)), 9), 0.0
    c = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx)
    f = my - c * mx
    if f < 0:  # through the origin instead
        f, c = 0.0, max(0.0, sum(x * y for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs))
    return round(f, 9), round(c, 12)


def arrival_rate(batches: Sequence[tuple[float, int, int | None]]) -> float | None:
    """Records per second that arrived over recent batches, each ``(end time in seconds,
    records read, backlog after it)``, oldest first: what the batches after the first read,
    plus the growth of the backlog, over the time between the first's end and the last's.
    None with fewer than two batches whose backlog is known, or no time between them.

    >>> arrival_rate([(0.0, 10, 100), (2.0, 300, 0)])  # 300 read, the backlog of 100 gone: 200 arrived
    100.0
    """
    known = [b for b in batches if b[2] is not None]
    if len(known) < 2 or known[-1][0] <= known[0][0]:
        return None
    first, last = known[0], known[-1]
    read = sum(n for t, n, _ in batches if first[0] < t <= last[0])
    assert first[2] is not None and last[2] is not None
    return max(0.0, read + last[2] - first[2]) / (last[0] - first[0])


def next_batch(target_seconds: float, batches: Sequence[tuple[int, float]], rate: float | None, cap: int | None = None) -> BatchSize:
    """The next batch's read limit: :func:`batch_records` with the costs fitted to recent
    ``batches`` (``(records, seconds)``) and the input ``rate``, at most ``GROWTH`` times
    the largest batch measured (at least ``PROBE_RECORDS`` times that) unless keeping up
    with the rate needs more: throughput first. With no batch measured, or the rate not
    measured yet (None), that bound (before any batch: ``PROBE_RECORDS``). ``cap`` as in
    :func:`batch_records`: it wins."""
    if not target_seconds > 0:
        raise ValueError("next_batch: the target must be > 0")
    bound = GROWTH * max(PROBE_RECORDS, max(n for n, _ in batches)) if batches else PROBE_RECORDS
    if not batches or rate is None:
        n = bound if cap is None else min(cap, bound)
        what = "no batch measured yet" if not batches else "the input rate is not measured yet"
        return BatchSize(n, None, False, f"{what}: {n:,} records (at most {GROWTH}x the largest batch measured)")
    f, c = fit_cost(batches)
    size = batch_records(target_seconds, f, c, rate, cap=cap)
    need = keep_up_records(rate, f, c) * HEADROOM
    if math.isfinite(need):
        bound = max(bound, math.ceil(need))
    if size.records is not None and size.records <= bound:
        return size
    seconds = f + c * bound
    return BatchSize(bound, seconds, meets(seconds, target_seconds) and math.isfinite(need),
                     f"{size.reason}; at most {GROWTH}x the largest batch measured: {bound:,} records")


WAITING_SECONDS = 2.0
"""About how long a batch runs while a scale-up waits for its executors (:func:`waiting_records`)."""
WAITING = f"a scale-up waiting for its executors (about {WAITING_SECONDS:g} s of work a batch)"
"""``ReadLimit.limited_by`` when :func:`waiting_records` is the smaller limit."""


def waiting_records(records: int, seconds: float, within: float = WAITING_SECONDS) -> int | None:
    """The most a batch reads while a live scale-up waits for the executors it asked Spark
    for: what the last batch's pace (its ``records`` over its ``seconds``, fixed cost
    included) gets through in ``within`` seconds, at least 1. The job looks for its
    executors between batches, so a batch of the whole backlog at the old parallelism would
    hold the rescale back for all its length once they came (one ran 10.9 s at P=1 on a
    local cluster while the executors it waited for were starting; docs/benchmarks.md, "The
    executor wait"). None (no limit) when the last batch read nothing: it measured no pace.

    >>> waiting_records(1500, 4.5), waiting_records(1500, 4.5, within=1.0), waiting_records(0, 0.3)
    (667, 334, None)
    """
    if records <= 0 or seconds <= 0:
        return None
    return max(1, math.ceil(records / seconds * within))


TARGET = "latency target"
"""``ReadLimit.limited_by`` when the target's limit is the smaller."""


@dataclass(frozen=True)
class ReadLimit:
    """A batch's read limit per partition and whose it is (``limited_by``): the target's
    (``size``, from :func:`~keyscale.scaling.batch_size.next_batch`) or the source's own,
    the smaller; the batch's expected seconds at that limit and whether the target holds."""

    target_seconds: float
    partitions: int
    per_partition: int | None
    size: BatchSize
    limited_by: str  # TARGET, or the source's own: "source 'uid' max_records_per_batch"
    expected_seconds: float | None
    meets_target: bool

    @property
    def records(self) -> int | None:
        return None if self.per_partition is None else self.per_partition * self.partitions

    def to_json(self) -> dict[str, Any]:
        """The status's ``batch_size``: the records limit (all partitions together), the
        expected batch seconds at it, whether the target is met, and why."""
        reason = self.size.reason
        if self.limited_by != TARGET:
            theirs = "no limit" if self.size.records is None else f"{self.size.records:,} records"
            reason = f"{self.limited_by} ({self.per_partition:,} a partition) is below the target's {theirs}: {reason}"
        return {
            "target_seconds": self.target_seconds, "records": self.records, "records_per_partition": self.per_partition,
            "partitions": self.partitions, "limited_by": self.limited_by, "meets_target": self.meets_target,
            "expected_batch_seconds": None if self.expected_seconds is None else round(self.expected_seconds, 4), "reason": reason,
        }
