"""Timing a ladder's rungs (bench/suite_ladder.py, bench/nexmark/ladder.py): each rung a
function that runs one batch job once, per input file, repeated, interleaved.

The functions the rungs hand Spark's Python workers (``mapInArrow``) stay in the scripts:
run as ``__main__`` they are pickled by value, where the workers could not import this
module (bench/ is not on their path)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def time_rungs(per_file: list[dict[str, Callable[[], object]]], repeats: int) -> dict[str, list[float]]:
    """Seconds of each rung, in run order: ``repeats`` x every file x every rung."""
    times: dict[str, list[float]] = {name: [] for name in per_file[0]}
    for _ in range(repeats):
        for runs in per_file:
            for name, run in runs.items():
                t0 = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - t0)
    return times


def warm_median(seconds: list[float], files: int) -> float:
    """The median without the first repeat (``files`` runs), which warms up.

    >>> warm_median([9.0, 9.0, 1.0, 2.0, 3.0, 4.0], 2)
    2.5
    """
    return statistics.median(seconds[files:] or seconds)
