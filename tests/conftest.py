"""Shared fixtures: a local Spark session, event files, output readers, job runners; the
markers every test gets from what it uses, and the fast lane (``pytest --fast``,
``make test-fast``): no Spark, no servers."""

from __future__ import annotations

import contextlib
import datetime as dt
import inspect
import logging
import os
import shlex
import subprocess
import sys
import tempfile
import threading
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import settings

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
# With it, keyscale's class archive of Spark's classes (tests/jvm_archive.py), made in
# pytest_configure: the first process makes it, the others (xdist's workers) find it.
_JIT = "-XX:TieredStopAtLevel=1"
# The executors of the standalone-cluster tests are as short-lived: they get it through their
# drivers' conf (Spark reads a driver's spark.* system properties as defaults; a test's own
# --conf or builder setting still wins).
_EXECUTOR_JIT = f"-Dspark.executor.extraJavaOptions={_JIT}"
# Hypothesis' default 200 ms deadline fails pure tests on a loaded machine (the fast lane runs
# beside other work: a Kafka codec example took 316 ms at load 20 on 2 cores); most of the
# suite's property tests already say deadline=None, and a test's own @settings still wins.
settings.register_profile("keyscale", deadline=None)
settings.load_profile("keyscale")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fast", action="store_true", help=(
        "the fast lane (make test-fast): deselect the tests marked " + ", ".join(FAST_LANE_EXCLUDES)
        + "; a test left in it that starts Spark or a server fails, named"))


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--fast", False):
        config.pluginmanager.register(FastLaneGuard(), "keyscale-fast-lane-guard")
        return  # no Spark to start: no class-data-sharing archive either
    if "SPARK_SUBMIT_OPTS" in os.environ:  # the developer's own: kept as they set it
        return
    from jvm_archive import ensure

    archive = ensure()
    os.environ["SPARK_SUBMIT_OPTS"] = " ".join([_JIT, _EXECUTOR_JIT, *([archive] if archive else [])])


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """--doctest-modules (pyproject.toml) is for src/keyscale: it would import every module
    here, and the scripts tests run in child processes do their work at import
    (tests/api/user_script.py starts Spark). Test files and conftest.py are collected as ever."""
    if collection_path.suffix == ".py" and not collection_path.name.startswith("test_") and collection_path.name != "conftest.py":
        return True
    return None


# -- markers from what a test uses -------------------------------------------------------------
#
# A test is marked from the fixtures it uses (``item.fixturenames``: the fixtures' own
# fixtures too) and from the helpers it calls, directly or through functions, classes and
# fixtures of the tests' own modules: a helper says what it starts with ``@marks_callers``.
# Markers are not applied by hand where a fixture or helper says it (``slow``, and ``cluster``
# on a test that starts its own cluster, are marks of their own). The fast lane deselects
# every test that carries one of FAST_LANE_EXCLUDES; FastLaneGuard fails one that got in.

FAST_LANE_EXCLUDES = ("spark", "s3", "kafka", "redis", "cluster", "browser", "prometheus", "slow")

FIXTURE_MARKS = {
    "spark": "spark",  # the session's local Spark
    "s3_server": "s3",  # SeaweedFS (s3_bucket uses it)
    "kafka_broker": "kafka",  # Tansu
    "redis_url": "redis",  # redis-server (make_log's redis backend: its param is marked)
    "cluster": "cluster",  # a module's own standalone cluster (tests/cluster, tests/scaling)
    "browser": "browser",  # chromium through chromedriver (tests/api/test_dashboard.py)
}

_F = TypeVar("_F", bound=Callable[..., Any])


def marks_callers(*markers: str) -> Callable[[_F], _F]:
    """A helper that starts something a fixture cannot show (the CLI in a child process, a
    job on Spark, a server): every test that calls it, directly or not, gets ``markers``."""

    def mark(fn: _F) -> _F:
        fn.__keyscale_marks__ = markers  # type: ignore[attr-defined]
        return fn

    return mark


def _names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _ours(obj: Any) -> bool:
    """Defined in the tests' own files (not keyscale's, not a library's)."""
    try:
        return Path(inspect.getfile(obj)).resolve().is_relative_to(ROOT / "tests")
    except TypeError:
        return False


