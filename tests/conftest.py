"""Shared fixtures: a local Spark session, event files, output readers, job runners."""

from __future__ import annotations

import datetime as dt
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
RUNNING_COUNT = EXAMPLES / "running_count.py"
ALERTS = EXAMPLES / "threshold_alerts.py"

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
# Tansu 0.6 (the tests' Kafka broker) now and then stalls read_committed consumers for good
# when two transactions on one partition commit at the same moment (docs/design.md,
# "Concurrent commits on Tansu"): the Kafka sink's tasks take turns to commit.
os.environ.setdefault("KEYSCALE_KAFKA_SERIAL_COMMITS", "1")
# Every Spark driver the tests start (their own session, each CLI run) is a short-lived JVM
# over tiny data: the C1 compiler alone costs it ~30% less CPU than tiered C2 (30 -> 22 CPU
# seconds for a CLI run of the running count, /proc/stat, 2026-11-26), on a 2-core machine
# where the suite is CPU-bound. spark-submit reads this variable; keyscale never sets it.
# With it, a class-data-sharing archive of Spark's classes (tests/jvm_archive.py), made in
# pytest_configure: the first process makes it, the others (xdist's workers) find it.
_JIT = "-XX:TieredStopAtLevel=1"


def pytest_configure(config: pytest.Config) -> None:
    if "SPARK_SUBMIT_OPTS" in os.environ:  # the developer's own: kept as they set it
        return
    from jvm_archive import ensure

    archive = ensure(_JIT)
    os.environ["SPARK_SUBMIT_OPTS"] = f"{_JIT} {archive}" if archive else _JIT


@pytest.fixture(autouse=True)
def _keyscale_logs_reach_caplog() -> Any:
    """The CLI's main() routes keyscale's log to stderr only; undo that between tests."""
    yield
    log = logging.getLogger("keyscale")
    log.handlers[:] = []
    log.propagate = True


@pytest.fixture(scope="session")
def spark() -> Any:
    from keyscale.runtime.driver.session import spark_session

    session = spark_session("local[2]")
    yield session
    session.stop()


def write_events(folder: Path, files: int, rows: int, keys: int, seed: int = 0, first: int = 0, null_keys: int = 0) -> None:
    """Parquet files part-<first>..: columns key string, value long, ts timestamp."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed + first)
    for i in range(first, first + files):
        k = rng.integers(0, keys, rows)
        key_list: list[str | None] = [f"k{x}" for x in k]
        for j in range(null_keys):
            key_list[j * 7 % rows] = None
        base = dt.datetime(2026, 1, 1, tzinfo=dt.UTC) + dt.timedelta(seconds=i * rows)
        table = pa.table(
            {
                "key": pa.array(key_list, pa.string()),
                "value": pa.array(rng.integers(1, 100, rows), pa.int64()),
                "ts": pa.array([base + dt.timedelta(seconds=j) for j in range(rows)], pa.timestamp("us", tz="UTC")),
            }
        )
        tmp = folder / f".part-{i:05d}.parquet.tmp"
        pq.write_table(table, tmp)
        final = folder / f"part-{i:05d}.parquet"
        tmp.rename(final)
        # Spark's file source takes files in modification-time order: make it the name order.
        stamp = 1_700_000_000 + i
        os.utime(final, (stamp, stamp))


def read_output(folder: Path | str) -> pd.DataFrame:
    """Every row a job wrote (complete batches only: those with a marker), with its batch,
    in a canonical order; ``folder`` may be a local path or an ``s3://`` location."""
    from keyscale.sinks.parquet import read_output as read_sink_output

    table = read_sink_output(folder)
    if table.num_rows == 0:
        return pd.DataFrame()
    try:
        df = table.to_pandas(coerce_temporal_nanoseconds=True)  # as pandas reads any timestamp: datetime64[ns]
    except pa.ArrowInvalid:  # beyond datetime64[ns] (year 2262): keep the file's unit
        df = table.to_pandas()
    df = df[[c for c in df.columns if c != "batch"] + ["batch"]]
    return df.sort_values(list(df.columns)).reset_index(drop=True)


def run_job(
    job_file: Path,
    job_dir: Path,
    parallelism: int | None,
    args: dict[str, str],
    on_batch: Callable[[Any], None] | None = None,
    **kw: Any,
) -> Any:
    from keyscale.runtime.control.server import control_api
    from keyscale.runtime.driver.runner import JobRunner, RunOptions

    opts = RunOptions(job_file=str(job_file), job_dir=str(job_dir), parallelism=parallelism, until_idle=True, args=args, **kw)
    return JobRunner(opts, on_batch, serve=control_api(opts)).run()


def reference_output(tmp_path_factory: pytest.TempPathFactory, events: Path, parallelism: int = 1, **kw: Any) -> pd.DataFrame:
    """The output of an uninterrupted run of the running count: what other runs must equal."""
    tmp = tmp_path_factory.mktemp("ref")
    run_job(RUNNING_COUNT, tmp / "job", parallelism, {"input": str(events), "output": str(tmp / "out")}, **kw)
    return read_output(tmp / "out")


