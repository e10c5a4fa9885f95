"""Diffs of keyed state: the keys of one operator that one savepoint or checkpoint holds and
another does not, and those whose values changed (``keyscale state diff A B --uid OP``).

Each side is a savepoint or a job directory's checkpoint (the latest, or a given one), at
any parallelism and any max parallelism. Both are read piece by piece (a savepoint's data
files, a checkpoint's key-group ranges rebuilt from its restore chains), never whole:

- with the same max parallelism, both sides are walked in key-group order, one key-group
  range at a time, each piece read once;
- with another one, a key's key group differs between the sides: A's keys are first given
  their key group under B's max parallelism (``pmod(hash(key), M_B)``) and spilled to a
  local temporary folder by B's key-group ranges, then each range is compared.

Memory stays bounded by a piece (about a million keys) per side. Values are compared by
:func:`keyscale.state_processor.compare.values_equal`; the states compared are the
operator's own (not timers and TTL clocks) that both sides have: a state only one side has
is listed, not compared. A state whose type widened between the sides (int -> long, ...) is
compared in the wider type; keys of other types on the two sides are an error.

>>> import tempfile, pyarrow as pa
>>> from pathlib import Path
>>> from keyscale.state_processor import write_savepoint_from_dataframes
>>> root = Path(tempfile.mkdtemp())
>>> def sp(name, users, counts, m):
...     table = pa.table({"user": users, "n": counts})
...     return write_savepoint_from_dataframes(root / name, "clicks", {"count": (table, ["user"], {"n": "long"})}, m)
>>> d = diff_savepoints(sp("a", ["ann", "bob", "cy"], [1, 2, 3], 16), sp("b", ["bob", "cy", "dee"], [2, 30, 4], 32), "count")
>>> d.only_a, d.only_b, d.changed, d.unchanged, d.equal
(1, 1, 1, 1, False)
>>> d.samples["changed"][0]["key"], d.samples["changed"][0]["a"], d.samples["changed"][0]["b"]
({'user': 'cy'}, {'n': 3}, {'n': 30})
"""

from __future__ import annotations

import itertools
import json
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from keyscale.checkpoint.savepoint import (
    DEFAULT_ROWS_PER_FILE,
    KEY_GROUP_COLUMN,
    METADATA_FILE,
    Location,
    checkpoint_rows_per_key_group,
    checkpoint_types,
    chunk_ranges,
    read_data_file,
    read_savepoint,
    restore_key_groups,
    spark_type_name,
)
from keyscale.checkpoint.savepoint.schema import evolution_problem, evolve
from keyscale.checkpoint.savepoint.write import CheckpointFiles
from keyscale.errors import KeyscaleError, StateError
from keyscale.state.keygroups import KeyGroupRange
from keyscale.state.spark_hash import key_groups
from keyscale.state.types import StateDescriptor
from keyscale.state_processor.compare import DIFF_KINDS, diff_schema, diff_tables
from keyscale.state_processor.lookup import committed_checkpoint, jsonable
from keyscale.state_processor.read import _operator, spark_schema
from keyscale.storage import LocalStore, open_store

_PA: Any = pa

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

__all__ = ["StateDiff", "StateSide", "diff_rows", "diff_savepoints", "diff_state", "open_state"]


@dataclass(frozen=True)
class StateSide:
    """Operator ``uid``'s keyed state in a savepoint or a job directory's checkpoint, as
    ``pieces``: key-group ranges in order, each read whole by ``read(i)`` as a table of the
    key columns, ``key_group`` and the states, sorted by key group then key."""

    location: str
    kind: str  # "savepoint" | "checkpoint"
    batch: int
    uid: str
    max_parallelism: int
    key_columns: tuple[tuple[str, pa.DataType], ...]
    states: tuple[StateDescriptor, ...]
    pieces: tuple[KeyGroupRange, ...]
    read: Callable[[int], pa.Table] = field(compare=False, repr=False)

    def to_json(self) -> dict[str, Any]:
        return {"location": self.location, "kind": self.kind, "batch": self.batch, "max_parallelism": self.max_parallelism}

    def describe(self) -> str:
        what = f"savepoint {self.location}" if self.kind == "savepoint" else f"checkpoint {self.batch} of job directory {self.location}"
        return f"{what} (batch {self.batch}, max parallelism {self.max_parallelism})"


