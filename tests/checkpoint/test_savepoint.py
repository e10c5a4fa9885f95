"""Savepoints: write from a checkpoint, verify, move, restore (with schema evolution).

Checkpoints are built directly with ``write_state_file`` + ``Manifest`` + ``JobDir`` by a
small simulated job that keeps a reference copy of its state in Python dicts, so every
test compares against plain Python. No Spark.
"""

from __future__ import annotations

import io
import json
import random
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from keyscale.checkpoint.encode import write_state_file
from keyscale.checkpoint.files import read_state_slice
from keyscale.checkpoint.jobdir import JobDir
from keyscale.checkpoint.manifest import (
    Manifest,
    OperatorCheckpoint,
    StateFile,
    live_files,
    restore_chain,
)
from keyscale.checkpoint.savepoint import (
    METADATA_FILE,
    OperatorSpec,
    chunk_ranges,
    evolution_problem,
    parse_arrow_type,
    read_savepoint,
    restore_savepoint,
    spark_type_name,
    text_progress,
    write_savepoint,
)
from keyscale.errors import JobDirError, StateError
from keyscale.state.keygroups import KeyGroupRange, key_group_range
from keyscale.state.spark_hash import key_group_of
from keyscale.state.table import KG_COLUMN, KeyedStateTable
from keyscale.state.types import StateDescriptor
from keyscale.storage import Store, open_store

M = 16
UID = "tracker"
TOTAL = StateDescriptor("total", "value", pa.int64())
RECENT = StateDescriptor("recent", "list", pa.int64())
PARITY = StateDescriptor("parity", "map", pa.int64(), pa.string())
STATES = (TOTAL, RECENT, PARITY)
SINGLE_KEY = (("user", pa.string()),)
MULTI_KEY = (("user", pa.string()), ("shard", pa.int64()))

Key = tuple[Any, ...]


# -- a simulated job writing checkpoints ------------------------------------------------------


@dataclass
class SimJob:
    """Writes checkpoints of one keyed operator the way the runtime does (deltas, snapshots)."""

    path: Path | str  # a local folder or an object store URI
    key_columns: tuple[tuple[str, pa.DataType], ...] = SINGLE_KEY
    states: tuple[StateDescriptor, ...] = STATES
    uid: str = UID
    max_parallelism: int = M
    name: str = "job"
    state: dict[Key, dict[str, Any]] = field(default_factory=dict)
    files: list[StateFile] = field(default_factory=list)
    batch: int = -1
    manifest: Manifest | None = None

    def __post_init__(self) -> None:
        self.jd = JobDir(self.path)
        self.jd.claim(self.name, self.max_parallelism, self.max_parallelism)

    @property
    def spark_types(self) -> list[str]:
        return [spark_type_name(t) for _, t in self.key_columns]

    def kg(self, key: Key) -> int:
        return key_group_of(list(key), self.spark_types, self.max_parallelism)

    def _table(self, rows: Sequence[tuple[Key, dict[str, Any] | None]]) -> pa.Table:
        rows = sorted(rows, key=lambda r: self.kg(r[0]))
        cols: dict[str, Any] = {}
        for i, (name, t) in enumerate(self.key_columns):
            cols[name] = pa.array([k[i] for k, _ in rows], t)
        cols[KG_COLUMN] = pa.array([self.kg(k) for k, _ in rows], pa.int32())
        for s in self.states:
            vals = [(v or {}).get(s.name) for _, v in rows]
            if s.kind == "map":
                vals = [list(x.items()) if x is not None else None for x in vals]
            cols[s.name] = pa.array(vals, s.column_type)
        return pa.table(cols)

    def commit(self, updates: dict[Key, dict[str, Any] | None], parallelism: int, snapshot: Sequence[int] = ()) -> Manifest:
        """Apply ``updates`` (None deletes a key) as batch ``batch + 1`` at ``parallelism``;
        subtasks in ``snapshot`` write a snapshot of their range, the others a delta."""
        self.batch += 1
        b = self.batch
        for k, v in updates.items():
            if v is None or all(x is None for x in v.values()):
                self.state.pop(k, None)
            else:
                self.state[k] = dict(v)
        new = []
        for s in range(parallelism):
            rng = key_group_range(s, self.max_parallelism, parallelism)
            kind = "snapshot" if s in snapshot else "delta"
            rows: list[tuple[Key, dict[str, Any] | None]]
            if kind == "snapshot":
                rows = [(k, v) for k, v in self.state.items() if self.kg(k) in rng]
            else:
                rows = [(k, self.state.get(k)) for k in updates if self.kg(k) in rng]
            if rows or kind == "snapshot":
                rel = f"state/{self.uid}/{b:012d}-s{s:05d}-{kind}.arrow"
                new.append(write_state_file(self.jd.store, rel, self._table(rows), kind, b, rng))  # type: ignore[arg-type]
        self.files = live_files([*self.files, *new], self.max_parallelism)
        op = OperatorCheckpoint(
            self.uid, self.max_parallelism, parallelism,
            tuple((n, str(t)) for n, t in self.key_columns), tuple(d.to_json() for d in self.states), tuple(self.files),
        )
        self.manifest = Manifest(self.name, b, 1_000 + b, {self.uid: op}, watermark_ms=500 + b, created_ms=2_000 + b)
        self.jd.commit(self.manifest)
        self._spark_log(b)
        return self.manifest

    def _spark_log(self, b: int) -> None:
        """Spark's checkpoint as Spark keeps it: offsets (one ahead), commits, .crc files."""
        sc = self.jd.spark_checkpoint
        for d in ("offsets", "commits", "sources/0"):
            (sc / d).mkdir(parents=True, exist_ok=True)
        (sc / "metadata").write_text('{"id":"query-id"}')
        for d, n in (("offsets", b), ("offsets", b + 1), ("commits", b), ("sources/0", b)):
            (sc / d / str(n)).write_text(f"v1\n{d} {n}")
            (sc / d / f".{n}.crc").write_bytes(b"crc")