def _called_marks(obj: Any, seen: set[int]) -> set[str]:
    """The markers of the helpers ``obj`` (a function or class) reaches."""
    if id(obj) in seen:
        return set()
    seen.add(id(obj))
    found = set(getattr(obj, "__keyscale_marks__", ()))
    if isinstance(obj, type):
        for member in vars(obj).values():
            member = getattr(member, "__func__", member)  # staticmethod, classmethod
            if isinstance(member, property):
                member = member.fget
            if isinstance(member, types.FunctionType):
                found |= _called_marks(member, seen)
        return found
    fn = inspect.unwrap(obj)
    code = getattr(fn, "__code__", None)
    if code is None:
        return found
    found |= set(getattr(fn, "__keyscale_marks__", ()))
    scope = getattr(fn, "__globals__", {})
    for name in _names(code):
        target = scope.get(name)
        if target is None:
            continue
        if hasattr(target, "__keyscale_marks__"):
            found |= set(target.__keyscale_marks__)
        elif isinstance(target, types.FunctionType | type) and _ours(target):
            found |= _called_marks(target, seen)
    return found


def _markers_for(item: pytest.Item) -> set[str]:
    names = getattr(item, "fixturenames", ())
    found = {FIXTURE_MARKS[name] for name in names if name in FIXTURE_MARKS}
    seen: set[int] = set()
    function = getattr(item, "function", None)
    if function is not None:
        found |= _called_marks(function, seen)
    info = getattr(item, "_fixtureinfo", None)
    for name in names:
        for fixturedef in (info.name2fixturedefs.get(name, ()) if info else ()):
            if _ours(fixturedef.func):
                found |= _called_marks(fixturedef.func, seen)
    return found


@pytest.hookimpl(tryfirst=True)  # before -m reads the markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for name in sorted(_markers_for(item) - {m.name for m in item.iter_markers()}):
            item.add_marker(name)
    if config.getoption("--fast", False):
        kept = [i for i in items if not any(i.get_closest_marker(m) for m in FAST_LANE_EXCLUDES)]
        if len(kept) < len(items):
            config.hook.pytest_deselected(items=[i for i in items if i not in set(kept)])
            items[:] = kept


# -- the fast lane's guard: what no test in it may start --------------------------------------

_SERVERS = {"redis-server": "redis", "weed": "s3", "tansu": "kafka", "prometheus": "prometheus",
            "chromium": "browser", "chromedriver": "browser", "java": "spark", "spark-submit": "spark"}
# What the stand-in java writes: every JVM a test starts, in any process under it.
_STAND_IN_JAVA = """#!/bin/sh
echo "${PYTEST_CURRENT_TEST:-a test}" >> "$KEYSCALE_FAST_LANE_JVMS"
echo "keyscale fast lane: ${PYTEST_CURRENT_TEST:-a test} starts a JVM (Spark); the fast lane runs none:\
 it needs a fixture or a @marks_callers helper that marks it spark (tests/conftest.py)" >&2
exit 97
"""


class FastLaneError(RuntimeError):
    pass


def _current_test() -> str:
    return os.environ.get("PYTEST_CURRENT_TEST", "a test").rsplit(" (", 1)[0]


