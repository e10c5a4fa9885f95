"""Event time: durations, the watermark of a source, and how it advances per micro-batch.

The watermark is an event time up to which the job takes its input as complete. In
keyscale it moves once per micro-batch, between batches (docs/design.md, "Event time in
micro-batches"):

- batch ``b`` runs with the watermark ``W(b)`` committed by batch ``b - 1``: event-time
  timers and windows due at ``W(b)`` fire at the start of ``b``, and a record is late when
  its event time is at or before ``W(b)``;
- after ``b``, ``W(b + 1) = max(W(b), max event time seen in b - out-of-orderness - 1)``
  (as Flink's bounded out-of-orderness: a watermark ``W`` says no record at or before
  ``W`` is still to come, so a record exactly ``out-of-orderness`` behind is on time);
- an input without records for ``idleness`` (processing time) stops holding the
  watermark back; when every input is idle the watermark follows the clock, staying
  ``idleness`` behind the batch time (so sessions and windows close when traffic stops);
- ``W`` never decreases: it is part of the checkpoint and the savepoint and is restored
  with them, whatever the parallelism;
- an event time more than ``max_ahead`` after the batch's time (fixed in its intent) is
  not believed: one record stamped in the year 9999, or in microseconds read as
  milliseconds, would otherwise move ``W`` to the end of time for good and make every
  later record late. Such a record never moves ``W`` (nor a log partition's clock); a
  window sends it to its late output (or drops it), and it is counted.

Everything here is pure.

>>> spec = WatermarkSpec("ts", parse_duration_ms("5 seconds"))
>>> advance(spec, WatermarkState(), {"main": 60_000}, batch_time_ms=100_000).watermark_ms
54999
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

import numpy as np
import pyarrow as pa

from keyscale.errors import InputDataError, JobDefinitionError

# No watermark yet: defined where a function's context reads it, a floor below this one;
# it is the watermark's lower bound, named here with the upper one for this module's readers.
from keyscale.state.contexts import NO_WATERMARK as NO_WATERMARK

#: The watermark of a drained job: every event-time timer and window is due.
END_OF_TIME = 2**63 - 1
#: How far ahead of the batch's time an event time may be by default: a producer clock an
#: hour fast is broken, and an hour is also the limit Kafka brokers put on producer
#: timestamps (``message.timestamp.after.max.ms``). Wrong time zones (hours ahead), years
#: like 9999 and microseconds taken as milliseconds (centuries ahead) are all caught.
DEFAULT_MAX_AHEAD_MS = 3_600_000

_UNITS_MS = {
    "ms": 1, "millisecond": 1, "milliseconds": 1,
    "s": 1000, "sec": 1000, "second": 1000, "seconds": 1000,
    "m": 60_000, "min": 60_000, "minute": 60_000, "minutes": 60_000,
    "h": 3_600_000, "hour": 3_600_000, "hours": 3_600_000,
    "d": 86_400_000, "day": 86_400_000, "days": 86_400_000,
}

Duration = str | int | float | timedelta


def parse_duration_ms(value: Duration, what: str = "duration") -> int:
    """Milliseconds of ``"10 seconds"``, ``"1 minute"``, ``"250ms"``, a timedelta, or a number of seconds.

    >>> parse_duration_ms("1 minute"), parse_duration_ms("250ms"), parse_duration_ms(2)
    (60000, 250, 2000)
    """
    if isinstance(value, timedelta):
        ms = round(value.total_seconds() * 1000)
    elif isinstance(value, int | float) and not isinstance(value, bool):
        ms = round(float(value) * 1000)
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", value)
        unit = m.group(2).lower() if m else ""
        if m is None or (unit and unit not in _UNITS_MS):
            raise JobDefinitionError(f"{what} {value!r} is not a duration such as '10 seconds', '1 minute' or '500 ms'")
        ms = round(float(m.group(1)) * _UNITS_MS[unit or "s"])
    else:
        raise JobDefinitionError(f"{what} {value!r} is not a duration")
    if ms < 0:
        raise JobDefinitionError(f"{what} {value!r} is negative")
    return ms


@dataclass(frozen=True)
class WatermarkSpec:
    """A source's event-time column, its bounded out-of-orderness, idleness and how far
    ahead of the batch's time an event time may be (ms; None: no bound)."""

    column: str
    out_of_orderness_ms: int = 0
    idleness_ms: int | None = None
    max_ahead_ms: int | None = DEFAULT_MAX_AHEAD_MS


