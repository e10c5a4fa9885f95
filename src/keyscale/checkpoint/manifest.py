"""The checkpoint manifest: what state a committed batch consists of.

A manifest is written last, by rename, once a batch's output and state files are durable;
a batch exists for keyscale exactly when its manifest does. Per keyed operator (by uid) it
names the max parallelism, the parallelism, and the live state files, each covering a
contiguous key-group range. The state of a key group is its latest snapshot file followed
by the delta files written after it, in batch order (Flink's key-group-offset idea: each
file is sorted by key group and indexed, so a reader takes just its slice).

Everything here is pure: no I/O, so restore planning and garbage collection are tested
without Spark or files.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np

from keyscale.errors import StateError
from keyscale.state.keygroups import KeyGroupRange, key_group_ranges, mask_runs

FORMAT_VERSION = 1
FileKind = Literal["delta", "snapshot"]


@dataclass(frozen=True)
class StateFile:
    """One state file: the keys of key groups ``start..end`` that a batch wrote.

    A ``snapshot`` holds every live key of its range as of ``batch``; a ``delta`` holds the
    keys that changed in ``batch`` (a key whose states are all null was deleted).
    """

    path: str  # relative to the job directory
    batch: int
    kind: FileKind
    start: int
    end: int
    rows: int
    bytes: int
    crc32: int

    @property
    def range(self) -> KeyGroupRange:
        return KeyGroupRange(self.start, self.end)

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path, "batch": self.batch, "kind": self.kind, "start": self.start,
            "end": self.end, "rows": self.rows, "bytes": self.bytes, "crc32": self.crc32,
        }

    @staticmethod
    def from_json(d: dict[str, Any]) -> StateFile:
        return StateFile(
            path=str(d["path"]), batch=int(d["batch"]), kind=d["kind"], start=int(d["start"]),
            end=int(d["end"]), rows=int(d["rows"]), bytes=int(d["bytes"]), crc32=int(d["crc32"]),
        )


@dataclass(frozen=True)
class OperatorCheckpoint:
    """The committed state of one keyed operator."""

    uid: str
    max_parallelism: int
    parallelism: int
    key_columns: tuple[tuple[str, str], ...]  # (name, arrow type)
    states: tuple[dict[str, Any], ...]  # StateDescriptor.to_json()
    files: tuple[StateFile, ...] = ()
    operator_state: dict[str, Any] = field(default_factory=dict)  # non-keyed state, by name

    def state_bytes_per_subtask(self) -> list[int]:
        """Bytes of the checkpoint's state files per subtask's key-group range (a file that
        spans several ranges is shared by the key groups each holds of it)."""
        out = []
        for r in key_group_ranges(self.max_parallelism, self.parallelism):
            share = sum(f.bytes * (min(f.end, r.end) - max(f.start, r.start) + 1) / (f.end - f.start + 1)
                        for f in self.files if f.start <= r.end and f.end >= r.start)
            out.append(int(share))
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "uid": self.uid,
            "max_parallelism": self.max_parallelism,
            "parallelism": self.parallelism,
            "key_columns": [list(k) for k in self.key_columns],
            "states": list(self.states),
            "files": [f.to_json() for f in self.files],
            "operator_state": self.operator_state,
        }

    @staticmethod
    def from_json(d: dict[str, Any]) -> OperatorCheckpoint:
        return OperatorCheckpoint(
            uid=str(d["uid"]),
            max_parallelism=int(d["max_parallelism"]),
            parallelism=int(d["parallelism"]),
            key_columns=tuple((str(a), str(b)) for a, b in d["key_columns"]),
            states=tuple(d["states"]),
            files=tuple(StateFile.from_json(f) for f in d["files"]),
            operator_state=dict(d.get("operator_state", {})),
        )


def summarize_operator_state(state: dict[str, Any]) -> dict[str, Any]:
    """Non-keyed state for people: each reader's partitions and offsets, list sizes, broadcast entries.

    >>> summarize_operator_state({"offsets": {"mode": "split_merge", "subtasks": [[[0, 5], [1, 7]]]}, "broadcast": [["k", 1]]})
    {'readers': [{'0': 5, '1': 7}], 'broadcast_entries': 1}
    """
    out: dict[str, Any] = {}
    if "offsets" in state:
        out["readers"] = [{str(p): o for p, o in entries} for entries in state["offsets"]["subtasks"]]
    for name, e in state.get("lists", {}).items():
        out[name] = {"mode": e["mode"], "entries_per_subtask": [len(x) for x in e["subtasks"]]}
    if "broadcast" in state:
        out["broadcast_entries"] = len(state["broadcast"])
    return out


@dataclass(frozen=True)
class Manifest:
    """Everything a committed batch consists of."""

    job: str
    batch: int
    batch_time_ms: int
    operators: dict[str, OperatorCheckpoint]
    watermark_ms: int | None = None
    created_ms: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        body = {
            "format_version": FORMAT_VERSION,
            "job": self.job,
            "batch": self.batch,
            "batch_time_ms": self.batch_time_ms,
            "created_ms": self.created_ms,
            "watermark_ms": self.watermark_ms,
            "operators": {uid: op.to_json() for uid, op in sorted(self.operators.items())},
            "extra": self.extra,
        }
        body["checksum"] = _checksum(body)
        return body

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1, sort_keys=True)

    @staticmethod
    def loads(text: str, where: str = "manifest") -> Manifest:
        """Parse and verify a manifest; a damaged one raises :class:`StateError`."""
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise StateError(f"{where} is not valid JSON ({e.msg} at line {e.lineno})") from None
        if not isinstance(d, dict) or "checksum" not in d:
            raise StateError(f"{where} is incomplete (no checksum)")
        want = d.pop("checksum")
        if _checksum(d) != want:
            raise StateError(f"{where} is damaged (checksum mismatch)")
        if d.get("format_version") != FORMAT_VERSION:
            raise StateError(f"{where} has format version {d.get('format_version')}, this keyscale reads {FORMAT_VERSION}")
        try:
            return Manifest(
                job=str(d["job"]),
                batch=int(d["batch"]),
                batch_time_ms=int(d["batch_time_ms"]),
                created_ms=int(d.get("created_ms", 0)),
                watermark_ms=d.get("watermark_ms"),
                operators={uid: OperatorCheckpoint.from_json(op) for uid, op in d["operators"].items()},
                extra=dict(d.get("extra", {})),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise StateError(f"{where} is missing or has a bad field ({e})") from None

    def with_operator(self, op: OperatorCheckpoint) -> Manifest:
        ops = dict(self.operators)
        ops[op.uid] = op
        return replace(self, operators=ops)


def _checksum(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


# -- planning over state files ---------------------------------------------------------------


def latest_snapshot_batches(files: Iterable[StateFile], max_parallelism: int) -> np.ndarray:
    """Per key group, the batch of its latest snapshot (-1 where none)."""
    snap = np.full(max_parallelism, -1, dtype=np.int64)
    for f in files:
        if f.kind == "snapshot":
            seg = snap[f.start : f.end + 1]
            np.maximum(seg, f.batch, out=seg)
    return snap


def restore_chain(files: Sequence[StateFile], key_group: int, after: int | None = None) -> list[StateFile]:
    """The files to apply, in order, to rebuild ``key_group``.

    With nothing held (``after`` None): its latest snapshot and the deltas after it (all
    deltas if it has no snapshot). With ``after`` (a version the reader already holds): only
    newer files, unless a snapshot newer than ``after`` exists: then from that snapshot.
    A restored savepoint without source positions has batch -1.
    """
    covering = [f for f in files if f.start <= key_group <= f.end]
    snaps = [f.batch for f in covering if f.kind == "snapshot"]
    if snaps and (after is None or max(snaps) > after):
        start = max(snaps)
    elif after is None:
        start = min((f.batch for f in covering), default=0)
    else:
        start = after + 1
    return sorted((f for f in covering if f.batch >= start), key=lambda f: f.batch)


def live_files(files: Sequence[StateFile], max_parallelism: int) -> list[StateFile]:
    """The files some key group still needs (its latest snapshot and later deltas)."""
    snap = latest_snapshot_batches(files, max_parallelism)
    out = []
    for f in files:
        # A file is needed by key group kg when it is not older than kg's latest snapshot.
        if int(snap[f.start : f.end + 1].min()) <= f.batch:
            out.append(f)
    return out


def chain_length(files: Sequence[StateFile], rng: KeyGroupRange, max_parallelism: int) -> int:
    """Longest restore chain (files to read) over the key groups of ``rng``."""
    snap = latest_snapshot_batches(files, max_parallelism)
    counts = np.zeros(max_parallelism, dtype=np.int64)
    for f in files:
        lo, hi = max(f.start, rng.start), min(f.end, rng.end)
        if lo > hi:
            continue
        seg = slice(lo, hi + 1)
        counts[seg] += snap[seg] <= f.batch
    return int(counts[rng.start : rng.end + 1].max())


def oldest_chain_file(files: Sequence[StateFile], rng: KeyGroupRange, max_parallelism: int) -> int | None:
    """The batch of the oldest file some key group of ``rng`` still needs (None: no file)."""
    snap = latest_snapshot_batches(files, max_parallelism)
    oldest: int | None = None
    for f in files:
        lo, hi = max(f.start, rng.start), min(f.end, rng.end)
        if lo <= hi and bool((snap[lo : hi + 1] <= f.batch).any()):
            oldest = f.batch if oldest is None else min(oldest, f.batch)
    return oldest


def files_overlapping(files: Sequence[StateFile], rng: KeyGroupRange) -> list[StateFile]:
    return [f for f in files if f.start <= rng.end and f.end >= rng.start]


def catch_up(files: Sequence[StateFile], rng: KeyGroupRange, held: np.ndarray, committed: int, max_parallelism: int,
             ) -> tuple[np.ndarray, list[tuple[StateFile, KeyGroupRange]], dict[str, int]]:
    """What a subtask must read to bring its key groups ``rng`` to checkpoint ``committed``.

    ``held``: per key group of ``rng``, the batch its warm copy reflects (-1: none). A key
    group is loaded in full (its latest snapshot and the deltas after it) when nothing
    usable is held: no copy, a copy ahead of the checkpoint (a failed attempt's), or one
    older than a snapshot since; otherwise only the deltas after its copy. Returns the
    per-group ``full`` mask (those to drop first), the (file, key-group run) slices to
    read in batch order, and counts for the task's report.
    """
    lo, hi = rng.start, rng.end
    mine = files_overlapping(files, rng)
    snap = latest_snapshot_batches(mine, max_parallelism)[lo : hi + 1]
    full = (held < 0) | (held > committed) | (snap > held)
    start_at = np.where(full, snap, held + 1)  # first batch each key group still needs
    reads: list[tuple[StateFile, KeyGroupRange]] = []
    read_files = 0
    for f in sorted(mine, key=lambda f: f.batch):
        a, b = max(f.start, lo), min(f.end, hi)
        runs = mask_runs(f.batch >= start_at[a - lo : b - lo + 1], a)
        read_files += bool(runs)
        reads += [(f, KeyGroupRange(ra, rb)) for ra, rb in runs]
    stats = {"warm_key_groups": int((~full).sum()), "loaded_key_groups": int(full.sum()), "files_read": read_files}
    return full, reads, stats