def random_value(rng: random.Random, key_columns: tuple[tuple[str, pa.DataType], ...]) -> dict[str, Any]:
    v: dict[str, Any] = {
        "total": rng.choice([None, rng.randint(-10**12, 10**12)]),
        "recent": rng.choice([None, [], [rng.randint(0, 99) for _ in range(rng.randint(1, 4))]]),
        "parity": rng.choice([None, {}, {"even": rng.randint(0, 9), "odd": rng.randint(0, 9)}]),
    }
    if all(x is None for x in v.values()):
        v["total"] = 0
    return v


def make_key(i: int, key_columns: tuple[tuple[str, pa.DataType], ...]) -> Key:
    return (f"u{i}",) if len(key_columns) == 1 else (f"u{i % 23}", i // 23)


def run_sim(path: Path | str, final_p: int, key_columns: tuple[tuple[str, pa.DataType], ...] = SINGLE_KEY, seed: int = 0, keys: int = 120) -> SimJob:
    """Five batches: snapshots at P=3, deltas, a rescale to ``final_p``, deletes, partial compaction."""
    rng = random.Random(seed)
    job = SimJob(path, key_columns)
    pool = [make_key(i, key_columns) for i in range(keys)]

    def updates(n: int, deletes: int) -> dict[Key, dict[str, Any] | None]:
        out: dict[Key, dict[str, Any] | None] = {k: random_value(rng, key_columns) for k in rng.sample(pool, n)}
        for k in rng.sample(sorted(job.state), min(deletes, len(job.state))):
            out[k] = None
        return out

    job.commit(updates(keys // 2, 0), 3, snapshot=range(3))
    job.commit(updates(keys // 4, 5), 3)
    job.commit(updates(keys // 4, 5), final_p)
    job.commit(updates(keys // 4, 5), final_p, snapshot=[0])
    job.commit(updates(keys // 5, 3), final_p)
    return job


def normalize(states: Sequence[StateDescriptor], row: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for s in states:
        v = row.get(s.name)
        if s.kind == "map" and isinstance(v, list):
            v = dict(v)
        out[s.name] = v
    return out


def state_of(jd_path: Path | Store, op: OperatorCheckpoint, key_columns: tuple[tuple[str, pa.DataType], ...], states: Sequence[StateDescriptor]) -> dict[Key, dict[str, Any]]:
    """Every key's state, each key group rebuilt alone from its ``restore_chain``."""
    out: dict[Key, dict[str, Any]] = {}
    names = [k for k, _ in key_columns]
    for kg in range(op.max_parallelism):
        t = KeyedStateTable(names, [t for _, t in key_columns], states)
        for f in restore_chain(op.files, kg):
            t.apply(read_state_slice(jd_path, f, KeyGroupRange(kg, kg), verify=True))
        t.compact()
        for row in t.to_arrow().to_pylist():
            assert row[KG_COLUMN] == kg
            key = tuple(row[n] for n in names)
            assert key not in out
            out[key] = normalize(states, row)
    return out


def expected(job: SimJob, states: Sequence[StateDescriptor] = STATES) -> dict[Key, dict[str, Any]]:
    return {k: normalize(states, v) for k, v in job.state.items()}


def new_job_dir(path: Path | str, m: int = M, name: str = "job") -> JobDir:
    jd = JobDir(path)
    jd.claim(name, m, m)
    return jd


# -- round trip -------------------------------------------------------------------------------


@pytest.mark.parametrize("key_columns", [SINGLE_KEY, MULTI_KEY], ids=["key", "two-keys"])
@pytest.mark.parametrize("p", [1, 2, 16])
def test_round_trip_through_a_moved_savepoint(tmp_path: Path, p: int, key_columns: tuple[tuple[str, pa.DataType], ...]) -> None:
    job = run_sim(tmp_path / "job", p, key_columns)
    assert job.manifest is not None
    op = job.manifest.operators[UID]
    assert state_of(job.jd.path, op, key_columns, STATES) == expected(job)  # the simulation is right

    calls: list[tuple[str, int, int]] = []
    sp = Path(write_savepoint(job.jd, job.manifest, tmp_path / "sp", progress=lambda *a: calls.append(a), rows_per_file=15))
    assert sp == (tmp_path / "sp").absolute()  # a local savepoint's location is its path
    assert calls[0][1] == 0 and calls[-1][1] == calls[-1][2] and len(calls) > 3
    moved = tmp_path / "elsewhere" / "deeper" / "sp-moved"
    moved.parent.mkdir(parents=True)
    shutil.move(str(sp), moved)
    shutil.rmtree(job.jd.path)  # self-contained: nothing of the job is needed any more

    info = read_savepoint(moved)
    assert (info.job, info.batch, info.batch_time_ms, info.watermark_ms, info.origin) == ("job", 4, 1004, 504, "checkpoint")
    sop = info.operators[UID]
    assert (sop.max_parallelism, sop.parallelism, sop.key_columns, sop.states) == (M, p, key_columns, STATES)
    assert sop.rows == len(job.state) and len(sop.files) > 1

    for new_p in (1, 2, M):
        target = new_job_dir(tmp_path / f"restored-{new_p}")
        spec = OperatorSpec(key_columns, STATES)
        m = restore_savepoint(moved, target, "job", {UID: spec})
        assert (m.job, m.batch, m.batch_time_ms, m.watermark_ms) == ("job", 4, 1004, 504)
        assert target.latest_manifest() == m
        rop = m.operators[UID]
        assert rop.parallelism == p  # as the savepoint recorded; the driver sets its own
        assert rop.key_columns == tuple((n, str(t)) for n, t in key_columns)
        assert rop.states == tuple(d.to_json() for d in STATES)
        assert all(f.kind == "snapshot" and f.batch == 4 for f in rop.files)
        assert state_of(target.path, rop, key_columns, STATES) == expected(job)
        # each subtask's range at the new parallelism holds exactly its keys
        for s in range(new_p):
            rng = key_group_range(s, M, new_p)
            t = KeyedStateTable([k for k, _ in key_columns], [t for _, t in key_columns], STATES)
            for f in rop.files:
                t.apply(read_state_slice(target.path, f, rng))
            assert len(t) == sum(1 for k in job.state if job.kg(k) in rng)


def test_savepoint_layout_and_metadata(tmp_path: Path) -> None:
    job = run_sim(tmp_path / "job", 2, MULTI_KEY)
    assert job.manifest is not None
    sp = Path(write_savepoint(job.jd, job.manifest, tmp_path / "sp", rows_per_file=20))
    meta = json.loads((sp / METADATA_FILE).read_text())
    assert meta["format"] == "keyscale-savepoint" and meta["format_version"] == 1
    assert (meta["job"], meta["batch"], meta["source"]) == ("job", 4, "source/spark")
    op = meta["operators"][UID]
    assert op["key_columns"] == [{"name": "user", "type": "string", "spark_type": "string"}, {"name": "shard", "type": "int64", "spark_type": "long"}]
    assert [(s["name"], s["kind"], s["type"], s["spark_type"]) for s in op["states"]] == [
        ("total", "value", "int64", "long"),
        ("recent", "list", "list<item: int64>", "array<long>"),
        ("parity", "map", "map<string, int64>", "map<string,long>"),
    ]
    text = (sp / METADATA_FILE).read_text()
    assert str(tmp_path) not in text  # relocatable: no absolute path anywhere
    seen: list[tuple[Any, ...]] = []
    for f in op["files"]:
        assert not Path(f["path"]).is_absolute() and f["path"] == f"operators/{UID}/kg-{f['start']}-{f['end']}.parquet"
        t = pq.read_table(sp / f["path"])
        assert t.column_names == ["user", "shard", "key_group", "total", "recent", "parity"]
        assert t.schema.field("key_group").type == pa.int32()
        rows = t.to_pylist()
        assert len(rows) == f["rows"] and rows
        order = [(r["key_group"], r["user"], r["shard"]) for r in rows]
        assert order == sorted(order)
        assert all(f["start"] <= r["key_group"] <= f["end"] for r in rows)
        assert all(any(r[s] is not None for s in ("total", "recent", "parity")) for r in rows)
        seen.extend((r["user"], r["shard"]) for r in rows)
    assert sorted(seen) == sorted(job.state)
    starts = [f["start"] for f in op["files"]]
    assert starts == sorted(starts)
    # Spark's checkpoint without the batch log after the savepoint's batch
    src = sp / "source" / "spark"
    assert sorted(p.name for p in (src / "offsets").iterdir()) == sorted([*(str(i) for i in range(5)), *(f".{i}.crc" for i in range(5))])
    assert sorted(p.name for p in (src / "commits").iterdir()) == sorted([*(str(i) for i in range(5)), *(f".{i}.crc" for i in range(5))])
    assert (src / "metadata").read_text() == '{"id":"query-id"}'
    assert (src / "sources" / "0" / "4").exists()


def test_savepoint_content_does_not_depend_on_parallelism(tmp_path: Path) -> None:
    tables = []
    for p in (1, 2, 5, 16):
        job = run_sim(tmp_path / f"job{p}", p, seed=7)
        assert job.manifest is not None
        sp = Path(write_savepoint(job.jd, job.manifest, tmp_path / f"sp{p}"))
        info = read_savepoint(sp)
        tables.append(pa.concat_tables([pq.read_table(sp / f.path) for f in info.operators[UID].files]))
    assert all(t.equals(tables[0]) for t in tables[1:])


def test_no_half_written_savepoint(tmp_path: Path) -> None:
    job = run_sim(tmp_path / "job", 2)
    assert job.manifest is not None
    victim = job.manifest.operators[UID].files[-1]
    (job.jd.path / victim.path).write_bytes(b"garbage")
    with pytest.raises(StateError, match=f"checkpoint 4: operator '{UID}'.*{Path(victim.path).name}"):
        write_savepoint(job.jd, job.manifest, tmp_path / "sp")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job"]  # no savepoint, no temp folder


def test_existing_destination_refused(tmp_path: Path) -> None:
    job = run_sim(tmp_path / "job", 2)
    assert job.manifest is not None
    (tmp_path / "empty").mkdir()
    write_savepoint(job.jd, job.manifest, tmp_path / "empty")  # an empty folder is fine
    meta = (tmp_path / "empty" / METADATA_FILE).read_bytes()
    with pytest.raises(StateError, match=r"already holds a savepoint.*never overwritten"):
        write_savepoint(job.jd, job.manifest, tmp_path / "empty")
    assert (tmp_path / "empty" / METADATA_FILE).read_bytes() == meta
    read_savepoint(tmp_path / "empty")  # untouched and intact
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(StateError, match=r"exists and is not empty.*notes\.txt"):
        write_savepoint(job.jd, job.manifest, tmp_path / "other")
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"
    (tmp_path / "file").write_text("x")
    with pytest.raises(StateError, match="is a file"):
        write_savepoint(job.jd, job.manifest, tmp_path / "file")


def test_savepoint_of_an_empty_operator(tmp_path: Path) -> None:
    job = SimJob(tmp_path / "job")
    job.commit({}, 2)
    assert job.manifest is not None
    sp = Path(write_savepoint(job.jd, job.manifest, tmp_path / "sp"))
    assert read_savepoint(sp).operators[UID].files == ()
    target = new_job_dir(tmp_path / "new")
    m = restore_savepoint(sp, target, "job", {UID: OperatorSpec(SINGLE_KEY, STATES)})
    assert m.operators[UID].files == () and m.batch == 0


# -- damaged savepoints -----------------------------------------------------------------------


@pytest.fixture
def savepoint(tmp_path: Path) -> tuple[Path, SimJob]:
    job = run_sim(tmp_path / "job", 2)
    assert job.manifest is not None
    return Path(write_savepoint(job.jd, job.manifest, tmp_path / "sp", rows_per_file=20)), job


def _restore(sp: Path, tmp_path: Path, name: str = "new", **kw: Any) -> Manifest:
    return restore_savepoint(sp, new_job_dir(tmp_path / name), "job", {UID: OperatorSpec(SINGLE_KEY, STATES)}, **kw)


def test_missing_data_file_named(savepoint: tuple[Path, SimJob], tmp_path: Path) -> None:
    sp, _ = savepoint
    f = read_savepoint(sp).operators[UID].files[1]
    (sp / f.path).unlink()
    for call in (lambda: read_savepoint(sp), lambda: _restore(sp, tmp_path)):
        with pytest.raises(StateError, match=f"{f.path}.*is missing"):
            call()
    assert not list((tmp_path / "new" / "state").rglob("*.arrow"))
    assert (tmp_path / "new").exists() and not JobDir(tmp_path / "new").manifest_batches()


def test_corrupted_data_file_named(savepoint: tuple[Path, SimJob], tmp_path: Path) -> None:
    sp, _ = savepoint
    f = read_savepoint(sp).operators[UID].files[0]
    data = bytearray((sp / f.path).read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, other bytes
    (sp / f.path).write_bytes(bytes(data))
    with pytest.raises(StateError, match=f"{f.path}.*sha256"):
        _restore(sp, tmp_path)
    read_savepoint(sp, verify=False)  # sizes still match
    (sp / f.path).write_bytes(b"short")
    with pytest.raises(StateError, match=f"{f.path}.*5 bytes"):
        read_savepoint(sp, verify=False)


def test_bad_metadata(savepoint: tuple[Path, SimJob], tmp_path: Path) -> None:
    sp, _ = savepoint
    meta = sp / METADATA_FILE
    good = meta.read_text()
    meta.write_text(good[: len(good) // 2])
    with pytest.raises(StateError, match=f"{meta}.*not valid JSON"):
        _restore(sp, tmp_path)
    d = json.loads(good)
    del d["operators"][UID]["key_columns"]
    meta.write_text(json.dumps(d))
    with pytest.raises(StateError, match=r"missing or has a bad field.*key_columns"):
        read_savepoint(sp)
    meta.unlink()
    with pytest.raises(StateError, match=f"not a keyscale savepoint: {meta} is missing"):
        read_savepoint(sp)
    with pytest.raises(StateError, match="does not exist"):
        read_savepoint(tmp_path / "nope")


def test_missing_source_folder_named(savepoint: tuple[Path, SimJob]) -> None:
    sp, _ = savepoint
    shutil.rmtree(sp / "source")
    with pytest.raises(StateError, match=r"source positions folder .*source/spark is missing"):
        read_savepoint(sp)


def test_escaping_paths_refused(savepoint: tuple[Path, SimJob]) -> None:
    sp, _ = savepoint
    d = json.loads((sp / METADATA_FILE).read_text())
    d["operators"][UID]["files"][0]["path"] = "../../etc/passwd"
    (sp / METADATA_FILE).write_text(json.dumps(d))
    with pytest.raises(StateError, match="not relative to the savepoint"):
        read_savepoint(sp)


# -- restore rules ----------------------------------------------------------------------------


def test_restore_needs_a_new_claimed_job_dir(savepoint: tuple[Path, SimJob], tmp_path: Path) -> None:
    sp, job = savepoint
    spec = {UID: OperatorSpec(SINGLE_KEY, STATES)}
    with pytest.raises(JobDirError, match="claim it"):
        restore_savepoint(sp, JobDir(tmp_path / "unclaimed"), "job", spec)
    with pytest.raises(JobDirError, match="already has checkpoints"):
        restore_savepoint(sp, job.jd, "job", spec)
    jd = new_job_dir(tmp_path / "with-spark")
    (jd.spark_checkpoint / "offsets").mkdir(parents=True)
    with pytest.raises(JobDirError, match="already has a Spark checkpoint"):
        restore_savepoint(sp, jd, "job", spec)


def test_restore_copies_spark_checkpoint(savepoint: tuple[Path, SimJob], tmp_path: Path) -> None:
    sp, _ = savepoint
    m = _restore(sp, tmp_path)
    sc = JobDir(tmp_path / "new").spark_checkpoint
    assert sorted(int(p.name) for p in (sc / "offsets").iterdir() if p.name.isdigit()) == list(range(m.batch + 1))
    assert sorted(int(p.name) for p in (sc / "commits").iterdir() if p.name.isdigit()) == list(range(m.batch + 1))
    assert (sc / "metadata").exists()


def test_non_restored_state(savepoint: tuple[Path, SimJob], tmp_path: Path) -> None:
    sp, _ = savepoint
    other = OperatorSpec((("k", pa.int64()),), (StateDescriptor("n", "value", pa.int64()),))
    jd = new_job_dir(tmp_path / "new")
    # Both ways to say it: the CLI's flag and Pipeline.start's option.
    with pytest.raises(StateError, match=f"operator '{UID}'.*--allow-non-restored-state.*allow_non_restored_state=True"):
        restore_savepoint(sp, jd, "job", {"other": other})
    assert not jd.manifest_batches() and not jd.spark_checkpoint.exists()
    m = restore_savepoint(sp, jd, "job", {"other": other}, allow_non_restored_state=True)
    assert m.operators == {} and m.batch == 4  # the new operator starts empty
    assert jd.spark_checkpoint.exists()


def test_new_operator_starts_empty_next_to_restored_one(savepoint: tuple[Path, SimJob], tmp_path: Path) -> None:
    sp, job = savepoint
    other = OperatorSpec((("k", pa.int64()),), (StateDescriptor("n", "value", pa.int64()),))
    jd = new_job_dir(tmp_path / "new")
    m = restore_savepoint(sp, jd, "job", {UID: OperatorSpec(SINGLE_KEY, STATES), "added": other})
    assert set(m.operators) == {UID}
    assert state_of(jd.path, m.operators[UID], SINGLE_KEY, STATES) == expected(job)


@pytest.mark.parametrize(
    ("keys", "pattern"),
    [
        ((("user", pa.int64()),), r"keyed by \[user string\], the job keys it by \[user long\] \(key column 1: savepoint 'user' string, job 'user' long\)"),
        ((("name", pa.string()),), r"key column 1: savepoint 'user' string, job 'name' string"),
        ((("user", pa.string()), ("x", pa.int32())), r"key column 2: savepoint none, job 'x' int"),
    ],
)
def test_key_column_mismatch(savepoint: tuple[Path, SimJob], tmp_path: Path, keys: tuple[tuple[str, pa.DataType], ...], pattern: str) -> None:
    sp, _ = savepoint
    with pytest.raises(StateError, match=f"operator '{UID}'.*{pattern}"):
        restore_savepoint(sp, new_job_dir(tmp_path / "new"), "job", {UID: OperatorSpec(keys, STATES)})


def test_max_parallelism_must_match(savepoint: tuple[Path, SimJob], tmp_path: Path) -> None:
    sp, _ = savepoint
    with pytest.raises(StateError, match=f"operator '{UID}'.*max parallelism 16.*has 32.*re-key"):
        restore_savepoint(sp, new_job_dir(tmp_path / "new", m=32), "job", {UID: OperatorSpec(SINGLE_KEY, STATES)})


# -- schema evolution -------------------------------------------------------------------------


def _narrow_job(tmp_path: Path) -> tuple[SimJob, Path]:
    """A job with int32 / float32 / struct / list<int32> / map<string,int32> states."""
    states = (
        StateDescriptor("count", "value", pa.int32()),
        StateDescriptor("ratio", "value", pa.float32()),
        StateDescriptor("small", "value", pa.int8()),
        StateDescriptor("info", "value", pa.struct([("a", pa.int32()), ("b", pa.string())])),
        StateDescriptor("hist", "list", pa.int32()),
        StateDescriptor("by", "map", pa.int32(), pa.string()),
        StateDescriptor("gone", "value", pa.string()),
    )
    job = SimJob(tmp_path / "job", SINGLE_KEY, states)
    rng = random.Random(3)
    ups: dict[Key, dict[str, Any] | None] = {}
    for i in range(40):
        ups[(f"u{i}",)] = {
            "count": rng.choice([None, rng.randint(-(2**31), 2**31 - 1)]),
            "ratio": rng.choice([None, 0.5, -1.25, 3.0]),
            "small": rng.choice([None, -128, 127, 5]),
            "info": rng.choice([None, {"a": rng.randint(0, 9), "b": f"x{i}"}, {"a": None, "b": None}]),
            "hist": rng.choice([None, [], [rng.randint(0, 9), None]]),
            "by": rng.choice([None, {"k": rng.randint(0, 9)}]),
            "gone": "only this" if i < 5 else None,
        }
    ups[("only-gone",)] = {"count": None, "ratio": None, "small": None, "info": None, "hist": None, "by": None, "gone": "bye"}
    job.commit(ups, 2, snapshot=range(2))
    assert job.manifest is not None
    return job, Path(write_savepoint(job.jd, job.manifest, tmp_path / "sp"))


def test_schema_evolution_add_drop_widen(tmp_path: Path) -> None:
    job, sp = _narrow_job(tmp_path)
    new_states = (
        StateDescriptor("count", "value", pa.int64()),  # int -> long
        StateDescriptor("ratio", "value", pa.float64()),  # float -> double
        StateDescriptor("small", "value", pa.float64()),  # byte -> double
        StateDescriptor("info", "value", pa.struct([("a", pa.int64()), ("c", pa.float64())])),  # widen a, drop b, add c
        StateDescriptor("hist", "list", pa.int64()),  # list<int> -> list<long>
        StateDescriptor("by", "map", pa.float64(), pa.string()),  # map values int -> double
        StateDescriptor("added", "value", pa.string()),  # new: absent everywhere
    )  # "gone" is dropped
    jd = new_job_dir(tmp_path / "new")
    m = restore_savepoint(sp, jd, "job", {UID: OperatorSpec(SINGLE_KEY, new_states)})
    assert m.operators[UID].states == tuple(d.to_json() for d in new_states)
    got = state_of(jd.path, m.operators[UID], SINGLE_KEY, new_states)
    want: dict[Key, dict[str, Any]] = {}
    for k, v in job.state.items():
        info = v["info"]
        row = {
            "count": v["count"],
            "ratio": v["ratio"],
            "small": float(v["small"]) if v["small"] is not None else None,
            "info": {"a": info["a"], "c": None} if info is not None else None,
            "hist": v["hist"],
            "by": {kk: float(vv) for kk, vv in v["by"].items()} if v["by"] is not None else None,
            "added": None,
        }
        if any(x is not None for x in row.values()):  # a key that only had "gone" disappears
            want[k] = row
    assert ("only-gone",) in job.state and ("only-gone",) not in want
    assert got == want
    for f in m.operators[UID].files:  # the restored files have the new job's exact schema
        schema = read_state_slice(jd.path, f, f.range).schema
        assert [str(schema.field(d.name).type) for d in new_states] == [str(d.column_type) for d in new_states]


@pytest.mark.parametrize(
    ("new", "pattern"),
    [
        (StateDescriptor("count", "value", pa.string()), r"state 'count': saved as int \(int32\), the job declares string: int32 cannot become string"),
        (StateDescriptor("gone", "value", pa.int64()), r"state 'gone': saved as string, the job declares long \(int64\)"),
        (StateDescriptor("count", "value", pa.int16()), r"state 'count': .*int32 cannot become int16"),
        (StateDescriptor("count", "list", pa.int32()), r"state 'count': the savepoint has a value state of int \(int32\), the job declares a list state of array<int>"),
        (StateDescriptor("info", "value", pa.struct([("a", pa.string())])), r"state 'info': .*field 'a': int32 cannot become string"),
        (StateDescriptor("hist", "list", pa.string()), r"state 'hist': .*element: int32 cannot become string"),
        (StateDescriptor("by", "map", pa.int32(), pa.int64()), r"state 'by': .*map key: string cannot become int64"),
    ],
)
def test_incompatible_schema_change(tmp_path: Path, new: StateDescriptor, pattern: str) -> None:
    _, sp = _narrow_job(tmp_path)
    jd = new_job_dir(tmp_path / "new")
    with pytest.raises(StateError, match=f"operator '{UID}', {pattern}"):
        restore_savepoint(sp, jd, "job", {UID: OperatorSpec(SINGLE_KEY, (new,))})
    assert not list(jd.path.rglob("*.arrow")) and not jd.manifest_batches()  # nothing written


def test_evolution_rules() -> None:
    ok: list[tuple[pa.DataType, pa.DataType]] = [
        (pa.int8(), pa.int16()), (pa.int16(), pa.int32()), (pa.int32(), pa.int64()), (pa.int8(), pa.int64()),
        (pa.float32(), pa.float64()), (pa.int64(), pa.float64()), (pa.int16(), pa.float32()), (pa.uint16(), pa.int32()),
        (pa.list_(pa.int32()), pa.list_(pa.int64())), (pa.map_(pa.string(), pa.int32()), pa.map_(pa.string(), pa.int64())),
        (pa.struct([("a", pa.int32())]), pa.struct([("b", pa.string())])),
    ]
    bad: list[tuple[pa.DataType, pa.DataType]] = [
        (pa.int64(), pa.int32()), (pa.float64(), pa.float32()), (pa.int32(), pa.float32()), (pa.float64(), pa.int64()),
        (pa.string(), pa.int64()), (pa.int64(), pa.string()), (pa.int32(), pa.uint32()), (pa.list_(pa.int64()), pa.int64()),
        (pa.bool_(), pa.int32()), (pa.timestamp("us", tz="UTC"), pa.int64()),
    ]
    assert [evolution_problem(a, b) for a, b in ok] == [None] * len(ok)
    assert all(evolution_problem(a, b) for a, b in bad)


# -- bootstrapped savepoints (no source) ------------------------------------------------------


def test_savepoint_without_source_restores_before_the_first_batch(savepoint: tuple[Path, SimJob], tmp_path: Path) -> None:
    sp, job = savepoint
    shutil.rmtree(sp / "source")
    meta = json.loads((sp / METADATA_FILE).read_text())
    meta["source"] = None
    (sp / METADATA_FILE).write_text(json.dumps(meta))
    jd = new_job_dir(tmp_path / "new")
    m = restore_savepoint(sp, jd, "job", {UID: OperatorSpec(SINGLE_KEY, STATES)})
    assert m.batch == -1 and not jd.spark_checkpoint.exists()  # Spark starts at batch 0
    assert jd.read_manifest(-1) == m
    files = m.operators[UID].files
    assert all(f.batch == -1 and f.kind == "snapshot" for f in files)
    # disjoint snapshots: reading each file's range is the whole state (as a task's first load does)
    t = KeyedStateTable(["user"], [pa.string()], STATES)
    for f in files:
        t.apply(read_state_slice(jd.path, f, f.range, verify=True))
    got = {(r["user"],): normalize(STATES, r) for r in t.to_arrow().to_pylist()}
    assert got == expected(job)


def test_restore_chain_sees_batch_minus_one(savepoint: tuple[Path, SimJob], tmp_path: Path) -> None:
    sp, job = savepoint
    shutil.rmtree(sp / "source")
    meta = json.loads((sp / METADATA_FILE).read_text())
    meta["source"] = None
    (sp / METADATA_FILE).write_text(json.dumps(meta))
    m = restore_savepoint(sp, new_job_dir(tmp_path / "new"), "job", {UID: OperatorSpec(SINGLE_KEY, STATES)})
    assert state_of(tmp_path / "new", m.operators[UID], SINGLE_KEY, STATES) == expected(job)


def test_restored_bootstrap_checkpoint_survives_a_restart(savepoint: tuple[Path, SimJob], tmp_path: Path) -> None:
    sp, _ = savepoint
    shutil.rmtree(sp / "source")
    meta = json.loads((sp / METADATA_FILE).read_text())
    meta["source"] = None
    (sp / METADATA_FILE).write_text(json.dumps(meta))
    jd = new_job_dir(tmp_path / "new")
    m = restore_savepoint(sp, jd, "job", {UID: OperatorSpec(SINGLE_KEY, STATES)})
    assert JobDir(jd.path).recover().manifest == m


# -- helpers ----------------------------------------------------------------------------------


def test_arrow_type_strings_round_trip() -> None:
    types = [
        pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.uint64(), pa.float32(), pa.float64(), pa.bool_(),
        pa.string(), pa.large_string(), pa.binary(), pa.date32(), pa.timestamp("us", tz="UTC"), pa.timestamp("ms"),
        pa.decimal128(12, 3), pa.list_(pa.int64()), pa.large_list(pa.string()), pa.map_(pa.string(), pa.list_(pa.float64())),
        pa.struct([("a", pa.int32()), ("b", pa.map_(pa.int64(), pa.string())), ("c", pa.struct([("d", pa.bool_())]))]),
        pa.duration("s"), pa.time64("us"),
    ]
    for t in types:
        assert parse_arrow_type(str(t)) == t, t
    with pytest.raises(StateError, match="cannot read the Arrow type"):
        parse_arrow_type("whatever<")


def test_chunk_ranges_cover_every_row_once() -> None:
    rng = np.random.default_rng(1)
    for _ in range(50):
        rows = rng.integers(0, 5, size=int(rng.integers(1, 64))) * (rng.random(1) < 0.9)
        target = int(rng.integers(1, 20))
        ranges = chunk_ranges(rows, target)
        covered = np.zeros(len(rows), dtype=int)
        for r in ranges:
            covered[r.start : r.end + 1] += 1
            assert rows[r.start] > 0 and rows[r.end] > 0
            assert rows[r.start : r.end + 1].sum() <= target or r.start == r.end or rows[r.start : r.end].sum() <= target
        assert np.all(covered[rows > 0] == 1) and np.all(covered <= 1)
        assert [r.start for r in ranges] == sorted(r.start for r in ranges)


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_text_progress() -> None:
    out = io.StringIO()
    p = text_progress("savepoint", out, delay=0)
    for i in range(21):
        p("files", i, 20)
    lines = out.getvalue().splitlines()
    assert lines == [f"savepoint: files {2 * d}/20 ({d * 10}%)" for d in range(1, 11)]
    tty = _Tty()
    p = text_progress("restore", tty, delay=0)
    for i in range(4):
        p("files", i, 3)
    text = tty.getvalue()
    assert text.count("\r") == 3 and text.endswith("3/3 (100%)\n") and text.count("\n") == 1
    quiet = io.StringIO()
    p = text_progress("quick", quiet)  # finishes within the delay: shows nothing
    for i in range(3):
        p("files", i, 2)
    assert quiet.getvalue() == ""


def test_documented_pyarrow_reader_runs(savepoint: tuple[Path, SimJob], tmp_path: Path) -> None:
    """docs/savepoint-format.md's pyarrow-only example reads a real savepoint."""
    import re
    import subprocess
    import sys

    doc = (Path(__file__).resolve().parents[2] / "docs" / "savepoint-format.md").read_text()
    code = re.findall(r"```python\n(.*?)```", doc, re.S)[0]
    script = tmp_path / "read_savepoint.py"
    script.write_text(code)
    sp, job = savepoint
    out = subprocess.run([sys.executable, str(script), str(sp), UID], capture_output=True, text=True, timeout=120, check=True).stdout
    assert f"operator {UID}: M=16, keys [user string]" in out and f"{len(job.state)} keys" in out
    assert "recent [{'user'" in out and "parity [{'user'" in out


# -- savepoints on object stores, and across stores -------------------------------------------
#
# The same protocol on every store: a job directory and a savepoint may each be local or on
# S3 (SeaweedFS, the ``s3_bucket`` fixture), in any mix; the S3 cases are marked ``s3``.


@pytest.fixture
def at(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """``at(kind, name)``: a fresh location named ``name``, local or on S3."""
    monkeypatch.setenv("KEYSCALE_SPARK_CACHE", str(tmp_path / "spark-cache"))  # a remote job's local Spark folder
    bucket: list[str] = []

    def where(kind: str, name: str) -> Path | str:
        if kind == "local":
            return tmp_path / name
        if not bucket:
            bucket.append(request.getfixturevalue("s3_bucket"))  # only for tests marked s3
        return f"{bucket[0]}/{name}"

    return where


@pytest.mark.parametrize(
    ("job_kind", "sp_kind", "new_kind"),
    [pytest.param(*kinds, marks=pytest.mark.s3) for kinds in
     [("s3", "s3", "s3"), ("s3", "local", "local"), ("local", "s3", "s3"), ("s3", "s3", "local"), ("local", "s3", "local")]],
)
def test_savepoint_across_stores(at: Any, job_kind: str, sp_kind: str, new_kind: str) -> None:
    job = run_sim(at(job_kind, "job"), 3)
    assert job.manifest is not None
    sp = write_savepoint(job.jd, job.manifest, at(sp_kind, "sp"), rows_per_file=15)
    assert sp == open_store(at(sp_kind, "sp"), "savepoint").url()  # a path on local disk, else the URI
    job.jd.remove()  # self-contained: nothing of the job is needed any more
    info = read_savepoint(sp)
    assert (info.job, info.batch, info.source, info.operators[UID].rows) == ("job", 4, "source/spark", len(job.state))
    sp_store = open_store(sp, "savepoint")
    assert {o.key.split("/")[0] for o in sp_store.list()} == {METADATA_FILE, "operators", "source"}
    assert sp_store.exists("source/spark/offsets/4") and not sp_store.exists("source/spark/offsets/5")

    target = new_job_dir(at(new_kind, "restored"))
    if new_kind == "s3":
        target.lock()  # as the driver does: the restore commits under this run's epoch
    m = restore_savepoint(sp, target, "job", {UID: OperatorSpec(SINGLE_KEY, STATES)})
    assert m.batch == 4 and JobDir(target.store).latest_manifest() == m
    assert state_of(target.store, m.operators[UID], SINGLE_KEY, STATES) == expected(job)
    for new_p in (1, 5):  # each subtask's range at a new parallelism holds exactly its keys
        for s in range(new_p):
            rng = key_group_range(s, M, new_p)
            t = KeyedStateTable(["user"], [pa.string()], STATES)
            for f in m.operators[UID].files:
                t.apply(read_state_slice(target.store, f, rng))
            assert len(t) == sum(1 for k in job.state if job.kg(k) in rng)
    # Spark's checkpoint: in the new job's local folder; for a job directory on S3 also in it
    sc = target.spark_checkpoint
    assert sorted(int(p.name) for p in (sc / "offsets").iterdir() if p.name.isdigit()) == list(range(5))
    if new_kind == "s3":
        assert target.store.list_names("spark") == [f"bundle-000000000004-e{target.epoch:010d}.json"]
        assert not (sc.parent / "state").exists()  # nothing of the job directory went to local disk


@pytest.mark.parametrize("kind", ["local", pytest.param("s3", marks=pytest.mark.s3)])
def test_interrupted_savepoint_is_written_again(at: Any, kind: str) -> None:
    job = run_sim(at("local", "job"), 2)
    assert job.manifest is not None
    dest = at(kind, "sp")
    sp = write_savepoint(job.jd, job.manifest, dest, rows_per_file=20)
    store = open_store(sp, "savepoint")
    complete = {o.key: store.get(o.key) for o in store.list()}
    # a crash before the metadata: data files (one of another attempt's ranges) and no metadata
    store.delete(METADATA_FILE)
    store.put(f"operators/{UID}/kg-999-999.parquet", b"left by a crashed attempt")
    with pytest.raises(StateError, match="is not a keyscale savepoint"):
        read_savepoint(sp)
    again = write_savepoint(job.jd, job.manifest, dest, rows_per_file=20)
    assert again == sp
    info = read_savepoint(sp)
    assert {o.key for o in store.list()} == set(complete)  # the stray file is gone
    assert {f.path for f in info.operators[UID].files} == {k for k in complete if k.startswith("operators/")}
    assert all(store.get(k) == v for k, v in complete.items() if k != METADATA_FILE)  # canonical: same bytes


@pytest.mark.parametrize("kind", ["local", pytest.param("s3", marks=pytest.mark.s3)])
def test_complete_savepoint_is_never_overwritten(at: Any, kind: str) -> None:
    job = run_sim(at("local", "job"), 2)
    assert job.manifest is not None
    sp = write_savepoint(job.jd, job.manifest, at(kind, "sp"))
    store = open_store(sp, "savepoint")
    before = {o.key: store.get(o.key) for o in store.list()}
    later = job.commit({make_key(1, SINGLE_KEY): {"total": 7}}, 2)
    with pytest.raises(StateError, match=f"{METADATA_FILE}.*never overwritten"):
        write_savepoint(job.jd, later, sp)
    assert {o.key: store.get(o.key) for o in store.list()} == before
    assert read_savepoint(sp).batch == 4


@pytest.mark.parametrize("kind", ["local", pytest.param("s3", marks=pytest.mark.s3)])
def test_failed_savepoint_leaves_nothing(at: Any, kind: str) -> None:
    job = run_sim(at(kind, "job"), 2)
    assert job.manifest is not None
    victim = job.manifest.operators[UID].files[-1]
    job.jd.store.put(victim.path, b"garbage")
    with pytest.raises(StateError, match=f"checkpoint 4: operator '{UID}'.*{Path(victim.path).name}"):
        write_savepoint(job.jd, job.manifest, at(kind, "sp"))
    assert not open_store(at(kind, "sp"), "savepoint").list()


@pytest.mark.parametrize("kind", ["local", pytest.param("s3", marks=pytest.mark.s3)])
def test_damaged_savepoint_on_a_store_names_the_file(at: Any, kind: str) -> None:
    job = run_sim(at("local", "job"), 2)
    assert job.manifest is not None
    sp = write_savepoint(job.jd, job.manifest, at(kind, "sp"), rows_per_file=20)
    store = open_store(sp, "savepoint")
    f = read_savepoint(sp).operators[UID].files[0]
    data = bytearray(store.get(f.path))
    data[len(data) // 2] ^= 0xFF
    store.put(f.path, bytes(data))
    with pytest.raises(StateError, match=f"{store.url(f.path)}.*sha256"):
        restore_savepoint(sp, new_job_dir(at("local", "new")), "job", {UID: OperatorSpec(SINGLE_KEY, STATES)})
    store.delete(f.path)
    with pytest.raises(StateError, match=f"{store.url(f.path)}.*is missing"):
        read_savepoint(sp, verify=False)
    with pytest.raises(StateError, match="does not exist"):
        read_savepoint(at(kind, "nothing-here"))


@pytest.mark.s3
def test_inspect_on_s3(at: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from keyscale.cli.main import main as keyscale_main

    job = run_sim(at("s3", "job"), 2)
    assert job.manifest is not None
    sp = write_savepoint(job.jd, job.manifest, at("s3", "sp"), rows_per_file=20)
    assert isinstance(sp, str) and sp.startswith("s3://")
    assert keyscale_main(["inspect", sp]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"savepoint {sp}"
    assert f"operator '{UID}': max parallelism {M} (ran at parallelism 2)" in out
    assert out[-1].startswith("source positions: source/spark")


@pytest.mark.s3
@pytest.mark.parametrize("sp_kind", ["s3", "local"])
def test_cli_savepoint_of_a_stopped_job_on_s3(at: Any, sp_kind: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`keyscale savepoint` of a stopped job whose job directory is on S3, from a machine
    without its local Spark folder: the source positions come from the job directory."""
    from keyscale.checkpoint.sparkmirror import SparkMirror
    from keyscale.cli.main import main as keyscale_main

    job = run_sim(at("s3", "job"), 2)
    SparkMirror(job.jd.store, job.jd.spark_checkpoint).push(job.batch)  # as the running job did
    shutil.rmtree(job.jd.spark_checkpoint)  # another machine
    dest = at(sp_kind, "sp")
    assert keyscale_main(["savepoint", str(job.jd.uri), "--dest", str(dest)]) == 0
    sp = capsys.readouterr().out.strip()
    assert sp == str(dest)
    info = read_savepoint(sp)
    assert (info.batch, info.source, info.operators[UID].rows) == (4, "source/spark", len(job.state))
    assert open_store(sp, "savepoint").exists("source/spark/commits/4")
    assert keyscale_main(["savepoint", str(job.jd.uri)]) == 0  # default: inside the job directory
    default = capsys.readouterr().out.strip()
    assert default.startswith(f"{job.jd.uri}/savepoints/savepoint-000000000004-")
    assert read_savepoint(default).operators[UID].rows == len(job.state)
