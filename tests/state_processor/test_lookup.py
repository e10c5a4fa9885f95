"""Point lookups of keyed state (issue 37, item 1), against a model: every key's answer equals
what the whole read (``restore_key_groups``, ``read_keyed_state``) gives at the same
checkpoint; through a delta chain and at another parallelism, on local disk and S3 (reading
only the key's key group by byte range); and from a running job, live rescaled, through
``JobHandle.state``, ``GET /state/<uid>`` (with the job's secret), ``keyscale state serve``
and ``keyscale state get``.
A lookup reads its chain's footers in one round of reads and their record batches in one
more; a record batch read for one key serves the others in it from the cache.
"""

from __future__ import annotations

import datetime as dt
import json
import time
import urllib.error
import urllib.request
from decimal import Decimal
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

import keyscale as ks
from conftest import write_events
from keyscale.checkpoint.encode import write_state_file
from keyscale.checkpoint.jobdir import JobDir
from keyscale.checkpoint.manifest import Manifest, OperatorCheckpoint
from keyscale.checkpoint.savepoint import checkpoint_types, restore_key_groups
from keyscale.errors import InputDataError, StateError
from keyscale.runtime.control.lookups import LookupServer
from keyscale.runtime.control.settings import BearerToken
from keyscale.state.keygroups import KeyGroupRange, key_group_ranges
from keyscale.state.order import order_rows
from keyscale.state.table import KG_COLUMN
from keyscale.state.types import StateDescriptor
from keyscale.state_processor import StateLookup, read_keyed_state
from keyscale.state_processor.keygroups import key_groups
from keyscale.state_processor.lookup import jsonable
from keyscale.storage import Store, open_store

TOTAL = StateDescriptor("total", "value", pa.int64(), ttl_seconds=60.0)
RECENT = StateDescriptor("recent", "list", pa.int64())
SEEN = StateDescriptor("seen", "map", pa.int64(), pa.string())
HIDDEN = (StateDescriptor("__ttl_total", "value", pa.int64()), StateDescriptor("__timers_proc", "list", pa.int64()),
          StateDescriptor("__next_proc", "value", pa.int64()))
STATES = (TOTAL, RECENT, SEEN, *HIDDEN)
M = 16


def _rows(rng: np.random.Generator, users: list[str], batch: int) -> pa.Table:
    """One row per user: random states, some users deleted (every state null)."""
    n = len(users)
    dead = rng.random(n) < 0.15
    total = [None if d else int(x) for d, x in zip(dead, rng.integers(0, 1000, n), strict=True)]
    recent = [None if d or i % 5 == 0 else [int(v) for v in rng.integers(0, 9, i % 4 + 1)] for i, d in enumerate(dead)]
    seen = [None if d or i % 3 == 0 else [(f"p{j}", int(batch * 10 + j)) for j in range(i % 3)] for i, d in enumerate(dead)]
    timers = [None if d or i % 4 else [1_000_000 + i, 2_000_000 + batch] for i, d in enumerate(dead)]
    table = pa.table({
        "user": pa.array(users, pa.string()),
        "total": pa.array(total, pa.int64()), "recent": pa.array(recent, RECENT.column_type),
        "seen": pa.array(seen, SEEN.column_type),
        "__ttl_total": pa.array([None if t is None else 1000 * batch for t in total], pa.int64()),
        "__timers_proc": pa.array(timers, pa.list_(pa.int64())),
        "__next_proc": pa.array([None if t is None else t[0] for t in timers], pa.int64()),
    })
    kgs = key_groups(table, ["user"], ["string"], M)
    # As a job writes them: by key group, then sub key (a snapshot in that order gets fences).
    return table.add_column(1, KG_COLUMN, pa.array(kgs, pa.int32())).take(pa.array(order_rows(kgs, table.column("user"))))


def _write(store: Store, uid: str, batch: int, kind: str, table: pa.Table, p: int) -> list[Any]:
    kgs = table.column(KG_COLUMN).to_numpy()
    files = []
    for s, rng in enumerate(key_group_ranges(M, p)):
        part = table.filter(pa.array((kgs >= rng.start) & (kgs <= rng.end)))
        if part.num_rows or kind == "snapshot":
            rel = f"state/{uid}/{batch:012d}-s{s:05d}-{kind}.arrow"
            files.append(write_state_file(store, rel, part, kind, batch, rng))  # type: ignore[arg-type]
    return files


