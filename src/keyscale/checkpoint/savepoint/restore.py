"""Restoring a savepoint into a new job directory: operators matched by uid, key columns
checked, state schemas evolved (added, dropped and widened states)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from keyscale.checkpoint.drain import restored_event_time
from keyscale.checkpoint.encode import write_state_file
from keyscale.checkpoint.jobdir import JobDir
from keyscale.checkpoint.lineage import restored_lineage
from keyscale.checkpoint.manifest import Manifest, OperatorCheckpoint, StateFile
from keyscale.checkpoint.savepoint.format import (
    KEY_GROUP_COLUMN,
    Location,
    SavepointFile,
    SavepointInfo,
    SavepointOperator,
    read_data_file,
    read_savepoint,
)
from keyscale.checkpoint.savepoint.progress import Progress, report_progress
from keyscale.checkpoint.savepoint.schema import evolution_problem, evolve, spark_type_name
from keyscale.checkpoint.sparkmirror import FOLDER as MIRROR_FOLDER
from keyscale.checkpoint.sparkmirror import SparkMirror
from keyscale.errors import JobDirError, StateError
from keyscale.state.table import KG_COLUMN
from keyscale.state.types import StateDescriptor
from keyscale.storage import LocalStore

_PA: Any = pa


@dataclass(frozen=True)
class OperatorSpec:
    """What the new job declares for one keyed operator: its key columns and states."""

    key_columns: tuple[tuple[str, pa.DataType], ...]
    states: tuple[StateDescriptor, ...]


def _describe(t: pa.DataType) -> str:
    spark = spark_type_name(t)
    return str(t) if spark == str(t) else f"{spark} ({t})"


def _keys_text(keys: Sequence[tuple[str, pa.DataType]]) -> str:
    return ", ".join(f"{k} {spark_type_name(t)}" for k, t in keys) or "nothing"


def _check_keys(uid: str, op: SavepointOperator, spec: OperatorSpec) -> None:
    have, want = list(op.key_columns), list(spec.key_columns)
    same = len(have) == len(want) and all(a == c and b.equals(d) for (a, b), (c, d) in zip(have, want, strict=True))
    if same:
        return
    detail = ""
    for i in range(max(len(have), len(want))):
        h = have[i] if i < len(have) else None
        w = want[i] if i < len(want) else None
        if h is None or w is None or h[0] != w[0] or not h[1].equals(w[1]):
            hs = f"'{h[0]}' {spark_type_name(h[1])}" if h else "none"
            ws = f"'{w[0]}' {spark_type_name(w[1])}" if w else "none"
            detail = f" (key column {i + 1}: savepoint {hs}, job {ws})"
            break
    raise StateError(
        f"operator '{uid}': the savepoint's state is keyed by [{_keys_text(have)}], the job keys it by "
        f"[{_keys_text(want)}]{detail}; key columns and their types must match, because a key's key group "
        "depends on both (rewrite the state with the State Processor API to change the key)"
    )


def _check_evolution(uid: str, op: SavepointOperator, spec: OperatorSpec) -> None:
    old = {s.name: s for s in op.states}
    for d in spec.states:
        s = old.get(d.name)
        if s is None:
            continue  # a new state: absent for every key
        if s.kind != d.kind:
            raise StateError(
                f"operator '{uid}', state '{d.name}': the savepoint has a {s.kind} state of {_describe(s.column_type)}, "
                f"the job declares a {d.kind} state of {_describe(d.column_type)}; a state cannot change its kind "
                "(rename it to start it empty)"
            )
        problem = evolution_problem(s.column_type, d.column_type)
        if problem:
            raise StateError(
                f"operator '{uid}', state '{d.name}': saved as {_describe(s.column_type)}, the job declares "
                f"{_describe(d.column_type)}: {problem}; allowed changes are numeric widening (int -> long, "
                "float -> double, int/long -> double) and adding or dropping struct fields (rename the state to start it empty)"
            )


def _to_state_table(uid: str, op: SavepointOperator, spec: OperatorSpec, table: pa.Table, f: SavepointFile, where: str) -> pa.Table:
    """A savepoint data file as a checkpoint snapshot table of the new job's schema."""
    n = table.num_rows
    missing = [c for c in [*op.key_names, KEY_GROUP_COLUMN] if c not in table.column_names]
    if missing:
        raise StateError(f"savepoint data file {where} (operator '{uid}') has no column '{missing[0]}'")
    arrays: list[Any] = [table.column(k).cast(t) for k, t in spec.key_columns]
    names = [k for k, _ in spec.key_columns]
    kgs = table.column(KEY_GROUP_COLUMN).cast(pa.int32())
    arrays.append(kgs)
    names.append(KG_COLUMN)
    saved = {s.name for s in op.states}
    for d in spec.states:
        if d.name in saved and d.name in table.column_names:
            arrays.append(evolve(table.column(d.name), d.column_type))
        else:
            arrays.append(_PA.nulls(n, d.column_type))
        names.append(d.name)
    out = pa.Table.from_arrays(arrays, names=names)
    if n:
        kg = kgs.to_numpy()
        if int(kg.min()) < f.start or int(kg.max()) > f.end:
            raise StateError(f"savepoint data file {where} (operator '{uid}') has key groups outside its range {f.start}-{f.end}")
        if np.any(np.diff(kg) < 0):
            out = out.sort_by([(KG_COLUMN, "ascending")])
    if spec.states and n:
        alive = np.zeros(n, dtype=bool)
        for d in spec.states:
            alive |= np.asarray(out.column(d.name).is_valid().to_numpy(zero_copy_only=False), dtype=bool)
        if not alive.all():  # keys whose only state was dropped no longer exist
            out = out.filter(pa.array(alive))
    return out


