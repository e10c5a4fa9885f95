"""Counts of records a batch did not process the normal way, per operator, per batch and in total.

A record that is late, too far ahead in event time, dropped or skipped must never vanish
without a sign. Each subtask's report carries ``counters``: ``{name: count}`` (a dict of
named counters, so any operator can add its own: an error policy's skipped records, for
example). The driver sums them per operator for the batch, adds them to the totals of the
previous checkpoint and commits the totals in the batch's manifest (``extra["counters"]``):
they survive retention (each manifest holds the totals so far) and restarts (a replayed
batch is counted once, as its manifest is written once). A batch with any count is logged
in plain words and appended to ``events.jsonl``; the status shows the last batch's counts
and the totals.

Names keyscale itself counts:

- ``late``: records behind the watermark by more than the window's allowed lateness;
- ``too_far_ahead``: records whose event time is more than ``max_ahead`` after the batch's
  time (they never move the watermark);
- ``to_late_output``: of those, records written to the window's late output;
- ``dropped``: records dropped (a window without a late output);
- ``dropped_null_keys``: records with a null key dropped by ``key_by(..., null_keys="drop")``;
- ``skipped`` / ``dead_lettered``: records whose processing raised, under ``on_error="skip"``
  or ``"dead_letter"`` (operators/poison.py);
- ``malformed_skipped`` / ``malformed_dead_lettered``: a JSON/CSV source's malformed records
  (Spark's corrupt-record column) under the job's ``on_error``, counted under ``input``
  (runtime/batch/malformed.py).

Everything here is pure.

>>> from keyscale.runtime.task.report import TaskReport
>>> def sub(**counts): return TaskReport(subtask=0, records=0, busy_seconds=0.0, counters=counts)
>>> batch = of_reports({"w": [sub(late=2, dropped=2), sub(late=1, dropped=1)], "s": [sub()]})
>>> batch
{'w': {'dropped': 3, 'late': 3}}
>>> add({"w": {"late": 4, "dropped": 4}}, batch)
{'w': {'dropped': 7, 'late': 7}}
>>> describe(12, "window", "w", batch["w"])
"batch 12: window 'w' got 3 late records (beyond the allowed lateness): 3 dropped"
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from keyscale.runtime.task.report import TaskReport

LATE = "late"
TOO_FAR_AHEAD = "too_far_ahead"
TO_LATE_OUTPUT = "to_late_output"
DROPPED = "dropped"
DROPPED_NULL_KEYS = "dropped_null_keys"
SKIPPED = "skipped"
DEAD_LETTERED = "dead_lettered"

#: Where the manifest keeps the totals (in its ``extra``).
MANIFEST_KEY = "counters"

Counts = dict[str, int]  # counter name -> count
Counters = dict[str, Counts]  # operator uid -> its counts


def window_counters(late: int, ahead: int, late_output: bool) -> Counts:
    """A window subtask's counts: its late and too-far-ahead records and where they went."""
    out = {LATE: late, TOO_FAR_AHEAD: ahead, (TO_LATE_OUTPUT if late_output else DROPPED): late + ahead}
    return {k: v for k, v in out.items() if v}


def of_reports(reports: Mapping[str, Sequence[TaskReport]]) -> Counters:
    """The batch's counts per operator: the sum of its subtasks' ``counters`` (zeros left out)."""
    out: Counters = {}
    for uid, rs in reports.items():
        counts: Counts = {}
        for r in rs:
            for name, n in r.counters.items():
                counts[name] = counts.get(name, 0) + int(n)
        counts = {k: v for k, v in sorted(counts.items()) if v}
        if counts:
            out[uid] = counts
    return out


def add(a: Mapping[str, Mapping[str, int]], b: Mapping[str, Mapping[str, int]]) -> Counters:
    """Totals plus a batch's counts."""
    out: Counters = {uid: dict(c) for uid, c in a.items()}
    for uid, counts in b.items():
        mine = out.setdefault(uid, {})
        for name, n in counts.items():
            mine[name] = mine.get(name, 0) + int(n)
    return {uid: dict(sorted(c.items())) for uid, c in sorted(out.items()) if c}


def from_extra(extra: Mapping[str, Any] | None) -> Counters:
    """The totals a manifest's ``extra`` holds (none before the first count)."""
    raw = (extra or {}).get(MANIFEST_KEY) or {}
    return {str(uid): {str(k): int(v) for k, v in c.items()} for uid, c in raw.items()}