@dataclass(frozen=True)
class InputClock:
    """What the watermark remembers of one input (a source, or a partition of a log)."""

    max_event_ms: int = NO_WATERMARK
    last_active_ms: int | None = None  # batch time of the last batch with records

    def to_json(self) -> dict[str, Any]:
        return {"max_event_ms": self.max_event_ms, "last_active_ms": self.last_active_ms}

    @staticmethod
    def from_json(d: dict[str, Any]) -> InputClock:
        last = d.get("last_active_ms")
        return InputClock(int(d["max_event_ms"]), None if last is None else int(last))


@dataclass(frozen=True)
class WatermarkState:
    """The job's watermark and its inputs' clocks: committed with every batch."""

    watermark_ms: int = NO_WATERMARK
    inputs: dict[str, InputClock] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"watermark_ms": self.watermark_ms, "inputs": {k: v.to_json() for k, v in sorted(self.inputs.items())}}

    @staticmethod
    def from_json(d: dict[str, Any] | None) -> WatermarkState:
        if not d:
            return WatermarkState()
        return WatermarkState(int(d["watermark_ms"]), {k: InputClock.from_json(v) for k, v in d.get("inputs", {}).items()})

    def drained(self) -> WatermarkState:
        return replace(self, watermark_ms=END_OF_TIME)


def advance(spec: WatermarkSpec, state: WatermarkState, seen: dict[str, int | None], batch_time_ms: int) -> WatermarkState:
    """The state after a batch in which each input of ``seen`` had records up to that event time.

    ``seen[input]`` is the largest event time the input delivered in the batch (``None``:
    no records). Inputs not named keep their clocks. The result never goes back.
    """
    inputs = dict(state.inputs)
    for name, max_ts in seen.items():
        old = inputs.get(name, InputClock())
        if max_ts is None:
            inputs[name] = old
        else:
            inputs[name] = InputClock(max(old.max_event_ms, int(max_ts)), batch_time_ms)
    idle = spec.idleness_ms

    def is_idle(c: InputClock) -> bool:
        return idle is not None and c.last_active_ms is not None and batch_time_ms - c.last_active_ms >= idle

    active = [c for c in inputs.values() if c.last_active_ms is not None and not is_idle(c)]
    candidate = NO_WATERMARK
    if active:
        low = min(c.max_event_ms for c in active)
        candidate = low - spec.out_of_orderness_ms - 1 if low > NO_WATERMARK else NO_WATERMARK
    elif idle is not None and inputs and all(is_idle(c) for c in inputs.values() if c.last_active_ms is not None):
        # Everything idle: event time follows the clock, idleness behind it.
        candidate = batch_time_ms - idle
    return WatermarkState(max(state.watermark_ms, candidate), inputs)


def watermark_ms_of(value: object, what: str = "watermark") -> int:
    """Epoch milliseconds of a watermark given as an event-time column holds times: an
    integer (epoch ms), or a timestamp (``datetime``, ``pandas.Timestamp``,
    ``numpy.datetime64``; naive is UTC, as Arrow reads a naive ``datetime``), floored to
    its millisecond as :func:`event_time_ms` floors event times.

    >>> from datetime import datetime, timezone
    >>> watermark_ms_of(1_500), watermark_ms_of(datetime(1970, 1, 1, 0, 0, 1, 999_999))
    (1500, 1999)
    >>> watermark_ms_of(datetime(1970, 1, 1, 1, tzinfo=timezone(timedelta(hours=1))))
    0
    >>> watermark_ms_of("2026-01-01")
    Traceback (most recent call last):
    ...
    keyscale.errors.JobDefinitionError: watermark '2026-01-01' (str) is not an event time: give epoch milliseconds (int) or a datetime
    """
    from datetime import date, datetime

    if isinstance(value, np.integer):
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, datetime | np.datetime64):
        # Through Arrow, as the records' timestamps go: same time zone rule, same flooring.
        try:
            if isinstance(value, np.datetime64):
                arr = pa.array([value if np.datetime_data(value.dtype)[0] in ("s", "ms", "us", "ns") else value.astype("datetime64[s]")])
            else:
                arr = pa.array([value], pa.timestamp("us", tz="UTC"))
            return int(event_time_ms(pa.table({"t": arr}), "t")[0])
        except (ValueError, OverflowError, pa.ArrowException):  # NaT, out of range
            raise JobDefinitionError(f"{what} {value!r} is not a time") from None
    kind = "a date (no time of day)" if isinstance(value, date) else type(value).__name__
    raise JobDefinitionError(
        f"{what} {value!r} ({kind}) is not an event time: give epoch milliseconds (int) or a datetime"
    )


