"""Task reports back to the driver, through Spark, never through a shared disk.

Each task of a batch (a reader, a keyed or a non-keyed subtask) ends with a small
:class:`TaskReport`: records, keys, busy time (and the garbage collector's pauses in it), the state file it wrote with its size and
checksum, its counters. A reader also sends a summary of its records' append times (:mod:`keyscale.latency`).
The report travels in the task's result (an accumulator update,
which Spark carries with a task's success only) in its wire form (:meth:`TaskReport.to_wire`,
a dict with a version ``"v"``), so executors need no disk in common with the driver. Two
successful attempts of one subtask (speculation, a stage computed again) may both report:
either is right, since each names the state file its own attempt wrote; the last one is
taken.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from keyscale.checkpoint.manifest import StateFile
from keyscale.errors import KeyscaleError
from keyscale.latency import Ages

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

#: The version :meth:`TaskReport.to_wire` writes; a report without one is version 1.
#: Version 2 added ``ages`` (a reader's append times, :mod:`keyscale.latency`); a driver
#: reads every version up to its own (an older report has no ages: no latency measured).
#: Version 3 added ``gc_seconds`` (:mod:`keyscale.runtime.task.gcpauses`); an older report
#: reads with 0 (its busy time taken whole as work, as before). Version 4 added
#: ``companion`` (the delta written beside a snapshot); an older report has none.
REPORT_VERSION = 4


@dataclass(frozen=True)
class PartitionRead:
    """What a reader task read of one log partition: the offsets ``[start, end)`` of its
    plan, the records, their largest believed event time, and the fingerprint of the last
    record (``sources.reader.fingerprint``; None when it read none)."""

    records: int
    start: int
    end: int
    max_event_ms: int | None = None
    last_crc: int | None = None

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"records": self.records, "start": self.start, "end": self.end, "max_event_ms": self.max_event_ms}
        if self.last_crc is not None:
            out["last_crc"] = self.last_crc
        return out

    @staticmethod
    def from_wire(d: Mapping[str, Any]) -> PartitionRead:
        crc, event = d.get("last_crc"), d.get("max_event_ms")
        return PartitionRead(int(d["records"]), int(d["start"]), int(d["end"]), None if event is None else int(event),
                             None if crc is None else int(crc))


@dataclass(frozen=True)
class TaskReport:
    """One subtask's report of one batch. Every kind sets the first fields; the rest are
    its kind's (None or empty otherwise): a keyed subtask's (its range, keys, state file,
    how its state was loaded, a window's counts, a RocksDB subtask's fetch), a non-keyed
    subtask's list state, a reader's partitions."""

    subtask: int
    records: int  # records in (a keyed stage: before null keys were dropped)
    busy_seconds: float
    # Of busy_seconds, the Python garbage collector's pauses (keyed and non-keyed subtasks;
    # 0 from a reader, or from a version before 3): the autoscaler's rates are net of them.
    gc_seconds: float = 0.0
    emitted: int = 0  # rows out (a reader: none counted)
    counters: Mapping[str, int] = field(default_factory=dict)  # runtime/task/counters.py
    store_requests: Mapping[str, int] = field(default_factory=dict)  # the task's own requests to the job directory's store
    # A keyed subtask's.
    range: tuple[int, int] | None = None  # its key groups, first and last
    keys: int = 0  # distinct keys with records this batch
    timer_keys: int = 0  # keys with due timers
    max_event_ms: int | None = None  # the largest event time believed (the stage's event-time column)
    file: StateFile | None = None  # the state file this attempt wrote (None: no change)
    companion: StateFile | None = None  # beside a snapshot in ``file``: the delta of the batch's changes
    state_keys: int = 0  # keys in its state after the batch
    load_seconds: float = 0.0
    warm_key_groups: int = 0  # key groups held at the committed version (nothing read)
    loaded_key_groups: int = 0  # key groups loaded from the checkpoint
    files_read: int = 0
    late_records: int | None = None  # a window aggregate's
    windows_fired: int | None = None
    windows_purged: int | None = None
    fetched_keys: int | None = None  # a RocksDB subtask's: its working set
    copied_from: str | None = None  # a RocksDB subtask's: the database it started from (another worker's)
    # A non-keyed subtask's list state after the batch (list name -> entries).
    lists: Mapping[str, list[Any]] | None = None
    # A reader's, per log partition.
    partitions: Mapping[int, PartitionRead] | None = None
    # A reader's: its records' ages when it ended (None: its log keeps no append times).
    ages: Ages | None = None

    def state_files(self) -> list[StateFile]:
        """The state files this attempt wrote, for the manifest: ``file`` and its ``companion``."""
        return [f for f in (self.file, self.companion) if f is not None]

    def to_wire(self) -> dict[str, Any]:
        """The report as it travels in the accumulator: a dict of plain values with ``"v"``
        (fields left at None are left out)."""
        out: dict[str, Any] = {"v": REPORT_VERSION}
        for name in _FIELDS:
            value = getattr(self, name)
            if value is None:
                continue
            if name in ("file", "companion"):
                value = value.to_json()
            elif name == "range":
                value = list(value)
            elif name == "partitions":
                value = {str(p): r.to_wire() for p, r in value.items()}
            elif name == "ages":
                value = value.to_wire()
            elif name in ("counters", "store_requests", "lists"):
                value = dict(value)
            out[name] = value
        return out

    @staticmethod
    def from_wire(d: Mapping[str, Any], what: str = "a task report") -> TaskReport:
        """A report from its wire form (``what`` names it in the error: operator, batch and
        subtask). A report without ``"v"`` is version 1; a later version is refused."""
        version = d.get("v", 1)
        if not isinstance(version, int) or not 1 <= version <= REPORT_VERSION:
            raise KeyscaleError(f"{what} is of version {version}, which this keyscale (report version {REPORT_VERSION}) cannot read: "
                                "the executors run another keyscale than the driver")
        kw: dict[str, Any] = {k: v for k, v in d.items() if k in _FIELDS}
        for name in ("file", "companion"):
            if kw.get(name) is not None:
                kw[name] = StateFile.from_json(kw[name])
        if kw.get("range") is not None:
            kw["range"] = (int(kw["range"][0]), int(kw["range"][1]))
        if kw.get("partitions") is not None:
            kw["partitions"] = {int(p): PartitionRead.from_wire(r) for p, r in kw["partitions"].items()}
        if kw.get("ages") is not None:
            kw["ages"] = Ages.from_wire(kw["ages"])
        return TaskReport(**kw)


_FIELDS = tuple(TaskReport.__dataclass_fields__)

TaskReports = dict[str, list[TaskReport]]  # a batch's reports, per operator uid

Entry = tuple[str, int, int, dict[str, Any]]  # (operator uid, batch, subtask, the report's wire form)


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


def send(sender: Any, uid: str, batch: int, subtask: int, report: TaskReport) -> None:
    """Called by a task when it is done (``sender`` None: nobody collects, e.g. a unit test)."""
    if sender is not None:
        sender.add([(uid, batch, subtask, report.to_wire())])


class Reports:
    """The driver's side: what tasks reported, per operator and batch.

    >>> r = Reports()
    >>> send(r.sender, "count", 3, 0, TaskReport(subtask=0, records=5, busy_seconds=0.5))
    >>> [(t.subtask, t.records) for t in r.take("count", 3, 1)]
    [(0, 5)]
    """

    def __init__(self, spark: SparkSession | None = None):
        self._entries: list[Entry] = []
        self._acc = spark.sparkContext.accumulator([], _append_param()) if spark is not None else None
        self.sender: Any = self._acc if self._acc is not None else LocalSender(self._entries)

    def _all(self) -> list[Entry]:
        return list(self._acc.value) if self._acc is not None else self._entries

    def take(self, uid: str, batch: int, parallelism: int) -> list[TaskReport]:
        """The report of every subtask of ``uid`` for ``batch``; a missing one is an error."""
        found: dict[int, dict[str, Any]] = {}
        for u, b, s, report in self._all():
            if u == uid and b == batch:
                found[s] = report
        for s in range(parallelism):
            if s not in found:
                raise KeyscaleError(f"subtask {s} of operator '{uid}' did not report for batch {batch}")
        return [TaskReport.from_wire(found[s], f"the report of subtask {s} of operator '{uid}' for batch {batch}") for s in range(parallelism)]

    def forget(self, batch: int) -> None:
        """Drop what tasks reported for batches up to ``batch`` (it is committed or abandoned)."""
        keep = [e for e in self._all() if e[1] > batch]
        if self._acc is not None:
            self._acc.value = keep
        else:
            self._entries[:] = keep
