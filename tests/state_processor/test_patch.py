"""Validated edits of keyed state (issue 37, item 5): a patch writes a new savepoint whose
state equals the model (the source's state with the edits applied), refuses a value of the
wrong type naming key, state and field with nothing written, never writes into a job
directory's checkpoints, records who/what/when, and restores: a job started from it
continues from the patched values."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import RUNNING_COUNT, read_output, run_job, write_events
from keyscale.checkpoint.jobdir import JobDir
from keyscale.checkpoint.savepoint import read_savepoint, write_savepoint
from keyscale.errors import InputDataError, StateError
from keyscale.state.types import StateDescriptor
from keyscale.state_processor import write_savepoint_from_dataframes
from keyscale.state_processor.diff import diff_rows, diff_savepoints, diff_state
from keyscale.state_processor.patch import Edit, patch_state

PREFS = pa.struct([("lang", pa.string()), ("limits", pa.list_(pa.int32()))])
SCHEMA = pa.schema([("user", pa.string()), ("total", pa.int64()), ("seen", pa.map_(pa.string(), pa.int64())), ("prefs", PREFS)])
STATES = {"total": "long", "seen": "map<string,long>", "prefs": StateDescriptor("prefs", "value", PREFS)}


def _source(where: Any, n: int = 300, m: int = 16) -> tuple[str, dict[str, dict[str, Any]]]:
    rng = random.Random(n)
    model = {f"u{i}": {"total": rng.randint(0, 99), "seen": {"p": i} if i % 3 else None,
                       "prefs": {"lang": "en", "limits": [i % 7]} if i % 2 else None} for i in range(n)}
    rows = {"user": list(model), "total": [v["total"] for v in model.values()],
            "seen": [None if v["seen"] is None else list(v["seen"].items()) for v in model.values()],
            "prefs": [v["prefs"] for v in model.values()]}
    sp = write_savepoint_from_dataframes(where, "job", {"op": (pa.table(rows, schema=SCHEMA), ["user"], STATES)}, m, rows_per_file=40)
    return sp, model


def _read(sp: str) -> dict[str, dict[str, Any]]:
    info = read_savepoint(sp)
    out = {}
    for f in info.operators["op"].files:
        import pyarrow.parquet as pq

        for r in pq.read_table(pa.BufferReader(info.store.get(f.path))).to_pylist():
            assert f.start <= r["key_group"] <= f.end
            out[r["user"]] = {"total": r["total"], "seen": dict(r["seen"]) if r["seen"] is not None else None, "prefs": r["prefs"]}
    return out


def test_a_patch_equals_the_model_and_is_recorded(tmp_path: Path) -> None:
    sp, model = _source(tmp_path / "sp")
    updates = {"u1": {"total": 1000}, "u2": {"seen": {"q": 5, "r": 6}, "prefs": {"lang": "fr", "limits": [1, 2]}},
               "new-user": {"total": 7}, "u4": {"total": None, "seen": None, "prefs": None}}
    new = patch_state(sp, tmp_path / "fixed", "op", updates=updates, deletes=["u5", "u6"], note="INC-42")
    want = {k: dict(v) for k, v in model.items() if k not in ("u4", "u5", "u6")}  # u4: every state cleared
    want["u1"]["total"] = 1000
    want["u2"].update(seen={"q": 5, "r": 6}, prefs={"lang": "fr", "limits": [1, 2]})
    want["new-user"] = {"total": 7, "seen": None, "prefs": None}
    assert _read(new) == want
    info = read_savepoint(new)
    before = read_savepoint(sp)
    assert (info.origin, info.batch, info.operators["op"].max_parallelism) == ("patch", before.batch, 16)
    record = info.extra["patches"][-1]
    assert record["set"] == 4 and record["deleted"] == 2 and record["note"] == "INC-42" and record["operator"] == "op"
    assert {"user", "host"} <= record["who"].keys() and record["when_ms"] >= before.created_ms and len(record["digest"]) == 64
    assert {"user": "new-user"} in record["keys_set"] and record["keys_deleted"] == [{"user": "u5"}, {"user": "u6"}]
    assert record["from"]["path"] == before.path
    # Unedited data files are copied as they were; the diff against the source is exactly the edits.
    untouched = {f.path: f.sha256 for f in before.operators["op"].files}
    assert sum(1 for f in info.operators["op"].files if untouched.get(f.path) == f.sha256) >= len(untouched) - 5
    kinds = {r["user"]: r["kind"] for r in diff_rows(sp, new, "op").to_pylist()}
    assert kinds == {"u1": "changed", "u2": "changed", "new-user": "only_b", "u4": "only_a", "u5": "only_a", "u6": "only_a"}
    # A patch of a patch keeps both records, the first first.
    again = patch_state(new, tmp_path / "fixed2", "op", deletes=["u1"])
    assert [p["deleted"] for p in read_savepoint(again).extra["patches"]] == [2, 1]


@pytest.mark.parametrize(("updates", "message"), [
    ({"u1": {"total": "ten"}}, "operator 'op', key {'user': 'u1'}, state 'total': 'ten' is not a long"),
    ({"u1": {"total": 1.5}}, "state 'total': 1.5 is not a long"),
    ({"u1": {"prefs": {"lang": "en", "limits": [1, "x"]}}}, "key {'user': 'u1'}, state 'prefs', field 'limits'[1]: 'x' is not a int"),
    ({"u1": {"prefs": {"language": "en"}}}, "state 'prefs': no field 'language' (fields: lang, limits)"),
    ({"u1": {"seen": [1, 2]}}, "state 'seen': map entry 1 is not a [key, value] pair"),
    ({"u1": {"seen": {"p": True}}}, "state 'seen'['p']: True is not a long"),
    ({"u1": {"color": 1}}, "operator 'op' has no state 'color' to set (states: total, seen, prefs)"),
    ({"u1": {"total": 2**63}}, "is not a long"),
])
def test_a_value_of_the_wrong_type_is_refused_and_nothing_written(tmp_path: Path, updates: dict[str, Any], message: str) -> None:
    sp, _ = _source(tmp_path / "sp", n=20)
    with pytest.raises(InputDataError) as e:
        patch_state(sp, tmp_path / "out", "op", updates={"u0": {"total": 1}, **updates})
    assert message in str(e.value)
    assert not (tmp_path / "out").exists()


def test_where_a_patch_may_write(tmp_path: Path) -> None:
    sp, _ = _source(tmp_path / "sp", n=20)
    jd = JobDir(tmp_path / "job")
    jd.claim("job", 16, 16)
    for inside in ("checkpoints/x", "state/op", "x"):
        with pytest.raises(StateError, match=r"is inside job directory .*: a patch never writes into a job's checkpoints"):
            patch_state(sp, tmp_path / "job" / inside, "op", deletes=["u1"])
    assert not (tmp_path / "job" / "x").exists()
    ok = patch_state(sp, tmp_path / "job" / "savepoints" / "fixed", "op", deletes=["u1"])
    with pytest.raises(StateError, match="exists; a patch writes only a new savepoint"):
        patch_state(sp, ok, "op", deletes=["u2"])
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(StateError, match="exists"):
        patch_state(sp, tmp_path / "busy", "op", deletes=["u2"])
    with pytest.raises(StateError, match=r"key \{'user': 'ghost'\} cannot be deleted"):
        patch_state(sp, tmp_path / "out", "op", deletes=["ghost"])
    with pytest.raises(InputDataError, match="edited twice"):
        patch_state(sp, tmp_path / "out", "op", updates={"u1": {"total": 1}}, deletes=["u1"])
    with pytest.raises(StateError, match=r"is a job directory, not a savepoint: take a savepoint of it first"):
        patch_state(tmp_path / "job", tmp_path / "out", "op", deletes=["u1"])
    with pytest.raises(InputDataError, match="no key to set or delete"):
        patch_state(sp, tmp_path / "out", "op")
    assert not (tmp_path / "out").exists()


def test_cli_state_patch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from keyscale.cli.main import main as cli

    sp, model = _source(tmp_path / "sp", n=30)
    edits = tmp_path / "edits.jsonl"
    edits.write_text(json.dumps({"key": "u3", "set": {"total": 33}}) + "\n" + json.dumps({"key": "u4", "delete": True}) + "\n")
    out = tmp_path / "fixed"
    assert cli(["state", "patch", sp, "--uid", "op", "--set", 'u1={"total": 11}', "--delete", "u2", "--from-file", str(edits),
                "-o", str(out), "--note", "why"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    got = _read(str(out))
    assert got["u1"]["total"] == 11 and got["u3"]["total"] == 33 and "u2" not in got and "u4" not in got
    assert got["u5"] == model["u5"]
    assert cli(["state", "patch", sp, "--uid", "op", "--set", 'u1={"total": "x"}', "-o", str(tmp_path / "bad")]) == 5
    assert "key {'user': 'u1'}, state 'total': 'x' is not a long" in capsys.readouterr().err
    assert cli(["state", "patch", sp, "--uid", "op", "--set", "u1=5", "-o", str(tmp_path / "bad")]) != 0
    assert "write KEY=" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_parse_edits() -> None:
    from keyscale.state_processor.patch import parse_edit_lines

    assert parse_edit_lines(['{"key": 3, "set": {"a": 1}}'], "f") == [Edit(3, {"a": 1})]
    with pytest.raises(InputDataError, match="f, line 2: write"):
        parse_edit_lines(["", '{"key": 3, "set": {"a": 1}, "delete": true}'], "f")


@pytest.mark.s3
def test_patch_on_s3(s3_bucket: str, tmp_path: Path) -> None:
    sp, model = _source(f"{s3_bucket}/sp", n=60)
    new = patch_state(sp, f"{s3_bucket}/fixed", "op", updates={"u1": {"total": -1}}, deletes=["u2"])
    want = {k: v for k, v in model.items() if k != "u2"}
    want["u1"] = {**want["u1"], "total": -1}
    assert _read(new) == want
    jd = JobDir(f"{s3_bucket}/job")
    jd.claim("job", 16, 16)
    with pytest.raises(StateError, match="is inside job directory"):
        patch_state(sp, f"{s3_bucket}/job/checkpoints/p", "op", deletes=["u3"])
    assert patch_state(new, tmp_path / "local", "op", deletes=["u3"]) == str(tmp_path / "local")  # S3 -> local disk


# -- a real job, restored from a patched savepoint --------------------------------------------


def _totals(folder: Path, files: range) -> pd.DataFrame:
    frames = [pd.read_parquet(folder / f"part-{i:05d}.parquet") for i in files]
    return pd.concat(frames).groupby("key")["value"].agg(["count", "sum"])


@pytest.mark.parametrize("where", ["local", pytest.param("s3", marks=pytest.mark.s3)])
def test_a_job_continues_from_the_patched_values(spark: Any, tmp_path: Path, where: str, request: pytest.FixtureRequest) -> None:
    """The running count runs 3 batches (p=2, retaining its checkpoints); its checkpoints of
    batches 0 and 2 differ as the input's model says; a savepoint of batch 2 is patched (one
    key's count set, one deleted, one created) and a job restored from it at p=3 over two
    more files continues from the patched values; the diff of the patched savepoint and the
    restored job's checkpoint is exactly the new input's keys. Job directories and savepoints
    on local disk, and on the S3 server (the input and output stay local)."""
    root = request.getfixturevalue("s3_bucket") if where == "s3" else str(tmp_path)
    inp = tmp_path / "in"
    write_events(inp, files=3, rows=400, keys=40, seed=9)
    args = {"input": str(inp), "output": str(tmp_path / "out")}
    run_job(RUNNING_COUNT, f"{root}/job", 2, args, retain=10)
    jd = JobDir(f"{root}/job")
    # the diff of two checkpoints is the model's: keys of batch 0 against those of batches 0..2
    b0, b2 = _totals(inp, range(1)), _totals(inp, range(3))
    d = diff_savepoints(f"{root}/job", f"{root}/job", "totals", checkpoint_a=0, checkpoint_b=2)
    assert d.only_a == 0 and d.only_b == len(set(b2.index) - set(b0.index))
    assert d.changed == sum(1 for k in b0.index if tuple(b0.loc[k]) != tuple(b2.loc[k])) and d.unchanged == len(b0) - d.changed
    # The DataFrame form reads both sides in this process: on S3 too, though this session's
    # Spark workers started before the S3 settings were in the environment.
    frame = diff_state(spark, f"{root}/job", f"{root}/job", "totals", checkpoint_a=0, checkpoint_b=2)
    assert {r["kind"]: r["count"] for r in frame.groupBy("kind").count().collect()} == {
        k: n for k, n in (("only_b", d.only_b), ("changed", d.changed)) if n}
    for r in frame.where("kind = 'changed'").collect():
        assert (r["value_a"]["count"], r["value_b"]["count"]) == (b0.loc[r["key"], "count"], b2.loc[r["key"], "count"])
    man = jd.latest_manifest()
    assert man is not None and man.batch == 2
    sp = write_savepoint(jd, man, f"{root}/sp")
    states = [s.name for s in read_savepoint(sp).operators["totals"].states if not s.name.startswith("__")]
    assert states == ["count", "sum"]
    keys = sorted(b2.index)
    patched = patch_state(sp, f"{root}/sp-fixed", "totals",
                          updates={keys[0]: {"count": 1000, "sum": 5}, "k-new": {"count": 7, "sum": 70}}, deletes=[keys[1]])
    write_events(inp, files=2, rows=400, keys=40, seed=9, first=3)
    run_job(RUNNING_COUNT, f"{root}/job2", 3, {"input": str(inp), "output": str(tmp_path / "out2")}, from_savepoint=patched)
    out = read_output(tmp_path / "out2")
    final = out.sort_values("count").groupby("key").last()
    after = _totals(inp, range(3, 5))
    base = {k: (int(b2.loc[k, "count"]), int(b2.loc[k, "sum"])) for k in keys}
    base[keys[0]] = (1000, 5)
    base[keys[1]] = (0, 0)
    for k in after.index:
        c, s = base[k]
        assert (int(final.loc[k, "count"]), int(final.loc[k, "sum"])) == (c + after.loc[k, "count"], s + after.loc[k, "sum"]), k
    assert "k-new" not in set(out["key"])  # no input for it: the job emits nothing for it ...
    d = diff_savepoints(patched, f"{root}/job2", "totals")  # ... and its state is still there
    deleted_came_back = int(keys[1] in after.index)  # the deleted key starts again from its new input
    assert (d.only_a, d.only_b, d.changed) == (0, deleted_came_back, len(after) - deleted_came_back)


# -- the merge of edits into a data file, against a dict model ---------------------------------

OP_SCHEMA_STATES = (StateDescriptor("a", "value", pa.int64()), StateDescriptor("b", "list", pa.int64()))


@given(st.dictionaries(st.integers(0, 30), st.tuples(st.one_of(st.none(), st.integers(-5, 5)), st.one_of(st.none(), st.lists(st.integers(0, 3), max_size=2)))
                       .filter(lambda v: v != (None, None)), max_size=20),
       st.dictionaries(st.integers(0, 35), st.one_of(st.none(), st.dictionaries(st.sampled_from("ab"), st.one_of(st.none(), st.integers(0, 9)), min_size=1)),
                       max_size=10))
def test_applying_edits_matches_a_dict_model(rows: dict[int, tuple[Any, Any]], edits: dict[int, dict[str, Any] | None]) -> None:
    from keyscale.checkpoint.savepoint import SavepointOperator
    from keyscale.state_processor.patch import _apply, _Planned

    op = SavepointOperator("op", 4, None, (("k", pa.int64()),), OP_SCHEMA_STATES)
    keys = sorted(rows)
    table = pa.table({"k": pa.array(keys, pa.int64()), "key_group": pa.array([k % 4 for k in keys], pa.int32()),
                      "a": pa.array([rows[k][0] for k in keys], pa.int64()), "b": pa.array([rows[k][1] for k in keys], pa.list_(pa.int64()))})
    edits = {k: e for k, e in edits.items() if e is not None or k in rows}  # a delete of an absent key is refused elsewhere
    planned = [_Planned((k, ), k % 4, None if e is None else {n: (None if v is None else v if n == "a" else [v]) for n, v in e.items()})
               for k, e in edits.items()]
    want = {k: {"a": v[0], "b": v[1]} for k, v in rows.items()}
    for p in planned:
        (k,) = p.values
        if p.states is None:
            del want[k]
            continue
        want[k] = {**want.get(k, {"a": None, "b": None}), **p.states}
        if want[k] == {"a": None, "b": None}:
            del want[k]
    out = _apply(table, op, planned, 0, "test")
    assert {r["k"]: {"a": r["a"], "b": r["b"]} for r in out.to_pylist()} == want
    assert out.column("k").to_pylist() == sorted(out.column("k").to_pylist(), key=lambda k: (k % 4, k))  # canonical order