def _schema(keys: Sequence[tuple[str, pa.DataType]], states: Sequence[StateDescriptor]) -> pa.Schema:
    return pa.schema([*(pa.field(k, t) for k, t in keys), pa.field(KEY_GROUP_COLUMN, pa.int32()),
                      *(pa.field(s.name, s.column_type) for s in states)])


def open_state(location: Location, uid: str, checkpoint: int | None = None, *, rows_per_piece: int = DEFAULT_ROWS_PER_FILE) -> StateSide:
    """Operator ``uid`` of a savepoint, or of a job directory's latest checkpoint (or
    checkpoint ``checkpoint``), ready to be read piece by piece."""
    store = open_store(location, "savepoint or job directory")
    if store.exists(METADATA_FILE):
        if checkpoint is not None:
            raise KeyscaleError(f"{store.url()} is a savepoint; a checkpoint number only applies to a job directory")
        info = read_savepoint(store, verify=False)
        op = _operator(info.operators, uid, f"savepoint {info.path}")
        schema = op.schema()
        files = op.files

        def read_file(i: int) -> pa.Table:
            return read_data_file(info, files[i], uid).select(schema.names).cast(schema)

        return StateSide(info.path, "savepoint", info.batch, uid, op.max_parallelism, op.key_columns, op.states,
                         tuple(f.range for f in files), read_file)
    jd, manifest = committed_checkpoint(store, checkpoint)
    cop = _operator(manifest.operators, uid, f"checkpoint {manifest.batch} of {jd.uri}")
    if not cop.key_columns:
        raise StateError(f"operator '{uid}' has no keyed state in checkpoint {manifest.batch} of {jd.uri}")
    files_ = CheckpointFiles(jd.store)
    keys, states = checkpoint_types(files_, cop)
    schema = _schema(keys, states)
    ranges = chunk_ranges(checkpoint_rows_per_key_group(files_, cop), rows_per_piece)

    def read_range(i: int) -> pa.Table:
        return restore_key_groups(files_, cop, ranges[i], keys, states).select(schema.names).cast(schema)

    return StateSide(jd.uri, "checkpoint", manifest.batch, uid, cop.max_parallelism, keys, states, tuple(ranges), read_range)


# -- what is compared ---------------------------------------------------------------------------


def _user_states(side: StateSide) -> dict[str, StateDescriptor]:
    return {s.name: s for s in side.states if not s.name.startswith("__")}


def _compared(a: StateSide, b: StateSide) -> tuple[list[tuple[str, pa.DataType]], list[str], list[str]]:
    """The states compared (each in the type both sides' values are read as), and the states
    only A and only B have. Keys of other names or types are an error."""
    if [k for k, _ in a.key_columns] != [k for k, _ in b.key_columns] or any(
        not ta.equals(tb) for (_, ta), (_, tb) in zip(a.key_columns, b.key_columns, strict=True)
    ):
        def text(s: StateSide) -> str:
            return ", ".join(f"{k} {spark_type_name(t)}" for k, t in s.key_columns)

        raise StateError(f"operator '{a.uid}' is keyed by ({text(a)}) in A and by ({text(b)}) in B: keys of other columns or types cannot be compared")
    sa, sb = _user_states(a), _user_states(b)
    both: list[tuple[str, pa.DataType]] = []
    for name, da in sa.items():
        if name not in sb:
            continue
        ta, tb = da.column_type, sb[name].column_type
        if evolution_problem(ta, tb) is None:
            both.append((name, tb))
        elif evolution_problem(tb, ta) is None:
            both.append((name, ta))
        else:
            raise StateError(f"operator '{a.uid}', state '{name}': {spark_type_name(ta)} in A, {spark_type_name(tb)} in B: values of these types cannot be compared")
    return both, sorted(set(sa) - set(sb)), sorted(set(sb) - set(sa))


