"""Scans of keyed state by key-group range: what the ``keyscale`` Spark data source reads.

A :class:`StateScan` is one operator's keyed state at one point, planned once (on the
driver, or in the Python worker where Spark plans a data source) and read by tasks, one
key-group range each (:meth:`StateScan.read`): at a job directory's checkpoint (the newest
committed one, or a named one) or in a savepoint. It is picklable: the store travels with
it, so no task needs the driver's disk.

A range of a checkpoint is rebuilt as a restore rebuilds it (each key group's restore
chain, :func:`keyscale.checkpoint.manifest.chain_files`), except that a key group whose
chain is one file (a snapshot and no delta since, the common case after a compaction) is
that file's slice as it is, read by byte range, without going through a state table: the
scan's fast path. A range of a savepoint is its data files' rows.

The rows are :func:`~keyscale.state_processor.read_keyed_state`'s: the key columns,
``key_group``, one column per state; flattened as it flattens them
(:func:`shape_schema`, :func:`shape_table`).

Key filters prune key groups: :meth:`StateScan.key_groups_of` gives the key groups that can
hold keys given by their values per routing column (``EqualTo``/``In`` on those columns),
and :meth:`StateScan.parts` plans only those. Spark still applies the filters to the rows
read, so pruning only has to be conservative: a key type whose equality Spark and the hash
may disagree on (floating point, timestamps, decimals) is never pruned on.

>>> import tempfile, pyarrow as pa
>>> from pathlib import Path
>>> from keyscale.state_processor import write_savepoint_from_dataframes
>>> table = pa.table({"user": ["ann", "bob", "cy"], "clicks": [3, 5, 7]})
>>> sp = write_savepoint_from_dataframes(Path(tempfile.mkdtemp()) / "sp", "clicks",
...                                      {"count": (table, ["user"], {"clicks": "long"})}, 8)
>>> scan = open_scan(sp, "count")
>>> scan.schema().names
['user', 'key_group', 'clicks']
>>> sorted(r["user"] for p in scan.parts() for r in scan.read(p).to_pylist())
['ann', 'bob', 'cy']
>>> kgs = scan.key_groups_of({"user": ["bob"]}); [str(p.range) for p in scan.parts(key_groups=kgs)]
['5-5']
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from keyscale.checkpoint.files import read_state_slice
from keyscale.checkpoint.manifest import OperatorCheckpoint, chain_files, chain_starts
from keyscale.checkpoint.savepoint import (
    KEY_GROUP_COLUMN,
    METADATA_FILE,
    Location,
    SavepointFile,
    SavepointInfo,
    checkpoint_types,
    read_data_file,
    read_savepoint,
    restore_key_groups,
)
from keyscale.checkpoint.savepoint.schema import spark_type_name
from keyscale.checkpoint.savepoint.write import CheckpointFiles
from keyscale.errors import InputDataError, KeyscaleError, StateError
from keyscale.state.keygroups import KeyGroupRange, key_group_ranges, mask_runs
from keyscale.state.spark_hash import key_group_of
from keyscale.state.table import KG_COLUMN, last_rows
from keyscale.state.types import StateDescriptor
from keyscale.state_processor.keys import parse_key
from keyscale.state_processor.lookup import committed_checkpoint, routing_columns
from keyscale.storage import Store, open_store

__all__ = ["ROWS_PER_PART", "ScanPart", "StateScan", "open_scan", "shape_plan", "shape_schema", "shape_table"]

#: About how many rows one part (one Spark input partition) of a scan reads, by default.
ROWS_PER_PART = 1_000_000
#: Key combinations past which a filter on several key columns is not used to prune.
MAX_FILTER_KEYS = 4096


# -- the shape of the rows: read_keyed_state's rule, in Arrow -------------------------------------


def shape_plan(states: Sequence[StateDescriptor], state: str | None, flatten: bool, uid: str) -> tuple[str, str | None]:
    """The rule of how :func:`read_keyed_state` and the data source shape an operator's
    columns (one place for both): ``("all", None)``,
    ``("select", name)`` (one state, nested), or ``("value" | "list" | "map", name)``
    (one state flattened); the same errors."""
    by_name = {s.name: s for s in states}
    if state is not None and state not in by_name:
        raise StateError(f"operator '{uid}' has no state '{state}' (states: {', '.join(by_name) or 'none'})")
    if not flatten:
        return ("select", state) if state is not None else ("all", None)
    if state is None:
        nested = [s.name for s in states if s.kind != "value"]
        if not nested:
            return "all", None
        if len(states) > 1:
            raise KeyscaleError(
                f"operator '{uid}' has list or map state ({', '.join(nested)}) among {len(states)} states; "
                "pass state='NAME' to read one of them flattened, or flatten=False for nested columns"
            )
        state = nested[0]
    return by_name[state].kind, state


def shape_schema(canonical: pa.Schema, states: Sequence[StateDescriptor], state: str | None, flatten: bool, uid: str) -> pa.Schema:
    """The schema of :func:`shape_table`'s rows, for a canonical schema (keys, ``key_group``, states)."""
    mode, name = shape_plan(states, state, flatten, uid)
    ids = [f for f in canonical if f.name not in {s.name for s in states}]
    if mode == "all":
        return canonical
    assert name is not None
    t = canonical.field(name).type
    if mode in ("select", "value"):
        return pa.schema([*ids, pa.field(name, t)])
    if mode == "list":
        return pa.schema([*ids, pa.field(name, t.value_type), pa.field(f"{name}_index", pa.int32())])
    return pa.schema([*ids, pa.field(f"{name}_key", t.key_type), pa.field(f"{name}_value", t.item_type)])