class FastLaneGuard:
    """The fast lane's guard, so that a test without the markers it needs cannot hide in it.

    In the tests' process a SparkSession (``SparkSession.builder.getOrCreate``) or a server
    started by a test raises FastLaneError naming the test. Below it, ``JAVA_HOME`` is a
    stand-in whose ``bin/java`` refuses and notes the test: every Spark driver, spark-submit
    and standalone daemon, in a child (``keyscale run``, a script) or a grandchild, runs
    Java from there. A test that started one fails even where it caught the error."""

    def __init__(self) -> None:
        self.violations: dict[str, list[str]] = {}
        self._home = tempfile.mkdtemp(prefix="keyscale-fast-lane-")
        self._jvms = Path(self._home) / "jvms.txt"
        java = Path(self._home) / "bin" / "java"
        java.parent.mkdir()
        java.write_text(_STAND_IN_JAVA)
        java.chmod(0o755)
        os.environ["JAVA_HOME"] = self._home
        os.environ["KEYSCALE_FAST_LANE_JVMS"] = str(self._jvms)
        from pyspark.sql import SparkSession

        guard = self

        def get_or_create(builder: Any) -> Any:
            guard.refuse("starts Spark (SparkSession.builder.getOrCreate)", "spark")

        SparkSession.Builder.getOrCreate = get_or_create  # type: ignore[method-assign,assignment]
        popen_init = subprocess.Popen.__init__

        def guarded_init(popen: Any, args: Any, *a: Any, **kw: Any) -> None:
            guard.check_command(args)
            popen_init(popen, args, *a, **kw)

        subprocess.Popen.__init__ = guarded_init  # type: ignore[method-assign]

    def refuse(self, what: str, marker: str) -> None:
        test = _current_test()
        message = (f"this test {what}: {test}; the fast lane runs no Spark and no servers: "
                   f"it needs a fixture or a @marks_callers helper that marks it {marker} (tests/conftest.py)")
        self.violations.setdefault(test, []).append(message)
        raise FastLaneError(message)

    def check_command(self, args: Any) -> None:
        argv = shlex.split(args) if isinstance(args, str) else [os.fspath(a) for a in args]
        name = os.path.basename(argv[0]) if argv else ""
        if name in _SERVERS:
            self.refuse(f"starts {name} ({' '.join(argv[:3])} ...)", _SERVERS[name])

    def _jvms_of(self, nodeid: str) -> list[str]:
        if not self._jvms.exists():
            return []
        lines = self._jvms.read_text().splitlines()
        mine = [line for line in lines if line.rsplit(" (", 1)[0] == nodeid]
        if mine:
            self._jvms.write_text("".join(f"{line}\n" for line in lines if line not in mine))
        return [f"this test started a JVM (Spark) in a child process ({line}); the fast lane runs none: "
                "it needs a fixture or a @marks_callers helper that marks it spark (tests/conftest.py)" for line in mine]

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
        report = yield
        caught = self.violations.pop(item.nodeid, []) + self._jvms_of(item.nodeid)
        if caught and not report.failed:
            report.outcome = "failed"
            report.longrepr = "\n".join(caught) + "\n(the fast lane fails the test even though it caught the error)"
        return report

    def pytest_unconfigure(self) -> None:
        import shutil

        shutil.rmtree(self._home, ignore_errors=True)


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
        write_input_file(table, folder / f"part-{i:05d}.parquet", i)


def write_input_file(table: pa.Table, path: Path, order: int) -> None:
    """A Parquet input file that appears whole, stamped ``order`` seconds after 2023-11-14:
    Spark's file source takes files in modification-time order, so the stamp makes it the
    tests' order. Stamped before the rename, so that a running job never lists the file with
    today's time: its source would then drop every later file (stamped 2023) as older than
    its maxFileAge (7 days) behind the newest file it has seen, and wait forever."""
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(table, tmp)
    stamp = 1_700_000_000 + order
    os.utime(tmp, (stamp, stamp))
    tmp.rename(path)


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


@marks_callers("spark")
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


@marks_callers("spark")
def reference_output(tmp_path_factory: pytest.TempPathFactory, events: Path, parallelism: int = 1, **kw: Any) -> pd.DataFrame:
    """The output of an uninterrupted run of the running count: what other runs must equal."""
    tmp = tmp_path_factory.mktemp("ref")
    run_job(RUNNING_COUNT, tmp / "job", parallelism, {"input": str(events), "output": str(tmp / "out")}, **kw)
    return read_output(tmp / "out")


# -- a module's input and its reference output ------------------------------------------------
#
# One definition for the modules that run jobs over Parquet events and compare runs with an
# uninterrupted one; a module says how in two constants (pytest reads them from the module):
#   EVENTS = {"files": 5, "rows": 2000, "keys": 300, "seed": 7}   # write_events' arguments
#   REFERENCE = {"parallelism": 2, "max_chain": 2}                 # reference_output's
# A module that needs more (another file, other jobs) builds on these: a fixture of the same
# name may request the one it overrides (tests/operators/test_combine.py).

DEFAULT_EVENTS: dict[str, int] = {"files": 4, "rows": 1500, "keys": 200, "seed": 3}


