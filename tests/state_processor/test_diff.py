"""Diffs of keyed state (issue 37, item 4) against a Python model: two states of an operator
as dicts, their diff computed key by key, equal to ``diff_savepoints`` / ``diff_rows`` /
``keyscale state diff`` between savepoints and checkpoints at other parallelisms and max
parallelisms, read piece by piece; on local disk and S3."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from keyscale.checkpoint.jobdir import JobDir
from keyscale.checkpoint.savepoint import (
    OperatorSpec,
    checkpoint_types,
    read_savepoint,
    restore_key_groups,
    restore_savepoint,
    write_savepoint,
)
from keyscale.errors import StateError
from keyscale.state.keygroups import KeyGroupRange
from keyscale.state_processor import rekey_savepoint, write_savepoint_from_dataframes
from keyscale.state_processor.diff import diff_rows, diff_savepoints, open_state

STATES = {"total": "long", "recent": "array<long>", "seen": "map<string,long>"}
Model = dict[str, dict[str, Any]]


def _state(rng: random.Random, users: int, batch: int) -> Model:
    """A random state: about 80% of ``users`` have one, some states null."""
    out: Model = {}
    for i in range(users):
        if rng.random() < 0.2:
            continue
        v = {"total": rng.choice([None, rng.randint(0, 5) + batch]),
             "recent": rng.choice([None, [], [rng.randint(0, 3) for _ in range(rng.randint(1, 3))]]),
             "seen": rng.choice([None, {"p": rng.randint(0, 2)}, {"p": 1, "q": batch % 2}])}
        if any(x is not None for x in v.values()):
            out[f"u{i}"] = v
    return out


def _evolve(rng: random.Random, old: Model, batch: int) -> Model:
    """The next state: most keys kept as they are, some changed, some gone, some new."""
    new = {k: dict(v) for k, v in old.items() if rng.random() > 0.1}
    for k in list(new):
        if rng.random() < 0.2:
            new[k]["total"] = (new[k]["total"] or 0) + 1
    for i in range(20):
        new[f"n{batch}-{i}"] = {"total": i, "recent": None, "seen": {"z": i}}
    return new


def _savepoint(where: Any, state: Model, m: int, rows_per_file: int = 40) -> str:
    table = pa.table({"user": list(state), **{s: [v[s] if s != "seen" or v[s] is None else list(v[s].items()) for v in state.values()]
                                             for s in STATES}},
                     schema=pa.schema([("user", pa.string()), ("total", pa.int64()), ("recent", pa.list_(pa.int64())),
                                       ("seen", pa.map_(pa.string(), pa.int64()))]))
    return write_savepoint_from_dataframes(where, "job", {"op": (table, ["user"], STATES)}, m, rows_per_file=rows_per_file)


def _model_diff(a: Model, b: Model) -> dict[str, tuple[str, list[str]]]:
    out = {}
    for k in a.keys() | b.keys():
        if k not in b:
            out[k] = ("only_a", [])
        elif k not in a:
            out[k] = ("only_b", [])
        else:
            changed = [s for s in STATES if a[k][s] != b[k][s]]
            if changed:
                out[k] = ("changed", changed)
    return out


def _as_model_value(v: dict[str, Any] | None) -> dict[str, Any] | None:
    if v is None:
        return None
    return {**v, "seen": dict(v["seen"]) if v["seen"] is not None else None}


def _check(rows: pa.Table, a: Model, b: Model) -> None:
    want = _model_diff(a, b)
    got = {r["user"]: (r["kind"], r["changed_states"]) for r in rows.to_pylist()}
    assert got == want
    for r in rows.to_pylist():
        assert _as_model_value(r["value_a"]) == a.get(r["user"]) and _as_model_value(r["value_b"]) == b.get(r["user"])


@pytest.mark.parametrize(("m_a", "m_b"), [(16, 16), (16, 32), (32, 7)])
def test_diff_of_savepoints_equals_the_models(tmp_path: Path, m_a: int, m_b: int) -> None:
    rng = random.Random(m_a * 100 + m_b)
    a = _state(rng, 400, 1)
    b = _evolve(rng, a, 2)
    sa, sb = _savepoint(tmp_path / "a", a, m_a), _savepoint(tmp_path / "b", b, m_b, rows_per_file=25)
    assert len(open_state(sa, "op").pieces) > 3 and len(open_state(sb, "op").pieces) > 3
    rows = diff_rows(sa, sb, "op")
    _check(rows, a, b)
    d = diff_savepoints(sa, sb, "op", samples=3)
    want = _model_diff(a, b)
    counts = {kind: sum(1 for v in want.values() if v[0] == kind) for kind in ("only_a", "only_b", "changed")}
    assert (d.only_a, d.only_b, d.changed) == (counts["only_a"], counts["only_b"], counts["changed"])
    assert d.unchanged == len(a.keys() & b.keys()) - counts["changed"] and not d.equal
    assert all(len(d.samples[k]) == min(3, counts[k]) for k in counts)
    sample = d.samples["changed"][0]
    user = sample["key"]["user"]
    assert sample["a"] == {**a[user], "seen": a[user]["seen"]} and sample["changed_states"] == want[user][1]
    # the same state at another max parallelism is equal; both directions mirror each other
    again = rekey_savepoint(sb, tmp_path / "b-rekeyed", 64)
    same = diff_savepoints(sb, again, "op")
    assert same.equal and same.unchanged == len(b)
    back = diff_rows(sb, sa, "op")
    assert {r["user"]: r["kind"] for r in back.to_pylist()} == {
        k: {"only_a": "only_b", "only_b": "only_a", "changed": "changed"}[v[0]] for k, v in want.items()}


def _model_of(jd: JobDir, batch: int) -> Model:
    op = jd.read_manifest(batch).operators["op"]
    keys, states = checkpoint_types(jd.store, op)
    table = restore_key_groups(jd.store, op, KeyGroupRange(0, op.max_parallelism - 1), keys, states)
    return {r["user"]: {"total": r["total"], "recent": r["recent"], "seen": dict(r["seen"]) if r["seen"] is not None else None}
            for r in table.to_pylist()}


def test_diff_of_checkpoints_through_deltas_and_a_rescale(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A job directory's checkpoints (snapshots and deltas, parallelism 2 then 4): checkpoint
    against checkpoint, and against a savepoint rekeyed to another max parallelism."""
    from test_lookup import _job

    from keyscale.cli.main import main as cli

    jd = _job(tmp_path / "job")
    m1, m3 = _model_of(jd, 1), _model_of(jd, 3)
    rows = diff_rows(tmp_path / "job", tmp_path / "job", "op", checkpoint_a=1, checkpoint_b=3, rows_per_piece=30)
    want = _model_diff(m1, m3)
    assert want and {r["user"]: (r["kind"], r["changed_states"]) for r in rows.to_pylist()} == want
    man = jd.read_manifest(1)
    sp = write_savepoint(jd, man, tmp_path / "sp1", rows_per_file=50)
    sp32 = rekey_savepoint(sp, tmp_path / "sp1-32", 32)
    assert diff_savepoints(sp32, tmp_path / "job", "op", checkpoint_b=1).equal
    # round trip: the savepoint restored into a new job directory holds the same state
    info = read_savepoint(sp32)
    restored = JobDir(tmp_path / "restored")
    restored.claim("job", 32, 32)
    op32 = info.operators["op"]
    restore_savepoint(sp32, restored, "job", {"op": OperatorSpec(op32.key_columns, op32.states)}, allow_non_restored_state=True)
    assert diff_savepoints(sp32, tmp_path / "restored", "op").equal and diff_savepoints(tmp_path / "restored", sp, "op").equal
    d = diff_savepoints(sp32, tmp_path / "job", "op")  # the latest checkpoint: 3
    assert d.b.batch == 3 and (d.only_a, d.only_b, d.changed) == tuple(
        sum(1 for v in want.values() if v[0] == k) for k in ("only_a", "only_b", "changed"))
    # The command: exit 1 and counts when they differ, 0 when equal, 2+ on an error.
    assert cli(["state", "diff", sp32, str(tmp_path / "job"), "--uid", "op", "--json", "--samples", "2"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["changed"] == d.changed and len(out["samples"]["only_b"]) == min(2, d.only_b) and out["b"]["batch"] == 3
    assert cli(["state", "diff", sp32, str(tmp_path / "job"), "--uid", "op", "--checkpoint-b", "1"]) == 0
    assert "only in A: 0 keys" in capsys.readouterr().out
    assert cli(["state", "diff", sp32, str(tmp_path / "job"), "--uid", "nope"]) >= 2
    assert "operator 'nope'" in capsys.readouterr().err
    assert cli(["state", "diff", sp32, sp32, "--uid", "op", "--checkpoint-a", "2"]) >= 2
    assert "is a savepoint" in capsys.readouterr().err


def test_diff_refuses_keys_of_other_types(tmp_path: Path) -> None:
    a = write_savepoint_from_dataframes(tmp_path / "a", "job", {"op": (pa.table({"k": ["1"], "n": [1]}), ["k"], {"n": "long"})}, 8)
    b = write_savepoint_from_dataframes(tmp_path / "b", "job", {"op": (pa.table({"k": [1], "n": [1]}), ["k"], {"n": "long"})}, 8)
    with pytest.raises(StateError, match=r"operator 'op' is keyed by \(k string\) in A and by \(k long\) in B"):
        diff_savepoints(a, b, "op")
    c = write_savepoint_from_dataframes(tmp_path / "c", "job", {"op": (pa.table({"k": ["1"], "n": ["x"]}), ["k"], {"n": "string"})}, 8)
    with pytest.raises(StateError, match="state 'n': long in A, string in B"):
        diff_savepoints(a, c, "op")
    # a widened state compares in the wider type; a state only one side has is listed, not compared
    d = write_savepoint_from_dataframes(tmp_path / "d", "job", {"op": (pa.table({"k": ["1"], "n": pa.array([1], pa.int32()), "m": [2]}), ["k"],
                                                                       {"n": "int", "m": "long"})}, 8)
    same = diff_savepoints(d, a, "op")
    assert same.equal and same.states == ["n"] and same.states_only_a == ["m"]


@pytest.mark.s3
def test_diff_on_s3(s3_bucket: str, tmp_path: Path) -> None:
    rng = random.Random(5)
    a = _state(rng, 200, 1)
    b = _evolve(rng, a, 2)
    sa = _savepoint(f"{s3_bucket}/a", a, 16)
    sb = _savepoint(tmp_path / "b", b, 32)
    _check(diff_rows(sa, sb, "op"), a, b)
    assert diff_savepoints(sa, rekey_savepoint(sa, f"{s3_bucket}/a8", 8), "op").equal
    # checkpoints of a job directory on S3, through deltas and a rescale
    from test_lookup import _job

    jd = _job(f"{s3_bucket}/job")
    rows = diff_rows(f"{s3_bucket}/job", f"{s3_bucket}/job", "op", checkpoint_a=0, checkpoint_b=3, rows_per_piece=40)
    assert {r["user"]: (r["kind"], r["changed_states"]) for r in rows.to_pylist()} == _model_diff(_model_of(jd, 0), _model_of(jd, 3))


def test_a_checkpoint_deleted_under_a_diff_is_an_error_naming_the_file(tmp_path: Path) -> None:
    """What a running job's retention does to a diff of an old checkpoint: the missing file is named."""
    from test_lookup import _job

    jd = _job(tmp_path / "job")
    gone = jd.read_manifest(0).operators["op"].files[0]
    (tmp_path / "job" / gone.path).unlink()
    with pytest.raises(StateError, match=f"state file .*{gone.path} is missing"):
        diff_savepoints(tmp_path / "job", tmp_path / "job", "op", checkpoint_a=0)
