"""Poison records: what a keyed operator does with a record it cannot process.

A record is *poison* when the user's function raises on it, or when it breaks a rule of
event time (a null event time in a window operator). Each operator has a policy
(``on_error``), from the operator's own argument or the pipeline's default:

- ``"fail"`` (default): the batch fails, with one screen naming the operator, the key, the
  batch, the record, the user's own frames of the traceback, and the cause on the last line;
  nothing of the batch is committed, so after a fix the job resumes at that batch;
- ``"skip"``: the record is dropped and counted;
- ``"dead_letter"``: the record goes to the pipeline's dead-letter sink (one row: operator,
  key, batch, subtask, the record as JSON, the error, the traceback), written exactly-once
  with the batch's output, and is counted.

Both non-failing policies are bounded: more than ``max_errors_per_batch`` poison records in
one subtask and batch fail the batch anyway (a bug that makes every record fail must not
silently empty a stream). The bound is checked inside the task, before any output of the
batch is written.

Per-key functions (:class:`~keyscale.operators.keyed.KeyedProcessFunction`) leave no
half-applied state: with ``process_element`` a failing record's state changes and output
are rolled back to just before that record (the key's other records still apply); with an
overridden ``process(key, rows, ctx)`` the unit is the key's records of the batch; a
failing ``on_timer`` is rolled back and that timer is dropped. Everything here except the
runner is pure.
"""

from __future__ import annotations

import json
import os
import re
import sys
import sysconfig
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa

from keyscale.errors import (
    JobDefinitionError,
    KeyscaleError,
    RecordError,
)
from keyscale.operators.eventtime import END_OF_TIME
from keyscale.operators.keyed import KeyedProcessFunction, _fire_timers
from keyscale.state.contexts import Context, TimerService
from keyscale.state.handles import TIMER_STATES, Cursor
from keyscale.state.types import arrow_schema

T = TypeVar("T")

ON_ERROR = ("fail", "skip", "dead_letter")
#: The default bound of poison records per subtask and batch under skip/dead_letter.
DEFAULT_MAX_ERRORS = 1000

#: The dead-letter sink's rows (the sink's ``batch=<b>`` folder also names the batch).
# key: JSON (a value, or a list for several key columns); record: JSON object of the
# record's columns (null for a timer); error: one line "Type: message"; traceback: the user's frames.
DEAD_LETTER_SCHEMA = arrow_schema("operator string, key string, batch_id long, subtask int, record string, error string, traceback string")


@dataclass(frozen=True)
class ErrorPolicy:
    """An operator's effective poison-record policy (shipped to its tasks)."""

    on_error: str = "fail"
    max_errors_per_batch: int | None = DEFAULT_MAX_ERRORS

    @property
    def isolates(self) -> bool:
        """Whether a failure is contained to its record (skip, dead_letter) instead of failing."""
        return self.on_error != "fail"


#: The default policy: a poison record stops the job, naming it.
FAIL = ErrorPolicy()


def check_on_error(value: str | None, what: str) -> None:
    if value is not None and value not in ON_ERROR:
        raise JobDefinitionError(f"{what}: on_error must be one of {', '.join(repr(v) for v in ON_ERROR)}, not {value!r}")