def _check_new_job_dir(job_dir: JobDir) -> None:
    if not job_dir.exists():
        raise JobDirError(f"{job_dir.uri} is not a keyscale job directory yet; claim it before restoring a savepoint into it")
    if job_dir.manifest_batches():
        raise JobDirError(f"job directory {job_dir.uri} already has checkpoints; a savepoint is restored into a new job directory")
    if LocalStore(job_dir.spark_checkpoint).list_names(""):
        raise JobDirError(f"job directory {job_dir.uri} already has a Spark checkpoint; restore a savepoint into a new job directory")


def _plan(info: SavepointInfo, job_dir: JobDir, operators: dict[str, OperatorSpec], allow_non_restored_state: bool) -> list[tuple[str, SavepointOperator, OperatorSpec]]:
    """The operators to restore, every rule checked before anything is written."""
    ident = job_dir.identity()
    dropped = sorted(set(info.operators) - set(operators))
    if dropped and not allow_non_restored_state:
        more = f" (and {', '.join(repr(u) for u in dropped[1:])})" if len(dropped) > 1 else ""
        raise StateError(
            f"savepoint {info.path} has state of operator '{dropped[0]}'{more}, which the job does not have; "
            "give the operator its old uid, or pass --allow-non-restored-state (Pipeline.start: allow_non_restored_state=True) "
            "to start without that state"
        )
    plans = []
    for uid, spec in sorted(operators.items()):
        op = info.operators.get(uid)
        if op is None:
            continue
        if op.max_parallelism != ident.max_parallelism:
            raise StateError(
                f"operator '{uid}': the savepoint's state has max parallelism {op.max_parallelism} (key groups), the job "
                f"directory {job_dir.uri} has {ident.max_parallelism}; the number of key groups never changes on restore: "
                f"create the job directory with --max-parallelism {op.max_parallelism}, or re-key the savepoint first "
                f"(keyscale.state_processor.rekey_savepoint(SP, NEW_SP, {ident.max_parallelism}))"
            )
        _check_keys(uid, op, spec)
        _check_evolution(uid, op, spec)
        plans.append((uid, op, spec))
    return plans


