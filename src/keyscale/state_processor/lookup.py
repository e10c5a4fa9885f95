"""Point lookups of keyed state: what one key holds at a committed checkpoint, read by byte range.

The one rule behind ``keyscale state get``, :meth:`keyscale.JobHandle.state` and the
control API's ``GET /state/<uid>?key=...``: key ``K`` of operator ``U`` at checkpoint ``N``
is in key group ``kg = pmod(hash(K), M)`` (:mod:`keyscale.state.spark_hash`); its value is
the key's rows in ``kg``'s restore chain at ``N`` (its latest snapshot, then the deltas after
it: :func:`keyscale.checkpoint.manifest.restore_chain`) applied in order, as a restore
applies them (:func:`keyscale.state.table.applied_rows`, the rule of
:meth:`~keyscale.state.table.KeyedStateTable.apply` for a few rows). Of each file only its
footer and the record batches holding ``kg`` are read, by byte range, and of a snapshot with fences
only the one record batch of ``kg`` that can hold the key (:mod:`keyscale.state.order`):
the footers of the chain's files in one round of reads, then the record batches of all of
them in one more (:mod:`keyscale.checkpoint.ranged`: ranged GETs at once on an object
store, ``pread`` on local disk). Parsed footers and slices stay in a small LRU cache
(:class:`SliceCache`), keyed by file (path and checksum: state files are immutable) and
the record batches read, so a hot key (or another key of the same record batch) costs no
read at all, and a lookup whose footers are cached costs one round trip; a small delta is
read whole once and kept, so it serves every key group's lookups after the first.

Why here, in the State Processor: a lookup is a read of keyed state outside the running
job, like :func:`read_keyed_state`, and the next readers (a Spark data source partitioned
by key-group ranges, a change feed from the deltas, diffs, validated edits) plan with the
same pieces: :meth:`StateLookup.operator` (the operator at a checkpoint, its types, its
routing key), :func:`~keyscale.state_processor.keys.parse_key` (a key as users give it),
:meth:`SliceCache.slices` and :func:`jsonable`.

An answer is JSON-able: ``batch`` (the checkpoint), ``uid``, ``key`` (by key column),
``key_group``, ``found``, ``state`` (each declared state's value, list and map states as
JSON arrays and objects, ``null`` where absent), and when the key has them ``timers``
(event and processing time, epoch ms) and ``ttl`` (per state with a TTL: when its clock was
last set and when the value expires, epoch ms). A window operator's answer has ``windows``
(one entry per open window of the key) instead of ``state``. A key without state is
``found: false`` with a ``message``, not an error; an operator the checkpoint does not have
is a :class:`~keyscale.errors.StateError` naming it and listing those it has.

>>> import tempfile, pyarrow as pa
>>> from pathlib import Path
>>> from keyscale.checkpoint.jobdir import JobDir
>>> from keyscale.checkpoint.encode import write_state_file
>>> from keyscale.checkpoint.manifest import Manifest, OperatorCheckpoint
>>> from keyscale.state.keygroups import KeyGroupRange
>>> from keyscale.state.spark_hash import key_group_of
>>> from keyscale.state.types import StateDescriptor
>>> jd = JobDir(Path(tempfile.mkdtemp()) / "job"); _ = jd.claim("clicks", 8, 8)
>>> kg = key_group_of(["ann"], ["string"], 8)
>>> rows = pa.table({"user": ["ann"], "__kg": pa.array([kg], pa.int32()), "seen": [{"home": 2}]},
...                 schema=pa.schema([("user", pa.string()), ("__kg", pa.int32()), ("seen", pa.map_(pa.string(), pa.int64()))]))
>>> f = write_state_file(jd.store, "state/pages/000000000003-s00000-snapshot.arrow", rows, "snapshot", 3, KeyGroupRange(0, 7))
>>> seen = StateDescriptor("seen", "map", pa.int64(), pa.string())
>>> _ = jd.commit(Manifest("clicks", 3, 0, {"pages": OperatorCheckpoint("pages", 8, 1, (("user", "string"),), (seen.to_json(),), (f,))}))
>>> answer = StateLookup(jd).get("pages", "ann")
>>> answer["batch"], answer["key"], answer["found"], answer["state"]
(3, {'user': 'ann'}, True, {'seen': {'home': 2}})
>>> StateLookup(jd).get("pages", "bob")["message"]
"key {'user': 'bob'} has no state in operator 'pages' at checkpoint 3"
"""

