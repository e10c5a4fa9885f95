"""Synthetic load traces for simulating the autoscaler.

A :class:`Trace` is a load curve (records/s arriving at the source, piecewise
constant between :class:`TracePoint` s) plus the parameters of a
:class:`SimulatedJob` that processes it. Traces round-trip through JSON::

    {
      "name": "step_up",
      "description": "2,400 rec/s, 20,000 rec/s from t=120 s",
      "duration_seconds": 600,
      "points": [{"time": 0, "input_rate": 2400}, {"time": 120, "input_rate": 20000}],
      "job": {"per_subtask_capacity_rps": 1000, "max_parallelism": 128,
              "initial_parallelism": 4, "trigger_interval_seconds": 5},
      "autoscaler": {"scale_down_delay_seconds": 120}
    }

``job`` fields other than ``per_subtask_capacity_rps`` are optional, and so is
``autoscaler`` (overrides of :class:`~keyscale.scaling.policy.AutoscalerConfig`).

The job model is :mod:`keyscale.scaling.jobmodel` (re-exported here).

>>> trace = step_up(low=2000, high=8000, at=60, duration=120)
>>> trace.job.start(trace).run_batch(4).metrics.input_records
10000
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import random
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from keyscale.errors import KeyscaleError
from keyscale.scaling.jobmodel import JobRun, Load, SimulatedBatch, SimulatedJob
from keyscale.scaling.policy import AutoscalerConfig

__all__ = [
    "GENERATORS",
    "JobRun",
    "Load",
    "SimulatedBatch",
    "SimulatedJob",
    "Trace",
    "TracePoint",
    "default_job",
    "load_trace",
    "save_trace",
    "sawtooth",
    "skewed_key_groups",
    "spike",
    "steady",
    "step_down",
    "step_up",
]


@dataclass(frozen=True)
class TracePoint:
    """From ``time`` on (until the next point), records arrive at ``input_rate`` per second."""

    time: float
    input_rate: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "time", float(self.time))
        object.__setattr__(self, "input_rate", float(self.input_rate))


@dataclass(frozen=True)
class Trace:
    """A load curve, the job that processes it, and optional autoscaler settings.

    >>> t = Trace("x", (TracePoint(0, 100.0), TracePoint(10, 300.0)), 20, SimulatedJob(50.0))
    >>> t.rate_at(5), t.rate_at(10), t.arrivals(5, 15)
    (100.0, 300.0, 2000.0)
    """

    name: str
    points: tuple[TracePoint, ...]
    duration_seconds: float
    job: SimulatedJob
    description: str = ""
    autoscaler: AutoscalerConfig | None = None
    _times: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.points:
            raise ValueError("a trace needs at least one point")
        times = tuple(float(p.time) for p in self.points)
        if any(b <= a for a, b in itertools.pairwise(times)):
            raise ValueError("point times must be strictly increasing")
        if any(not (math.isfinite(p.input_rate) and p.input_rate >= 0) for p in self.points):
            raise ValueError("input rates must be finite numbers >= 0")
        if not (math.isfinite(self.duration_seconds) and self.duration_seconds > 0):
            raise ValueError("duration_seconds must be > 0")
        object.__setattr__(self, "_times", times)

    def rate_at(self, t: float) -> float:
        """Input rate at time ``t`` (the first point's rate before it)."""
        i = bisect.bisect_right(self._times, t) - 1
        return self.points[max(i, 0)].input_rate

    def arrivals(self, start: float, end: float) -> float:
        """Records arriving in ``[start, end)`` (the integral of the rate)."""
        if end <= start:
            return 0.0
        total = 0.0
        t = start
        i = max(bisect.bisect_right(self._times, start) - 1, 0)
        while t < end:
            nxt = self._times[i + 1] if i + 1 < len(self._times) else math.inf
            seg_end = min(end, nxt) if nxt > t else end
            total += self.points[i].input_rate * (seg_end - t)
            t = seg_end
            i += 1
        return total

    def load_changes(self, min_relative_change: float = 0.25) -> list[tuple[float, float, float]]:
        """``(time, from_rate, to_rate)`` where the rate changes by more than the given fraction.

        >>> step_up(low=1000, high=5000, at=60).load_changes()
        [(60.0, 1000.0, 5000.0)]
        """
        out: list[tuple[float, float, float]] = []
        for prev, cur in itertools.pairwise(self.points):
            base = max(prev.input_rate, 1e-9)
            if abs(cur.input_rate - prev.input_rate) / base > min_relative_change:
                out.append((float(cur.time), prev.input_rate, cur.input_rate))
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (what :func:`save_trace` writes)."""
        out: dict[str, Any] = {
            "name": self.name,
            "description": self.description,
            "duration_seconds": self.duration_seconds,
            "points": [{"time": p.time, "input_rate": p.input_rate} for p in self.points],
            "job": asdict(self.job),
        }
        if self.autoscaler is not None:
            default = AutoscalerConfig()
            out["autoscaler"] = {
                f.name: getattr(self.autoscaler, f.name)
                for f in fields(AutoscalerConfig)
                if getattr(self.autoscaler, f.name) != getattr(default, f.name)
            }
        return out

    @classmethod
    def from_dict(cls, data: object) -> Trace:
        """Build a trace from its JSON form; raises ``ValueError`` naming the problem."""
        if not isinstance(data, Mapping):
            raise ValueError("the top level must be a JSON object")
        _check_keys(data, {"name", "description", "duration_seconds", "points", "job",
                           "autoscaler"}, "")  # fmt: skip
        for key in ("points", "job"):
            if key not in data:
                raise ValueError(f"missing {key!r}")
        raw_points = data["points"]
        if not isinstance(raw_points, list) or not raw_points:
            raise ValueError("'points' must be a non-empty list")
        points = []
        for i, p in enumerate(raw_points):
            if not isinstance(p, Mapping):
                raise ValueError(f"points[{i}] must be an object with time and input_rate")
            _check_keys(p, {"time", "input_rate"}, f"points[{i}].")
            points.append(
                TracePoint(
                    _number(p, "time", f"points[{i}]"), _number(p, "input_rate", f"points[{i}]")
                )
            )
        job_data = data["job"]
        if not isinstance(job_data, Mapping):
            raise ValueError("'job' must be an object")
        job = SimulatedJob(**_typed_fields(SimulatedJob, job_data, "job"))
        autoscaler = None
        if data.get("autoscaler") is not None:
            a = data["autoscaler"]
            if not isinstance(a, Mapping):
                raise ValueError("'autoscaler' must be an object")
            autoscaler = AutoscalerConfig(**_typed_fields(AutoscalerConfig, a, "autoscaler"))
        duration = data.get("duration_seconds")
        if duration is None:
            duration = points[-1].time + 300.0
        if not isinstance(duration, int | float) or isinstance(duration, bool):
            raise ValueError("'duration_seconds' must be a number")
        name = data.get("name", "trace")
        description = data.get("description", "")
        if not isinstance(name, str) or not isinstance(description, str):
            raise ValueError("'name' and 'description' must be strings")
        return cls(name, tuple(points), float(duration), job, description, autoscaler)


def _check_keys(data: Mapping[str, object], allowed: set[str], prefix: str) -> None:
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ValueError(
            f"unknown field {prefix}{unknown[0]!r} (expected one of: {', '.join(sorted(allowed))})"
        )


def _number(data: Mapping[str, object], key: str, where: str) -> float:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{where}.{key} must be a number, got {value!r}")
    return float(value)


def _typed_fields(cls: type, data: Mapping[str, object], where: str) -> dict[str, Any]:
    """Check a JSON object's fields against a dataclass's annotations (int/float/bool/str)."""
    known = {f.name: str(f.type) for f in fields(cls) if not f.name.startswith("_")}
    _check_keys(data, set(known), where + ".")
    out: dict[str, Any] = {}
    for key, value in data.items():
        kind = known[key]
        optional = "None" in kind
        if value is None:
            if not optional:
                raise ValueError(f"{where}.{key} must not be null")
        elif kind.startswith("bool"):
            if not isinstance(value, bool):
                raise ValueError(f"{where}.{key} must be true or false, got {value!r}")
        elif kind.startswith("int"):
            if isinstance(value, bool) or not (
                isinstance(value, int) or (isinstance(value, float) and value.is_integer())
            ):
                raise ValueError(f"{where}.{key} must be an integer, got {value!r}")
            value = int(value)
        elif kind.startswith("float"):
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{where}.{key} must be a number, got {value!r}")
            value = float(value)
        elif kind.startswith("str") and not isinstance(value, str):
            raise ValueError(f"{where}.{key} must be a string, got {value!r}")
        out[key] = value
    return out


def load_trace(path: str | Path) -> Trace:
    """Read a trace JSON file; any problem raises a one-line :class:`KeyscaleError`.

    >>> import tempfile, os
    >>> with tempfile.TemporaryDirectory() as d:
    ...     p = os.path.join(d, "t.json")
    ...     save_trace(steady(rate=500, duration=30), p)
    ...     load_trace(p).points[0].input_rate
    500.0
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as err:
        raise KeyscaleError(f"trace file {p}: cannot read it ({err.strerror or err})") from err
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise KeyscaleError(
            f"trace file {p}: not valid JSON ({err.msg} at line {err.lineno} column {err.colno})"
        ) from err
    try:
        return Trace.from_dict(data)
    except (ValueError, TypeError) as err:
        raise KeyscaleError(f"trace file {p}: {err}") from err


def save_trace(trace: Trace, path: str | Path) -> None:
    """Write ``trace`` as indented JSON (readable by :func:`load_trace`)."""
    data = trace.to_dict()
    points = data.pop("points")
    text = json.dumps(data, indent=2, ensure_ascii=False)
    # One point per line keeps long traces readable and diffable.
    rows = ",\n".join("    " + json.dumps(p) for p in points)
    job_at = text.index('\n  "job":')
    text = f'{text[:job_at]}\n  "points": [\n{rows}\n  ],{text[job_at:]}'
    json.loads(text)  # the splice above must keep the JSON valid
    Path(path).write_text(text + "\n", encoding="utf-8")


# --- generators ------------------------------------------------------------------


def default_job(**overrides: Any) -> SimulatedJob:
    """The job the generators use: 1,000 rec/s per subtask, 128 key groups, P=4, 5 s trigger.

    >>> default_job(skew=2.0).skew
    2.0
    """
    params: dict[str, Any] = {
        "per_subtask_capacity_rps": 1000.0,
        "max_parallelism": 128,
        "initial_parallelism": 4,
        "trigger_interval_seconds": 5.0,
    }
    params.update(overrides)
    return SimulatedJob(**params)


def _curve(
    rate: Callable[[float], float], duration: float, resolution: float, noise: float, seed: int
) -> tuple[TracePoint, ...]:
    rng = random.Random(seed)
    points: list[TracePoint] = []
    n = math.ceil(duration / resolution)
    for i in range(n):
        t = i * resolution
        r = rate(t)
        if noise:
            r *= max(0.0, 1.0 + rng.uniform(-noise, noise))
        r = round(r, 1)
        if not points or points[-1].input_rate != r:
            points.append(TracePoint(t, r))
    return tuple(points)


def steady(
    rate: float = 2400.0,
    duration: float = 600.0,
    job: SimulatedJob | None = None,
    noise: float = 0.0,
    seed: int = 0,
    resolution: float = 5.0,
) -> Trace:
    """Constant load, optionally with uniform relative ``noise`` per ``resolution`` seconds.

    >>> len(steady(noise=0.1, duration=60).points)
    12
    """
    return Trace(
        "steady",
        _curve(lambda t: rate, duration, resolution, noise, seed),
        duration,
        job or default_job(),
        f"{rate:,.0f} rec/s" + (f" ±{noise:.0%}" if noise else ""),
    )


def step_up(
    low: float = 2400.0,
    high: float = 20000.0,
    at: float = 120.0,
    duration: float = 600.0,
    job: SimulatedJob | None = None,
) -> Trace:
    """``low`` rec/s, then ``high`` from ``at`` on."""
    return Trace(
        "step_up",
        (TracePoint(0.0, low), TracePoint(at, high)),
        duration,
        job or default_job(),
        f"{low:,.0f} rec/s, {high:,.0f} rec/s from t={at:g} s",
    )


def step_down(
    high: float = 20000.0,
    low: float = 2400.0,
    at: float = 120.0,
    duration: float = 600.0,
    job: SimulatedJob | None = None,
) -> Trace:
    """``high`` rec/s, then ``low`` from ``at`` on (default job starts at P=32)."""
    return Trace(
        "step_down",
        (TracePoint(0.0, high), TracePoint(at, low)),
        duration,
        job or default_job(initial_parallelism=32),
        f"{high:,.0f} rec/s, {low:,.0f} rec/s from t={at:g} s",
    )


def spike(
    base: float = 2400.0,
    peak: float = 16000.0,
    start: float = 120.0,
    length: float = 60.0,
    duration: float = 600.0,
    job: SimulatedJob | None = None,
) -> Trace:
    """``base`` rec/s with ``peak`` rec/s during ``[start, start + length)``."""
    return Trace(
        "spike",
        (TracePoint(0.0, base), TracePoint(start, peak), TracePoint(start + length, base)),
        duration,
        job or default_job(),
        f"{base:,.0f} rec/s, {peak:,.0f} rec/s for {length:g} s from t={start:g} s",
    )


def sawtooth(
    low: float = 2400.0,
    high: float = 10000.0,
    period: float = 120.0,
    duration: float = 900.0,
    job: SimulatedJob | None = None,
    resolution: float = 5.0,
) -> Trace:
    """Ramps from ``low`` to ``high`` over ``period`` seconds, drops back, repeats."""
    return Trace(
        "sawtooth",
        _curve(lambda t: low + (high - low) * ((t % period) / period), duration, resolution, 0, 0),
        duration,
        job or default_job(),
        f"ramps {low:,.0f} -> {high:,.0f} rec/s every {period:g} s",
    )


def skewed_key_groups(
    rate: float = 2500.0,
    skew: float = 3.0,
    duration: float = 600.0,
    job: SimulatedJob | None = None,
) -> Trace:
    """Constant load where the hottest subtask gets ``skew`` times its fair share.

    The default job starts at P=8: on average its subtasks are 31% busy, but the
    hottest one is 94% busy and bounds the batch.
    """
    return Trace(
        "skewed_key_groups",
        (TracePoint(0.0, rate),),
        duration,
        job or default_job(skew=skew, initial_parallelism=8),
        f"{rate:,.0f} rec/s, hottest subtask {skew:g}x its fair share",
    )


GENERATORS: dict[str, Callable[..., Trace]] = {
    "steady": steady,
    "step_up": step_up,
    "step_down": step_down,
    "spike": spike,
    "sawtooth": sawtooth,
    "skewed_key_groups": skewed_key_groups,
}
"""Trace generators by name."""
