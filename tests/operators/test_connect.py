"""Two keyed inputs in one stage: a co-process function (enrichment) and the interval
join, on real Spark, across a live rescale and a restart."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from conftest import read_output, run_job, write_input_file
from keyscale.checkpoint.jobdir import JobDir

pytestmark = [pytest.mark.spark, pytest.mark.slow]

JOB = '''
import keyscale as ks

NAME = "connected"

class Enrich(ks.KeyedCoProcessFunction):
    """Clicks get the user's latest name; a click before any name waits for it."""
    def open(self, ctx):
        self.name = ctx.value_state("name", "string")
        self.waiting = ctx.list_state("waiting", "string")
    def process_element1(self, row, ctx):
        self.name.update(row["name"])
        for page in self.waiting.get():
            yield (ctx.key, row["name"], page)
        self.waiting.update([])
    def process_element2(self, row, ctx):
        if self.name.value() is None:
            self.waiting.add(row["page"])
        else:
            yield (ctx.key, self.name.value(), row["page"])

class VEnrich(ks.VectorizedKeyedCoProcessFunction):
    """Enrich, a batch at a time: a batch's names apply before its clicks (as the combined
    order has them); unnamed users' clicks wait in an array state."""
    input_columns1 = ["name"]
    input_columns2 = ["page"]
    def open(self, ctx):
        self.name = ctx.value_state("name", "string")
        self.waiting = ctx.value_state("waiting", "array<string>")
    def process_batch(self, b):
        import numpy as np, pandas as pd
        users = b.keys["id"].to_numpy(dtype=object)
        name = b.state["name"].to_numpy(dtype=object, na_value=None).copy()
        waiting = [list(w) if isinstance(w, (list, np.ndarray)) else [] for w in b.state["waiting"]]
        order = np.argsort(b.positions1, kind="stable")
        name[b.codes1[order]] = b.records1["name"].to_numpy(dtype=object)[order]
        out = [(users[j], name[j], p) for j in np.unique(b.codes1) for p in waiting[j]]
        for j in np.unique(b.codes1):
            waiting[j] = []
        pages = b.records2["page"].to_numpy(dtype=object)
        for j, p in zip(b.codes2, pages):
            if name[j] is None:
                waiting[j].append(p)
            else:
                out.append((users[j], name[j], p))
        state = {"name": pd.Series(name, dtype=object), "waiting": pd.Series([w or None for w in waiting], dtype=object)}
        return state, pd.DataFrame(out, columns=["user", "name", "page"])

def build(ctx):
    read = lambda name, schema: ctx.spark.readStream.schema(schema).option("maxFilesPerTrigger", 1).parquet(ctx.arg(name))
    users = ks.stream(read("users", "id string, name string, ts timestamp")).with_watermark("ts", "1 hour")
    clicks = ks.stream(read("clicks", "user string, page string, ts timestamp")).with_watermark("ts", "1 hour")
    if ctx.arg("mode") in ("enrich", "venrich"):
        fn = Enrich() if ctx.arg("mode") == "enrich" else VEnrich()
        out = users.connect(clicks).key_by("id", "user").process(fn, "user string, name string, page string", uid="enrich")
    elif ctx.arg("mode") == "window":
        out = users.connect(clicks).key_by("id", "user").window_join(ks.windows.TumblingWindows("1 minute"), uid="wjoin")
    else:
        out = users.connect(clicks).key_by("id", "user").interval_join("-30 seconds", "1 minute", uid="join")
    return out.sink(ks.sinks.ParquetSink(ctx.arg("output")))