def shape_table(table: pa.Table, states: Sequence[StateDescriptor], state: str | None, flatten: bool, uid: str) -> pa.Table:
    """Canonical rows shaped as :func:`read_keyed_state` shapes them: one state picked, a
    list state one row per element (with its index), a map state one row per entry, a value
    state picked its keys that have it."""
    mode, name = shape_plan(states, state, flatten, uid)
    if mode == "all":
        return table
    assert name is not None
    ids = [c for c in table.column_names if c not in {s.name for s in states}]
    if mode == "select":
        return table.select([*ids, name])
    if mode == "value":
        return table.select([*ids, name]).filter(pc.is_valid(table.column(name)))
    chunks = table.column(name).chunks
    col: Any = pa.concat_arrays(chunks) if chunks else pa.array([], table.schema.field(name).type)  # offsets from 0
    if mode == "map":  # as a list of (key, value) structs: Arrow's list kernels take no map
        entries = pa.StructArray.from_arrays([col.keys, col.items], ["key", "value"])
        col = pa.ListArray.from_arrays(col.offsets, entries, mask=col.is_null())
    parents = pc.list_parent_indices(col)
    base = table.select(ids).take(parents)
    flat: Any = pc.list_flatten(col)
    if mode == "list":
        offsets = np.asarray(col.offsets)
        index = np.arange(len(parents), dtype=np.int64) + offsets[0] - offsets[np.asarray(parents, dtype=np.int64)]
        return base.append_column(name, flat).append_column(f"{name}_index", pa.array(index, pa.int32()))
    return base.append_column(f"{name}_key", flat.field(0)).append_column(f"{name}_value", flat.field(1))


# -- the scan --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ScanPart:
    """One part of a scan (one Spark input partition): key groups ``range`` of the
    checkpoint, or of savepoint data file ``file`` (its index), only ``key_groups`` of it
    when a key filter pruned it."""

    range: KeyGroupRange
    file: int | None = None
    key_groups: tuple[int, ...] | None = None


# Key types whose equality in Spark is equality of the values the key-group hash reads.
def _prunable(t: pa.DataType) -> bool:
    return bool(pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_integer(t) or pa.types.is_boolean(t)
                or pa.types.is_date32(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t))