from __future__ import annotations

import base64
import datetime as dt
import decimal
import json
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from keyscale.checkpoint.files import Location
from keyscale.checkpoint.jobdir import JobDir
from keyscale.checkpoint.manifest import Manifest, OperatorCheckpoint, StateFile, restore_chains
from keyscale.checkpoint.ranged import DEFAULT_CACHE_BYTES, SliceCache
from keyscale.checkpoint.savepoint import METADATA_FILE
from keyscale.checkpoint.savepoint.schema import spark_type_name
from keyscale.checkpoint.savepoint.write import CheckpointFiles, checkpoint_types
from keyscale.errors import StateError
from keyscale.operators.windows import FIRED, WINDOW_END, WINDOW_START
from keyscale.state.handles import TIMER_STATES, ttl_column
from keyscale.state.keygroups import KeyGroupRange
from keyscale.state.order import sort_key
from keyscale.state.spark_hash import key_group_of
from keyscale.state.table import applied_rows
from keyscale.state.types import StateDescriptor
from keyscale.state_processor.keys import parse_key
from keyscale.storage import Store

__all__ = [
    "DEFAULT_CACHE_BYTES", "LookupOperator", "SliceCache", "StateLookup", "committed_checkpoint", "jsonable", "parse_key"]  # parse_key: keys.py's, here too as before

# Key groups whose restore chains a lookup works out together, for one checkpoint: all of a
# job's at the default max parallelism (128); a block at a time of a larger one.
CHAIN_BLOCK = 128

# Hidden states (state/handles.py): a key's timers, and each TTL state's clock.
_TIMERS = {timers: domain for domain, (timers, _) in TIMER_STATES.items()}


def committed_checkpoint(store: Store, checkpoint: int | None = None) -> tuple[JobDir, Manifest]:
    """The job directory in ``store`` (not a savepoint: the caller checked) and its checkpoint
    ``checkpoint``, or its newest committed one: what every reader of a job's state starts
    from. A folder that is neither, or a job without a checkpoint yet, is a StateError naming it."""
    jd = JobDir(store)
    if not jd.exists():
        raise StateError(f"{jd.uri} is neither a savepoint ({METADATA_FILE}) nor a keyscale job directory (job.json)")
    manifest = jd.read_manifest(checkpoint) if checkpoint is not None else jd.latest_manifest()
    if manifest is None:
        raise StateError(f"job directory {jd.uri} has no committed checkpoint yet")
    return jd, manifest


@dataclass(frozen=True)
class LookupOperator:
    """A keyed operator as a lookup sees it at one checkpoint."""

    checkpoint: OperatorCheckpoint
    keys: tuple[tuple[str, pa.DataType], ...]  # every key column of its state
    routing: tuple[tuple[str, pa.DataType], ...]  # those that make the key group (a window's start is not one)
    states: tuple[StateDescriptor, ...]

    @property
    def uid(self) -> str:
        return self.checkpoint.uid

    @property
    def is_window(self) -> bool:
        return len(self.routing) < len(self.keys)

    @property
    def user_states(self) -> tuple[StateDescriptor, ...]:
        hidden = {WINDOW_END, FIRED} if self.is_window else set()
        return tuple(s for s in self.states if not s.name.startswith("__") and s.name not in hidden)

    def key_group(self, values: Sequence[Any]) -> int:
        return key_group_of(list(values), [spark_type_name(t) for _, t in self.routing], self.checkpoint.max_parallelism)


def routing_columns(keys: Sequence[tuple[str, pa.DataType]], states: Sequence[StateDescriptor]) -> tuple[tuple[str, pa.DataType], ...]:
    """The key columns of an operator's state that make its key groups: all of them, but a
    window operator's ``window_start`` (it keys its state by (key..., window_start) and keeps
    the window's end and fired flag beside it)."""
    names = {s.name for s in states}
    window = len(keys) > 1 and keys[-1][0] == WINDOW_START and {WINDOW_END, FIRED} <= names
    return tuple(keys[:-1] if window else keys)


