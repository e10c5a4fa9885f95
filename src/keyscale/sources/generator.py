"""A load generator with a rate schedule: for demos, tests and benchmarks of the autoscaler.

A schedule is a list of segments, each a rate for a duration, or a linear ramp between two
rates::

    2000/s for 30s, 20000/s for 60s, 2000/s for 30s
    500/s for 10s, 500/s to 5k/s for 1m, 0/s for 5s, 120/min for 1m30s

Rates are ``NUMBER[k|M]/UNIT`` with UNIT ``s``, ``min`` (or ``m``) or ``h``; durations
``NUMBER UNIT`` with UNIT ``ms``, ``s``, ``m``/``min`` or ``h``, and may chain
(``1m30s``). Segments are separated by commas or semicolons.

:class:`RateSchedule` is pure arithmetic (exact, with fractions): the rate at a time, the
records due by a time, and the scheduled emission time of each record. Record ``n``
(``seq`` = ``n``, counting from 0) is due when the schedule's cumulative count reaches
``n + 1``, and its content depends only on ``n`` and the generator's parameters
(:func:`generated_records`), so a test can recompute exactly what was produced.

:func:`generate` appends what is due at every tick, through a
:class:`~keyscale.sources.log.LogWriter` keyed on ``key``, until the schedule ends.
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np
import pyarrow as pa

from keyscale.errors import KeyscaleError
from keyscale.sources.log import LogWriter
from keyscale.sources.partitioned import LogError, PartitionedLog

__all__ = [
    "GENERATOR_DDL",
    "GENERATOR_SCHEMA",
    "GenerateResult",
    "GeneratorThread",
    "RateSchedule",
    "ScheduleError",
    "Segment",
    "generate",
    "generated_records",
    "start_generator",
]

log = logging.getLogger("keyscale")

#: The columns the generator produces; a log it writes to must have a subset of them.
_FIELDS: list[pa.Field[Any]] = [
    pa.field("key", pa.string()),
    pa.field("value", pa.int64()),
    pa.field("ts", pa.timestamp("us", tz="UTC")),
    pa.field("seq", pa.int64()),
]
GENERATOR_SCHEMA = pa.schema(_FIELDS)

#: The generator's schema in Spark DDL, for ``keyscale log create --schema``.
GENERATOR_DDL = "key string, value long, ts timestamp, seq long"


class ScheduleError(KeyscaleError):
    """A rate schedule that does not parse or makes no sense."""


# -- schedules ------------------------------------------------------------------------------------

_RATE_UNITS = {"s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600}
_DURATION_UNITS = {"ms": Fraction(1, 1000), "s": Fraction(1), "sec": Fraction(1), "m": Fraction(60), "min": Fraction(60), "h": Fraction(3600)}
_NUM = r"\d+(?:\.\d*)?|\.\d+"
_RATE = re.compile(rf"^\s*({_NUM})\s*([kKM]?)\s*/\s*(s|sec|min|m|h)\s*$")
_DUR_PART = re.compile(rf"\s*({_NUM})\s*(ms|sec|min|s|m|h)")
_SEGMENT = re.compile(r"^\s*(?P<rate>.+?)(?:\s+to\s+(?P<end>.+?))?\s+for\s+(?P<dur>.+?)\s*$")


def _frac(x: int | float | str | Fraction) -> Fraction:
    """Fractions of decimals as written: 0.1 is 1/10, not the nearest binary fraction."""
    if isinstance(x, float):
        if not math.isfinite(x):
            raise ScheduleError(f"{x} is not a finite number")
        return Fraction(repr(x))
    return Fraction(x)


def _parse_rate(text: str, where: str) -> Fraction:
    m = _RATE.match(text)
    if not m:
        raise ScheduleError(f"{where}: rate {text.strip()!r} is not NUMBER/UNIT (e.g. '2000/s', '5k/s', '120/min')")
    scale = {"": 1, "k": 1000, "K": 1000, "M": 1_000_000}[m.group(2)]
    return Fraction(m.group(1)) * scale / _RATE_UNITS[m.group(3)]


def _parse_duration(text: str, where: str) -> Fraction:
    pos, total, parts = 0, Fraction(0), 0
    text = text.strip()
    while pos < len(text):
        m = _DUR_PART.match(text, pos)
        if not m:
            break
        total += Fraction(m.group(1)) * _DURATION_UNITS[m.group(2)]
        pos = m.end()
        parts += 1
    if parts == 0 or pos != len(text):
        raise ScheduleError(f"{where}: duration {text!r} is not NUMBER UNIT (e.g. '30s', '1m30s', '500ms', '2h')")
    return total


def _fmt(x: Fraction) -> str:
    return str(int(x)) if x.denominator == 1 else f"{float(x):g}"


@dataclass(frozen=True)
class Segment:
    """``rate`` records/s rising (or falling) linearly to ``end_rate`` over ``duration`` seconds.

    >>> s = Segment(100, 10)
    >>> s.records, s.end_rate
    (Fraction(1000, 1), Fraction(100, 1))
    """

    rate: Fraction
    duration: Fraction
    end_rate: Fraction

    def __init__(self, rate: int | float | str | Fraction, duration: int | float | str | Fraction, end_rate: int | float | str | Fraction | None = None) -> None:
        r = _frac(rate)
        e = r if end_rate is None else _frac(end_rate)
        d = _frac(duration)
        if r < 0 or e < 0:
            raise ScheduleError(f"a rate cannot be negative ({_fmt(min(r, e))}/s)")
        if d <= 0:
            raise ScheduleError(f"a segment's duration must be positive, not {_fmt(d)} s")
        object.__setattr__(self, "rate", r)
        object.__setattr__(self, "duration", d)
        object.__setattr__(self, "end_rate", e)

    @property
    def records(self) -> Fraction:
        """The (fractional) number of records the segment schedules."""
        return (self.rate + self.end_rate) / 2 * self.duration

    def rate_at(self, tau: Fraction) -> Fraction:
        """The rate ``tau`` seconds into the segment (0 <= tau <= duration)."""
        return self.rate + (self.end_rate - self.rate) * tau / self.duration

    def cumulative(self, tau: Fraction) -> Fraction:
        """Records scheduled in the first ``tau`` seconds of the segment (0 <= tau <= duration)."""
        return self.rate * tau + (self.end_rate - self.rate) * tau * tau / (2 * self.duration)

    def __str__(self) -> str:
        d = self.duration
        dur = f"{_fmt(d * 1000)}ms" if d < 1 else f"{_fmt(d)}s"
        if self.end_rate == self.rate:
            return f"{_fmt(self.rate)}/s for {dur}"
        return f"{_fmt(self.rate)}/s to {_fmt(self.end_rate)}/s for {dur}"


class RateSchedule:
    """Rates over time: pure functions of the time since the start (in seconds).

    >>> s = RateSchedule.parse("2000/s for 30s, 20000/s for 60s, 2000/s for 30s")
    >>> s.duration, s.total_records
    (120.0, 1320000)
    >>> s.rate_at(45), s.records_due(31.5)
    (20000.0, 90000)
    >>> RateSchedule.parse("0/s to 100/s for 10s").records_due(5)
    125
    """

    def __init__(self, segments: Sequence[Segment]) -> None:
        if not segments:
            raise ScheduleError("a schedule needs at least one segment")
        self.segments: tuple[Segment, ...] = tuple(segments)
        starts, cums = [Fraction(0)], [Fraction(0)]
        for s in self.segments:
            starts.append(starts[-1] + s.duration)
            cums.append(cums[-1] + s.records)
        self._starts = starts  # start time of each segment, then the end
        self._cums = cums  # records scheduled before each segment, then in all

    @classmethod
    def parse(cls, text: str) -> RateSchedule:
        """Parse ``"RATE for DURATION, RATE to RATE for DURATION, ..."`` (see the module doc)."""
        segments = []
        pieces = [p for p in re.split(r"[,;]", text)]
        for i, piece in enumerate(pieces, 1):
            where = f"schedule {text.strip()!r}, segment {i}"
            if not piece.strip():
                raise ScheduleError(f"{where} is empty")
            m = _SEGMENT.match(piece)
            if not m:
                raise ScheduleError(f"{where}: {piece.strip()!r} is not 'RATE for DURATION' (e.g. '2000/s for 30s') or 'RATE to RATE for DURATION'")
            rate = _parse_rate(m.group("rate"), where)
            end = _parse_rate(m.group("end"), where) if m.group("end") else None
            try:
                segments.append(Segment(rate, _parse_duration(m.group("dur"), where), end))
            except ScheduleError as e:
                raise ScheduleError(f"{where}: {e}") from None
        return cls(segments)

    def __str__(self) -> str:
        return ", ".join(str(s) for s in self.segments)

    def __repr__(self) -> str:
        return f"RateSchedule.parse({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RateSchedule) and self.segments == other.segments

    def __hash__(self) -> int:
        return hash(self.segments)

    @property
    def duration(self) -> float:
        """Seconds from the start to the end of the last segment."""
        return float(self._starts[-1])

    @property
    def total_records(self) -> int:
        """Records the whole schedule produces: the floor of the sum of its segments' records."""
        return math.floor(self._cums[-1])

    def _locate(self, t: Fraction) -> int:
        """Index of the segment that time ``t`` (0 <= t < duration) falls in."""
        lo, hi = 0, len(self.segments) - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._starts[mid] <= t:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def rate_at(self, t: float | Fraction) -> float:
        """Records per second scheduled at time ``t`` (0 before the start and from the end on)."""
        ft = _frac(t)
        if ft < 0 or ft >= self._starts[-1]:
            return 0.0
        i = self._locate(ft)
        return float(self.segments[i].rate_at(ft - self._starts[i]))

    def expected_records(self, t: float | Fraction) -> Fraction:
        """The exact cumulative number of records scheduled by time ``t`` (a fraction)."""
        ft = _frac(t)
        if ft <= 0:
            return Fraction(0)
        # A float time at the (float) duration is the end: the float may round below the exact end.
        if ft >= self._starts[-1] or (not isinstance(t, Fraction) and t >= self.duration):
            return self._cums[-1]
        i = self._locate(ft)
        return self._cums[i] + self.segments[i].cumulative(ft - self._starts[i])

    def records_due(self, t: float | Fraction) -> int:
        """Whole records due by time ``t``: ``floor(expected_records(t))``, monotone in ``t``."""
        return math.floor(self.expected_records(t))

    def emission_times(self, seq: np.ndarray[Any, Any] | Sequence[int]) -> np.ndarray[Any, np.dtype[np.float64]]:
        """Scheduled time (seconds from the start) of records ``seq``: when the cumulative count reaches ``seq + 1``.

        >>> RateSchedule.parse("10/s for 1s, 100/s for 1s").emission_times([0, 9, 10]).tolist()
        [0.1, 1.0, 1.01]
        """
        n = np.asarray(seq, dtype=np.float64) + 1.0
        if len(n) and (n.min() < 1 or n.max() > self.total_records):
            raise ScheduleError(f"records 0..{self.total_records - 1} are scheduled; asked for {int(n.min()) - 1}..{int(n.max()) - 1}")
        cum_ends = np.array([float(c) for c in self._cums[1:]])
        idx = np.searchsorted(cum_ends, n, side="left")
        idx = np.minimum(idx, len(self.segments) - 1)
        out = np.empty(len(n), dtype=np.float64)
        for i in np.unique(idx):
            mask = idx == i
            seg = self.segments[i]
            c = n[mask] - float(self._cums[i])  # records into the segment
            r0 = float(seg.rate)
            a = float((seg.end_rate - seg.rate) / (2 * seg.duration))
            # r0*tau + a*tau^2 = c: the root in [0, duration], in a form stable for small a
            tau = c / r0 if a == 0 else 2 * c / (r0 + np.sqrt(np.maximum(r0 * r0 + 4 * a * c, 0.0)))
            out[mask] = float(self._starts[i]) + np.minimum(tau, float(seg.duration))
        return out


