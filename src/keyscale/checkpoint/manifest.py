"""The checkpoint manifest: what state a committed batch consists of.

A manifest is written last, once a batch's output and state files are durable, and created
only if absent (``JobDir.commit``, through ``Store.create``, never a rename: on local disk a
fully written temporary file hard-linked to the manifest's name, on an object store a
conditional PUT). A batch exists for keyscale exactly when its manifest does. Per keyed
operator (by uid) it names the max parallelism, the parallelism, and the live state files,
each covering a contiguous key-group range. The state of a key group is its latest snapshot
file followed by the delta files written after it, in batch order (Flink's key-group-offset
idea: each file is sorted by key group and indexed, so a reader takes just its slice): that
rule, the restore chain, lives here only (``chain_starts``, ``chain_files``), and every
reader of state files plans with it.

Everything here is pure: no I/O, so restore planning and garbage collection are tested
without Spark or files.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, NamedTuple

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
    ``deltas_since`` (a snapshot's, None for none): every change of its key groups after
    that batch is in a delta, its own batch's included (its *companion*, written beside it
    when the batch changed a key), and the manifest keeps those deltas while the snapshot is
    the latest, so a copy held at that batch or later catches up across the snapshot.
    """

    path: str  # relative to the job directory
    batch: int
    kind: FileKind
    start: int
    end: int
    rows: int
    bytes: int
    crc32: int
    deltas_since: int | None = None

    @property
    def range(self) -> KeyGroupRange:
        return KeyGroupRange(self.start, self.end)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "path": self.path, "batch": self.batch, "kind": self.kind, "start": self.start,
            "end": self.end, "rows": self.rows, "bytes": self.bytes, "crc32": self.crc32,
        }
        if self.deltas_since is not None:  # absent otherwise: a manifest without it reads as before
            out["deltas_since"] = self.deltas_since
        return out

    @staticmethod
    def from_json(d: dict[str, Any]) -> StateFile:
        since = d.get("deltas_since")
        return StateFile(
            path=str(d["path"]), batch=int(d["batch"]), kind=d["kind"], start=int(d["start"]),
            end=int(d["end"]), rows=int(d["rows"]), bytes=int(d["bytes"]), crc32=int(d["crc32"]),
            deltas_since=None if since is None else int(since),
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


# -- planning over state files: the restore chain --------------------------------------------
#
# The restore chain of a key group (which files make its state at a checkpoint) is one rule,
# here: its latest snapshot, then the deltas after it, in batch order (every delta when it
# has no snapshot). A reader that already holds the key group at some batch needs only the
# deltas after that batch, unless a newer snapshot exists that it cannot cross on deltas
# (``StateFile.deltas_since``: a snapshot whose batch also wrote its changes as a delta, and
# whose key groups' deltas since the snapshot before it stay live). ``chain_starts`` says
# where each key group's chain starts, ``chain_files``/``chain_reads`` which files (and runs
# of key groups in each) that makes. The task's catch-up (``catch_up``), savepoints' and the
# State Processor's reads (``savepoint.write.restore_key_groups``), ``restore_chain``, the
# compaction rule's view of the chains (``chains``), which deltas a snapshot keeps
# (``deltas_since``) and retention (``live_files``, ``restore_files``) are built on them.


def _snapshots_in(files: Iterable[StateFile], rng: KeyGroupRange) -> tuple[np.ndarray, np.ndarray]:
    """Per key group of ``rng``: the batch of its latest snapshot (-1 where none), and the
    batch after which its deltas are live (the snapshot's ``deltas_since``, else its batch)."""
    lo, hi = rng.start, rng.end
    latest = np.full(hi - lo + 1, -1, dtype=np.int64)
    since = latest.copy()
    for f in sorted((f for f in files if f.kind == "snapshot" and f.start <= hi and f.end >= lo), key=lambda f: f.batch):
        a, b = max(f.start, lo) - lo, min(f.end, hi) - lo + 1
        latest[a:b] = f.batch
        since[a:b] = f.batch if f.deltas_since is None else min(f.deltas_since, f.batch)
    return latest, since


def latest_snapshot_batches(files: Iterable[StateFile], max_parallelism: int) -> np.ndarray:
    """Per key group, the batch of its latest snapshot (-1 where none)."""
    return _snapshots_in(files, KeyGroupRange(0, max_parallelism - 1))[0]


def deltas_since(files: Sequence[StateFile], rng: KeyGroupRange) -> int:
    """What a snapshot of ``rng`` written now (with its batch's changes as a delta beside it)
    records as its ``deltas_since``: the newest of its key groups' latest snapshots in
    ``files`` (the live files before it), after which every delta of ``rng`` is live; 0
    when none is newer (a copy is of batch 0 or later). The manifest keeps those deltas
    while the new snapshot is the latest: one snapshot interval of them, never more. A
    snapshot written in that batch or before has nothing to keep (no companion needed).

    >>> deltas_since([StateFile("a", 2, "snapshot", 0, 1, 1, 1, 1), StateFile("b", 5, "snapshot", 2, 3, 1, 1, 1)], KeyGroupRange(0, 3))
    5
    """
    return max(int(_snapshots_in(files, rng)[0].max(initial=-1)), 0)


def chain_starts(
    files: Sequence[StateFile], rng: KeyGroupRange, held: np.ndarray | None = None, usable: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Where each key group of ``rng`` starts its restore chain.

    ``held``: per key group, the batch a reader's copy reflects, where ``usable`` (default:
    everywhere ``held`` is given; nowhere without ``held``) says the copy may be built on.
    Returns per key group ``full``, whether it is rebuilt from nothing (from its latest
    snapshot, or from its first delta when it has none), and the first batch its chain
    needs: the snapshot's batch where it is full, ``held + 1`` where it is not. A copy is
    rebuilt when it is not usable, or when a snapshot newer than it exists that it cannot
    cross on deltas: one without ``deltas_since``, or whose ``deltas_since`` is newer than
    the copy (the deltas before it are no longer kept).

    >>> files = [StateFile("a", 0, "delta", 0, 3, 1, 1, 1), StateFile("b", 1, "snapshot", 0, 1, 1, 1, 1)]
    >>> [x.tolist() for x in chain_starts(files, KeyGroupRange(0, 3))]
    [[True, True, True, True], [1, 1, -1, -1]]
    >>> [x.tolist() for x in chain_starts(files, KeyGroupRange(0, 3), np.array([0, 1, 0, 0]))]
    [[True, False, False, False], [1, 2, 1, 1]]
    >>> crossable = [files[0], StateFile("b", 1, "snapshot", 0, 1, 1, 1, 1, deltas_since=0), StateFile("c", 1, "delta", 0, 1, 1, 1, 1)]
    >>> [x.tolist() for x in chain_starts(crossable, KeyGroupRange(0, 3), np.array([0, 1, 0, 0]))]
    [[False, False, False, False], [1, 2, 1, 1]]
    """
    latest, since = _snapshots_in(files, rng)
    if held is None:
        return np.ones(len(latest), dtype=bool), latest
    ok = np.ones(len(latest), dtype=bool) if usable is None else np.asarray(usable, dtype=bool)
    full = ~ok | (held < since)  # since <= latest: a copy newer than the snapshot always catches up
    return full, np.where(full, latest, held + 1)


def _counts_for(f: StateFile, full: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Whether ``f`` is in the chain of each key group of its slice of ``full``/``starts``:
    a snapshot only where the chain is full and starts at it; a delta where it is newer
    than the chain's snapshot (full: a snapshot's companion is not read after it) or not
    older than the chain's first batch (a copy's catch-up)."""
    counts: np.ndarray = full & (starts == f.batch) if f.kind == "snapshot" else (f.batch > starts) | (~full & (f.batch == starts))
    return counts


def chain_files(
    files: Sequence[StateFile], rng: KeyGroupRange, full: np.ndarray, starts: np.ndarray,
) -> list[tuple[StateFile, list[KeyGroupRange]]]:
    """The files that make the restore chains of ``rng``, which start as ``full`` and
    ``starts`` say (from :func:`chain_starts`), each with the runs of key groups it is read
    for. Files come in batch order (a stable sort: files of one batch keep their order);
    files no chain needs are left out.
    """
    lo, hi = rng.start, rng.end
    out: list[tuple[StateFile, list[KeyGroupRange]]] = []
    for f in sorted(files_overlapping(files, rng), key=lambda f: f.batch):
        a, b = max(f.start, lo), min(f.end, hi)
        runs = mask_runs(_counts_for(f, full[a - lo : b - lo + 1], starts[a - lo : b - lo + 1]), a)
        if runs:
            out.append((f, [KeyGroupRange(ra, rb) for ra, rb in runs]))
    return out


def chain_reads(
    files: Sequence[StateFile], rng: KeyGroupRange, full: np.ndarray, starts: np.ndarray,
) -> list[tuple[StateFile, KeyGroupRange]]:
    """:func:`chain_files` as the (file, run of key groups) slices to read, in batch order."""
    return [(f, run) for f, runs in chain_files(files, rng, full, starts) for run in runs]


def restore_chain(files: Sequence[StateFile], key_group: int, after: int | None = None) -> list[StateFile]:
    """The files to apply, in order, to rebuild ``key_group`` (:func:`chain_starts` and
    :func:`chain_reads` for one key group).

    With nothing held (``after`` None): its latest snapshot and the deltas after it (all
    deltas if it has no snapshot). With ``after`` (a version the reader already holds): only
    newer deltas, unless a snapshot newer than ``after`` cannot be crossed on them: then
    from that snapshot. A restored savepoint without source positions has batch -1.
    """
    return restore_chains(files, KeyGroupRange(key_group, key_group), after)[0]


def restore_chains(files: Sequence[StateFile], rng: KeyGroupRange, after: int | None = None) -> list[list[StateFile]]:
    """:func:`restore_chain` of every key group of ``rng`` (in its order), worked out in one
    pass over ``files``: what a reader of many key groups of one checkpoint (the point
    lookups of a running job, which commits a new checkpoint every batch) plans at once.

    >>> files = [StateFile("a", 0, "delta", 0, 3, 1, 1, 1), StateFile("b", 1, "snapshot", 0, 1, 1, 1, 1)]
    >>> [[f.path for f in chain] for chain in restore_chains(files, KeyGroupRange(0, 3))]
    [['b'], ['b'], ['a'], ['a']]
    """
    held = None if after is None else np.full(rng.end - rng.start + 1, after, dtype=np.int64)
    full, starts = chain_starts(files, rng, held)
    chains: list[list[StateFile]] = [[] for _ in range(rng.end - rng.start + 1)]
    for f, run in chain_reads(files, rng, full, starts):
        for kg in range(run.start, run.end + 1):
            chains[kg - rng.start].append(f)
    return chains


def restore_files(files: Sequence[StateFile], max_parallelism: int) -> list[StateFile]:
    """The files a restore from nothing reads (some key group's latest snapshot, or a delta
    after it): what a checkpoint needs intact, and what retention's anchor is measured by."""
    everything = KeyGroupRange(0, max_parallelism - 1)
    full, starts = chain_starts(files, everything)
    return [f for f in files if bool(_counts_for(f, full[f.start : f.end + 1], starts[f.start : f.end + 1]).any())]


def live_files(files: Sequence[StateFile], max_parallelism: int) -> list[StateFile]:
    """The files some key group still needs: its restore chain (:func:`restore_files`),
    and the deltas since its latest snapshot's ``deltas_since``, which a copy that old
    catches up on (:func:`chain_starts`)."""
    latest, since = _snapshots_in(files, KeyGroupRange(0, max_parallelism - 1))
    return [
        f for f in files
        if (bool((latest[f.start : f.end + 1] == f.batch).any()) if f.kind == "snapshot"
            else int(since[f.start : f.end + 1].min()) < f.batch)
    ]


class Chains(NamedTuple):
    """Per key group of a range, its restore chain (:func:`chains`): the files to read, the
    deltas among them, the batch of the oldest (``NO_FILE`` where the chain is empty), and
    the rows they hold for it (each file's rows spread evenly over its key groups)."""

    length: np.ndarray
    deltas: np.ndarray
    oldest: np.ndarray
    rows: np.ndarray


#: :class:`Chains`' oldest batch of a key group whose chain has no file.
NO_FILE = np.iinfo(np.int64).max


def chains(files: Sequence[StateFile], rng: KeyGroupRange) -> Chains:
    """The restore chain of each key group of ``rng`` as the compaction rule
    (``retention.snapshot_range``) sees it.

    >>> files = [StateFile("a", 0, "delta", 0, 3, 4, 1, 1), StateFile("b", 1, "snapshot", 0, 1, 2, 1, 1), StateFile("c", 2, "delta", 1, 3, 3, 1, 1)]
    >>> [x.tolist() for x in chains(files, KeyGroupRange(0, 3))]
    [[1, 2, 2, 2], [0, 1, 2, 2], [1, 1, 0, 0], [1.0, 2.0, 2.0, 2.0]]
    """
    length = np.zeros(len(rng), dtype=np.int64)
    deltas = length.copy()
    oldest = np.full(len(rng), NO_FILE, dtype=np.int64)
    rows = np.zeros(len(rng), dtype=np.float64)
    for f, run in chain_reads(files, rng, *chain_starts(files, rng)):
        a, b = run.start - rng.start, run.end - rng.start + 1
        length[a:b] += 1
        deltas[a:b] += f.kind == "delta"
        oldest[a:b] = np.minimum(oldest[a:b], f.batch)
        rows[a:b] += f.rows / len(f.range)
    return Chains(length, deltas, oldest, rows)


def chain_length(files: Sequence[StateFile], rng: KeyGroupRange, max_parallelism: int) -> int:
    """Longest restore chain (files to read) over the key groups of ``rng``."""
    return int(chains(files, rng).length.max(initial=0))


def files_overlapping(files: Sequence[StateFile], rng: KeyGroupRange) -> list[StateFile]:
    return [f for f in files if f.start <= rng.end and f.end >= rng.start]


def catch_up(files: Sequence[StateFile], rng: KeyGroupRange, held: np.ndarray, committed: int, max_parallelism: int,
             ) -> tuple[np.ndarray, list[tuple[StateFile, KeyGroupRange]], dict[str, int]]:
    """What a subtask must read to bring its key groups ``rng`` to checkpoint ``committed``.

    ``held``: per key group of ``rng``, the batch its warm copy reflects (-1: none). A key
    group is loaded in full (its latest snapshot and the deltas after it) when nothing
    usable is held: no copy, a copy ahead of the checkpoint (a failed attempt's), or one
    older than a snapshot since that it cannot cross; otherwise only the deltas after its copy
    (:func:`chain_starts`). Returns the per-group ``full`` mask (those to drop first), the
    (file, key-group run) slices to read in batch order (:func:`chain_reads`), and counts
    for the task's report.
    """
    mine = files_overlapping(files, rng)
    full, starts = chain_starts(mine, rng, held, (held >= 0) & (held <= committed))
    needed = chain_files(mine, rng, full, starts)
    stats = {"warm_key_groups": int((~full).sum()), "loaded_key_groups": int(full.sum()), "files_read": len(needed)}
    return full, [(f, run) for f, runs in needed for run in runs], stats
