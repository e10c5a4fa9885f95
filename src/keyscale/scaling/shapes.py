"""The load shapes autoscalers are compared on (``bench/autoscale.py``): a diurnal day
with noise, a 10x spike, a step, a flat noisy load and a slow ramp. Seeded and
deterministic: the same arguments give the same :class:`~keyscale.scaling.traces.Trace`.

They all run :func:`bench_job`: 1,000 records/s per subtask, 128 key groups, P=4 at the
start, a 5 s trigger, and at most 10,000 records per subtask per batch (a source read in
parallel with a per-partition limit, as ``bench/elastic.py``'s job), so a batch of a job
that fell behind lasts at most 10 s and the rest waits at the source.

>>> sorted(SHAPES)
['diurnal', 'diurnal_24h', 'flat_noisy', 'ramp', 'spike_10x', 'step']
>>> a, b = diurnal(seed=3), diurnal(seed=3)
>>> a == b, a.points != diurnal(seed=4).points
(True, True)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from keyscale.scaling.jobmodel import SimulatedJob
from keyscale.scaling.traces import Trace, _curve, default_job, spike, step_up

__all__ = ["SHAPES", "bench_job", "diurnal", "flat_noisy", "ramp", "spike_10x", "step"]


def bench_job(**overrides: Any) -> SimulatedJob:
    """The job every shape runs (see the module docstring).

    >>> bench_job().capacity_rps(8), bench_job().read_limit(8)
    (8000.0, 80000)
    """
    params: dict[str, Any] = {"max_records_per_subtask": 10_000}
    params.update(overrides)
    return default_job(**params)


def diurnal(
    low: float = 2000.0,
    high: float = 20000.0,
    day_seconds: float = 7200.0,
    noise: float = 0.1,
    seed: int = 1,
    job: SimulatedJob | None = None,
    name: str = "diurnal",
) -> Trace:
    """One day, compressed into ``day_seconds``: ``low`` at its start and end, ``high`` at
    noon (a cosine), times ``1 ± noise`` (uniform, a new draw every 5 s).

    >>> t = diurnal(noise=0.0)
    >>> t.rate_at(0), t.rate_at(3600), t.duration_seconds
    (2000.0, 20000.0, 7200.0)
    """

    def rate(t: float) -> float:
        return low + (high - low) * (1 - math.cos(2 * math.pi * t / day_seconds)) / 2

    return Trace(
        name,
        _curve(rate, day_seconds, 5.0, noise, seed),
        day_seconds,
        job or bench_job(),
        f"a day in {day_seconds / 3600:g} h: {low:,.0f} -> {high:,.0f} -> {low:,.0f} rec/s"
        + (f" ±{noise:.0%}" if noise else ""),
    )


def diurnal_24h(**kwargs: Any) -> Trace:
    """:func:`diurnal` at its real length, 24 h (what Flink's defaults are sized for).

    >>> diurnal_24h().duration_seconds / 3600
    24.0
    """
    return diurnal(day_seconds=86400.0, name="diurnal_24h", **kwargs)


def spike_10x(
    base: float = 2000.0,
    at: float = 1800.0,
    length: float = 300.0,
    duration: float = 3600.0,
    job: SimulatedJob | None = None,
) -> Trace:
    """``base`` rec/s, ten times that for ``length`` seconds from ``at``.

    >>> t = spike_10x()
    >>> t.rate_at(0), t.rate_at(1800), t.rate_at(2100)
    (2000.0, 20000.0, 2000.0)
    """
    return replace(spike(base, 10 * base, at, length, duration, job or bench_job()), name="spike_10x")


def step(
    low: float = 2000.0,
    high: float = 10000.0,
    at: float = 1200.0,
    duration: float = 3600.0,
    job: SimulatedJob | None = None,
) -> Trace:
    """``low`` rec/s, ``high`` from ``at`` on.

    >>> step().load_changes()
    [(1200.0, 2000.0, 10000.0)]
    """
    return replace(step_up(low, high, at, duration, job or bench_job()), name="step")


def flat_noisy(
    rate: float = 5000.0,
    noise: float = 0.2,
    duration: float = 3600.0,
    seed: int = 2,
    job: SimulatedJob | None = None,
) -> Trace:
    """``rate`` rec/s times ``1 ± noise`` (uniform, a new draw every 5 s), on a job that
    starts at P=8, sized for it (62.5 % busy on average at 5,000 rec/s).

    >>> t = flat_noisy()
    >>> all(4000 <= p.input_rate <= 6000 for p in t.points), t.job.initial_parallelism
    (True, 8)
    """
    return Trace(
        "flat_noisy",
        _curve(lambda t: rate, duration, 5.0, noise, seed),
        duration,
        job or bench_job(initial_parallelism=8),
        f"{rate:,.0f} rec/s ±{noise:.0%}",
    )


def ramp(
    low: float = 2000.0,
    high: float = 20000.0,
    duration: float = 7200.0,
    job: SimulatedJob | None = None,
) -> Trace:
    """From ``low`` to ``high`` rec/s, linearly over ``duration`` (a new rate every 5 s).

    >>> t = ramp()
    >>> t.rate_at(0), t.rate_at(3600)
    (2000.0, 11000.0)
    """
    return Trace(
        "ramp",
        _curve(lambda t: low + (high - low) * t / duration, duration, 5.0, 0.0, 0),
        duration,
        job or bench_job(),
        f"{low:,.0f} -> {high:,.0f} rec/s over {duration / 3600:g} h",
    )


SHAPES: dict[str, Callable[..., Trace]] = {
    "diurnal": diurnal,
    "diurnal_24h": diurnal_24h,
    "spike_10x": spike_10x,
    "step": step,
    "flat_noisy": flat_noisy,
    "ramp": ramp,
}
"""The shapes by name, each a function of keyword overrides to a trace."""