def cli(*argv: str, timeout: float = 300, check: bool = False) -> subprocess.CompletedProcess[str]:
    """Run the keyscale CLI in a fresh process (its own Spark driver)."""
    proc = subprocess.run(
        [sys.executable, "-m", "keyscale.cli.main", *argv],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT,
        env={**os.environ, "KEYSCALE_SPARK_LOG_LEVEL": "ERROR"},
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"keyscale {' '.join(argv)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc


# -- logs (keyscale.sources): a real redis-server for the session, logs of both backends --------


def _redis_server_binary() -> str | None:
    import shutil

    found = shutil.which("redis-server")
    if found:
        return found
    return next((c for c in ("/usr/bin/redis-server", "/usr/sbin/redis-server", "/usr/local/bin/redis-server") if Path(c).is_file()), None)


def stop_server(proc: subprocess.Popen[Any], timeout: float) -> None:
    """Stop a server a test started (by its PID): SIGTERM, then SIGKILL after ``timeout`` s."""
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``redis://127.0.0.1:PORT/0`` of a redis-server of our own (no persistence), stopped by its PID at the end."""
    import socket
    import time

    import redis

    binary = _redis_server_binary()
    if binary is None:
        pytest.skip("redis-server is not installed (`make redis` installs it: apt-get install redis-server)")
    folder = tmp_path_factory.mktemp("redis")
    for _attempt in range(3):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        proc = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(folder),
             "--daemonize", "no", "--logfile", str(folder / "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
        )
        client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=1)
        deadline = time.time() + 15
        while time.time() < deadline and proc.poll() is None:
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                time.sleep(0.05)
        client.close()
        if proc.poll() is None:
            break
    else:
        text = (folder / "redis.log").read_text() if (folder / "redis.log").exists() else ""
        raise RuntimeError(f"redis-server did not start: {text[-2000:]}")
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        stop_server(proc, 10)


@pytest.fixture(params=["local", "redis"])
def make_log(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    """``make_log(schema, partitions)``: a new, empty log of the parametrised backend."""
    import uuid

    from keyscale.sources import create_log

    if request.param == "local":
        return lambda schema, partitions: create_log(tmp_path / f"log-{uuid.uuid4().hex[:8]}", schema, partitions)
    url = request.getfixturevalue("redis_url")
    return lambda schema, partitions: create_log(f"{url}?name=t-{uuid.uuid4().hex[:12]}", schema, partitions)


# -- S3 (keyscale.storage): a real SeaweedFS server for the session, a fresh bucket per test ------

_S3_FIXTURES = ("s3_server", "s3_bucket")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test that uses an S3 fixture carries the ``s3`` marker (``-m 'not s3'`` skips them)."""
    for item in items:
        if any(name in getattr(item, "fixturenames", ()) for name in _S3_FIXTURES):
            item.add_marker(pytest.mark.s3)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A SeaweedFS S3 server on 127.0.0.1 (keyscale.storage.seaweed.S3Server), started on
    first use and stopped, by its PID, at the end of the session."""
    import secrets

    from keyscale.storage.seaweed import start_seaweedfs

    server = start_seaweedfs(tmp_path_factory.mktemp("seaweedfs"), "keyscale-test", secrets.token_hex(16))
    try:
        yield server
    finally:
        server.stop()


_bucket_count = 0


@pytest.fixture
def s3_bucket(s3_server: Any, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Any:
    """``s3://BUCKET``: a new, empty bucket for this test, deleted after it.

    The test's environment points at the server (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID,
    AWS_SECRET_ACCESS_KEY, AWS_REGION, AWS_DEFAULT_REGION, AWS_ALLOW_HTTP,
    AWS_EC2_METADATA_DISABLED), so keyscale code and child processes (Spark workers,
    the CLI) find it as they would find a real S3. Spark's Python workers are the
    exception when the session's Spark started before this test: they keep the
    environment of their JVM's launch, so code running in them must be given the
    endpoint and keys explicitly (all tests of one session share one server).
    """
    import contextlib
    import re

    from keyscale.errors import StorageError
    from keyscale.storage.seaweed import create_bucket, delete_bucket

    global _bucket_count
    _bucket_count += 1
    slug = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")
    name = f"t{_bucket_count:04d}-{slug}"[:63].rstrip("-")
    create_bucket(s3_server, name)
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    yield f"s3://{name}"
    # Frees the bucket's volumes: the server allows a limited number (-volume.max).
    with contextlib.suppress(StorageError, OSError):
        delete_bucket(s3_server, name)


# -- Kafka (keyscale.kafka): a real Kafka-protocol broker (Tansu) for the session -----------------


@pytest.fixture(scope="session")
def kafka_broker(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A Tansu broker on 127.0.0.1 (keyscale.kafka.broker), started on first use and
    stopped, by its PID, at the end of the session. Tests make topics of their own."""
    from keyscale.kafka.broker import start_tansu

    broker = start_tansu(log_dir=tmp_path_factory.mktemp("tansu"))
    try:
        yield broker
    finally:
        broker.stop()


_topic_count = 0


def new_topic(bootstrap: str, partitions: int, prefix: str = "t") -> str:
    """A new topic with ``partitions`` partitions and a name no other test uses."""
    from confluent_kafka.admin import AdminClient, NewTopic

    global _topic_count
    _topic_count += 1
    name = f"{prefix}{_topic_count:03d}-{os.getpid()}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(name, partitions)])[name].result(timeout=30)
    return name


def produce_events(bootstrap: str, topic: str, rows: int, keys: int, first: int = 0, seed: int = 0) -> list[dict[str, Any]]:
    """``rows`` JSON events {key, value, ts} keyed by their key (numbered from ``first``);
    returns them."""
    import json

    import numpy as np
    from confluent_kafka import Producer

    rng = np.random.default_rng(seed + first)
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, "partitioner": "murmur2_random", "log_level": 3})
    out = []
    for i in range(first, first + rows):
        e = {"key": f"k{int(rng.integers(keys)):04d}", "value": int(rng.integers(1, 100)), "ts": f"2026-01-01T00:{(i // 60) % 60:02d}:{i % 60:02d}Z"}
        p.produce(topic, key=e["key"].encode(), value=json.dumps(e).encode())
        out.append(e)
    p.flush(30)
    return out
