"""How long the Python garbage collector paused a task: the part of its busy time that is
the worker's heap, not its records.

A task's busy time (:attr:`~keyscale.runtime.task.report.TaskReport.busy_seconds`) is wall
time in the Python worker, and a cyclic collection stops that worker while it runs. A
collection's pause grows with the objects it scans (a warm state's Python values, caches,
what earlier tasks in the same worker left), so under memory pressure busy time rises
without one more record: read as load, that is Flink's FLINK-33764 (GC pressure scaled
up). :func:`gc_pauses` measures those pauses over a task (``gc.callbacks``, start/stop
pairs, on the busy time's clock) and the task reports them as
:attr:`~keyscale.runtime.task.report.TaskReport.gc_seconds`; the autoscaler measures rates
from busy time net of them (:func:`keyscale.scaling.load.net_busy`).

What it does not see: the executor JVM's garbage collection. The JVM is another process;
its pauses stop the Python worker only where the worker waits on it. Within the busy time
that is where a task reads Spark's iterator of its input (the batch's records, which the
JVM sends over a socket): a JVM pause there is counted as busy, not told apart from the
JVM's other work on the input; Spark reports the JVM's GC time per task (``jvmGcTime`` of its task metrics) on the
driver's side, which keyscale does not read.

>>> import gc
>>> with gc_pauses() as pauses:
...     _ = gc.collect()
>>> pauses.seconds >= 0.0, pauses in gc.callbacks
(True, False)
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from time import perf_counter
from typing import Any

__all__ = ["GcPauses", "gc_pauses"]


class GcPauses:
    """A ``gc.callbacks`` entry that sums the collector's pauses, in seconds of
    :func:`time.perf_counter` (the clock busy time is measured on).

    The callback runs inside every collection, so it does as little as it can: read the
    clock and add one float. A ``"stop"`` without its ``"start"`` (the entry was added
    while a collection ran, from a finalizer or another thread) counts nothing.
    """

    __slots__ = ("_began", "seconds")

    def __init__(self) -> None:
        self.seconds = 0.0
        self._began = -1.0  # when the running collection began; < 0: none seen running

    def __call__(self, phase: str, info: Any) -> None:
        if phase == "start":
            self._began = perf_counter()
        elif self._began >= 0.0:
            self.seconds += perf_counter() - self._began
            self._began = -1.0


@contextmanager
def gc_pauses() -> Iterator[GcPauses]:
    """Sum the garbage collector's pauses while the block runs (its ``seconds``); the
    callback is removed when the block ends, however it ends. Collections on every thread
    of the worker count: each holds the interpreter lock, so it stops the task too."""
    pauses = GcPauses()
    gc.callbacks.append(pauses)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(pauses)
