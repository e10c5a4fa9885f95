"""Reactive scaling: the parallelism follows the cores the job has (Flink's reactive mode).

Pure: the runtime measures the cores (:func:`keyscale.cluster.executor_cores`) and
applies the answer as a live rescale; nothing here talks to Spark.

The rule, with ``M`` key groups, bounds ``[min_p, max_p]`` and ``cores`` executor cores:

1. The ceiling is ``min(cores, max_p, M)``: one subtask per core (more subtasks than cores
   only queue up), never above the upper bound, never more subtasks than key groups. With
   fewer cores than ``min_p`` the ceiling is ``min_p``: the lower bound wins over the cores
   (subtasks then share cores) rather than the job dropping below it.
2. Within ``[min_p, ceiling]`` the largest divisor of ``M`` is taken: every subtask then owns
   the same number of key groups, so none is a hot spot, and no core is more than one
   divisor step away from being used. Rounding *down* keeps ``P <= cores``.
3. When no divisor of ``M`` lies in ``[min_p, ceiling]``, the ceiling itself is taken: an
   uneven split of key groups is better than leaving cores unused or breaking a bound.

The result is never below ``min_p`` nor above ``max_p``, at most ``cores`` whenever
``cores >= min_p``, and it never decreases when cores are added (a divisor found for fewer
cores is still in range; one that appears further up is larger than any earlier answer).

>>> [reactive_parallelism(c, 1, 128, 128) for c in (0, 1, 2, 3, 5, 7, 8, 100, 500)]
[1, 1, 2, 2, 4, 4, 8, 64, 128]
>>> reactive_parallelism(7, 1, 12, 60)   # 6 divides 60; 7 does not
6
>>> reactive_parallelism(9, 7, 9, 100)   # no divisor of 100 in [7, 9]: the ceiling
9
>>> reactive_parallelism(2, 4, 16, 128)  # fewer cores than the lower bound
4
"""

from __future__ import annotations

from keyscale.errors import KeyscaleError

__all__ = ["reactive_parallelism"]


def reactive_parallelism(cores: int, min_p: int, max_p: int, max_parallelism: int) -> int:
    """The parallelism for ``cores`` executor cores within ``[min_p, max_p]``, aligned to key groups.

    ``max_p`` above ``max_parallelism`` (the number of key groups) is capped at it. Raises
    :class:`~keyscale.errors.KeyscaleError` for negative cores or bounds that leave nothing
    (``min_p < 1``, ``min_p > max_p``, ``min_p > max_parallelism``). See the module docstring
    for the rule.

    >>> reactive_parallelism(cores=6, min_p=2, max_p=32, max_parallelism=128)
    4
    >>> reactive_parallelism(cores=6, min_p=8, max_p=4, max_parallelism=128)
    Traceback (most recent call last):
    ...
    keyscale.errors.KeyscaleError: reactive scaling: min parallelism 8 is above max parallelism 4
    """
    if cores < 0:
        raise KeyscaleError(f"reactive scaling: cores must be 0 or more, got {cores}")
    if max_parallelism < 1:
        raise KeyscaleError(f"reactive scaling: max parallelism (key groups) must be at least 1, got {max_parallelism}")
    if min_p < 1:
        raise KeyscaleError(f"reactive scaling: min parallelism must be at least 1, got {min_p}")
    if min_p > max_p:
        raise KeyscaleError(f"reactive scaling: min parallelism {min_p} is above max parallelism {max_p}")
    if min_p > max_parallelism:
        raise KeyscaleError(
            f"reactive scaling: min parallelism {min_p} is above the number of key groups {max_parallelism}"
        )
    upper = min(max_p, max_parallelism)
    ceiling = max(min_p, min(cores, upper))
    for p in range(ceiling, min_p - 1, -1):
        if max_parallelism % p == 0:
            return p
    return ceiling
