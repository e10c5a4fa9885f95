"""The ``keyscale`` Spark data source (issue 37, items 2 and 3) over real jobs, against models:
its scan equals what the job committed (``read_keyed_state`` of the same checkpoint) and a
Python model of the input, at parallelism 1 and 3 and during a live rescale (local disk and S3); a single-key
filter plans one input partition of one key group; the change feed between two batches
equals the diffs of the checkpoints between them. Options are checked, errors name them.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

import keyscale as ks
from conftest import marks_callers, write_events
from keyscale.checkpoint.jobdir import JobDir
from keyscale.state.spark_hash import key_group_of
from keyscale.state_processor import read_keyed_state
from keyscale.state_processor.datasource import PUSHDOWN_CONF, check_options, register
from keyscale.state_processor.scan import open_scan

SCHEMA = "key string, value long, ts timestamp"


class Totals(ks.KeyedProcessFunction):
    def open(self, ctx: Any) -> None:
        self.total = ctx.value_state("total", "long")
        self.seen = ctx.value_state("seen", "long")

    def process(self, key: Any, rows: Any, ctx: Any) -> Any:
        total = (self.total.value() or 0) + sum(r.value for r in rows)
        self.total.update(total)
        self.seen.update((self.seen.value() or 0) + len(rows))
        return [(key, total)]


def _model(folder: Path) -> dict[str, tuple[int, int]]:
    """Per key, (sum of values, records): what the job's state holds after the whole input."""
    out: dict[str, tuple[int, int]] = {}
    for f in sorted(folder.glob("part-*.parquet")):
        for r in pq.read_table(f).to_pylist():
            total, n = out.get(r["key"], (0, 0))
            out[r["key"]] = (total + r["value"], n + 1)
    return out


@pytest.fixture
def spark(spark: Any) -> Any:
    """The tests' session with the data source registered, as a user's session registers it."""
    register(spark)
    return spark


def _read(spark: Any, job: Path, **options: Any) -> Any:
    reader = spark.read.format("keyscale").option("uid", "totals")
    for k, v in options.items():
        reader = reader.option(k, str(v))
    return reader.load(str(job))


def _rows(df: Any) -> dict[str, tuple[int, int, int]]:
    return {r["key"]: (r["key_group"], r["total"], r["seen"]) for r in df.collect()}


def _changes(before: dict[str, tuple[int, int, int]], after: dict[str, tuple[int, int, int]], batch: int) -> set[tuple[Any, ...]]:
    out = set()
    for k in set(before) | set(after):
        old, new = before.get(k), after.get(k)
        if old != new:
            kind = "insert" if old is None else "delete" if new is None else "update"
            out.add((k, batch, kind, None if old is None else old[1:], None if new is None else new[1:]))
    return out


def _run(spark: Any, inp: Path, job: Path, parallelism: int) -> None:
    events = spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1).parquet(str(inp))
    handle = (ks.stream(events).key_by("key").process(Totals(), "key string, total long", uid="totals")
              .sink(ks.sinks.NoopSink()).start(str(job), parallelism, until_idle=True, retain=50, max_chain=2))
    assert handle.await_termination(300)