def duration_words(ms: int) -> str:
    """A bound for people: ``3600000`` -> ``'1 hour'``.

    >>> duration_words(3_600_000), duration_words(86_400_000 * 2), duration_words(90_000), duration_words(1500)
    ('1 hour', '2 days', '90 seconds', '1500 ms')
    """
    for unit, size in (("day", 86_400_000), ("hour", 3_600_000), ("minute", 60_000), ("second", 1000)):
        if ms >= size and ms % size == 0:
            n = ms // size
            return f"{n} {unit}{'s' if n != 1 else ''}"
    return f"{ms} ms"


def _records(n: int, adjective: str = "") -> str:
    return f"{n:,} {adjective}record{'s' if n != 1 else ''}"


def describe(batch: int, kind: str, uid: str, counts: Mapping[str, int], max_ahead_ms: int | None = None) -> str:
    """One log line for one operator's counts in one batch.

    ``kind`` says what the operator is (``window``, ``source``, ``operator``).

    >>> describe(3, "window", "per_minute", {"late": 5, "too_far_ahead": 2, "to_late_output": 7}, 3_600_000)
    "batch 3: window 'per_minute' got 5 late records (beyond the allowed lateness), 2 records too far ahead (event time more than 1 hour after the batch time): 7 to the late output"
    >>> describe(7, "operator", "alerts", {"dead_lettered": 3})
    "batch 7: operator 'alerts' got 3 records whose processing raised, sent to the dead-letter sink (on_error)"
    >>> describe(3, "source", "reader", {"too_far_ahead": 1}, 3_600_000)
    "batch 3: source 'reader' got 1 record too far ahead (event time more than 1 hour after the batch time), passed on but not used for the watermark"
    """
    c = dict(counts)
    what = []
    if c.get(LATE):
        what.append(f"{_records(c.pop(LATE), 'late ')} (beyond the allowed lateness)")
    if c.get(TOO_FAR_AHEAD):
        bound = f"more than {duration_words(max_ahead_ms)} " if max_ahead_ms is not None else ""
        what.append(f"{_records(c.pop(TOO_FAR_AHEAD))} too far ahead (event time {bound}after the batch time)")
    for name, where in ((SKIPPED, "skipped"), (DEAD_LETTERED, "sent to the dead-letter sink")):
        if c.get(name):
            what.append(f"{_records(c.pop(name))} whose processing raised, {where} (on_error)")
    for name, where in (("malformed_skipped", "skipped"), ("malformed_dead_lettered", "sent to the dead-letter sink")):
        if c.get(name):
            what.append(f"{_records(c.pop(name), 'malformed ')} (Spark's corrupt-record column), {where} (on_error)")
    if c.get(DROPPED_NULL_KEYS):
        what.append(f"{_records(c.pop(DROPPED_NULL_KEYS))} with a null key, dropped (null_keys='drop')")
    dests = []
    if c.get(TO_LATE_OUTPUT):
        dests.append(f"{c.pop(TO_LATE_OUTPUT):,} to the late output")
    if c.get(DROPPED):
        dests.append(f"{c.pop(DROPPED):,} dropped")
    what += [f"{n:,} {name.replace('_', ' ')}" for name, n in sorted(c.items()) if n]
    line = f"batch {batch}: {kind} '{uid}' got {', '.join(what)}"
    if dests:
        return f"{line}: {', '.join(dests)}"
    if counts.get(TOO_FAR_AHEAD):
        return f"{line}, passed on but not used for the watermark"
    return line


def summary(counts: Mapping[str, int]) -> str:
    """Counts in a few words, for ``keyscale status``.

    >>> summary({"late": 12, "too_far_ahead": 3, "to_late_output": 15})
    '12 late, 15 to the late output, 3 too far ahead'
    """
    words = {LATE: "late", TOO_FAR_AHEAD: "too far ahead", TO_LATE_OUTPUT: "to the late output", DROPPED: "dropped",
             DROPPED_NULL_KEYS: "dropped for a null key", SKIPPED: "skipped (raised)", DEAD_LETTERED: "dead-lettered (raised)",
             "malformed_skipped": "malformed, skipped", "malformed_dead_lettered": "malformed, dead-lettered"}
    return ", ".join(f"{n:,} {words.get(k, k.replace('_', ' '))}" for k, n in sorted(counts.items()) if n)


def event(batch: int, counts: Counters) -> dict[str, Any]:
    """The ``events.jsonl`` line of a batch with counts."""
    return {"type": "records_not_processed_normally", "batch": batch, "operators": counts}
