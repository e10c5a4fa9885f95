"""Task reports back to the driver, through Spark, never through a shared disk.

Each task of a batch (a reader, a keyed or a non-keyed subtask) ends with a small report:
records, keys, busy time, the state file it wrote with its size and checksum. The report
travels in the task's result (an accumulator update, which Spark carries with a task's
success only), so executors need no disk in common with the driver. Two successful
attempts of one subtask (speculation, a stage computed again) may both report: either is
right, since each names the state file its own attempt wrote; the last one is taken.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from keyscale.errors import KeyscaleError

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

Entry = tuple[str, int, int, dict[str, Any]]  # (operator uid, batch, subtask, report)


def _append_param() -> Any:
    from pyspark.accumulators import AccumulatorParam

    class Append(AccumulatorParam):  # type: ignore[type-arg, misc]
        def zero(self, value: list[Entry]) -> list[Entry]:
            return []

        def addInPlace(self, a: list[Entry], b: list[Entry]) -> list[Entry]:
            a.extend(b)
            return a

    return Append()


class LocalSender:
    """A sender for tasks run in this process (tests, the testing kit): appends to a list."""

    def __init__(self, entries: list[Entry]):
        self.entries = entries

    def add(self, entries: list[Entry]) -> None:
        self.entries.extend(entries)


def send(sender: Any, uid: str, batch: int, subtask: int, report: dict[str, Any]) -> None:
    """Called by a task when it is done (``sender`` None: nobody collects, e.g. a unit test)."""
    if sender is not None:
        sender.add([(uid, batch, subtask, report)])


class Reports:
    """The driver's side: what tasks reported, per operator and batch.

    >>> r = Reports()
    >>> send(r.sender, "count", 3, 0, {"records": 5})
    >>> r.take("count", 3, 1)
    [{'records': 5}]
    """

    def __init__(self, spark: SparkSession | None = None):
        self._entries: list[Entry] = []
        self._acc = spark.sparkContext.accumulator([], _append_param()) if spark is not None else None
        self.sender: Any = self._acc if self._acc is not None else LocalSender(self._entries)

    def _all(self) -> list[Entry]:
        return list(self._acc.value) if self._acc is not None else self._entries

    def take(self, uid: str, batch: int, parallelism: int) -> list[dict[str, Any]]:
        """The report of every subtask of ``uid`` for ``batch``; a missing one is an error."""
        found: dict[int, dict[str, Any]] = {}
        for u, b, s, report in self._all():
            if u == uid and b == batch:
                found[s] = report
        for s in range(parallelism):
            if s not in found:
                raise KeyscaleError(f"subtask {s} of operator '{uid}' did not report for batch {batch}")
        return [found[s] for s in range(parallelism)]

    def forget(self, batch: int) -> None:
        """Drop what tasks reported for batches up to ``batch`` (it is committed or abandoned)."""
        keep = [e for e in self._all() if e[1] > batch]
        if self._acc is not None:
            self._acc.value = keep
        else:
            self._entries[:] = keep