def _as_compared(table: pa.Table, keys: Sequence[str], states: Sequence[tuple[str, pa.DataType]]) -> pa.Table:
    cols = {k: table.column(k) for k in [*keys, KEY_GROUP_COLUMN]}
    for name, t in states:
        col = table.column(name)
        cols[name] = col if col.type.equals(t) else evolve(col, t)
    out: pa.Table = _PA.table(cols)
    return out


# -- walking both sides -------------------------------------------------------------------------


class _Cursor:
    """A side's rows of ascending key-group ranges, each piece read once."""

    def __init__(self, side: StateSide):
        self.side = side
        self._at = -1
        self._table: pa.Table | None = None

    def rows(self, seg: KeyGroupRange) -> pa.Table | None:
        for i, p in enumerate(self.side.pieces):
            if p.end < seg.start or p.start > seg.end:
                continue
            if i != self._at:
                self._at, self._table = i, self.side.read(i)
            table = self._table
            assert table is not None
            kgs = table.column(KEY_GROUP_COLUMN).to_numpy()
            lo, hi = int(np.searchsorted(kgs, seg.start, "left")), int(np.searchsorted(kgs, seg.end, "right"))
            return table.slice(lo, hi - lo)  # segments never straddle two pieces of one side
        return None


def _segments(bounds: set[int], m: int) -> list[KeyGroupRange]:
    cuts = sorted(b for b in bounds | {0, m} if 0 <= b <= m)
    return [KeyGroupRange(s, e - 1) for s, e in itertools.pairwise(cuts) if e > s]