def describe(watermark_ms: int) -> str:
    """A watermark for people: an ISO time, 'none' or 'end of time'."""
    if watermark_ms <= NO_WATERMARK:
        return "none"
    if watermark_ms >= END_OF_TIME:
        return "end of time"
    from datetime import UTC, datetime

    return datetime.fromtimestamp(watermark_ms / 1000, tz=UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def ahead_limit_ms(max_ahead_ms: int | None, batch_time_ms: int) -> int | None:
    """The latest believable event time of a batch (None: every one is).

    >>> ahead_limit_ms(3_600_000, 1_000), ahead_limit_ms(None, 1_000)
    (3601000, None)
    """
    if max_ahead_ms is None:
        return None
    return min(batch_time_ms + max_ahead_ms, END_OF_TIME - 1)


def too_far_ahead(ts: np.ndarray, limit_ms: int | None) -> np.ndarray:
    """Which event times are beyond the batch's bound (see :func:`ahead_limit_ms`)."""
    if limit_ms is None:
        return np.zeros(len(ts), dtype=bool)
    return np.asarray(ts > limit_ms, dtype=bool)


def max_event_within(ts: np.ndarray, limit_ms: int | None) -> tuple[int | None, int]:
    """(largest event time within the bound or None, number of event times beyond it):
    what an input reports for the watermark.

    >>> max_event_within(np.array([5, 10**15, 7]), 100)
    (7, 1)
    >>> max_event_within(np.array([5.0, np.nan]), None), max_event_within(np.array([np.nan]), None)
    ((5, 0), (None, 0))
    """
    if ts.dtype.kind == "f":  # nulls (NaN): never move the watermark
        ts = ts[~np.isnan(ts)]
    ahead = too_far_ahead(ts, limit_ms)
    kept = ts[~ahead]
    return (int(kept.max()) if len(kept) else None), int(ahead.sum())


def event_time_ms(table: pa.Table, column: str) -> np.ndarray:
    """Event times of a column as epoch milliseconds (timestamps, or integers taken as ms).

    Timestamps finer than milliseconds are floored to the millisecond they fall in.

    >>> t = pa.table({"ts": pa.array([1_500, -1_500, None], pa.timestamp("us"))})
    >>> event_time_ms(t, "ts").tolist()
    [1.0, -2.0, nan]
    """
    col = table.column(column)
    if pa.types.is_timestamp(col.type):
        raw = col.cast(pa.int64())
        unit = col.type.unit
        if unit == "ms":
            col = raw
        else:
            # Floored, not truncated: a time before 1970 stays in the millisecond it falls in.
            values = raw.fill_null(pa.scalar(0, pa.int64())).to_numpy()
            values = values * 1000 if unit == "s" else values // (1_000 if unit == "us" else 1_000_000)
            if raw.null_count:
                out = values.astype(np.float64)
                out[np.asarray(raw.is_null().to_numpy(zero_copy_only=False))] = np.nan
                return out
            return values
    elif not pa.types.is_integer(col.type):
        raise InputDataError(f"event-time column '{column}' has type {col.type}; it must be a timestamp or epoch milliseconds")
    return np.asarray(col.to_numpy(zero_copy_only=False))