@pytest.fixture(scope="module")
def events(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of Parquet event files (write_events), as the module's ``EVENTS`` says."""
    folder = tmp_path_factory.mktemp("events")
    write_events(folder, **getattr(request.module, "EVENTS", DEFAULT_EVENTS))
    return folder


@pytest.fixture(scope="module")
def reference(request: pytest.FixtureRequest, spark: Any, events: Path, tmp_path_factory: pytest.TempPathFactory) -> pd.DataFrame:
    """The running count's output over ``events`` in one uninterrupted run, as the module's
    ``REFERENCE`` says (parallelism 1 without it): what the module's other runs must equal."""
    return reference_output(tmp_path_factory, events, **getattr(request.module, "REFERENCE", {}))


@marks_callers("spark")
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


@contextlib.contextmanager
def jvm_calls() -> Iterator[list[str]]:
    """The Py4J commands this thread sends to the JVM inside the block (not those of another
    thread, such as Py4J's garbage collector): a count of round trips, never a time."""
    from py4j import clientserver

    sent: list[str] = []
    me = threading.get_ident()
    send = clientserver.ClientServerConnection.send_command

    def counted(self: Any, command: str) -> Any:
        if threading.get_ident() == me:
            sent.append(command)
        return send(self, command)

    clientserver.ClientServerConnection.send_command = counted  # type: ignore[method-assign]
    try:
        yield sent
    finally:
        clientserver.ClientServerConnection.send_command = send  # type: ignore[method-assign]


def run_on_thread(run: Callable[[], Any], timeout: float) -> None:
    """Call ``run`` (a ``JobRunner``'s, for one) on a thread of its own, as
    ``Pipeline.start`` runs a job, while callbacks on the test's side stop it; fail if it is
    still running after ``timeout`` seconds, raise what it raised."""
    errors: list[BaseException] = []

    def guarded() -> None:
        try:
            run()
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=guarded, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"still running after {timeout:.0f} s (the job did not stop)"
    if errors:
        raise errors[0]


@marks_callers("spark")
def cli_here(*argv: str, check: bool = False) -> subprocess.CompletedProcess[str]:
    """Run the keyscale CLI's ``main`` in this process, on the tests' Spark session: the code
    :func:`cli` runs, without a JVM and Python workers of its own to start (half a minute of a
    run on a loaded machine). For a run whose own process is not what a test checks: the one
    that resumes the job a killed driver (a :func:`cli` run) left. What ``main`` sets for a
    process (signal handlers, the log's route to stderr, storage options) is put back."""
    import io
    import signal

    from keyscale.cli.main import main
    from keyscale.storage import uri

    out, err = io.StringIO(), io.StringIO()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    options = dict(uri._OPTIONS)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(argv))
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
        uri.set_storage_options(options)
        log = logging.getLogger("keyscale")
        log.handlers[:] = []
        log.propagate = True
    proc = subprocess.CompletedProcess(["keyscale", *argv], code, out.getvalue(), err.getvalue())
    if check and code != 0:
        raise AssertionError(f"keyscale {' '.join(argv)} exited {code}:\n{proc.stderr[-3000:]}")
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


@pytest.fixture(params=["local", pytest.param("redis", marks=pytest.mark.redis)])
def make_log(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    """``make_log(schema, partitions)``: a new, empty log of the parametrised backend."""
    import uuid

    from keyscale.sources import create_log

    if request.param == "local":
        return lambda schema, partitions: create_log(tmp_path / f"log-{uuid.uuid4().hex[:8]}", schema, partitions)
    url = request.getfixturevalue("redis_url")
    return lambda schema, partitions: create_log(f"{url}?name=t-{uuid.uuid4().hex[:12]}", schema, partitions)


# -- S3 (keyscale.storage): a real SeaweedFS server for the session, a fresh bucket per test ------

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


def produce_events(bootstrap: str, topic: str, rows: int, keys: int, first: int = 0, seed: int = 0,
                   transactional_id: str | None = None) -> list[dict[str, Any]]:
    """``rows`` JSON events {key, value, ts} keyed by their key (numbered from ``first``);
    returns them. With ``transactional_id``: in one Kafka transaction of that id, as an
    exactly-once producer writes (its commit marker takes an offset in each partition)."""
    import json

    import numpy as np
    from confluent_kafka import Producer

    rng = np.random.default_rng(seed + first)
    settings = {"bootstrap.servers": bootstrap, "linger.ms": 5, "partitioner": "murmur2_random", "log_level": 3}
    p = Producer({**settings, "transactional.id": transactional_id} if transactional_id else settings)
    if transactional_id:
        p.init_transactions(30)
        p.begin_transaction()
    out = []
    for i in range(first, first + rows):
        e = {"key": f"k{int(rng.integers(keys)):04d}", "value": int(rng.integers(1, 100)), "ts": f"2026-01-01T00:{(i // 60) % 60:02d}:{i % 60:02d}Z"}
        p.produce(topic, key=e["key"].encode(), value=json.dumps(e).encode())
        out.append(e)
    if transactional_id:
        p.commit_transaction(30)
    p.flush(30)
    return out