def _ipc(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    return bytes(sink.getvalue().to_pybytes())


def _pairs_same_m(a: StateSide, b: StateSide) -> Iterator[tuple[pa.Table | None, pa.Table | None]]:
    bounds = {p.start for s in (a, b) for p in s.pieces} | {p.end + 1 for s in (a, b) for p in s.pieces}
    ca, cb = _Cursor(a), _Cursor(b)
    for seg in _segments(bounds, b.max_parallelism):
        yield ca.rows(seg), cb.rows(seg)


def _pairs_rebucketed(a: StateSide, b: StateSide) -> Iterator[tuple[pa.Table | None, pa.Table | None]]:
    """A's keys spilled by the key-group ranges of B's pieces (under B's max parallelism)."""
    names = [k for k, _ in a.key_columns]
    types = [spark_type_name(t) for _, t in a.key_columns]
    segs = _segments({p.start for p in b.pieces} | {p.end + 1 for p in b.pieces}, b.max_parallelism)
    starts = np.array([s.start for s in segs], dtype=np.int64)
    with tempfile.TemporaryDirectory(prefix="keyscale-diff-") as scratch:
        spill = LocalStore(scratch)
        for i in range(len(a.pieces)):
            table = a.read(i)
            seg = np.searchsorted(starts, key_groups(table.select(names), names, types, b.max_parallelism), side="right") - 1
            order = np.argsort(seg, kind="stable")
            table, seg = table.take(order), seg[order]
            cuts = np.flatnonzero(np.diff(seg)) + 1
            for lo, hi in zip([0, *cuts.tolist()], [*cuts.tolist(), table.num_rows], strict=True):
                if hi > lo:
                    spill.put(f"seg-{int(seg[lo]):08d}/{i:08d}.arrow", _ipc(table.slice(lo, hi - lo)), durable=False)
            del table
        cb = _Cursor(b)
        for j, s in enumerate(segs):
            parts = [pa.ipc.open_file(pa.BufferReader(spill.get(o.key))).read_all() for o in spill.list(f"seg-{j:08d}")]
            spill.delete_prefix(f"seg-{j:08d}")
            yield (pa.concat_tables(parts) if parts else None), cb.rows(s)


def _diff_parts(a: StateSide, b: StateSide) -> Iterator[tuple[pa.Table, int]]:
    """Per key-group range: its differences (:func:`diff_schema`) and its unchanged keys."""
    states, _, _ = _compared(a, b)
    keys = [k for k, _ in a.key_columns]
    cols = [(k, t) for k, t in b.key_columns]
    empty = _schema(cols, []).empty_table()
    for name, t in states:
        empty = empty.append_column(name, pa.array([], t))
    pairs = _pairs_same_m(a, b) if a.max_parallelism == b.max_parallelism else _pairs_rebucketed(a, b)
    for ta, tb in pairs:
        if (ta is None or not ta.num_rows) and (tb is None or not tb.num_rows):
            continue
        ta = empty if ta is None else _as_compared(ta, keys, states)
        tb = empty if tb is None else _as_compared(tb, keys, states)
        yield diff_tables(ta, tb, keys, [n for n, _ in states])


# -- results ------------------------------------------------------------------------------------


@dataclass
class StateDiff:
    """What differs between two sides' state of one operator: counts, and up to ``limit``
    samples of each kind (``only_a``, ``only_b``, ``changed``) in key-group order."""

    uid: str
    a: StateSide
    b: StateSide
    states: list[str]
    states_only_a: list[str]
    states_only_b: list[str]
    limit: int
    only_a: int = 0
    only_b: int = 0
    changed: int = 0
    unchanged: int = 0
    samples: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: {k: [] for k in DIFF_KINDS})

    @property
    def equal(self) -> bool:
        """No key only on one side and no value changed (states only one side has aside)."""
        return not (self.only_a or self.only_b or self.changed)

    def add(self, part: pa.Table, unchanged: int) -> None:
        self.unchanged += unchanged
        kinds = np.asarray(part.column("kind").to_numpy(zero_copy_only=False))
        for kind in DIFF_KINDS:
            rows = np.flatnonzero(kinds == kind)
            setattr(self, kind, getattr(self, kind) + len(rows))
            room = self.limit - len(self.samples[kind])
            if room > 0 and len(rows):
                self.samples[kind].extend(self._sample(r) for r in part.take(rows[:room]).to_pylist())

    def _sample(self, row: dict[str, Any]) -> dict[str, Any]:
        types = {k: t for k, t in self.a.key_columns}
        out: dict[str, Any] = {"key": {k: jsonable(row[k], types[k]) for k in types}}
        for side in ("a", "b"):
            if row[f"key_group_{side}"] is not None:
                out[f"key_group_{side}"] = row[f"key_group_{side}"]
        if row["kind"] == "changed":
            out["changed_states"] = row["changed_states"]
        state_types = {s.name: s.column_type for s in self.a.states}
        for side in ("a", "b"):
            value = row[f"value_{side}"]
            if value is not None:
                out[side] = {s: jsonable(value.get(s), state_types[s]) for s in self.states}
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "uid": self.uid, "a": self.a.to_json(), "b": self.b.to_json(), "equal": self.equal,
            "states": self.states, "states_only_a": self.states_only_a, "states_only_b": self.states_only_b,
            "only_a": self.only_a, "only_b": self.only_b, "changed": self.changed, "unchanged": self.unchanged,
            "samples": self.samples,
        }

    def text(self) -> str:
        """The summary ``keyscale state diff`` prints."""
        lines = [f"operator '{self.uid}'", f"  A: {self.a.describe()}", f"  B: {self.b.describe()}",
                 f"  states compared: {', '.join(self.states) or 'none'}"]
        if self.states_only_a or self.states_only_b:
            lines.append(f"  states not compared: only in A: {', '.join(self.states_only_a) or '-'}; only in B: {', '.join(self.states_only_b) or '-'}")
        lines += [f"  only in A: {self.only_a:,} keys", f"  only in B: {self.only_b:,} keys",
                  f"  changed:   {self.changed:,} keys", f"  unchanged: {self.unchanged:,} keys"]
        titles = {"only_a": "only in A", "only_b": "only in B", "changed": "changed"}
        for kind in DIFF_KINDS:
            shown = self.samples[kind]
            if shown:
                lines.append(f"{titles[kind]} ({len(shown)} of {getattr(self, kind):,}):")
                lines.extend("  " + json.dumps(s, ensure_ascii=False) for s in shown)
        return "\n".join(lines)