def check_bound(value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise JobDefinitionError(f"max_errors_per_batch must be a non-negative integer or None (no bound), not {value!r}")


# -- describing an error ----------------------------------------------------------------------


def _library_dirs() -> tuple[str, ...]:
    """Folders whose frames are not the user's: keyscale, Spark, Py4J, the data libraries, the stdlib."""
    dirs = []
    for name in ("keyscale", "pyspark", "py4j", "numpy", "pandas", "pyarrow"):
        mod = sys.modules.get(name)
        f = getattr(mod, "__file__", None)
        if f:
            dirs.append(os.path.dirname(os.path.abspath(f)) + os.sep)
    for key in ("stdlib", "platstdlib"):
        p = sysconfig.get_paths().get(key)
        if p:
            dirs.append(os.path.abspath(p) + os.sep)
    return tuple(dirs)


def user_frames(exc: BaseException) -> list[traceback.FrameSummary]:
    """The traceback's frames that are the user's code (not keyscale's, Spark's, numpy's...)."""
    skip = _library_dirs()
    frames = traceback.extract_tb(exc.__traceback__)
    return [f for f in frames if not os.path.abspath(f.filename).startswith(skip) and not f.filename.startswith("<frozen")]


def one_line(exc: BaseException) -> str:
    """``Type: message`` on one line."""
    msg = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__


def user_traceback(exc: BaseException) -> str:
    """The user's frames, formatted as Python does, without the final exception line.

    No frame of the user's (the error is in keyscale or a library it calls): every frame,
    so that the report of a keyscale bug carries what its maintainers need."""
    frames = user_frames(exc) or traceback.extract_tb(exc.__traceback__)
    return "".join(traceback.format_list(frames)).rstrip("\n")


def _not_the_records_fault(exc: BaseException | None) -> None:
    """A module the worker cannot import fails every record alike: it is the workers'
    Python environment at fault, not a record, so no policy may skip or dead-letter it.
    It leaves the task as it is, and the driver names the module in one line
    (keyscale.runtime.driver.shipping.unimportable_module)."""
    if isinstance(exc, ImportError):
        raise exc


def json_text(value: Any) -> str:
    """A value as JSON text (timestamps, decimals and bytes as their string form)."""
    return json.dumps(_plain(value), default=str, ensure_ascii=False)


def _plain(value: Any) -> Any:
    if isinstance(value, float) and value != value:
        return "NaN"
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


# -- collecting a subtask's poison records ---------------------------------------------------------


class ErrorCollector:
    """One subtask's poison records of one batch, handled by the operator's policy.

    ``add`` raises :class:`RecordError` under ``fail`` (or beyond the bound) and otherwise
    counts the record and, for ``dead_letter``, keeps its dead-letter row.
    """

    def __init__(self, policy: ErrorPolicy, uid: str, batch_id: int, subtask: int):
        self.policy = policy
        self.uid = uid
        self.batch_id = batch_id
        self.subtask = subtask
        self.count = 0
        self._rows: list[dict[str, Any]] = []

    def where(self, key: Any) -> str:
        k = "" if key is _NO_KEY else f" on key {json_text(key)}"
        return f"operator '{self.uid}' failed{k} in batch {self.batch_id} (subtask {self.subtask})"

    def add(self, reason: str, key: Any = None, records: list[dict[str, Any]] | None = None, exc: BaseException | None = None,
            what: str | None = None) -> None:
        """Handle poison: ``reason`` one line; ``records`` the records at fault (None: a timer)."""
        _not_the_records_fault(exc)
        tb = user_traceback(exc) if exc is not None else ""
        n = len(records) if records else 1
        if self.policy.on_error == "fail":
            raise RecordError(self._message(reason, key, records, tb, what, n))
        self.count += n
        bound = self.policy.max_errors_per_batch
        if bound is not None and self.count > bound:
            head = (f"operator '{self.uid}': more than max_errors_per_batch={bound} poison records in batch {self.batch_id} "
                    f"(subtask {self.subtask}) under on_error={self.policy.on_error!r}; the last one")
            raise RecordError(self._message(reason, key, records, tb, what, n, head))
        if self.policy.on_error == "dead_letter":
            for r in records or [None]:  # type: ignore[list-item]
                self._rows.append({
                    "operator": self.uid, "key": json_text(key), "batch_id": self.batch_id, "subtask": self.subtask,
                    "record": None if r is None else json_text(r), "error": reason, "traceback": tb,
                })

    def _message(self, reason: str, key: Any, records: list[dict[str, Any]] | None, tb: str, what: str | None, n: int,
                 head: str | None = None) -> str:
        lines = [f"{head or self.where(key)}: {reason}"]
        if head is not None and key is not _NO_KEY:
            lines.append(f"  key: {json_text(key)}")
        if what:
            lines.append(f"  {what}")
        if records:
            lines.append(f"  record: {json_text(records[0])}" + (f" (and {n - 1} more of the key)" if n > 1 else ""))
        if tb:
            lines += ["  in your code:", *("  " + ln for ln in tb.splitlines())]
        if head is None:
            lines.append('  to go on past such records: on_error="skip" or "dead_letter" on the operator, or .sink(..., on_error=...)')
        lines.append(reason)
        return "\n".join(lines)

    def fail_batch(self, exc: BaseException, what: str | None = None) -> None:
        """A function that sees the whole batch raised: the batch fails (no record to blame)."""
        if isinstance(exc, KeyscaleError):
            raise exc
        _not_the_records_fault(exc)
        reason = one_line(exc)
        raise RecordError(self._message(reason, _NO_KEY, None, user_traceback(exc), what, 0, f"operator '{self.uid}' failed in batch {self.batch_id} (subtask {self.subtask})"))

    def dead_letters(self) -> pa.Table:
        return pa.Table.from_pylist(self._rows, schema=DEAD_LETTER_SCHEMA)

    def counters(self) -> dict[str, int]:
        """The subtask's count of records that raised, named by where they went
        (``skipped`` or ``dead_lettered``), for its report's counters (runtime/task/counters.py)."""
        if not self.count:
            return {}
        return {"dead_lettered" if self.policy.on_error == "dead_letter" else "skipped": self.count}


_NO_KEY = object()


# -- running a per-key function under a policy -----------------------------------------------------


def _snapshot(cursor: Cursor, j: int) -> tuple[dict[str, Any], bool, dict[str, bool]]:
    return (
        {n: c[j] for n, c in cursor.columns.items()},
        cursor.dirty[j],
        {n: j in s for n, s in cursor.ttl_written.items()},
    )


def _restore(cursor: Cursor, j: int, snap: tuple[dict[str, Any], bool, dict[str, bool]]) -> None:
    values, dirty, ttl = snap
    for n, v in values.items():
        cursor.columns[n][j] = v
    cursor.dirty[j] = dirty
    for n, had in ttl.items():
        (cursor.ttl_written[n].add if had else cursor.ttl_written[n].discard)(j)


def _drop_timer(cursor: Cursor, j: int, domain: str, ts: int) -> None:
    lst, nxt = TIMER_STATES[domain]
    rest = [t for t in (cursor.columns[lst][j] or ()) if t != ts]
    cursor.columns[lst][j] = rest or None
    cursor.columns[nxt][j] = rest[0] if rest else None
    cursor.dirty[j] = True


def _listed(out: Any) -> list[Any]:
    """A function's output as a list, so that an error in a generator surfaces here."""
    return [] if out is None else list(out)


def run_guarded(
    fn: KeyedProcessFunction,
    cursor: Cursor,
    ctx: Context,
    keys: list[Any],
    key_groups: np.ndarray,
    order: np.ndarray,
    bounds: np.ndarray,
    records: list[Any],
    columns: dict[str, list[Any]],
    due: np.ndarray | None,
    errors: ErrorCollector,
    record_at: Callable[[int], dict[str, Any]],
) -> Iterator[Any]:
    """Call ``fn`` per key, keys in order of their first record, due timers first; each
    record (or key, or timer) is a unit that either applies whole or is handed to
    ``errors`` with its state changes rolled back.

    ``order[bounds[j]:bounds[j+1]]`` are the positions (in arrival order) of key j's
    records; ``columns`` hold each state's value per key and are updated in place.
    """
    cursor.columns = columns
    cursor.dirty = [False] * len(keys)
    ctx.timer_service = TimerService(cursor, ctx)
    isolate = errors.policy.isolates
    per_element = type(fn).process is KeyedProcessFunction.process
    # At the end of time (a drain) no batch follows: timers that the records register fire
    # after them, in this batch (a stage after another gets its rows only now).
    drain = ctx.current_watermark >= END_OF_TIME and TIMER_STATES["event_time"][1] in columns

    def fire(j: int, key: Any) -> list[Any]:
        """The key's due timers, each failing one rolled back and dropped (when isolating)."""
        while True:
            snap = _snapshot(cursor, j) if isolate else None
            try:
                return _listed(_fire_timers(fn, cursor, ctx, key))
            except KeyscaleError:
                raise
            except Exception as e:
                domain, ts = ctx.time_domain, ctx.timestamp
                ctx.timestamp = ctx.time_domain = None
                where = f"in on_timer for the {domain} timer at {ts}"
                if snap is None or domain is None or ts is None:
                    errors.add(one_line(e), key, None, e, where)
                    raise
                _restore(cursor, j, snap)
                _drop_timer(cursor, j, domain, ts)
                errors.add(one_line(e), key, None, e, where)

    try:
        for j, key in enumerate(keys):
            cursor.i = j
            ctx.key = key
            ctx.key_group = int(key_groups[j])
            if due is not None and due[j]:
                yield from fire(j, key)
            if bounds[j + 1] <= bounds[j]:
                continue
            positions = order[bounds[j] : bounds[j + 1]]
            units = [[int(p)] for p in positions] if per_element else [[int(p) for p in positions]]
            for unit in units:
                snap = _snapshot(cursor, j) if isolate else None
                try:
                    if per_element:
                        out = _listed(fn.process_element(records[unit[0]], ctx))
                    else:
                        out = _listed(fn.process(key, [records[p] for p in unit], ctx))
                except KeyscaleError:
                    raise
                except Exception as e:
                    if snap is not None:
                        _restore(cursor, j, snap)
                    errors.add(one_line(e), key, [record_at(p) for p in unit], e)
                    continue
                yield from out
            if drain:
                yield from fire(j, key)
    finally:
        cursor.i = -1
        ctx.timestamp = ctx.time_domain = None


def bisect_failures(keys: np.ndarray, attempt: Callable[[np.ndarray], T]) -> tuple[list[T], list[tuple[int, Exception]]]:
    """Run ``attempt`` on halves of ``keys``, recursively, until each failure is one key.

    For a function that sees many keys at once (vectorized) and raised: the keys that
    cannot be processed are found in O(failures * log(keys)) calls, the others processed.
    Returns (results of the successful calls, [(key, its exception)]).
    """
    results: list[T] = []
    failed: list[tuple[int, Exception]] = []
    mid = len(keys) // 2
    stack = [keys[mid:], keys[:mid]]
    while stack:
        part = stack.pop()
        if not len(part):
            continue
        try:
            results.append(attempt(part))
        except KeyscaleError:
            raise
        except Exception as e:
            if len(part) == 1:
                failed.append((int(part[0]), e))
            else:
                half = len(part) // 2
                stack += [part[half:], part[:half]]
    return results, failed


# -- rules of keys and event times -----------------------------------------------------------------


def null_key_mask(col: pa.ChunkedArray[Any] | pa.Array[Any]) -> np.ndarray:
    """Records whose key column is null, or NaN (a NaN key is a null key: same rule)."""
    if col.null_count == 0 and not pa.types.is_floating(col.type):
        return np.zeros(len(col), dtype=bool)
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    mask = np.asarray(arr.is_null().to_numpy(zero_copy_only=False), dtype=bool)
    if pa.types.is_floating(arr.type):
        nan = np.asarray(arr.fill_null(0).to_numpy(zero_copy_only=False), dtype=np.float64)
        mask |= np.isnan(nan)
    return mask


def null_event_time_mask(col: pa.ChunkedArray[Any] | pa.Array[Any]) -> np.ndarray:
    """Records without an event time (null): they cannot be placed in event time."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    return np.asarray(arr.is_null().to_numpy(zero_copy_only=False), dtype=bool)



# -- Spark's errors --------------------------------------------------------------------------------

# Spark 4: "[FAILED_READ_FILE.<reason>] Encountered error while reading file <path>. <cause> SQLSTATE: ..."
_READ_FILE = re.compile(r"Encountered error while reading file (\S+?)\.(?:\s+([^\n]*?))?\s*(?:SQLSTATE[^\n]*)?$", re.M)
_OLD_READ_FILE = re.compile(r"(?:in|while reading) file (file:\S+|hdfs:\S+|s3a?:\S+|/\S+)")


def input_error(text: str) -> str | None:
    """For a Spark error reading an input file: one line naming the file and the cause."""
    m = _READ_FILE.search(text)
    if m is None:
        m = _OLD_READ_FILE.search(text)
        if m is None:
            return None
    path = re.sub(r"^file:(//)?", "", m.group(1).rstrip(".,;"))
    cause = (m.group(2) or "").strip() if m.re is _READ_FILE else ""
    if not cause:  # the innermost cause says what it is
        caused = [c.strip() for c in re.findall(r"Caused by: ([^\n]+)", text)]
        cause = re.sub(r"^[\w.$]+(Exception|Error): ", "", caused[-1]) if caused else "Spark could not read it"
    col = re.search(r"Parquet column \[([^\]]+)\]", cause)
    if col:
        cause += _file_column_type(path, col.group(1))
    return f"cannot read input file {path}: {cause}"


def _file_column_type(path: str, column: str) -> str:
    """`` (the file has ts: timestamp[ns, tz=UTC])`` for a local Parquet file; else nothing."""
    try:
        import pyarrow.parquet as pq

        schema = pq.read_schema(path)
        return f" (the file has {column}: {schema.field(column).type})"
    except Exception:
        return ""