'''

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def _write(folder: Path, batches: list[list[dict[str, Any]]], schema: pa.Schema) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for i, rows in enumerate(batches):
        write_input_file(pa.Table.from_pylist(rows, schema=schema), folder / f"part-{i:05d}.parquet", i)


USERS = pa.schema([("id", pa.string()), ("name", pa.string()), ("ts", pa.timestamp("us", tz="UTC"))])
CLICKS = pa.schema([("user", pa.string()), ("page", pa.string()), ("ts", pa.timestamp("us", tz="UTC"))])


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[list[dict[str, Any]]], list[list[dict[str, Any]]]]:
    root = tmp_path_factory.mktemp("connect")
    users, clicks = [], []
    for b in range(6):
        # Users u0..u19 named in batch b under "n<b>" if (i + b) % 3 == 0; clicks of every user.
        users.append([{"id": f"u{i}", "name": f"n{b}-{i}", "ts": T0 + dt.timedelta(seconds=60 * b + i)} for i in range(20) if (i + b) % 3 == 0])
        clicks.append([{"user": f"u{(i * 7 + b) % 20}", "page": f"p{b}-{i}", "ts": T0 + dt.timedelta(seconds=60 * b + i * 2)} for i in range(25)])
    _write(root / "users", users, USERS)
    _write(root / "clicks", clicks, CLICKS)
    return root / "users", root / "clicks", users, clicks


def _expected_enrich(users: list[list[dict[str, Any]]], clicks: list[list[dict[str, Any]]]) -> list[tuple[str, str, str]]:
    """Batch by batch: a batch's names apply before its clicks only where the model says
    so: each key's rows in a batch in the combined order, names (first input) first."""
    name: dict[str, str] = {}
    waiting: dict[str, list[str]] = {}
    out = []
    for ub, cb in zip(users, clicks, strict=True):
        for u in ub:
            name[u["id"]] = u["name"]
            out += [(u["id"], u["name"], p) for p in waiting.pop(u["id"], [])]
        for c in cb:
            if c["user"] in name:
                out.append((c["user"], name[c["user"]], c["page"]))
            else:
                waiting.setdefault(c["user"], []).append(c["page"])
    return sorted(out)


def _rescale_after_batch_1(jd: JobDir) -> Callable[[Any], None]:
    """An ``on_batch`` asking the job for parallelism 3 once batch 1 has committed."""
    def rescale(rec: Any) -> None:
        if rec.batch == 1:
            jd.request_rescale(3)
    return rescale


def _job(tmp_path: Path) -> Path:
    path = tmp_path / "connected.py"
    path.write_text(JOB)
    return path


@pytest.mark.parametrize("mode", ["enrich", "venrich"])
def test_co_process_enrichment_is_the_same_across_a_live_rescale(spark: Any, inputs: Any, tmp_path: Path, mode: str) -> None:
    """Per record (KeyedCoProcessFunction) and a batch at a time (VectorizedKeyedCoProcessFunction)."""
    users_dir, clicks_dir, users, clicks = inputs
    job = _job(tmp_path)
    args = {"users": str(users_dir), "clicks": str(clicks_dir), "mode": mode}
    run_job(job, tmp_path / "a", 2, {**args, "output": str(tmp_path / "out-a")})
    jd = JobDir(tmp_path / "b")
    rescale = _rescale_after_batch_1(jd)

    summary = run_job(job, tmp_path / "b", 2, {**args, "output": str(tmp_path / "out-b")}, rescale)
    assert any(r[1] == "enrich" and r[3] == 3 for r in summary.rescales)
    a, b = read_output(tmp_path / "out-a"), read_output(tmp_path / "out-b")
    assert sorted(zip(a["user"], a["name"], a["page"], strict=True)) == _expected_enrich(users, clicks)
    assert a.drop(columns="batch").equals(b.drop(columns="batch"))


def test_vectorized_co_process_restored_from_a_savepoint_at_another_parallelism(spark: Any, inputs: Any, tmp_path: Path) -> None:
    """The names and waiting clicks of a batch-at-a-time co-process function move with a
    savepoint restored at P=3: what it emits after equals the rest of an uninterrupted run."""
    from keyscale.checkpoint.savepoint import write_savepoint

    users_dir, clicks_dir, users, clicks = inputs
    job = _job(tmp_path)
    args = {"users": str(users_dir), "clicks": str(clicks_dir), "mode": "venrich"}
    run_job(job, tmp_path / "a", 2, {**args, "output": str(tmp_path / "out-a")}, retain=20)
    a = JobDir(tmp_path / "a")
    sp = write_savepoint(a, a.read_manifest(2), tmp_path / "sp")
    run_job(job, tmp_path / "b", 3, {**args, "output": str(tmp_path / "out-b")}, from_savepoint=str(sp))
    whole, after = read_output(tmp_path / "out-a"), read_output(tmp_path / "out-b")
    rows = lambda df: sorted(zip(df["user"], df["name"], df["page"], strict=True))  # noqa: E731
    assert rows(whole) == _expected_enrich(users, clicks)
    # The restored query may take the remaining files in fewer batches (a batch's names
    # apply to all of its clicks), so the model follows the batches it ran.
    later = len(set(after.batch))
    assert later in (1, 3)
    merged = lambda batches: batches if later == 3 else [*batches[:3], [r for b in batches[3:] for r in b]]  # noqa: E731
    users_b, clicks_b = merged(users), merged(clicks)
    assert len(after) > 0 and sorted(rows(whole[whole.batch <= 2]) + rows(after)) == _expected_enrich(users_b, clicks_b)


def test_interval_join_matches_a_plain_join_and_forgets_old_rows(spark: Any, inputs: Any, tmp_path: Path) -> None:
    users_dir, clicks_dir, users, clicks = inputs
    out = run_job(_job(tmp_path), tmp_path / "job", 2,
                  {"users": str(users_dir), "clicks": str(clicks_dir), "mode": "join", "output": str(tmp_path / "out")}, drain_at_end=True)
    assert out.batches
    got = read_output(tmp_path / "out")
    pairs = sorted(zip(got["id"], got["name"], got["page"], strict=True))
    want = sorted((u["id"], u["name"], c["page"]) for u in (u for b in users for u in b) for c in (c for b in clicks for c in b)
                  if u["id"] == c["user"] and u["ts"] - dt.timedelta(seconds=30) <= c["ts"] <= u["ts"] + dt.timedelta(minutes=1))
    assert pairs == want
    # The drain at the end moves the watermark past every row: each row's timer removed it.
    from keyscale.state_processor.read import read_keyed_state

    for side in ("left", "right"):
        assert read_keyed_state(spark, tmp_path / "job", "join", state=side).count() == 0


def test_window_join_pairs_rows_of_one_window_across_a_live_rescale(spark: Any, inputs: Any, tmp_path: Path) -> None:
    users_dir, clicks_dir, users, clicks = inputs
    jd = JobDir(tmp_path / "job")
    rescale = _rescale_after_batch_1(jd)

    summary = run_job(_job(tmp_path), tmp_path / "job", 2, {"users": str(users_dir), "clicks": str(clicks_dir), "mode": "window",
                      "output": str(tmp_path / "out")}, rescale, drain_at_end=True)
    assert any(r[1] == "wjoin" and r[3] == 3 for r in summary.rescales)
    got = read_output(tmp_path / "out")
    minute = lambda t: int(t.timestamp()) // 60  # noqa: E731
    assert sorted(zip(got["id"], got["page"], (minute(t) for t in got["window_start"]), strict=True)) == sorted(
        (u["id"], c["page"], minute(u["ts"])) for u in (u for b in users for u in b) for c in (c for b in clicks for c in b)
        if u["id"] == c["user"] and minute(u["ts"]) == minute(c["ts"]))
    assert ((got["window_end"] - got["window_start"]).dt.total_seconds() == 60).all()
    from keyscale.state_processor.read import read_keyed_state

    for side in ("left", "right"):
        assert read_keyed_state(spark, tmp_path / "job", "wjoin", state=side).count() == 0


def test_interval_join_restored_from_a_savepoint_at_another_parallelism(spark: Any, inputs: Any, tmp_path: Path) -> None:
    """The rows waiting in the join's state move with a savepoint taken mid-stream and
    restored at P=3: the pairs after it plus those before are the whole join."""
    from keyscale.checkpoint.savepoint import write_savepoint

    users_dir, clicks_dir, _, _ = inputs
    job = _job(tmp_path)
    args = {"users": str(users_dir), "clicks": str(clicks_dir), "mode": "join"}
    run_job(job, tmp_path / "a", 2, {**args, "output": str(tmp_path / "out-a")}, retain=20)  # keep checkpoint 2
    a = JobDir(tmp_path / "a")
    sp = write_savepoint(a, a.read_manifest(2), tmp_path / "sp")
    run_job(job, tmp_path / "b", 3, {**args, "output": str(tmp_path / "out-b")}, from_savepoint=str(sp))
    whole, after = read_output(tmp_path / "out-a"), read_output(tmp_path / "out-b")
    pairs = lambda df: sorted(zip(df["id"], df["page"], strict=True))  # noqa: E731
    assert len(after) > 0
    assert pairs(whole) == sorted(pairs(whole[whole.batch <= 2]) + pairs(after))


JOB_LOGS = '''
import keyscale as ks