def _open_pair(a: Location, b: Location, uid: str, checkpoint_a: int | None, checkpoint_b: int | None,
               rows_per_piece: int) -> tuple[StateSide, StateSide]:
    return (open_state(a, uid, checkpoint_a, rows_per_piece=rows_per_piece),
            open_state(b, uid, checkpoint_b, rows_per_piece=rows_per_piece))


def diff_savepoints(
    a: Location, b: Location, uid: str, *, samples: int = 10, checkpoint_a: int | None = None, checkpoint_b: int | None = None,
    rows_per_piece: int = DEFAULT_ROWS_PER_FILE,
) -> StateDiff:
    """The diff of operator ``uid`` between ``a`` and ``b``: savepoints or job directories
    (their latest checkpoint, or ``checkpoint_a`` / ``checkpoint_b``), local or on an object
    store, at any parallelism and max parallelism. Counts every difference and keeps the
    first ``samples`` of each kind; see the module for how."""
    sa, sb = _open_pair(a, b, uid, checkpoint_a, checkpoint_b, rows_per_piece)
    states, only_a, only_b = _compared(sa, sb)
    out = StateDiff(uid, sa, sb, [n for n, _ in states], only_a, only_b, samples)
    for part, unchanged in _diff_parts(sa, sb):
        out.add(part, unchanged)
    return out


def diff_rows(a: Location, b: Location, uid: str, *, checkpoint_a: int | None = None, checkpoint_b: int | None = None,
              rows_per_piece: int = DEFAULT_ROWS_PER_FILE) -> pa.Table:
    """Every difference of operator ``uid`` between ``a`` and ``b`` as one Arrow table, in
    the columns of :func:`keyscale.state_processor.compare.diff_schema` (the key, ``kind``,
    ``key_group_a``, ``key_group_b``, ``changed_states``, ``value_a``, ``value_b``)."""
    sa, sb = _open_pair(a, b, uid, checkpoint_a, checkpoint_b, rows_per_piece)
    states, _, _ = _compared(sa, sb)
    parts = [part for part, _ in _diff_parts(sa, sb)]
    return pa.concat_tables(parts) if parts else diff_schema(sa.key_columns, states).empty_table()


def diff_state(spark: SparkSession, a: Location, b: Location, uid: str, *, checkpoint_a: int | None = None,
               checkpoint_b: int | None = None) -> DataFrame:
    """:func:`diff_rows` as a Spark DataFrame (the differences are gathered in the driver,
    the unchanged keys never are). Both sides are read in the calling process, so a side on
    an object store needs only that process's settings (``AWS_*`` in its environment when it
    is called), none in Spark's workers: unlike the ``keyscale`` data source, a session
    started before the settings diffs an ``s3://`` location.

    Example (a running Spark session ``spark``)::

        d = diff_state(spark, "savepoints/sp-41", "savepoints/sp-57", "totals")
        d.groupBy("kind").count().show()
        d.where("kind = 'changed'").select("user", "value_a.total", "value_b.total").show()
    """
    table = diff_rows(a, b, uid, checkpoint_a=checkpoint_a, checkpoint_b=checkpoint_b)
    if table.num_rows == 0:
        return spark.createDataFrame([], spark_schema(table.schema))
    return spark.createDataFrame(table)

