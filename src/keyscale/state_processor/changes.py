"""A change feed of keyed state: what changed between two checkpoints, read from their deltas.

Every batch writes, per subtask, either a *delta* (the rows of the keys it changed; a key
whose states are all null was deleted) or, when it compacts, a *snapshot* of its whole
key-group range (:mod:`keyscale.checkpoint.manifest`). So the keys that changed in batches
``changes_from + 1 .. changes_to`` are those of the files those batches wrote, and only
those files are read, plus, for the old values, the state at ``changes_from`` of the key
groups they touch (each key group's restore chain, by byte range): never the key groups
nothing changed in. A subtask's snapshot in a batch is read only when its batch's changes
are not beside it as a delta (a snapshot without ``deltas_since``, written before
keyscale wrote them): then it is diffed against its range's state before it, that range
read whole, once.

One row per key and batch in which its state changed: the key columns, ``key_group``,
``batch``, ``change`` (``insert``: the key had no state before; ``update``; ``delete``:
it has none after) and ``old`` / ``new``, structs of the operator's states (its own, not
the hidden ones keyscale keeps for timers and TTL; null for an insert's ``old`` and a
delete's ``new``). A key written but left as it was (the same values) is no change.

What it relies on: the checkpoint of every batch from ``changes_from`` to ``changes_to``
is still kept (its manifest names the files the batch wrote); retention keeps the newest
``--retain`` checkpoints (and deletes the files only older ones used), so a feed reaches
back that far. A batch whose checkpoint is gone is a :class:`~keyscale.errors.StateError`
naming it and the oldest one kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from keyscale.checkpoint.files import read_state_slice
from keyscale.checkpoint.jobdir import JobDir
from keyscale.checkpoint.manifest import (
    Manifest,
    OperatorCheckpoint,
    StateFile,
    chain_files,
    chain_starts,
)
from keyscale.checkpoint.savepoint import (
    KEY_GROUP_COLUMN,
    METADATA_FILE,
    Location,
    checkpoint_types,
)
from keyscale.checkpoint.savepoint.write import CheckpointFiles
from keyscale.errors import KeyscaleError, StateError
from keyscale.state.keygroups import KeyGroupRange, key_group_ranges, mask_runs
from keyscale.state.table import KG_COLUMN, KeyedStateTable, numpy_to_arrow
from keyscale.state.types import StateDescriptor, is_numeric
from keyscale.state_processor.lookup import routing_columns
from keyscale.storage import Store, open_store

__all__ = ["CHANGE_KINDS", "ChangeFeed", "open_changes"]

CHANGE_KINDS = ("insert", "update", "delete")


def _user(states: Sequence[StateDescriptor]) -> tuple[StateDescriptor, ...]:
    return tuple(s for s in states if not s.name.startswith("__"))


@dataclass(frozen=True)
class ChangeFeed:
    """The changes of operator ``uid`` in batches ``start + 1 .. end`` of a job directory:
    its entry at ``start`` (``before``; None when it had none) and, per batch, the state
    files that batch wrote."""

    store: Store
    uid: str
    start: int
    end: int
    max_parallelism: int
    parallelism: int
    keys: tuple[tuple[str, pa.DataType], ...]
    routing: tuple[tuple[str, pa.DataType], ...]
    states: tuple[StateDescriptor, ...]
    before: OperatorCheckpoint | None
    written: tuple[tuple[int, tuple[StateFile, ...]], ...]

    def schema(self) -> pa.Schema:
        user = pa.struct([pa.field(s.name, s.column_type) for s in _user(self.states)])
        fields = [pa.field(k, t) for k, t in self.keys]
        fields += [pa.field(KEY_GROUP_COLUMN, pa.int32()), pa.field("batch", pa.int64()), pa.field("change", pa.string()),
                   pa.field("old", user), pa.field("new", user)]
        return pa.schema(fields)

    def ranges(self, partitions: int | None = None, key_groups: set[int] | None = None) -> list[KeyGroupRange]:
        """Key-group ranges to read: the subtasks' at ``end`` (or ``partitions`` equal
        ones), only the runs of ``key_groups`` when a key filter gave them."""
        if key_groups is not None:
            mask = np.zeros(self.max_parallelism, dtype=bool)
            mask[sorted(key_groups)] = True
            return [KeyGroupRange(a, b) for a, b in mask_runs(mask)]
        return key_group_ranges(self.max_parallelism, max(1, min(partitions or self.parallelism, self.max_parallelism)))

    def read(self, rng: KeyGroupRange) -> pa.Table:
        """The changes of key groups ``rng``, in batch order."""
        names = [k for k, _ in self.keys]
        files = [(b, f, self._slice(f, rng)) for b, fs in self.written for f in fs if f.start <= rng.end and f.end >= rng.start]
        touched = np.zeros(len(rng), dtype=bool)
        for _, f, part in files:
            if f.kind == "snapshot":
                touched[max(f.start, rng.start) - rng.start : min(f.end, rng.end) - rng.start + 1] = True
            else:
                touched[np.asarray(part.column(KG_COLUMN).to_numpy(), dtype=np.int64) - rng.start] = True
        table = KeyedStateTable(names, [t for _, t in self.keys], self.states)
        if self.before is not None:  # the state at ``start`` of the key groups that change, as a restore reads it
            for a, b in mask_runs(touched, rng.start):
                run = KeyGroupRange(a, b)
                for f, runs in chain_files(self.before.files, run, *chain_starts(self.before.files, run)):
                    for r in runs:
                        table.apply(self._slice(f, r))
        out = [self._diff(table, self._with_deletes(table, f, part, rng) if f.kind == "snapshot" else part, b)
               for b, f, part in files]
        schema = self.schema()
        return pa.concat_tables(out) if out else schema.empty_table()

    def _slice(self, f: StateFile, rng: KeyGroupRange) -> pa.Table:
        return read_state_slice(self.store, f, KeyGroupRange(max(f.start, rng.start), min(f.end, rng.end)))

    def _with_deletes(self, table: KeyedStateTable, f: StateFile, part: pa.Table, rng: KeyGroupRange) -> pa.Table:
        """A snapshot's slice as a delta against ``table``: its rows, and a deleting row (all
        states null) for each live key of its key groups that it no longer holds."""
        lo, hi = max(f.start, rng.start), min(f.end, rng.end)
        old = table.to_arrow(table.rows_in_range(lo, hi, live_only=True))
        if not old.num_rows:
            return part
        names = list(table.key_names)
        held = KeyedStateTable(names, list(table.key_types), ())
        held.apply(part.select([*names, KG_COLUMN]))
        gone = old.filter(pa.array(held.positions([old.column(k) for k in names]) < 0))
        if not gone.num_rows:
            return part
        cols: dict[str, Any] = {c: gone.column(c) for c in [*names, KG_COLUMN]}
        for c in part.column_names:
            if c not in cols:
                cols[c] = pa.nulls(gone.num_rows, part.schema.field(c).type)
        deletes = pa.table({c: cols[c] for c in part.column_names}).cast(part.schema)
        return pa.concat_tables([part, deletes])

    def _diff(self, table: KeyedStateTable, part: pa.Table, batch: int) -> pa.Table:
        """Apply ``part`` (rows batch ``batch`` wrote) to ``table``; the rows whose user
        states it changed, with their values before and after."""
        schema = self.schema()
        if not part.num_rows:
            return schema.empty_table()
        keys = [part.column(k) for k, _ in self.keys]
        user = _user(self.states)
        before = table.positions(keys)
        old = {s.name: table.gather(s.name, before) for s in user}
        table.apply(part)
        after = table.positions(keys)
        new = {s.name: table.gather(s.name, after) for s in user}
        n = part.num_rows
        had, has, changed = np.zeros(n, dtype=bool), np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
        for s in user:
            (v0, ok0), (v1, ok1) = old[s.name], new[s.name]
            had |= ok0
            has |= ok1
            both = ok0 & ok1
            if is_numeric(s.column_type):
                differ = both & (v0 != v1)
            else:
                differ = np.zeros(n, dtype=bool)
                for i in np.flatnonzero(both):
                    differ[i] = bool(v0[i] != v1[i])
            changed |= (ok0 != ok1) | differ
        keep = np.flatnonzero(changed & (had | has))
        if not len(keep):
            return schema.empty_table()
        kind = np.where(~had[keep], "insert", np.where(~has[keep], "delete", "update"))

        def struct(values: dict[str, tuple[np.ndarray, np.ndarray]], alive: np.ndarray) -> Any:
            arrays = [numpy_to_arrow(values[s.name][0][keep], values[s.name][1][keep], s.column_type) for s in user]
            return pa.StructArray.from_arrays(arrays, fields=list(schema.field("old").type), mask=pa.array(~alive[keep]))

        idx: Any = pa.array(keep)
        cols: list[Any] = [part.column(k).take(idx) for k, _ in self.keys]
        cols += [part.column(KG_COLUMN).take(idx), pa.array(np.full(len(keep), batch, dtype=np.int64)), pa.array(kind.tolist(), pa.string()),
                 struct(old, had), struct(new, has)]
        return pa.Table.from_arrays(cols, schema=schema)


def _beside_delta(f: StateFile) -> bool:
    """A snapshot whose batch's changes are in a delta beside it (or there were none): the
    feed reads that delta, not the snapshot (``StateFile.deltas_since``)."""
    return f.kind == "snapshot" and f.deltas_since is not None


def _manifests(jd: JobDir, start: int, end: int) -> list[Manifest]:
    kept = jd.manifest_batches()
    out = []
    for b in range(start, end + 1):
        if b not in kept:
            oldest = min(kept) if kept else None
            raise StateError(
                f"the change feed from batch {start} to {end} needs checkpoint {b} of {jd.uri}, which is not kept "
                f"(the oldest kept is {oldest}; retention keeps the newest --retain checkpoints): "
                "read a later range, or keep more checkpoints")
        out.append(jd.read_manifest(b))
    return out


def open_changes(path: Location, uid: str, start: int, end: int | None = None) -> ChangeFeed:
    """Plan the change feed of operator ``uid`` in job directory ``path``: what changed in
    batches ``start + 1 .. end`` (``end``: the newest committed checkpoint by default)."""
    store = path if isinstance(path, Store) else open_store(path, "job directory")
    if store.exists(METADATA_FILE):
        raise KeyscaleError(f"{store.url()} is a savepoint: a change feed reads a job directory's checkpoints (changes_from, changes_to)")
    jd = JobDir(store)
    if not jd.exists():
        raise StateError(f"{jd.uri} is not a keyscale job directory (no job.json)")
    if end is None:
        latest = jd.latest_manifest()
        if latest is None:
            raise StateError(f"job directory {jd.uri} has no committed checkpoint yet")
        end = latest.batch
    if start >= end:
        raise KeyscaleError(f"changes_from ({start}) must be before changes_to ({end}): the feed is of the batches after changes_from")
    manifests = _manifests(jd, start, end)
    last = manifests[-1].operators.get(uid)
    if last is None or not last.key_columns:
        keyed = sorted(u for u, o in manifests[-1].operators.items() if o.key_columns)
        raise StateError(f"checkpoint {end} of {jd.uri} has no keyed state of operator '{uid}' "
                         f"(keyed operators: {', '.join(repr(u) for u in keyed) or 'none'})")
    first = manifests[0].operators.get(uid)
    for m in manifests:
        op = m.operators.get(uid)
        if op is not None and op.max_parallelism != last.max_parallelism:
            raise StateError(f"operator '{uid}' has max parallelism {op.max_parallelism} at checkpoint {m.batch} and "
                             f"{last.max_parallelism} at {end}: a change feed reads one key-group layout")
    written = tuple((m.batch, tuple(sorted((f for f in m.operators[uid].files if f.batch == m.batch and not _beside_delta(f)),
                                           key=lambda f: f.path)))
                    for m in manifests[1:] if uid in m.operators)
    keys, states = checkpoint_types(CheckpointFiles(store), last)
    return ChangeFeed(store, uid, start, end, last.max_parallelism, last.parallelism, tuple(keys), routing_columns(keys, states),
                      tuple(states), first, written)