def _operator(op: OperatorCheckpoint, files: CheckpointFiles) -> LookupOperator:
    keys, states = checkpoint_types(files, op)
    return LookupOperator(op, tuple(keys), routing_columns(keys, states), tuple(states))


def _matching(parts: Sequence[pa.Table], columns: Sequence[tuple[str, pa.DataType]], values: Sequence[Any]) -> list[pa.Table]:
    """The rows of each of ``parts`` whose key columns hold ``values``."""
    wanted = [None if v is None else pa.scalar(v, type=t) for (_, t), v in zip(columns, values, strict=True)]
    out = []
    for table in parts:
        if not table.num_rows:
            out.append(table)
            continue
        mask: Any = None
        for (name, _), v in zip(columns, wanted, strict=True):
            col: Any = table.column(name)
            eq = pc.is_null(col) if v is None else pc.equal(col, v if v.type == col.type else v.cast(col.type))
            mask = eq if mask is None else pc.and_(mask, eq)
        # A null in the mask (a null key column against a value) is no match. A key's rows in
        # a file are next to each other, mostly none or one: a slice of them, where a filter
        # of every column took longer.
        at = np.flatnonzero((mask.fill_null(False) if mask.null_count else mask).to_numpy())
        contiguous = len(at) == 0 or at[-1] - at[0] + 1 == len(at)
        out.append(table.slice(int(at[0]) if len(at) else 0, len(at)) if contiguous else table.take(at))
    return out


# -- answers ------------------------------------------------------------------------------------