@pytest.mark.parametrize("parallelism", [1, 3])
def test_a_scan_equals_what_the_job_committed_and_the_change_feed_its_diffs(spark: Any, tmp_path: Path, parallelism: int) -> None:
    from pyspark.sql import functions as F

    write_events(tmp_path / "in", files=2, rows=300, keys=20, seed=parallelism)
    write_events(tmp_path / "in", files=2, rows=300, keys=50, seed=parallelism, first=2)  # new keys: inserts
    _run(spark, tmp_path / "in", tmp_path / "job", parallelism)
    jd = JobDir(tmp_path / "job")
    batches = jd.manifest_batches()
    assert len(batches) >= 4
    written = [f for b in batches for f in jd.read_manifest(b).operators["totals"].files if f.batch == b]
    assert {f.kind for f in written if f.batch > batches[0]} == {"delta", "snapshot"}  # the feed diffs compactions too
    model = _model(tmp_path / "in")

    df = _read(spark, tmp_path / "job")
    committed = {r["key"]: (r["key_group"], r["total"], r["seen"]) for r in read_keyed_state(spark, str(tmp_path / "job"), "totals").collect()}
    assert _rows(df) == committed
    assert {k: v[1:] for k, v in committed.items()} == model
    assert df.rdd.getNumPartitions() >= parallelism

    # One key: one input partition, of that key's key group.
    one = df.where(F.col("key") == "k7")
    assert one.rdd.getNumPartitions() == 1 and [r["total"] for r in one.collect()] == [model["k7"][0]]
    kg = key_group_of(["k7"], ["string"], open_scan(tmp_path / "job", "totals").max_parallelism)
    assert {r["key_group"] for r in one.select("key_group").collect()} == {kg}
    two = df.where(F.col("key").isin("k7", "k8", "nobody"))
    assert two.rdd.getNumPartitions() <= 3 and {r["key"] for r in two.collect()} == {"k7", "k8"}

    # A named checkpoint, and SQL.
    states = {b: _rows(_read(spark, tmp_path / "job", checkpoint=b)) for b in batches}
    for b in batches:
        want = {r["key"]: (r["key_group"], r["total"], r["seen"])
                for r in read_keyed_state(spark, str(tmp_path / "job"), "totals", checkpoint=b).collect()}
        assert states[b] == want
    spark.sql(f"CREATE OR REPLACE TEMPORARY VIEW totals USING keyscale OPTIONS (path '{tmp_path / 'job'}', uid 'totals')")
    assert spark.sql("SELECT sum(total) AS s, count(*) AS n FROM totals").collect()[0].asDict() == {
        "s": sum(t for t, _ in model.values()), "n": len(model)}
    table = f"totals_p{parallelism}"
    spark.sql(f"CREATE TABLE {table} USING keyscale OPTIONS (path '{tmp_path / 'job'}', uid 'totals', checkpoint '{batches[1]}')")
    try:
        assert _rows(spark.table(table)) == states[batches[1]]
        assert spark.sql(f"SELECT total FROM {table} WHERE key = 'k7'").collect() == [(states[batches[1]]["k7"][1],)]
    finally:
        spark.sql(f"DROP TABLE {table}")

    # The change feed between two batches: the diffs of the checkpoints between them.
    a, b = batches[0], batches[-1]
    feed = _read(spark, tmp_path / "job", changes_from=a, changes_to=b).collect()
    got = {(r["key"], r["batch"], r["change"], None if r["old"] is None else (r["old"]["total"], r["old"]["seen"]),
            None if r["new"] is None else (r["new"]["total"], r["new"]["seen"])) for r in feed}
    assert len(got) == len(feed)
    want = set().union(*(_changes(states[x], states[y], y) for x, y in itertools.pairwise(batches)))
    assert got == want and {g[2] for g in got} >= {"insert", "update"}
    one_key = _read(spark, tmp_path / "job", changes_from=a).where(F.col("key") == "k7")
    assert one_key.rdd.getNumPartitions() == 1
    assert sorted(r["batch"] for r in one_key.collect()) == sorted(w[1] for w in want if w[0] == "k7")


Read = Callable[..., list[dict[str, Any]]]  # the data source's rows (as dicts) for options: a scan or the change feed


def _scan_rows(rows: list[dict[str, Any]]) -> dict[str, tuple[int, int, int]]:
    return {r["key"]: (r["key_group"], r["total"], r["seen"]) for r in rows}


def _committed(job: str, batch: int) -> dict[str, tuple[int, int, int]]:
    """What checkpoint ``batch`` holds, read in this process (no Spark): to wait on."""
    scan = open_scan(job, "totals", checkpoint=batch)
    return _scan_rows([r for part in scan.parts() for r in scan.read(part).to_pylist()])