def restore_savepoint(
    sp: Location,
    job_dir: JobDir,
    job_name: str,
    operators: dict[str, OperatorSpec],
    allow_non_restored_state: bool = False,
    progress: Progress | None = None,
) -> Manifest:
    """Initialise the new job directory ``job_dir`` from savepoint ``sp``; returns its manifest.

    ``sp`` is a local path, a ``file://`` or object store URI, or a Store; ``job_dir`` may
    be on another store. ``job_dir`` must be claimed (:meth:`JobDir.claim`) and have no
    checkpoint yet; the caller holds its lock (:meth:`JobDir.lock`), if any, so that the
    commit is fenced by its epoch. Operators are matched by uid: state of a savepoint
    operator the job does not have is refused unless ``allow_non_restored_state``; an
    operator new in the job starts empty (it is not in the manifest). Key columns must
    match. Per state: a state new in the job is absent for every key, a dropped state is
    dropped (keys left without any state disappear), a numeric widening is applied (see
    :func:`evolution_problem`); anything else raises :class:`StateError` naming operator,
    state and both types, before anything is written.

    Each data file becomes one checkpoint snapshot file; Spark's checkpoint is copied from
    ``source/spark`` into the job's local Spark checkpoint folder (for a job directory on an
    object store, also into the job directory as the Spark mirror's bundle of the restored
    batch); the manifest is committed at the savepoint's batch, so Spark resumes at the next
    one. A savepoint without source positions (a bootstrapped one) is committed as batch
    -1, "before the first batch": Spark starts its source from scratch at batch 0. Each
    restored operator's parallelism is the one the savepoint recorded (1 if none): the
    caller sets the one to run at.
    """
    _check_new_job_dir(job_dir)
    info = read_savepoint(sp)
    plans = _plan(info, job_dir, operators, allow_non_restored_state)
    # Positions in the savepoint (Spark's checkpoint, or a log's offsets as operator state)
    # continue at the next batch; without any the job starts its input from scratch.
    ck_extra = info.extra.get("checkpoint", {})
    has_positions = info.source is not None or bool(ck_extra.get("source_positions"))
    batch = info.batch if has_positions else -1
    total = sum(len(op.files) for _, op, _ in plans) + 1
    done = [0]

    def tick() -> None:
        report_progress(progress, "restore", done[0], total)
        done[0] += 1

    tick()
    written: list[str] = []
    spark = LocalStore(job_dir.spark_checkpoint)
    copied = pushed = False
    try:
        ops = {uid: _restore_operator(info, job_dir, uid, op, spec, batch, written, tick) for uid, op, spec in plans}
        if info.source is not None:
            # Spark reads its checkpoint from local disk only; on an object store the job
            # directory keeps it as mirror bundles, the first one written here.
            copied = True
            prefix = info.source.rstrip("/") + "/"
            for o in info.store.list(info.source):
                spark.put(o.key[len(prefix):], info.store.get(o.key), durable=job_dir.is_local)
            if not job_dir.is_local:
                pushed = True
                SparkMirror(job_dir.store, job_dir.spark_checkpoint, job_dir.fence).push(batch)
        manifest = job_dir.commit(_restored_manifest(info, job_name, batch, ops))
    except BaseException:
        job_dir.store.delete_many(written)
        if copied:
            spark.delete_prefix("")
        if pushed:  # a new job directory: its only Spark bundle is the one written here
            job_dir.store.delete_prefix(MIRROR_FOLDER)
        raise
    report_progress(progress, "restore", total, total)
    return manifest


def _restore_operator(
    info: SavepointInfo,
    job_dir: JobDir,
    uid: str,
    op: SavepointOperator,
    spec: OperatorSpec,
    batch: int,
    written: list[str],
    tick: Callable[[], None],
) -> OperatorCheckpoint:
    """One operator's data files as snapshot files of ``job_dir`` (each one's path added to
    ``written`` before it is written, ``tick`` after), and its checkpoint entry."""
    files: list[StateFile] = []
    for f in op.files:
        table = _to_state_table(uid, op, spec, read_data_file(info, f, uid), f, info.store.url(f.path))
        if table.num_rows:
            # named by batch >= 0 so retention can parse (and in time delete) it
            rel = f"state/{uid}/{max(batch, 0):012d}-restore-{len(files):05d}-snapshot.arrow"
            written.append(rel)
            files.append(write_state_file(job_dir.store, rel, table, "snapshot", batch, f.range))
        tick()
    par = op.parallelism if op.parallelism is not None and 1 <= op.parallelism <= op.max_parallelism else 1
    return OperatorCheckpoint(
        uid=uid, max_parallelism=op.max_parallelism, parallelism=par,
        key_columns=tuple((k, str(t)) for k, t in spec.key_columns),
        states=tuple(d.to_json() for d in spec.states), files=tuple(files),
        operator_state=dict(op.operator_state),
    )  # fmt: skip


def _restored_manifest(info: SavepointInfo, job_name: str, batch: int, ops: dict[str, OperatorCheckpoint]) -> Manifest:
    """The new job directory's first manifest: the restored operators at ``batch``, with the
    savepoint's event time, source positions and counters, and a lineage descending from it."""
    ck_extra = info.extra.get("checkpoint", {})
    event_time, resumed_ms = restored_event_time(ck_extra)  # a drained one: the watermark before its drain
    return Manifest(
        job=job_name, batch=batch, batch_time_ms=info.batch_time_ms, operators=ops,
        watermark_ms=resumed_ms if ck_extra.get("drained") else info.watermark_ms, created_ms=int(time.time() * 1000),
        extra={
            "restored_from": {"savepoint": info.path, "job": info.job, "batch": info.batch, "drained": bool(ck_extra.get("drained"))},
            # event time, source positions and the counts of late or dropped records travel with the savepoint
            **event_time,
            **{k: v for k, v in ck_extra.items() if k in ("source_positions", "counters")},
            # a new lineage, descending from the savepoint's at the restored batch
            "lineage": restored_lineage(ck_extra, batch).to_json(),
        },
    )  # fmt: skip