def jsonable(value: Any, t: pa.DataType | None = None) -> Any:
    """A value read from state as JSON data: maps as objects (keys as text, as Spark's
    ``to_json`` writes them), lists as arrays, structs as objects, dates and times in ISO
    8601, binary as base64, decimals and non-finite floats as text."""
    if value is None:
        return None
    if t is not None and pa.types.is_map(t):
        return {str(jsonable(k, t.key_type)): jsonable(v, t.item_type) for k, v in (value.items() if isinstance(value, dict) else value)}
    if t is not None and (pa.types.is_list(t) or pa.types.is_large_list(t)):
        return [jsonable(v, t.value_type) for v in value]
    if t is not None and pa.types.is_struct(t):
        return {f.name: jsonable(value.get(f.name), f.type) for f in t}
    if isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, bytes | bytearray | memoryview):
        return base64.b64encode(bytes(value)).decode()
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    if isinstance(value, dict):
        return {str(jsonable(k)): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return str(value)


def _states_of(row: dict[str, Any], states: Sequence[StateDescriptor]) -> dict[str, Any]:
    return {s.name: jsonable(row.get(s.name), s.column_type) for s in states}


def _timers_and_ttl(rows: Sequence[dict[str, Any]], op: LookupOperator) -> dict[str, Any]:
    out: dict[str, Any] = {}
    timers = {domain: sorted({int(t) for r in rows for t in (r.get(col) or ())}) for col, domain in _TIMERS.items()}
    if any(timers.values()):
        out["timers"] = {d: ts for d, ts in timers.items() if ts}
    ttl = {}
    for s in op.states:
        if s.ttl_seconds is None:
            continue
        clock = ttl_column(s.name)
        clocks = [int(r[clock]) for r in rows if r.get(clock) is not None and r.get(s.name) is not None]
        if clocks:
            ttl[s.name] = {"clock_ms": max(clocks), "expires_ms": max(clocks) + round(s.ttl_seconds * 1000)}
    if ttl:
        out["ttl"] = ttl
    return out


def _answer(op: LookupOperator, batch: int, values: Sequence[Any], kg: int, rows: list[dict[str, Any]]) -> dict[str, Any]:
    key = {name: jsonable(v, t) for (name, t), v in zip(op.routing, values, strict=True)}
    out: dict[str, Any] = {"batch": batch, "uid": op.uid, "key": key, "key_group": kg, "found": bool(rows)}
    if not rows:
        out["state"] = {}
        out["message"] = f"key {key} has no state in operator '{op.uid}' at checkpoint {batch}"
        return out
    if op.is_window:
        windows = sorted(rows, key=lambda r: r[WINDOW_START])
        out["windows"] = [
            {WINDOW_START: r[WINDOW_START], WINDOW_END: r.get(WINDOW_END), FIRED: bool(r.get(FIRED)), "state": _states_of(r, op.user_states)}
            for r in windows
        ]
    else:
        out["state"] = _states_of(rows[0], op.user_states)
    out.update(_timers_and_ttl(rows, op))
    return out


# -- the lookup ---------------------------------------------------------------------------------


class _Newest:
    """The newest committed manifest of a job directory, listed at most once per ``max_age``
    seconds; the same object while the newest batch is unchanged (:class:`StateLookup`
    keeps restore chains per manifest)."""

    def __init__(self, jobdir: JobDir, max_age: float):
        self.jobdir, self.max_age = jobdir, max_age
        self._lock = threading.Lock()
        self._listed = -math.inf
        self._manifest: Manifest | None = None

    def __call__(self) -> Manifest | None:
        with self._lock:
            now = time.monotonic()
            if now - self._listed >= self.max_age:
                batches = self.jobdir.manifest_batches()
                if batches and (self._manifest is None or self._manifest.batch != batches[-1]):
                    self._manifest = self.jobdir.read_manifest(batches[-1])
                self._listed = now
            return self._manifest

    def expire(self) -> None:
        """List again at the next call (a file of the cached checkpoint was gone)."""
        with self._lock:
            self._listed = -math.inf


class StateLookup:
    """Point lookups of keyed state at the committed checkpoints of one job directory.

    ``job_dir``: a :class:`~keyscale.checkpoint.jobdir.JobDir`, a local path, ``file://`` or
    object store URI, or a Store. ``latest``: where the newest committed checkpoint comes
    from (the running job passes its own, so a lookup never lists the store); by default
    the job directory is listed at each lookup, or with ``max_age`` at most once per
    ``max_age`` seconds (``keyscale state serve``: an answer's checkpoint is then at most
    that much older than the newest). One instance serves many lookups from any thread, its
    :class:`SliceCache` (``cache_bytes``) shared by all.

    A file of the checkpoint that retention deleted meanwhile (the job went on committing)
    makes the lookup start again from the newer checkpoint; a pinned ``checkpoint=`` does not.
    """

    def __init__(self, job_dir: JobDir | Location, cache_bytes: int = DEFAULT_CACHE_BYTES,
                 latest: Callable[[], Manifest | None] | None = None, max_age: float | None = None):
        self.jobdir = job_dir if isinstance(job_dir, JobDir) else JobDir(job_dir)
        self.cache = SliceCache(cache_bytes)
        if latest is None and max_age is not None:
            latest = _Newest(self.jobdir, max_age)
        self._latest = latest
        self._files = CheckpointFiles(self.jobdir.store)
        self._types: dict[tuple[Any, ...], LookupOperator] = {}
        self._types_lock = threading.Lock()
        self._last_operator: dict[str, LookupOperator] = {}  # by uid, the last one made
        # Restore chains by (operator, block of CHAIN_BLOCK key groups), for the files tuple
        # they were worked out from: the running job hands every lookup the same manifest
        # until it commits again, and commits every batch.
        self._chains: dict[tuple[str, int], tuple[tuple[StateFile, ...], list[list[StateFile]]]] = {}

    # -- checkpoints and operators ---------------------------------------------------------
    def manifest(self, checkpoint: int | None = None) -> Manifest:
        """Checkpoint ``checkpoint``, or the newest committed one."""
        if checkpoint is not None:
            return self.jobdir.read_manifest(checkpoint)
        m = self._latest() if self._latest is not None else None
        if m is None:
            if not self.jobdir.exists():
                raise StateError(f"{self.jobdir.uri} is not a keyscale job directory (no job.json)")
            m = self.jobdir.latest_manifest()
        if m is None:
            raise StateError(f"job directory {self.jobdir.uri} has no committed checkpoint yet: no state to look up")
        return m

    def operator(self, manifest: Manifest, uid: str) -> LookupOperator:
        """Keyed operator ``uid`` at ``manifest``; a StateError naming it and listing the
        job's keyed operators if it has none of that uid."""
        op = manifest.operators.get(uid)
        if op is None or not op.key_columns:
            keyed = sorted(u for u, o in manifest.operators.items() if o.key_columns)
            what = "is not keyed" if op is not None else "does not exist"
            raise StateError(
                f"operator '{uid}' {what} in job '{manifest.job}' at checkpoint {manifest.batch} "
                f"(keyed operators: {', '.join(repr(u) for u in keyed) or 'none'})"
            )
        last = self._last_operator.get(uid)
        if last is not None and last.checkpoint is op:  # the running job's manifest, asked again
            return last
        sig = (uid, op.key_columns, tuple(json.dumps(s, sort_keys=True) for s in op.states))
        with self._types_lock:
            found = self._types.get(sig)
        if found is None:
            found = _operator(op, self._files)
            with self._types_lock:
                self._types[sig] = found
        self._last_operator[uid] = made = LookupOperator(op, found.keys, found.routing, found.states)
        return made

    # -- lookups ---------------------------------------------------------------------------
    def get(self, uid: str, key: Any, checkpoint: int | None = None) -> dict[str, Any]:
        """What key ``key`` of operator ``uid`` holds at the newest committed checkpoint (or
        ``checkpoint``); see the module's documentation for the answer and for how ``key``
        is given (:func:`~keyscale.state_processor.keys.parse_key`)."""
        return self.get_many(uid, [key], checkpoint)[0]

    def get_many(self, uid: str, keys: Sequence[Any], checkpoint: int | None = None) -> list[dict[str, Any]]:
        """:meth:`get` of several keys, all answered from one checkpoint."""
        tries = 0
        while True:
            m = self.manifest(checkpoint)
            op = self.operator(m, uid)
            parsed = [parse_key(k, op.routing, uid) for k in keys]
            try:
                return [self._one(m, op, values) for values in parsed]
            except StateError:
                tries += 1
                if isinstance(self._latest, _Newest):
                    self._latest.expire()
                if checkpoint is not None or tries >= 3 or self.manifest().batch == m.batch:
                    raise  # not a file retention deleted under a newer checkpoint

    def _chain(self, op: LookupOperator, kg: int) -> list[StateFile]:
        files, block = op.checkpoint.files, kg // CHAIN_BLOCK
        found = self._chains.get((op.uid, block))
        if found is None or found[0] is not files:
            # The block's chains at once: a running job's lookups find a new checkpoint after
            # every batch, and one pass over its files for each key group asked took an eighth
            # of a lookup's time at 10M keys (docs/benchmarks.md, "Lookups beside a job that
            # commits every batch").
            rng = KeyGroupRange(block * CHAIN_BLOCK, min((block + 1) * CHAIN_BLOCK, op.checkpoint.max_parallelism) - 1)
            found = (files, restore_chains(files, rng))
            if len(self._chains) >= 1 << 10:
                self._chains.clear()
            self._chains[(op.uid, block)] = found
        return found[1][kg - block * CHAIN_BLOCK]

    def _one(self, m: Manifest, op: LookupOperator, values: tuple[Any, ...]) -> dict[str, Any]:
        kg = op.key_group(values)
        chain = self._chain(op, kg)
        # Where the key sits in a fenced file (key group, then sub key of its first column).
        probe = sort_key(kg, values[0], op.routing[0][1])
        parts = self.cache.slices(self.jobdir.store, chain, KeyGroupRange(kg, kg), probe)  # read at once
        # Applied in order as a restore applies them, in Python: a key has a handful of rows
        # here, and a table built for them made a lookup cost 2.5x as much (docs/benchmarks.md,
        # "State lookups: the rule for a few rows").
        rows = applied_rows(_matching(parts, op.routing, values), [n for n, _ in op.keys], op.states)
        return _answer(op, m.batch, values, kg, rows)