NAME = "connected_logs"

def build(ctx):
    cap = int(ctx.arg("cap"))
    users = ks.stream(ks.sources.log_source(ctx.arg("users"), uid="users", max_records_per_batch=cap)).with_watermark("ts", "1 hour")
    clicks = ks.stream(ks.sources.log_source(ctx.arg("clicks"), uid="clicks", max_records_per_batch=cap)).with_watermark("ts", "1 hour")
    clicks = clicks.filter("page != 'p0-0'")  # each input keeps its own steps
    out = users.connect(clicks).key_by("id", "user").interval_join("-30 seconds", "1 minute", uid="join")
    return out.sink(ks.sinks.ParquetSink(ctx.arg("output")))
'''


@pytest.fixture(scope="module")
def logs(inputs: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[tuple[str, str, str]]]:
    """The same users and clicks in two logs (1 and 2 partitions), and the plain join of them."""
    from keyscale.sources.log import create_log

    _, _, users, clicks = inputs
    root = tmp_path_factory.mktemp("connect-logs")
    ulog, clog = create_log(root / "users", USERS, partitions=1), create_log(root / "clicks", CLICKS, partitions=2)
    for ub, cb in zip(users, clicks, strict=True):
        ulog.append(0, pa.Table.from_pylist(ub, schema=USERS))
        for p in (0, 1):
            clog.append(p, pa.Table.from_pylist(cb[p::2], schema=CLICKS))
    want = sorted((u["id"], u["name"], c["page"]) for u in (u for b in users for u in b) for c in (c for b in clicks for c in b)
                  if u["id"] == c["user"] and c["page"] != "p0-0"
                  and u["ts"] - dt.timedelta(seconds=30) <= c["ts"] <= u["ts"] + dt.timedelta(minutes=1))
    return root / "users", root / "clicks", want


def _pairs(folder: Path) -> list[tuple[str, str, str]]:
    got = read_output(folder)
    return sorted(zip(got["id"], got["name"], got["page"], strict=True))


def test_interval_join_of_two_logs_is_the_plain_join_across_a_live_rescale(spark: Any, logs: Any, tmp_path: Path) -> None:
    users, clicks, want = logs
    job = tmp_path / "logs.py"
    job.write_text(JOB_LOGS)
    jd = JobDir(tmp_path / "job")
    rescale = _rescale_after_batch_1(jd)

    summary = run_job(job, tmp_path / "job", 2, {"users": str(users), "clicks": str(clicks), "cap": "20", "output": str(tmp_path / "out")},
                      rescale, drain_at_end=True)
    assert len(summary.batches) >= 4  # 20 records per partition and batch: the logs take several batches
    assert any(r[1] == "join" and r[3] == 3 for r in summary.rescales)
    assert _pairs(tmp_path / "out") == want
    from keyscale.state_processor.read import read_keyed_state

    for side in ("left", "right"):
        assert read_keyed_state(spark, tmp_path / "job", "join", state=side).count() == 0


def test_interval_join_of_two_logs_resumes_exactly_once_after_a_kill(spark: Any, logs: Any, tmp_path: Path) -> None:
    import signal

    from conftest import cli, cli_here

    users, clicks, want = logs
    job = tmp_path / "logs.py"
    job.write_text(JOB_LOGS)
    base = ["run", str(job), "--job-dir", str(tmp_path / "job"), "-p", "2", "--until-idle", "--set", f"users={users}",
            "--set", f"clicks={clicks}", "--set", "cap=20", "--set", f"output={tmp_path / 'out'}"]
    crashed = cli(*base, "--fault", "after-sink:2")
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    cli_here(*base, "--drain-at-end", check=True)  # a new driver: the killed one's JVM went with it
    out = read_output(tmp_path / "out")
    assert not out.duplicated(["id", "page"]).any()
    assert _pairs(tmp_path / "out") == want


def test_a_vectorized_co_process_reading_a_column_its_input_lacks_is_refused(spark: Any, inputs: Any) -> None:
    import keyscale as ks
    from keyscale.errors import JobDefinitionError

    users_dir, clicks_dir, _, _ = inputs

    class Reads(ks.VectorizedKeyedCoProcessFunction):
        input_columns2 = ("page", "referrer")

    users = ks.stream(spark.readStream.schema("id string, name string, ts timestamp").parquet(str(users_dir)))
    clicks = ks.stream(spark.readStream.schema("user string, page string, ts timestamp").parquet(str(clicks_dir)))
    with pytest.raises(JobDefinitionError, match="operator 'v': input_columns2 names 'referrer', which is not a column of the second input"):
        users.connect(clicks).key_by("id", "user").process(Reads(), "user string", uid="v")
