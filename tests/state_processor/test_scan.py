"""Scans and change feeds of keyed state (issue 37, items 2 and 3), without Spark, against a
model: a scan of any checkpoint, cut into any number of key-group ranges, equals the whole
restore of that checkpoint; a key filter plans only its key group; the change feed between
two checkpoints equals the diffs of the restored states of every checkpoint between them,
through compactions (a snapshot of part of the key groups), deleted keys and a rescale; on
local disk and on S3.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keyscale.checkpoint.encode import write_state_file
from keyscale.checkpoint.files import read_state_slice
from keyscale.checkpoint.jobdir import JobDir
from keyscale.checkpoint.manifest import Manifest, OperatorCheckpoint, StateFile
from keyscale.checkpoint.savepoint import checkpoint_types, restore_key_groups, write_savepoint
from keyscale.errors import KeyscaleError, StateError
from keyscale.state.keygroups import KeyGroupRange, key_group_ranges
from keyscale.state.spark_hash import key_group_of
from keyscale.state.table import KG_COLUMN
from keyscale.state.types import StateDescriptor
from keyscale.state_processor.changes import open_changes
from keyscale.state_processor.keygroups import key_groups
from keyscale.state_processor.scan import ScanPart, StateScan, open_scan
from keyscale.storage import Store

TOTAL = StateDescriptor("total", "value", pa.int64())
RECENT = StateDescriptor("recent", "list", pa.int64())
SEEN = StateDescriptor("seen", "map", pa.int64(), pa.string())
CLOCK = StateDescriptor("__ttl_total", "value", pa.int64())
STATES = (TOTAL, RECENT, SEEN, CLOCK)
USER = ("total", "recent", "seen")
M = 16
BATCHES = 7


def _rows(rng: np.random.Generator, users: list[str], batch: int) -> pa.Table:
    """One row per user: random states, some users deleted (every state null), some written unchanged."""
    n = len(users)
    dead = rng.random(n) < 0.15
    total = [None if d else int(x) for d, x in zip(dead, rng.integers(0, 5, n), strict=True)]
    recent = [None if d or i % 5 == 0 else [int(v) for v in rng.integers(0, 3, i % 3 + 1)] for i, d in enumerate(dead)]
    seen = [None if d or i % 3 == 0 else [(f"p{j}", int(batch % 2 + j)) for j in range(i % 3)] for i, d in enumerate(dead)]
    table = pa.table({
        "user": pa.array(users, pa.string()),
        "total": pa.array(total, pa.int64()), "recent": pa.array(recent, RECENT.column_type),
        "seen": pa.array(seen, SEEN.column_type),
        "__ttl_total": pa.array([None if t is None else 1000 * batch for t in total], pa.int64()),
    })
    kgs = key_groups(table, ["user"], ["string"], M)
    return table.add_column(1, KG_COLUMN, pa.array(kgs, pa.int32())).sort_by(KG_COLUMN)


def _write(store: Store, batch: int, kind: str, table: pa.Table, p: int, subtasks: set[int] | None = None) -> list[Any]:
    kgs = table.column(KG_COLUMN).to_numpy()
    files = []
    for s, rng in enumerate(key_group_ranges(M, p)):
        if subtasks is not None and s not in subtasks:
            continue
        part = table.filter(pa.array((kgs >= rng.start) & (kgs <= rng.end)))
        if part.num_rows or kind == "snapshot":
            rel = f"state/op/{batch:012d}-s{s:05d}-{kind}.arrow"
            files.append(write_state_file(store, rel, part, kind, batch, rng))  # type: ignore[arg-type]
    return files


def _companions(jd: JobDir, snapshots: list[StateFile]) -> list[StateFile]:
    """Beside each snapshot, the delta a task writes with it: its rows, and a deleting row
    (every state null) for each key of its range it no longer holds; the snapshot records
    ``deltas_since`` (the checkpoint before it)."""
    before = jd.latest_manifest()
    assert before is not None
    op = before.operators["op"]
    keys, states = checkpoint_types(jd.store, op)
    out = []
    for f in snapshots:
        snap = read_state_slice(jd.store, f, f.range)
        held = restore_key_groups(jd.store, op, f.range, keys, states)
        gone = held.filter(pa.array(~np.isin(held.column("user").to_numpy(zero_copy_only=False), snap.column("user").to_numpy(zero_copy_only=False))))
        deletes = pa.table({c: gone.column("user") if c == "user" else gone.column("key_group").cast(pa.int32()) if c == KG_COLUMN
                            else pa.nulls(gone.num_rows, snap.schema.field(c).type) for c in snap.column_names}, schema=snap.schema)
        rel = f.path.replace("-snapshot", "-delta")
        out += [replace(f, deltas_since=before.batch),
                write_state_file(jd.store, rel, pa.concat_tables([snap, deletes]).sort_by(KG_COLUMN), "delta", f.batch, f.range)]
    return out


def _job(where: Any, users: int = 300, companions: bool = False) -> JobDir:
    """Batches 0..6 of operator 'op': a snapshot at parallelism 2, deltas, a rescale to 4 at
    batch 3 with a snapshot by two of its subtasks (of fewer keys: the others deleted), deltas.
    ``companions``: batch 3's snapshots with their changes beside them, as a task writes them."""
    jd = JobDir(where)
    jd.claim("job", M, M)
    rng = np.random.default_rng(7)
    names = [f"u{i}" for i in range(users)]
    files: list[Any] = []
    for batch in range(BATCHES):
        p = 2 if batch < 3 else 4
        if batch == 0:
            files += _write(jd.store, 0, "snapshot", _rows(rng, names, 0), p)
        elif batch == 3:
            snapshots = _write(jd.store, batch, "snapshot", _rows(rng, names[: users // 2], batch), p, {0, 2})
            files += _companions(jd, snapshots) if companions else snapshots
        else:
            files += _write(jd.store, batch, "delta", _rows(rng, [n for n in names if rng.random() < 0.3], batch), p)
        op = OperatorCheckpoint("op", M, p, (("user", "string"),), tuple(d.to_json() for d in STATES), tuple(files))
        jd.commit(Manifest("job", batch, 1000 * batch, {"op": op, "src": OperatorCheckpoint("src", M, 1, (), ())}))
    return jd


def _model(jd: JobDir, batch: int) -> dict[str, dict[str, Any]]:
    """Every live key's row at checkpoint ``batch``: the whole restore."""
    op = jd.read_manifest(batch).operators["op"]
    keys, states = checkpoint_types(jd.store, op)
    table = restore_key_groups(jd.store, op, KeyGroupRange(0, M - 1), keys, states)
    return {r["user"]: r for r in table.to_pylist()}


def _scanned(scan: StateScan, parts: list[ScanPart]) -> dict[str, dict[str, Any]]:
    rows = [r for p in parts for r in scan.read(p).to_pylist()]
    out = {r["user"]: r for r in rows}
    assert len(out) == len(rows)  # no key read twice
    return out


def _user(row: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if row is None else {k: row[k] for k in USER}


def _diff(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]], batch: int) -> set[tuple[Any, ...]]:
    """The model's changes of one batch: (user, batch, kind, old, new), values as text."""
    out = set()
    for user in set(before) | set(after):
        old, new = _user(before.get(user)), _user(after.get(user))
        if old is not None and all(v is None for v in old.values()):
            old = None
        if new is not None and all(v is None for v in new.values()):
            new = None
        if old == new:
            continue
        kind = "insert" if old is None else "delete" if new is None else "update"
        out.add((user, batch, kind, repr(old), repr(new)))
    return out


def _feed(rows: list[dict[str, Any]]) -> set[tuple[Any, ...]]:
    out = set()
    for r in rows:
        old = None if r["old"] is None else {k: r["old"][k] for k in USER}
        new = None if r["new"] is None else {k: r["new"][k] for k in USER}
        assert r["key_group"] == key_group_of([r["user"]], ["string"], M)
        out.add((r["user"], r["batch"], r["change"], repr(old), repr(new)))
    assert len(out) == len(rows)
    return out


def test_a_scan_equals_the_whole_restore_at_every_checkpoint_in_any_number_of_ranges(tmp_path: Path) -> None:
    jd = _job(tmp_path / "job")
    for batch in range(BATCHES):
        model = _model(jd, batch)
        scan = open_scan(tmp_path / "job", "op", checkpoint=batch, flatten=False)
        assert scan.batch == batch and scan.schema().names == ["user", "key_group", "total", "recent", "seen", "__ttl_total"]
        for n in (1, 3, M, None):
            parts = scan.parts(n)
            covered = [kg for p in parts for kg in p.range]
            assert covered == sorted(set(covered))  # disjoint ranges, in order
            if n is not None:
                assert len(parts) <= n
            assert _scanned(scan, parts) == model
    assert open_scan(tmp_path / "job", "op", flatten=False).batch == BATCHES - 1  # the newest by default


def test_a_key_filter_plans_only_the_key_groups_that_can_hold_its_keys(tmp_path: Path) -> None:
    _job(tmp_path / "job")
    scan = open_scan(tmp_path / "job", "op", flatten=False)
    model = _model(JobDir(tmp_path / "job"), BATCHES - 1)
    user = sorted(model)[0]
    kg = key_group_of([user], ["string"], M)
    parts = scan.parts(key_groups=scan.key_groups_of({"user": [user]}))
    assert parts == [ScanPart(KeyGroupRange(kg, kg))]
    rows = scan.read(parts[0]).to_pylist()
    assert {r["user"]: r for r in rows} == {u: r for u, r in model.items() if r["key_group"] == kg}
    two = scan.key_groups_of({"user": [user, "u6", None]})
    assert two == {kg, key_group_of(["u6"], ["string"], M)}
    # Nothing to prune on: no value for the key column, or one the column's type cannot take.
    assert scan.key_groups_of({"total": [3]}) is None
    assert StateScan(scan.store, "op", 0, M, 1, (("x", pa.float64()),), (("x", pa.float64()),), ()).key_groups_of({"x": [0.0]}) is None


def test_the_rows_are_shaped_as_read_keyed_state_shapes_them(tmp_path: Path) -> None:
    jd = _job(tmp_path / "job")
    model = _model(jd, BATCHES - 1)
    with pytest.raises(KeyscaleError, match="pass state='NAME'"):
        open_scan(tmp_path / "job", "op")
    with pytest.raises(StateError, match="no state 'nope'"):
        open_scan(tmp_path / "job", "op", state="nope")
    recent = open_scan(tmp_path / "job", "op", state="recent")
    rows = [r for p in recent.parts() for r in recent.read(p).to_pylist()]
    assert recent.schema().names == ["user", "key_group", "recent", "recent_index"]
    want = sorted((u, i, v) for u, r in model.items() for i, v in enumerate(r["recent"] or []))
    assert sorted((r["user"], r["recent_index"], r["recent"]) for r in rows) == want
    seen = open_scan(tmp_path / "job", "op", state="seen")
    rows = [r for p in seen.parts() for r in seen.read(p).to_pylist()]
    assert sorted((r["user"], r["seen_key"], r["seen_value"]) for r in rows) == sorted(
        (u, k, v) for u, r in model.items() for k, v in (r["seen"] or []))
    total = open_scan(tmp_path / "job", "op", state="total")
    rows = [r for p in total.parts() for r in total.read(p).to_pylist()]
    assert {r["user"]: r["total"] for r in rows} == {u: r["total"] for u, r in model.items() if r["total"] is not None}


def test_a_savepoint_scans_as_the_checkpoint_it_was_taken_of(tmp_path: Path) -> None:
    jd = _job(tmp_path / "job")
    sp = write_savepoint(jd, jd.read_manifest(4), tmp_path / "sp", rows_per_file=40)
    scan = open_scan(sp, "op", flatten=False)
    assert len(scan.parts()) > 1 and _scanned(scan, scan.parts()) == _model(jd, 4)
    kg = key_group_of(["u7"], ["string"], M)
    parts = scan.parts(key_groups={kg})
    assert len(parts) == 1 and parts[0].range == KeyGroupRange(kg, kg)
    assert {r["key_group"] for r in scan.read(parts[0]).to_pylist()} == {kg}
    with pytest.raises(KeyscaleError, match="is a savepoint"):
        open_scan(sp, "op", checkpoint=3)
    with pytest.raises(StateError, match=r"no keyed state of operator 'nope'.*'op'"):
        open_scan(sp, "nope")


@pytest.mark.parametrize("start,end", [(0, 6), (2, 4), (3, 4), (0, 1), (4, 6)])
def test_the_change_feed_equals_the_diffs_of_the_checkpoints_between(tmp_path: Path, start: int, end: int) -> None:
    jd = _job(tmp_path / "job")
    states = [_model(jd, b) for b in range(BATCHES)]
    want = set().union(*(_diff(states[b - 1], states[b], b) for b in range(start + 1, end + 1)))
    kinds = {w[2] for w in want}
    if (start, end) == (0, 6):
        assert kinds == {"insert", "update", "delete"}  # the model has each kind of change
    feed = open_changes(tmp_path / "job", "op", start, end)
    assert feed.schema().names == ["user", "key_group", "batch", "change", "old", "new"]
    for n in (1, 3):
        assert _feed([r for rng in feed.ranges(n) for r in feed.read(rng).to_pylist()]) == want


@pytest.mark.parametrize("start,end", [(0, 6), (2, 3), (3, 4)])
def test_the_change_feed_reads_a_snapshots_companion_instead_of_the_snapshot(tmp_path: Path, start: int, end: int) -> None:
    """A snapshot written with its batch's changes beside it (``deltas_since``): the feed reads
    that delta, never the snapshot, and equals the model; scans and restores read the snapshot."""
    jd = _job(tmp_path / "job", companions=True)
    states = [_model(jd, b) for b in range(BATCHES)]
    assert states == [_model(_job(tmp_path / "plain"), b) for b in range(BATCHES)]  # the same state either way
    want = set().union(*(_diff(states[b - 1], states[b], b) for b in range(start + 1, end + 1)))
    feed = open_changes(tmp_path / "job", "op", start, end)
    assert all(f.kind == "delta" for _, fs in feed.written for f in fs)
    assert _feed([r for rng in feed.ranges(2) for r in feed.read(rng).to_pylist()]) == want
    scan = open_scan(tmp_path / "job", "op", checkpoint=4, flatten=False)
    assert {k: _user(r) for k, r in _scanned(scan, scan.parts(3)).items()} == {k: _user(r) for k, r in states[4].items()}


def test_the_change_feed_reads_only_the_files_of_its_batches_and_names_a_batch_it_lacks(tmp_path: Path) -> None:
    jd = _job(tmp_path / "job")
    feed = open_changes(tmp_path / "job", "op", 4)
    assert feed.end == BATCHES - 1 and [b for b, _ in feed.written] == [5, 6]
    assert all(f.batch == b and f.kind == "delta" for b, fs in feed.written for f in fs)
    # A key filter: the feed of one key group holds that key's changes.
    kg = key_group_of(["u9"], ["string"], M)
    whole = [r for rng in feed.ranges() for r in feed.read(rng).to_pylist() if r["user"] == "u9"]
    assert feed.ranges(key_groups={kg}) == [KeyGroupRange(kg, kg)]
    assert [r for r in feed.read(KeyGroupRange(kg, kg)).to_pylist() if r["user"] == "u9"] == whole
    jd.store.delete(jd.manifest_key(2))
    with pytest.raises(StateError, match=r"needs checkpoint 2 of .*not kept"):
        open_changes(tmp_path / "job", "op", 1, 3)
    with pytest.raises(KeyscaleError, match=r"changes_from \(5\) must be before changes_to \(4\)"):
        open_changes(tmp_path / "job", "op", 5, 4)
    with pytest.raises(StateError, match=r"no keyed state of operator 'nope'.*'op'"):
        open_changes(tmp_path / "job", "nope", 4, 5)


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.integers(0, 50), min_size=M, max_size=M), n=st.integers(1, 20))
def test_parts_cover_every_key_group_with_state_once(rows: list[int], n: int) -> None:
    """Pure: planned ranges are disjoint, in order, start and end on key groups with rows,
    cover every key group with rows, and are at most ``n``."""
    files = []
    for kg, r in enumerate(rows):
        if r:
            files.append(StateFile(f"f{kg}", 0, "snapshot", kg, kg, r, 1, 0))
    op = OperatorCheckpoint("op", M, 1, (("k", "string"),), (TOTAL.to_json(),), tuple(files))
    scan = StateScan(None, "op", 0, M, 1, (("k", pa.string()),), (("k", pa.string()),), (TOTAL,), operator=op)  # type: ignore[arg-type]
    parts = scan.parts(n)
    covered = [kg for p in parts for kg in p.range]
    assert covered == sorted(set(covered))
    assert [kg for kg in covered if rows[kg]] == [kg for kg in range(M) if rows[kg]]
    assert all(rows[p.range.start] and rows[p.range.end] for p in parts)
    assert len(parts) <= n


def test_scans_and_change_feeds_on_s3_equal_the_model(s3_bucket: str, tmp_path: Path) -> None:
    jd = _job(f"{s3_bucket}/job")
    states = [_model(jd, b) for b in range(BATCHES)]
    scan = open_scan(f"{s3_bucket}/job", "op", checkpoint=4, flatten=False)
    assert scan.store.uri.startswith("s3://") and _scanned(scan, scan.parts(3)) == states[4]
    feed = open_changes(f"{s3_bucket}/job", "op", 1, 5)
    want = set().union(*(_diff(states[b - 1], states[b], b) for b in range(2, 6)))
    assert _feed([r for rng in feed.ranges(3) for r in feed.read(rng).to_pylist()]) == want