@dataclass(frozen=True)
class StateScan:
    """One operator's keyed state to read: at a job directory's checkpoint (``operator``:
    its entry there) or in a savepoint (``savepoint_files``)."""

    store: Store
    uid: str
    batch: int
    max_parallelism: int
    parallelism: int
    keys: tuple[tuple[str, pa.DataType], ...]
    routing: tuple[tuple[str, pa.DataType], ...]
    states: tuple[StateDescriptor, ...]
    operator: OperatorCheckpoint | None = None
    savepoint_files: tuple[SavepointFile, ...] = ()
    state: str | None = None
    flatten: bool = True

    def canonical_schema(self) -> pa.Schema:
        fields = [pa.field(k, t) for k, t in self.keys]
        fields.append(pa.field(KEY_GROUP_COLUMN, pa.int32()))
        fields.extend(pa.field(s.name, s.column_type) for s in self.states)
        return pa.schema(fields)

    def schema(self) -> pa.Schema:
        """The rows' schema: :func:`read_keyed_state`'s for the same ``state`` and ``flatten``."""
        return shape_schema(self.canonical_schema(), self.states, self.state, self.flatten, self.uid)

    # -- planning ------------------------------------------------------------------------------
    def key_groups_of(self, values: Mapping[str, Sequence[Any]]) -> set[int] | None:
        """The key groups that can hold keys whose routing columns take the given values
        (per column, the values it may equal); None when they cannot be told (a routing
        column without values, a type not pruned on, too many combinations)."""
        cols = []
        for name, t in self.routing:
            given = values.get(name)
            if given is None or not _prunable(t):
                return None
            cols.append([v for v in given if v is not None])
        if math.prod(len(c) for c in cols) > MAX_FILTER_KEYS:
            return None
        types = [spark_type_name(t) for _, t in self.routing]
        out = set()
        for combo in itertools.product(*cols):
            try:
                parsed = parse_key(tuple(combo), self.routing, self.uid)
            except InputDataError:
                return None  # a value Spark would cast: not ours to guess
            out.add(key_group_of(list(parsed), types, self.max_parallelism))
        return out

    def rows_per_key_group(self) -> np.ndarray:
        """Per key group, about how many rows it holds, from the files' entries alone (no read)."""
        rows = np.zeros(self.max_parallelism, dtype=np.float64)
        if self.operator is not None:
            everything = KeyGroupRange(0, self.max_parallelism - 1)
            for f, runs in chain_files(self.operator.files, everything, *chain_starts(self.operator.files, everything)):
                for r in runs:
                    rows[r.start : r.end + 1] += f.rows / len(f.range)
        for sf in self.savepoint_files:
            rows[sf.start : sf.end + 1] += sf.rows / len(sf.range)
        return rows

    def parts(self, partitions: int | None = None, key_groups: set[int] | None = None) -> list[ScanPart]:
        """The parts to read: about ``partitions`` key-group ranges of about equal rows (by
        default one per ``ROWS_PER_PART`` rows, at least one per subtask the state was
        written at); a savepoint's data files; with ``key_groups`` (a key filter's), only
        the runs of those key groups that hold state."""
        rows = self.rows_per_key_group()
        if key_groups is not None:
            mask = np.zeros(self.max_parallelism, dtype=bool)
            mask[sorted(key_groups)] = True
            mask &= rows > 0
            if self.savepoint_files:
                out = []
                for i, f in enumerate(self.savepoint_files):
                    kgs = tuple(int(k) for k in np.flatnonzero(mask[f.start : f.end + 1]) + f.start)
                    if kgs:
                        out.append(ScanPart(KeyGroupRange(kgs[0], kgs[-1]), i, kgs))
                return out
            return [ScanPart(KeyGroupRange(a, b)) for a, b in mask_runs(mask)]
        if self.savepoint_files:
            return [ScanPart(f.range, i) for i, f in enumerate(self.savepoint_files)]
        total = float(rows.sum())
        if total <= 0:
            return []
        n = partitions if partitions is not None else max(self.parallelism, math.ceil(total / ROWS_PER_PART))
        # Each key group with rows goes to the part its middle row falls in, of n equal shares
        # of the rows: at most n parts, none splitting a key group.
        held = np.flatnonzero(rows > 0)
        middle = np.cumsum(rows)[held] - rows[held] / 2
        share = np.minimum((middle * n / total).astype(np.int64), n - 1)
        cuts = np.flatnonzero(np.diff(share)) + 1
        return [ScanPart(KeyGroupRange(int(g[0]), int(g[-1]))) for g in np.split(held, cuts)]

    # -- reading -------------------------------------------------------------------------------
    def read(self, part: ScanPart) -> pa.Table:
        """The rows of ``part``, shaped (:meth:`schema`)."""
        if part.file is not None:
            table = self._read_savepoint_file(part)
        else:
            table = self._read_checkpoint(part.range)
        table = table.select(self.canonical_schema().names).cast(self.canonical_schema())
        return shape_table(table, self.states, self.state, self.flatten, self.uid)

    def _read_savepoint_file(self, part: ScanPart) -> pa.Table:
        f = self.savepoint_files[part.file or 0]
        slim = SavepointInfo(path=self.store.url(), job="", batch=self.batch, batch_time_ms=0, watermark_ms=None, created_ms=0,
                             origin="", source=None, operators={}, store=self.store)
        table = read_data_file(slim, f, self.uid)
        if part.key_groups is not None:
            table = table.filter(pc.is_in(table.column(KEY_GROUP_COLUMN), pa.array(part.key_groups, pa.int32())))
        return table

    def _read_checkpoint(self, rng: KeyGroupRange) -> pa.Table:
        op = self.operator
        assert op is not None
        reads = chain_files(op.files, rng, *chain_starts(op.files, rng))
        count = np.zeros(len(rng), dtype=np.int64)
        for _, runs in reads:
            for r in runs:
                count[r.start - rng.start : r.end - rng.start + 1] += 1
        parts: list[pa.Table] = []
        # The fast path: a key group whose chain is one file is that file's slice, its dead rows left out.
        for f, runs in reads:
            for r in runs:
                for a, b in mask_runs(count[r.start - rng.start : r.end - rng.start + 1] == 1, r.start):
                    parts.append(self._live(read_state_slice(self.store, f, KeyGroupRange(a, b))))
        for a, b in mask_runs(count > 1, rng.start):
            parts.append(self._merged(op, KeyGroupRange(a, b)))
        schema = self.canonical_schema()
        return pa.concat_tables([p.select(schema.names).cast(schema) for p in parts]) if parts else schema.empty_table()

    def _merged(self, op: OperatorCheckpoint, run: KeyGroupRange) -> pa.Table:
        """Key groups with a restore chain of several files: each key's last row in chain
        order, as applying the files in turn leaves it (every row of a state file holds all
        the states of its time; a state added since is null, as it is absent after an apply)."""
        slices = [self._columns(read_state_slice(self.store, f, r))
                  for f, runs in chain_files(op.files, run, *chain_starts(op.files, run)) for r in runs]
        table = pa.concat_tables(slices)
        last = last_rows(table, [k for k, _ in self.keys])
        if last is None:  # key codes too wide to combine: as a restore does it
            return restore_key_groups(CheckpointFiles(self.store), op, run, self.keys, self.states)
        return self._live(table.take(pa.array(last)))

    def _columns(self, table: pa.Table) -> pa.Table:
        """A state file's slice with the canonical columns: ``key_group``, a state added since it was written null."""
        table = table.rename_columns([KEY_GROUP_COLUMN if c == KG_COLUMN else c for c in table.column_names])
        for s in self.states:
            if s.name not in table.column_names:
                table = table.append_column(s.name, pa.nulls(table.num_rows, s.column_type))  # type: ignore[call-overload]
        return table.select(self.canonical_schema().names).cast(self.canonical_schema())

    def _live(self, table: pa.Table) -> pa.Table:
        """A state file's rows as canonical rows: its live keys (some state set)."""
        table = self._columns(table)
        valid = [pc.is_valid(table.column(s.name)) for s in self.states]
        if valid and table.num_rows:
            alive = valid[0]
            for v in valid[1:]:
                alive = pc.or_(alive, v)
            if not pc.all(alive).as_py():
                table = table.filter(alive)
        return table