def _scans_through_a_live_rescale(spark: Any, inp: Path, job_dir: str, read: Read) -> None:
    """A job at P=2 scanned (``read``: the data source) while it runs, rescaled live to 3, then
    scanned again at the rescaled checkpoint that holds the whole input and at the newest one:
    the scans equal the model of the input and ``read_keyed_state`` of the same checkpoints,
    and the change feed between the two checkpoints is the model's diff."""
    write_events(inp, files=1, rows=300, keys=40)
    events = spark.readStream.schema(SCHEMA).parquet(str(inp))
    job = (ks.stream(events).key_by("key").process(Totals(), "key string, total long", uid="totals")
           .sink(ks.sinks.NoopSink()).start(job_dir, 2, trigger_interval="200 milliseconds", retain=50))
    jd = JobDir(job_dir)
    seen: dict[int, dict[str, tuple[int, int, int]]] = {}
    try:
        deadline = time.time() + 180
        while not jd.manifest_batches() and time.time() < deadline:
            time.sleep(0.2)
        first = jd.manifest_batches()[-1]
        seen[first] = _scan_rows(read(checkpoint=first))  # while the job runs
        job.rescale(3)
        write_events(inp, files=1, rows=300, keys=60, first=1)
        while time.time() < deadline:
            m = jd.latest_manifest()
            if m is not None and m.operators["totals"].parallelism == 3 and _model(inp) == {
                    k: v[1:] for k, v in _committed(job_dir, m.batch).items()}:
                break
            time.sleep(0.2)
        last = m.batch
        seen[last] = _scan_rows(read(checkpoint=last))
        live = _scan_rows(read())  # the newest checkpoint, while the job runs
        feed = read(changes_from=first, changes_to=last)
    finally:
        job.stop(timeout=120)
    assert jd.read_manifest(last).operators["totals"].parallelism == 3 and jd.read_manifest(first).operators["totals"].parallelism == 2
    assert {k: v[1:] for k, v in seen[last].items()} == _model(inp) == {k: v[1:] for k, v in live.items()}
    for b, rows in seen.items():
        assert rows == {r["key"]: (r["key_group"], r["total"], r["seen"])
                        for r in read_keyed_state(spark, job_dir, "totals", checkpoint=b).collect()}
    # What changed from the first checkpoint to the rescaled one: the model's diff, in total.
    first_old: dict[str, Any] = {}
    last_new: dict[str, Any] = {}
    for r in sorted(feed, key=lambda r: r["batch"]):
        first_old.setdefault(r["key"], r["old"])
        last_new[r["key"]] = r["new"]

    def pair(s: Any) -> Any:
        return None if s is None else (s["total"], s["seen"])

    assert last_new and {k: (pair(first_old[k]), pair(n)) for k, n in last_new.items()} == {
        k: (seen[first][k][1:] if k in seen[first] else None, v[1:]) for k, v in seen[last].items() if seen[first].get(k) != v}


def test_scans_of_a_running_job_through_a_live_rescale(spark: Any, tmp_path: Path) -> None:
    job = str(tmp_path / "job")

    def read(**options: Any) -> list[dict[str, Any]]:
        return [r.asDict(recursive=True) for r in _read(spark, Path(job), **options).collect()]

    _scans_through_a_live_rescale(spark, tmp_path / "in", job, read)


_S3_SCANS = """
import json, sys
from keyscale.runtime.driver.session import spark_session
from keyscale.state_processor import register

spark = spark_session("local[1]")
register(spark)
for line in sys.stdin:
    ask = json.loads(line)
    reader = spark.read.format("keyscale").option("uid", ask["uid"])
    for k, v in ask["options"].items():
        reader = reader.option(k, str(v))
    rows = [r.asDict(recursive=True) for r in reader.load(ask["path"]).collect()]
    print("@@" + json.dumps(rows), flush=True)
"""


class _Scans:
    """The data source in a Spark session of a child process started after the S3 settings
    are in the environment (this process's Spark workers predate them), kept for the test:
    each read is one line in, one line of rows out, so it reads while this process's job runs."""

    def __init__(self, uid: str, path: str):
        import subprocess
        import sys

        self.uid, self.path = uid, path
        self.proc = subprocess.Popen([sys.executable, "-c", _S3_SCANS], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def _answer(self) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("@@"):
                return line[2:]
        raise AssertionError(f"the reading process ended (exit {self.proc.wait()})")

    def __call__(self, **options: Any) -> list[dict[str, Any]]:
        import json

        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"uid": self.uid, "path": self.path, "options": options}) + "\n")
        self.proc.stdin.flush()
        return list(json.loads(self._answer()))

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()  # its loop ends, and the process with it
        try:
            self.proc.wait(timeout=120)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


@marks_callers("spark")
def _scans_in_a_new_session(uid: str, path: str) -> _Scans:
    return _Scans(uid, path)


def test_scans_of_a_running_job_on_s3_through_a_live_rescale(spark: Any, s3_bucket: str, tmp_path: Path) -> None:
    """The job in this process, its directory on the S3 server; the scans in a child's session."""
    read = _scans_in_a_new_session("totals", f"{s3_bucket}/job")
    try:
        _scans_through_a_live_rescale(spark, tmp_path / "in", f"{s3_bucket}/job", read)
    finally:
        read.close()