def _job(where: Any, users: int = 300, rescale_at: int = 2) -> JobDir:
    """Batches 0..3 of operator 'op': a snapshot at parallelism 2, deltas, then (a rescale) a
    snapshot of some key groups at parallelism 4 and a delta after it."""
    jd = JobDir(where)
    jd.claim("job", M, M)
    rng = np.random.default_rng(7)
    names = [f"u{i}" for i in range(users)]
    files: list[Any] = []
    for batch in range(4):
        p = 2 if batch < rescale_at else 4
        if batch == 0:
            files += _write(jd.store, "op", 0, "snapshot", _rows(rng, names, 0), p)
        elif batch == rescale_at:
            snap = _write(jd.store, "op", batch, "snapshot", _rows(rng, names[: users // 2], batch), p)
            files += snap[:2]  # only some subtasks wrote a snapshot
        else:
            files += _write(jd.store, "op", batch, "delta", _rows(rng, [n for n in names if rng.random() < 0.4], batch), p)
        op = OperatorCheckpoint("op", M, p, (("user", "string"),), tuple(d.to_json() for d in STATES), tuple(files))
        other = OperatorCheckpoint("src", M, 1, (), ())
        jd.commit(Manifest("job", batch, 1000 * batch, {"op": op, "src": other}))
    return jd


def _model(jd: JobDir, batch: int) -> dict[str, dict[str, Any]]:
    """Every live key's states at checkpoint ``batch``, from the whole read's decoding."""
    op = jd.read_manifest(batch).operators["op"]
    keys, states = checkpoint_types(jd.store, op)
    table = restore_key_groups(jd.store, op, KeyGroupRange(0, M - 1), keys, states)
    return {r["user"]: r for r in table.to_pylist()}


def _check(answer: dict[str, Any], row: dict[str, Any] | None, batch: int) -> None:
    assert answer["batch"] == batch and answer["uid"] == "op"
    if row is None:
        assert not answer["found"] and answer["state"] == {} and "has no state" in answer["message"]
        return
    assert answer["found"] and answer["key_group"] == row["key_group"]
    assert answer["state"] == {s.name: jsonable(row[s.name], s.column_type) for s in (TOTAL, RECENT, SEEN)}
    if row["__timers_proc"]:
        assert answer["timers"] == {"processing_time": sorted(row["__timers_proc"])}
    else:
        assert "timers" not in answer
    if row["total"] is not None:
        assert answer["ttl"] == {"total": {"clock_ms": row["__ttl_total"], "expires_ms": row["__ttl_total"] + 60_000}}


def test_lookups_equal_the_whole_read_at_every_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import keyscale.checkpoint.files as files
    import keyscale.state_processor.lookup as lookups

    monkeypatch.setattr(files, "CHUNK_ROWS", 16)  # record batches of 16 rows: a key group spans several, fences pick one
    monkeypatch.setattr(lookups, "CHAIN_BLOCK", 5)  # restore chains worked out 5 key groups at a time, the last block short
    jd = _job(tmp_path / "job")
    snapshot = next(f for f in jd.read_manifest(0).operators["op"].files if f.kind == "snapshot")
    assert b"keyscale.fences" in pa.ipc.open_file(pa.memory_map(str(jd.store.path(snapshot.path)))).schema.metadata
    lookup = StateLookup(tmp_path / "job")
    users = [f"u{i}" for i in range(300)] + ["nobody"]
    for batch in range(4):
        model = _model(jd, batch)
        assert len(model) > 100
        for answer, user in zip(lookup.get_many("op", users, checkpoint=batch), users, strict=True):
            assert answer["key"] == {"user": user}
            _check(answer, model.get(user), batch)
    # The newest checkpoint by default; a second pass is served from the cache.
    assert lookup.get("op", "u3")["batch"] == 3
    assert lookup.get("op", "u3") == lookup.get("op", ("u3",))
    hits = lookup.cache.hits
    lookup.get("op", "u3")
    assert lookup.cache.hits > hits and lookup.cache.bytes <= lookup.cache.max_bytes


def test_lookup_errors_name_the_operator_and_the_key(tmp_path: Path) -> None:
    jd = _job(tmp_path / "job")
    lookup = StateLookup(jd)
    with pytest.raises(StateError, match=r"operator 'nope' does not exist in job 'job' at checkpoint 3 \(keyed operators: 'op'\)"):
        lookup.get("nope", "u1")
    with pytest.raises(StateError, match=r"operator 'src' is not keyed"):
        lookup.get("src", "u1")
    with pytest.raises(StateError, match="checkpoint 9 does not exist"):
        lookup.get("op", "u1", checkpoint=9)
    with pytest.raises(InputDataError, match=r"operator 'op': key 5 is not a string \(key column 'user'"):
        lookup.get("op", 5)
    empty = JobDir(tmp_path / "empty")
    empty.claim("job", M, M)
    with pytest.raises(StateError, match="has no committed checkpoint yet"):
        StateLookup(empty).get("op", "u1")


def test_keys_of_other_types_and_several_columns(tmp_path: Path) -> None:
    import datetime as dt

    jd = JobDir(tmp_path / "job")
    jd.claim("job", M, M)
    stamp = dt.datetime(2026, 5, 1, 12, tzinfo=dt.UTC)
    table = pa.table({"id": pa.array([7, 8], pa.int64()), "at": pa.array([stamp, stamp], pa.timestamp("us", tz="UTC")),
                      "n": pa.array([1, 2], pa.int64())})
    table = table.add_column(2, KG_COLUMN, pa.array(key_groups(table, ["id", "at"], ["long", "timestamp"], M), pa.int32())).sort_by(KG_COLUMN)
    f = write_state_file(jd.store, "state/t/000000000000-s00000-snapshot.arrow", table, "snapshot", 0, KeyGroupRange(0, M - 1))
    n = StateDescriptor("n", "value", pa.int64())
    op = OperatorCheckpoint("t", M, 1, (("id", "int64"), ("at", "timestamp[us, tz=UTC]")), (n.to_json(),), (f,))
    jd.commit(Manifest("job", 0, 0, {"t": op}))
    lookup = StateLookup(jd)
    assert lookup.get("t", '[8, "2026-05-01T12:00:00+00:00"]')["state"] == {"n": 2}
    assert lookup.get("t", (7, stamp))["key"] == {"id": 7, "at": "2026-05-01T12:00:00+00:00"}
    assert lookup.get("t", [7, int(stamp.timestamp() * 1_000_000)])["state"] == {"n": 1}
    assert not lookup.get("t", '[9, "2026-05-01T12:00:00Z"]')["found"]
    with pytest.raises(InputDataError, match=r"operator 't': key 'x' must give 2 values, one per key column \(id, at\)"):
        lookup.get("t", "x")
    with pytest.raises(InputDataError, match=r"key '\[\"a\", 1\]' is not a long \(key column 'id'"):
        lookup.get("t", '["a", 1]')


@pytest.mark.parametrize(("t", "values", "texts"), [
    (pa.date32(), [dt.date(2024, 2, 29), dt.date(1969, 12, 31)], ["2024-02-29", "1969-12-31"]),
    (pa.decimal128(12, 3), [Decimal("1.250"), Decimal("-99999.999")], ["1.25", "-99999.999"]),
    (pa.decimal128(30, 2), [Decimal("123456789012345678901.50"), Decimal("0.00")], ["123456789012345678901.5", "0"]),
    (pa.timestamp("us"), [dt.datetime(2024, 1, 1, 0, 0, 7), dt.datetime(1900, 5, 1)], ["2024-01-01T00:00:07", "1900-05-01"]),
    (pa.float64(), [0.25, -1e300], ["0.25", "-1e300"]),
    (pa.binary(), [b"\x00\xff", b"ann"], ["\x00\xff", "ann"]),
])
def test_a_key_of_each_spark_type_is_found_by_value_and_by_text(tmp_path: Path, t: pa.DataType, values: list[Any], texts: list[str]) -> None:
    """The key group a lookup computes is the one Spark's hash gave the key (decimals and
    wall-clock timestamps too); text from a command line or a URL is parsed as the type."""
    from keyscale.checkpoint.savepoint.schema import spark_type_name

    jd = JobDir(tmp_path / "job")
    jd.claim("job", M, M)
    table = pa.table({"k": pa.array(values, t), "n": pa.array([1, 2], pa.int64())})
    table = table.add_column(1, KG_COLUMN, pa.array(key_groups(table, ["k"], [spark_type_name(t)], M), pa.int32())).sort_by(KG_COLUMN)
    f = write_state_file(jd.store, "state/t/000000000000-s00000-snapshot.arrow", table, "snapshot", 0, KeyGroupRange(0, M - 1))
    n = StateDescriptor("n", "value", pa.int64())
    jd.commit(Manifest("job", 0, 0, {"t": OperatorCheckpoint("t", M, 1, (("k", str(t)),), (n.to_json(),), (f,))}))
    lookup = StateLookup(jd)
    for i, (v, text) in enumerate(zip(values, texts, strict=True)):
        assert lookup.get("t", v)["state"] == {"n": i + 1}, v
        if t != pa.binary():  # bytes from text are its UTF-8
            assert lookup.get("t", text)["state"] == {"n": i + 1}, text


def test_cli_state_get(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from keyscale.cli.main import main as cli

    jd = _job(tmp_path / "job")
    model = _model(jd, 3)
    live = sorted(model)[:2]
    assert cli(["state", "get", str(tmp_path / "job"), "--uid", "op", *live, "nobody", "--compact"]) == 0
    answers = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [a["key"]["user"] for a in answers] == [*live, "nobody"]
    for a in answers:
        _check(a, model.get(a["key"]["user"]), 3)
    assert cli(["state", "get", str(tmp_path / "job"), "--uid", "op", "--checkpoint", "1", live[0]]) == 0
    assert json.loads(capsys.readouterr().out)["batch"] == 1
    assert cli(["state", "get", str(tmp_path / "job"), "--uid", "nope", "u1"]) != 0
    assert "operator 'nope' does not exist" in capsys.readouterr().err


def test_a_small_delta_is_read_whole_once_and_serves_every_key_group_after(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lookup reads its key group's whole chain; a delta small enough is read whole the
    first time and kept, so a later lookup of another key group of the same deltas asks the
    store for its snapshot's record batch alone (one request, not one per chain file)."""
    import keyscale.checkpoint.files as files

    monkeypatch.setattr(files, "CHUNK_ROWS", 256)
    jd = _job(tmp_path / "job", users=4000)
    model = _model(jd, 3)
    store = open_store(tmp_path / "job", "job directory")
    asked: list[list[str]] = []
    get_ranges = store.get_ranges

    def counted(reads: Any) -> list[bytes]:
        asked.append([key for key, _, _ in reads])
        return get_ranges(reads)

    store.get_ranges = counted  # type: ignore[method-assign]
    lookup = StateLookup(store)
    # Two keys of key groups 8-11: one subtask's range at parallelism 4, whose chain is the
    # snapshot of batch 0 and the deltas of batches 1 and 3 (all three cover both keys).
    kgs = {u: key_groups(pa.table({"user": [u]}), ["user"], ["string"], M)[0] for u in model}
    first, second = [next(u for u in sorted(model) if kgs[u] == kg) for kg in (8, 9)]
    _check(lookup.get("op", first), model[first], 3)
    assert any(".delta" in k or "-delta" in k for call in asked for k in call)
    asked.clear()
    _check(lookup.get("op", second), model[second], 3)
    assert [[k.rsplit("/", 1)[-1] for k in call] for call in asked] == [["000000000000-s00001-snapshot.arrow"]]


# -- S3: only the key group's byte range is read ------------------------------------------------


class _Counting:
    """Counts what a store is asked for: whole reads and ranged bytes."""

    def __init__(self, store: Store):
        self.ranged = 0
        self.whole: list[str] = []
        get, get_range = store.get, store.get_range

        def counted_range(key: str, start: int, length: int) -> bytes:
            data = get_range(key, start, length)
            self.ranged += len(data)
            return data

        def counted_get(key: str) -> bytes:
            if key.startswith("state/"):
                self.whole.append(key)
            return get(key)

        store.get_range = counted_range  # type: ignore[method-assign]
        store.get = counted_get  # type: ignore[method-assign]


@pytest.mark.s3
def test_lookups_on_s3_read_only_the_key_groups_byte_range(s3_bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import keyscale.checkpoint.files as files
    import keyscale.checkpoint.ranged as ranged

    monkeypatch.setattr(files, "CHUNK_ROWS", 256)  # many record batches in a small file
    monkeypatch.setattr(ranged, "WHOLE_DELTA_BYTES", 0)  # deltas by byte range too (the next test: small ones whole)
    jd = _job(f"{s3_bucket}/job", users=20000)
    model = _model(jd, 3)
    store = open_store(f"{s3_bucket}/job", "job directory")
    counting = _Counting(store)
    lookup = StateLookup(store)
    m = jd.read_manifest(3)
    for user in ["u1", "u2", "u3999", "nobody"]:
        before = counting.ranged
        answer = lookup.get("op", user)
        _check(answer, model.get(user), 3)
        chain = [f for f in m.operators["op"].files if f.start <= answer["key_group"] <= f.end]
        # per file of the key group's chain: its footer, then the record batches holding the key
        # group (about 20000 / 16 rows: up to 6 batches of 256 rows; of a snapshot, with fences,
        # the one or two that can hold the key), each read whole in one request
        per_batch = [max(files.tail_bytes(f), f.bytes * 256 // max(f.rows, 1) * 5 // 4) for f in chain]
        assert counting.ranged - before <= sum(files.tail_bytes(f) + (2 if f.kind == "snapshot" else 6) * b
                                               for f, b in zip(chain, per_batch, strict=True))
        assert counting.ranged - before < sum(f.bytes for f in chain) / 3
    assert counting.whole == []  # never a whole state file
    again = counting.ranged
    lookup.get("op", "u1")
    assert counting.ranged == again  # a hot slice: from the cache


# -- a running job: JobHandle.state, GET /state/<uid>, live rescale ----------------------------


class Tracker(ks.KeyedProcessFunction):
    def open(self, ctx: Any) -> None:
        self.total = ctx.value_state("total", "long", ttl_seconds=3600)
        self.recent = ctx.list_state("recent", "long")
        self.seen = ctx.map_state("seen", "string", "long")

    def process(self, key: Any, rows: Any, ctx: Any) -> Any:
        total = (self.total.value() or 0) + sum(r.value for r in rows)
        self.total.update(total)
        self.recent.update((self.recent.get() + [r.value for r in rows])[-3:])
        for r in rows:
            bucket = f"b{r.value % 3}"
            self.seen.put(bucket, (self.seen.get(bucket) or 0) + 1)
        if key.endswith("1"):
            ctx.timer_service.register_processing_time_timer(4_000_000_000_000)
        return [(key, total)]

    def on_timer(self, key: Any, timestamp: int, ctx: Any) -> Any:
        return None


def _get(url: str, secret: str | None) -> tuple[int, dict[str, Any]]:
    headers = {"Authorization": f"Bearer {secret}"} if secret else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.spark
@pytest.mark.parametrize("where", ["local", pytest.param("s3", marks=pytest.mark.s3)])
def test_a_running_job_answers_lookups_through_a_live_rescale(spark: Any, tmp_path: Path, where: str, request: pytest.FixtureRequest) -> None:
    """On local disk and with the job directory on the S3 server: lookups while the job runs
    and rescales live equal the whole read of the checkpoint they name; ``keyscale state
    serve``'s equal ``JobHandle.state``'s."""
    from keyscale.runtime.control.auth import read_secret

    job_dir = f"{request.getfixturevalue('s3_bucket')}/job" if where == "s3" else str(tmp_path / "job")
    write_events(tmp_path / "in", files=1, rows=400, keys=40)
    events = spark.readStream.schema("key string, value long, ts timestamp").parquet(str(tmp_path / "in"))
    job = (ks.stream(events).key_by("key").process(Tracker(), "key string, total long", uid="tracker")
           .sink(ks.sinks.NoopSink()).start(job_dir, 2, trigger_interval="200 milliseconds"))
    jd = JobDir(job_dir)
    try:
        deadline = time.time() + 180
        while not jd.manifest_batches() and time.time() < deadline:
            time.sleep(0.2)
        job.rescale(3)
        write_events(tmp_path / "in", files=1, rows=400, keys=60, first=1)
        while time.time() < deadline:
            m = jd.latest_manifest()
            if m is not None and m.batch >= 1 and m.operators["tracker"].parallelism == 3:
                break
            time.sleep(0.2)
        # The job's own last committed checkpoint may trail its manifest on disk by a moment.
        while job.state("tracker", "k1")["batch"] < m.batch and time.time() < deadline:
            time.sleep(0.1)
        keys = [f"k{i}" for i in range(62)]
        answers = {k: job.state("tracker", k) for k in keys}
        batch = answers["k1"]["batch"]
        assert jd.read_manifest(batch).operators["tracker"].parallelism == 3  # after the live rescale
        assert batch >= 1 and answers["k1"]["found"] and answers["k1"]["timers"] == {"processing_time": [4_000_000_000_000]}
        ttl = answers["k1"]["ttl"]["total"]
        assert ttl["expires_ms"] - ttl["clock_ms"] == 3_600_000
        assert not answers["k61"]["found"]

        secret = read_secret(jd.store)
        url = jd.read_json("control/http.json")["url"]
        assert _get(f"{url}/state/tracker?key=k1", None)[0] == 401
        code, body = _get(f"{url}/state/tracker?key=k1", secret)
        assert code == 200 and body["batch"] >= batch
        if body["batch"] == batch:
            assert body == answers["k1"]
        code, body = _get(f"{url}/state/tracker?key=k2&key=k61", secret)
        assert code == 200 and [a["found"] for a in body["answers"]] == [True, False]
        code, body = _get(f"{url}/state/nope?key=k1", secret)
        assert code == 404 and "operator 'nope' does not exist" in body["error"] and "'tracker'" in body["error"]
        code, body = _get(f"{url}/state/tracker", secret)
        assert code == 400
        # keyscale state serve: the same answers from a server that only reads the job directory.
        served = LookupServer(job_dir, token=BearerToken(value="serve-token"), max_age=0)
        code, body = _get(f"{served.url}/state/tracker?key=k1", "serve-token")
        assert code == 200 and body["batch"] >= batch and body["found"]
    finally:
        job.stop(timeout=120)
    try:  # the job ended: both answer from its last checkpoint
        code, body = _get(f"{served.url}/state/tracker?" + "&".join(f"key={k}" for k in keys), "serve-token")
        assert code == 200 and body["answers"] == [job.state("tracker", k) for k in keys]
    finally:
        served.close()

    # The model: the whole read of the same checkpoint.
    rows = read_keyed_state(spark, job_dir, "tracker", flatten=False, checkpoint=batch).collect()
    model = {r["key"]: r for r in rows}
    assert {k for k, a in answers.items() if a["found"]} == set(model)
    for k, r in model.items():
        a = answers[k]
        assert a["batch"] == batch and a["key_group"] == r["key_group"]
        assert a["state"] == {"total": r["total"], "recent": r["recent"], "seen": dict(r["seen"])}
    assert job.state("tracker", "k1")["batch"] >= batch  # after the job ended: its last checkpoint


def test_a_window_operators_key_answers_its_open_windows(tmp_path: Path) -> None:
    jd = JobDir(tmp_path / "job")
    jd.claim("job", M, M)
    table = pa.table({"user": ["ann", "ann", "bob"], "window_start": pa.array([60_000, 0, 0], pa.int64()),
                      "n": pa.array([2, 5, 1], pa.int64()), "window_end": pa.array([120_000, 60_000, 60_000], pa.int64()),
                      "fired": [False, True, False]})
    kgs = key_groups(table, ["user"], ["string"], M)  # a window's start is not part of the key group
    table = table.add_column(2, KG_COLUMN, pa.array(kgs, pa.int32())).sort_by(KG_COLUMN)
    f = write_state_file(jd.store, "state/w/000000000000-s00000-snapshot.arrow", table, "snapshot", 0, KeyGroupRange(0, M - 1))
    states = [StateDescriptor("n", "value", pa.int64()), StateDescriptor("window_end", "value", pa.int64()),
              StateDescriptor("fired", "value", pa.bool_())]
    op = OperatorCheckpoint("w", M, 1, (("user", "string"), ("window_start", "int64")), tuple(s.to_json() for s in states), (f,))
    jd.commit(Manifest("job", 0, 0, {"w": op}))
    answer = StateLookup(jd).get("w", "ann")
    assert answer["key"] == {"user": "ann"} and answer["key_group"] == int(kgs[0])
    assert answer["windows"] == [{"window_start": 0, "window_end": 60_000, "fired": True, "state": {"n": 5}},
                                 {"window_start": 60_000, "window_end": 120_000, "fired": False, "state": {"n": 2}}]


def test_a_deltas_slice_is_read_once_for_every_key_of_its_key_group(tmp_path: Path) -> None:
    """Fences narrow a snapshot's read to the key; a delta's rows of a key group are read
    whole, so a second key of the same key group takes them from the cache."""
    from keyscale.state.spark_hash import key_group_of

    jd = _job(tmp_path / "job", users=2000)
    m = jd.read_manifest(3)
    by_kg: dict[int, list[str]] = {}
    for i in range(2000):
        by_kg.setdefault(key_group_of([f"u{i}"], ["string"], M), []).append(f"u{i}")
    kg, users = next((kg, us) for kg, us in by_kg.items() if len(us) >= 2)
    chain = [f for f in m.operators["op"].files if f.start <= kg <= f.end]
    deltas = sum(f.kind == "delta" for f in chain)
    assert deltas >= 1
    lookup = StateLookup(jd.store)
    lookup.get("op", users[0])
    hits = lookup.cache.hits
    lookup.get("op", users[1])
    assert lookup.cache.hits - hits >= deltas


class _Rounds:
    """Counts a store's rounds of ranged reads (``get_ranges`` calls) and the reads in them."""

    def __init__(self, store: Store):
        self.rounds: list[int] = []
        get_ranges = store.get_ranges

        def counted(reads: Any) -> list[bytes]:
            self.rounds.append(len(reads))
            return get_ranges(reads)

        store.get_ranges = counted  # type: ignore[method-assign]


def test_a_lookup_reads_its_chain_in_one_round_and_a_cached_batch_in_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Footers once (one round for every file of the chain), then one round per lookup for
    every file's record batches; another key of the same record batches reads nothing."""
    import keyscale.checkpoint.files as files
    from keyscale.checkpoint.manifest import restore_chain
    from keyscale.checkpoint.ranged import plan_read, read_footers
    from keyscale.state.order import sort_keys
    from keyscale.state.spark_hash import key_group_of

    monkeypatch.setattr(files, "CHUNK_ROWS", 64)
    jd = _job(tmp_path / "job", users=3000)
    lookup = StateLookup(jd.store)
    rounds = _Rounds(jd.store)
    m = jd.read_manifest(3)
    model = _model(jd, 3)
    users = [f"u{i}" for i in range(3000)]
    kg = key_group_of(["u1"], ["string"], M)
    chain = restore_chain(m.operators["op"].files, kg)
    assert len(chain) >= 2
    assert lookup.get("op", "u1", checkpoint=3)["found"] == ("u1" in model)
    assert rounds.rounds[0] == len(chain) and len(rounds.rounds) == 2  # the footers, then the record batches
    # Another key of the same key group, in another record batch of the snapshot: one round.
    same_kg = [u for u in users if key_group_of([u], ["string"], M) == kg]
    probe = {u: int(sort_keys(np.array([kg]), pa.array([u]))[0]) for u in same_kg}
    footers = read_footers(jd.store, chain)
    rng = KeyGroupRange(kg, kg)
    batch_of = {u: tuple(None if (p := plan_read(f, ft, rng, probe[u])) is None else p.batches for f, ft in zip(chain, footers, strict=True))
                for u in same_kg}  # per file of the chain, the record batches the key reads (a fenced file: of its key)
    other = next(u for u in same_kg if batch_of[u] != batch_of["u1"])
    before = len(rounds.rounds)
    lookup.get("op", other, checkpoint=3)
    assert len(rounds.rounds) == before + 1  # one round: the batches not cached yet, of every file at once
    mate = next(u for u in same_kg if u not in ("u1", other) and batch_of[u] == batch_of["u1"])
    before = len(rounds.rounds)
    answer = lookup.get("op", mate, checkpoint=3)
    assert len(rounds.rounds) == before  # the same record batch: from the cache
    assert answer["found"] == (mate in model)