def open_scan(path: Location, uid: str, *, checkpoint: int | None = None, state: str | None = None, flatten: bool = True) -> StateScan:
    """Plan a scan of operator ``uid``'s keyed state in ``path``: a savepoint, or a job
    directory at its newest committed checkpoint (or checkpoint ``checkpoint``). Errors name
    the location, the checkpoint and the operator (listing those there are)."""
    store = path if isinstance(path, Store) else open_store(path, "savepoint or job directory")
    if store.exists(METADATA_FILE):
        if checkpoint is not None:
            raise KeyscaleError(f"{store.url()} is a savepoint; a checkpoint only applies to a job directory")
        info = read_savepoint(store, verify=False)
        if uid not in info.operators:
            have = ", ".join(repr(u) for u in sorted(info.operators)) or "none"
            raise StateError(f"savepoint {info.path} has no keyed state of operator '{uid}' (operators: {have})")
        sop = info.operators[uid]
        keys = tuple(sop.key_columns)
        scan = StateScan(store, uid, info.batch, sop.max_parallelism, sop.parallelism or 1, keys, routing_columns(keys, sop.states),
                         tuple(sop.states), savepoint_files=tuple(sop.files), state=state, flatten=flatten)
    else:
        jd, m = committed_checkpoint(store, checkpoint)
        op = m.operators.get(uid)
        if op is None or not op.key_columns:
            keyed = sorted(u for u, o in m.operators.items() if o.key_columns)
            raise StateError(f"checkpoint {m.batch} of {jd.uri} has no keyed state of operator '{uid}' "
                             f"(keyed operators: {', '.join(repr(u) for u in keyed) or 'none'})")
        keys, states = checkpoint_types(CheckpointFiles(store), op)
        scan = StateScan(store, uid, m.batch, op.max_parallelism, op.parallelism, tuple(keys), routing_columns(keys, states),
                         tuple(states), operator=op, state=state, flatten=flatten)
    scan.schema()  # the state and flatten choice checked here, before any task
    return scan


def subtask_ranges(max_parallelism: int, parts: int) -> list[KeyGroupRange]:
    """``parts`` equal key-group ranges (as subtasks at that parallelism own them)."""
    return key_group_ranges(max_parallelism, max(1, min(parts, max_parallelism)))