def test_options_keyscale_cannot_serve_are_errors_naming_them(spark: Any, tmp_path: Path) -> None:
    write_events(tmp_path / "in", files=1, rows=50, keys=5)
    _run(spark, tmp_path / "in", tmp_path / "job", 1)
    with pytest.raises(Exception, match="unknown option 'chekpoint'"):
        _read(spark, tmp_path / "job", chekpoint=0).collect()
    with pytest.raises(Exception, match=r"operator 'nope'.*'totals'"):
        spark.read.format("keyscale").option("uid", "nope").load(str(tmp_path / "job")).collect()
    with pytest.raises(Exception, match="checkpoint 99 does not exist"):
        _read(spark, tmp_path / "job", checkpoint=99).collect()
    assert check_options({"path": "p", "uid": "u", "checkpoint": "3", "batch": "3"})["checkpoint"] == 3
    # The rows' types are read_keyed_state's.
    assert _read(spark, tmp_path / "job").schema.simpleString() == read_keyed_state(spark, str(tmp_path / "job"), "totals").schema.simpleString()
    # A pushdown setting the user made is kept: with it off, every key group is read and Spark filters.
    try:
        spark.conf.set(PUSHDOWN_CONF, "false")
        register(spark)
        assert spark.conf.get(PUSHDOWN_CONF) == "false"
        one = _read(spark, tmp_path / "job", partitions=3).where("key = 'k1'")
        assert one.rdd.getNumPartitions() == 3 and [r["key"] for r in one.collect()] == ["k1"]
    finally:
        spark.conf.unset(PUSHDOWN_CONF)
        register(spark)
    assert spark.conf.get(PUSHDOWN_CONF) == "true"
    assert _read(spark, tmp_path / "job", partitions=3).where("key = 'k1'").rdd.getNumPartitions() == 1
    with pytest.raises(ks.KeyscaleError, match="name different checkpoints"):
        check_options({"path": "p", "uid": "u", "checkpoint": "3", "batch": "4"})
    with pytest.raises(ks.KeyscaleError, match="changes_to needs changes_from"):
        check_options({"path": "p", "uid": "u", "changes_to": "3"})


_S3_READER = """
import json, sys
from keyscale.runtime.driver.session import spark_session
from keyscale.state_processor import register

spark = spark_session("local[1]")
register(spark)
where = sys.argv[1]
df = spark.read.format("keyscale").option("uid", "op").option("flatten", "false").load(where)
one = df.where("user = 'u1'")
feed = spark.read.format("keyscale").option("uid", "op").option("changes_from", 1).option("changes_to", 5).load(where)
print(json.dumps({"rows": {r["user"]: r["total"] for r in df.collect()}, "one": one.rdd.getNumPartitions(),
                  "feed": sorted([r["user"], r["batch"], r["change"]] for r in feed.collect())}))
"""


@marks_callers("spark")
def _read_in_a_new_session(where: str) -> dict[str, Any]:
    """The data source in a Spark session started after the S3 settings are in the
    environment, as a user starts one (this process's Spark workers predate them)."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _S3_READER, where], capture_output=True, text=True, timeout=300, check=True)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def test_the_data_source_reads_a_job_directory_on_s3(s3_bucket: str) -> None:
    from test_scan import _job, _model

    from keyscale.state_processor.changes import open_changes

    jd = _job(f"{s3_bucket}/job")
    got = _read_in_a_new_session(f"{s3_bucket}/job")
    assert got["rows"] == {u: r["total"] for u, r in _model(jd, 6).items()}
    assert got["one"] == 1
    feed = open_changes(f"{s3_bucket}/job", "op", 1, 5)
    assert got["feed"] == sorted([r["user"], r["batch"], r["change"]] for rng in feed.ranges() for r in feed.read(rng).to_pylist())


def test_the_data_source_on_every_pyspark_of_the_range(spark: Any, tmp_path: Path) -> None:
    """The smoke test `make test-oldest` runs on PySpark 4.0 too: there, without pushed filters
    (its readers take none), a key filter reads every key group and Spark filters the rows."""
    from pyspark.sql.datasource import DataSourceReader
    from test_scan import _job, _model

    from keyscale.state_processor.changes import open_changes

    jd = _job(tmp_path / "job")
    df = spark.read.format("keyscale").option("uid", "op").option("flatten", "false").load(str(tmp_path / "job"))
    assert {r["user"]: r["total"] for r in df.collect()} == {u: r["total"] for u, r in _model(jd, 6).items()}
    user = sorted(_model(jd, 6))[0]
    one = df.where(f"user = '{user}'")
    assert [r["user"] for r in one.collect()] == [user]
    pushdown = hasattr(DataSourceReader, "pushFilters")  # PySpark 4.1 on
    assert one.rdd.getNumPartitions() == (1 if pushdown else df.rdd.getNumPartitions())
    feed = open_changes(tmp_path / "job", "op", 1)
    want = sum(feed.read(r).num_rows for r in feed.ranges())
    assert spark.read.format("keyscale").option("uid", "op").option("changes_from", 1).load(str(tmp_path / "job")).count() == want