# -- record content -------------------------------------------------------------------------------


def _mix64(x: np.ndarray[Any, np.dtype[np.uint64]]) -> np.ndarray[Any, np.dtype[np.uint64]]:
    """SplitMix64's finaliser: a fixed, well-spread hash of each number."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def generated_records(schedule: RateSchedule, start: int, end: int, *, keys: int, start_time_ms: int, seed: int = 0) -> pa.Table:
    """Records ``[start, end)`` of a run (columns of :data:`GENERATOR_SCHEMA`), a pure function.

    - ``seq``: the record number;
    - ``key``: ``"k<i>"`` with ``i = mix(seq, seed) % keys``, evenly spread over the keys;
    - ``value``: 1..100, also from ``mix(seq, seed)``;
    - ``ts``: ``start_time_ms`` plus the record's scheduled emission time, whole milliseconds.

    >>> s = RateSchedule.parse("1000/s for 1s")
    >>> t = generated_records(s, 0, 3, keys=10, start_time_ms=1_700_000_000_000)
    >>> t.column("seq").to_pylist(), t.column("ts")[2].value // 1000
    ([0, 1, 2], 1700000000003)
    >>> t.equals(generated_records(s, 0, 3, keys=10, start_time_ms=1_700_000_000_000))
    True
    """
    _check_keys(keys)
    seq = np.arange(start, end, dtype=np.int64)
    h = _mix64(seq.astype(np.uint64) ^ _mix64(np.array([seed], dtype=np.uint64))[0])
    key_idx = (h % np.uint64(keys)).astype(np.int64)
    names = np.array([f"k{i}" for i in range(keys)], dtype=object)
    value = ((h >> np.uint64(32)) % np.uint64(100)).astype(np.int64) + 1
    ms = start_time_ms + np.floor(schedule.emission_times(seq) * 1000.0 + 1e-6).astype(np.int64)
    return pa.Table.from_arrays(
        [pa.array(names[key_idx], pa.string()), pa.array(value, pa.int64()), pa.array(ms * 1000, pa.int64()).cast(pa.timestamp("us", tz="UTC")), pa.array(seq, pa.int64())],
        schema=GENERATOR_SCHEMA,
    )


def _check_keys(keys: int) -> None:
    if isinstance(keys, bool) or not isinstance(keys, int) or keys < 1:
        raise ScheduleError(f"the number of keys must be an integer >= 1, not {keys!r}")


# -- running it ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GenerateResult:
    """What a :func:`generate` run did."""

    records: int
    seconds: float
    start_time_ms: int
    stopped_early: bool = False


def _columns_for(log_: PartitionedLog) -> list[str]:
    gen = set(GENERATOR_SCHEMA.names)
    for name in log_.schema.names:
        if name not in gen:
            raise LogError(f"log {log_.uri} has column {name!r}, which the generator does not produce (it writes {', '.join(GENERATOR_SCHEMA.names)})")
    return list(log_.schema.names)


def generate(
    log_: PartitionedLog,
    schedule: RateSchedule | str,
    *,
    keys: int = 100,
    start_time: float | None = None,
    tick: float = 0.1,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    stop: threading.Event | None = None,
    seed: int = 0,
    max_batch: int = 100_000,
    report_every: float = 5.0,
) -> GenerateResult:
    """Append the schedule's records to ``log_`` as they fall due, until the schedule ends.

    Every ``tick`` seconds (by ``clock``) it writes the records due by then (at most
    ``max_batch`` per append), keyed on ``key`` when the log has that column (round-robin
    otherwise). ``start_time`` (epoch seconds, default now) is the event time of the
    schedule's start. It logs progress to the ``keyscale`` logger every ``report_every``
    seconds. Set ``stop`` to end early; run it in a thread with :func:`start_generator`,
    or in another process with ``keyscale generate``.

    >>> import tempfile
    >>> from keyscale.sources.log import create_log
    >>> log = create_log(tempfile.mkdtemp() + "/l", "key string, value long, ts timestamp", partitions=2)
    >>> now = [0.0]
    >>> def fake_sleep(s): now[0] += s
    >>> r = generate(log, "100/s for 2s", keys=5, clock=lambda: now[0], sleep=fake_sleep, start_time=0)
    >>> r.records, sum(log.end_offsets())
    (200, 200)
    """
    sched = RateSchedule.parse(schedule) if isinstance(schedule, str) else schedule
    _check_keys(keys)
    if tick <= 0:
        raise ScheduleError(f"tick must be positive, not {tick}")
    columns = _columns_for(log_)
    writer = LogWriter(log_, key_columns=["key"] if "key" in columns else None)
    start_ms = round((time.time() if start_time is None else start_time) * 1000)
    total = sched.total_records
    t0 = clock()
    written = 0
    next_report = report_every
    log.info("generate: %s records into %s over %.1f s (%s)", f"{total:,}", log_.uri, sched.duration, sched)
    stopped = False
    while True:
        now = clock() - t0
        due = min(sched.records_due(now), total)
        while written < due:
            upto = min(due, written + max_batch)
            table = generated_records(sched, written, upto, keys=keys, start_time_ms=start_ms, seed=seed)
            writer.write(table.select(columns))
            written = upto
        if now >= next_report:
            log.info("generate: %s records written, %s/s now (t=%.1f s of %.1f s)", f"{written:,}", f"{sched.rate_at(now):,.0f}", now, sched.duration)
            next_report = now + report_every
        if written >= total:
            break
        if stop is not None and stop.is_set():
            stopped = True
            break
        sleep(max(0.0, min(tick, t0 + now + tick - clock())))
    elapsed = clock() - t0
    log.info("generate: %s%s records written in %.1f s", "stopped early: " if stopped else "done: ", f"{written:,}", elapsed)
    return GenerateResult(written, elapsed, start_ms, stopped)


class GeneratorThread(threading.Thread):
    """:func:`generate` in a daemon thread; ``stop()`` ends it early, ``result`` / ``error`` after ``join()``.

    >>> import tempfile
    >>> from keyscale.sources.log import create_log
    >>> log = create_log(tempfile.mkdtemp() + "/l", "key string, seq long", partitions=1)
    >>> g = start_generator(log, "1000/s for 0.2s", keys=3)
    >>> g.join(); g.result.records
    200
    """

    def __init__(self, log_: PartitionedLog, schedule: RateSchedule | str, **kwargs: Any) -> None:
        super().__init__(name="keyscale-generator", daemon=True)
        self._stop_event = threading.Event()
        self._args = (log_, schedule)
        self._kwargs = kwargs
        self.result: GenerateResult | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = generate(*self._args, stop=self._stop_event, **self._kwargs)
        except BaseException as e:
            self.error = e
            log.error("generate failed: %s", e)

    def stop(self) -> None:
        """Ask the generator to end at its next tick."""
        self._stop_event.set()


def start_generator(log_: PartitionedLog, schedule: RateSchedule | str, **kwargs: Any) -> GeneratorThread:
    """Start :func:`generate` (same keyword arguments, except ``stop``) in a background thread."""
    g = GeneratorThread(log_, schedule, **kwargs)
    g.start()
    return g
