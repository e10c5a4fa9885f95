"""A real Spark standalone cluster on 127.0.0.1: workers join and leave, the application follows.

The Spark application runs in a subprocess (``spark_app.py``): this process may already
hold a local SparkContext, and there is one per process.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from keyscale.classarchive import archive_problems
from keyscale.cli.main import main
from keyscale.cluster import (
    UNLIMITED,
    ClusterInfo,
    WorkerInfo,
    add_worker,
    cluster_status,
    read_cluster,
    start_cluster,
    stop_cluster,
    stop_worker,
)
from keyscale.cluster.processes import group_members
from keyscale.errors import ClusterError

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(300)]

APP = Path(__file__).with_name("spark_app.py")
JOIN_TIMEOUT = 90.0  # a worker JVM, then an executor JVM, on a shared 2-core machine
LEAVE_TIMEOUT = 30.0


class Cluster:
    """The module's cluster, and every daemon ever started in it (to check they all end)."""

    def __init__(self, folder: Path, info: ClusterInfo) -> None:
        self.folder = folder
        self.info = info
        self.daemons: list[tuple[int, int]] = [(info.master_pid, info.master_started)]
        self.daemons += [(w.pid, w.started) for w in info.workers]

    def add_worker(self, cores: int = 1) -> WorkerInfo:
        w = add_worker(self.folder, cores=cores)
        self.daemons.append((w.pid, w.started))
        return w

    def leftovers(self) -> list[int]:
        return [p for pid, started in self.daemons for p in group_members(pid, started)]


def _stop_and_check(folder: Path, daemons: list[tuple[int, int]]) -> None:
    """Stop the cluster; SIGKILL (by PID) and report anything still running."""
    stop_cluster(folder, grace=5.0)
    left = [p for pid, started in daemons for p in group_members(pid, started)]
    for pid, started in daemons:
        if group_members(pid, started):
            os.killpg(pid, signal.SIGKILL)
    assert not left, f"processes left after stop_cluster: {left}"
    assert read_cluster(folder) is None


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    folder = tmp_path_factory.mktemp("cluster")
    c = Cluster(folder, start_cluster(folder, workers=1, cores=1, memory="1g", class_archive=True))
    try:
        yield c
    finally:
        now = read_cluster(folder)
        _stop_and_check(folder, c.daemons + ([(w.pid, w.started) for w in now.workers] if now else []))


class App:
    """The Spark application in a subprocess, one JSON command and answer at a time."""

    def __init__(self, master_url: str, log: Path) -> None:
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, str(APP), master_url],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(log, "w"),  # noqa: SIM115
            text=True, start_new_session=True, env={**os.environ, "PYSPARK_PYTHON": sys.executable},
        )  # fmt: skip
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.ready = self._next(180)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)

    def _next(self, timeout: float) -> dict[str, Any]:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            tail = self.log.read_text()[-3000:] if self.log.exists() else ""
            raise AssertionError(f"the Spark app did not answer within {timeout} s:\n{tail}") from None
        out: dict[str, Any] = json.loads(line)
        return out

    def ask(self, op: str, reply_within: float = 120, **args: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        return self._next(reply_within)

    def wait_cores(self, cores: int, timeout: float) -> float:
        r = self.ask("wait", timeout + 30, cores=cores, timeout=timeout)
        assert r["ok"], f"executor cores {r['cores']}, expected {cores} within {timeout} s"
        return float(r["seconds"])

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.ask("stop", 60)
                self.proc.wait(timeout=30)
        except (AssertionError, OSError, subprocess.TimeoutExpired):
            pass
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def app(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[App]:
    a = App(cluster.info.master_url, tmp_path_factory.mktemp("app") / "driver.log")
    try:
        yield a
    finally:
        a.close()


def test_start_twice_in_one_folder_is_a_clear_error(cluster: Cluster, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ClusterError, match=r"already running in .*stop it first"):
        start_cluster(cluster.folder)
    assert main(["cluster", "start", "--dir", str(cluster.folder)]) == 6
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "keyscale: error: a cluster is already running" in err
    now = read_cluster(cluster.folder)
    assert now is not None and now.master_pid == cluster.info.master_pid  # untouched


def test_app_sees_one_executor_core_and_runs_a_job(cluster: Cluster, app: App) -> None:
    app.wait_cores(1, 60)
    # The executor list can trail the core count by a moment (and an executor that missed
    # its heartbeat on a loaded machine registers again): ask until it settles.
    deadline = time.monotonic() + 60
    while len(ids := app.ask("cores")["ids"]) != 1 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert len(ids) == 1
    job = app.ask("job")
    assert job["sum"] == sum(x * x for x in range(1000)) and job["groups"] == 7
    st = cluster_status(cluster.folder)
    assert st.running and len(st.alive_workers) == 1 and st.total_cores == 1 and st.cores_used == 1
    assert st.applications == ("keyscale-cluster-test",)
    assert st.alive_workers[0].id == "worker-2"  # worker-1 made the executors' class archive


def test_worker_joins_then_is_killed_and_the_app_follows(cluster: Cluster, app: App) -> None:
    app.wait_cores(1, 60)
    t0 = time.monotonic()
    w = cluster.add_worker()
    registered = time.monotonic() - t0
    seen = app.wait_cores(2, JOIN_TIMEOUT)
    print(f"worker registered in {registered:.1f} s; the app had its executor {seen:.1f} s later")
    assert cluster_status(cluster.folder).total_cores == 2

    t0 = time.monotonic()
    stop_worker(cluster.folder, w.id, kill=True)
    gone = app.wait_cores(1, LEAVE_TIMEOUT) + (time.monotonic() - t0)
    print(f"killed worker gone from the app {gone:.1f} s after the kill")
    assert not group_members(w.pid, w.started)  # the worker and its executor
    st = cluster_status(cluster.folder)
    assert [x.id for x in st.alive_workers] == ["worker-2"] and st.total_cores == 1
    job = app.ask("job")
    assert job["ok"] and job["groups"] == 7


def test_request_executors_shrinks_grows_and_caps(cluster: Cluster, app: App) -> None:
    app.wait_cores(1, 60)
    extra = [cluster.add_worker()]
    app.wait_cores(2, JOIN_TIMEOUT)  # no limit yet: the app takes the new core by itself
    try:
        assert app.ask("request", total=1)["ok"]
        print(f"one executor released in {app.wait_cores(1, LEAVE_TIMEOUT):.1f} s")
        assert app.ask("hold", cores=1, seconds=6)["ok"]  # not replaced: the limit is 1
        st = cluster_status(cluster.folder)
        assert st.total_cores == 2 and st.cores_used == 1

        assert app.ask("request", total=2)["ok"]
        print(f"one executor added in {app.wait_cores(2, JOIN_TIMEOUT):.1f} s")
        extra.append(cluster.add_worker())
        assert app.ask("hold", cores=2, seconds=8)["ok"]  # a new worker: still 2, the limit
        assert cluster_status(cluster.folder).total_cores == 3

        assert app.ask("request", total=UNLIMITED)["ok"]
        app.wait_cores(3, JOIN_TIMEOUT)
    finally:
        for w in extra:  # an orderly shutdown this time
            stop_worker(cluster.folder, w.id)
    app.wait_cores(1, LEAVE_TIMEOUT)
    assert app.ask("job")["ok"]
    assert all(not group_members(w.pid, w.started) for w in extra)


def test_stop_worker_names_the_known_workers(cluster: Cluster) -> None:
    with pytest.raises(ClusterError, match=r"no worker 'worker-99' .*\(workers: worker-2\)"):
        stop_worker(cluster.folder, "worker-99")


def _processes_mentioning(folder: Path) -> list[int]:
    """PIDs whose command line names ``folder`` (daemons and executors have it in their classpath)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if str(folder).encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def test_a_master_that_is_not_up_in_time_is_stopped(tmp_path: Path) -> None:
    folder = (tmp_path / "slow").resolve()
    with pytest.raises(ClusterError, match=r"the Spark master did not come up within 0 s; see .*master.log"):
        start_cluster(folder, timeout=0.01)
    assert read_cluster(folder) is None
    assert _processes_mentioning(folder) == []


def test_cli_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = str(tmp_path / "c")
    daemons: list[tuple[int, int]] = []
    try:
        assert main(["cluster", "start", "--dir", d, "--workers", "1", "--cores", "2", "--memory", "1g"]) == 0
        out, err = capsys.readouterr()
        info = read_cluster(d)
        assert info is not None
        daemons += [(info.master_pid, info.master_started), *((w.pid, w.started) for w in info.workers)]
        assert out.strip() == info.master_url and info.master_url.startswith("spark://127.0.0.1:")
        assert f"keyscale run JOB --master {info.master_url}" in err
        assert ":7077" not in info.master_url and info.webui_port != 8080

        assert main(["cluster", "status", "--dir", d]) == 0
        out = capsys.readouterr().out
        assert "1 alive worker, 2 cores (0 in use)" in out and "worker-1" in out

        assert main(["cluster", "add-worker", "--dir", d, "--cores", "1", "--memory", "512m"]) == 0
        assert capsys.readouterr().out.strip() == "worker-2"
        w2 = read_cluster(d).worker("worker-2")  # type: ignore[union-attr]
        daemons.append((w2.pid, w2.started))
        assert main(["cluster", "status", "--dir", d, "--json"]) == 0
        st = json.loads(capsys.readouterr().out)
        assert st["alive_workers"] == 2 and st["total_cores"] == 3 and st["running"]

        assert main(["cluster", "stop-worker", "--dir", d, "worker-2", "--kill"]) == 0
        assert "worker-2 killed" in capsys.readouterr().err
        assert main(["cluster", "status", "--dir", d, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["total_cores"] == 2

        assert main(["cluster", "stop", "--dir", d]) == 0
        assert "stopped" in capsys.readouterr().err
        assert not [p for pid, started in daemons for p in group_members(pid, started)]
        assert _processes_mentioning(Path(d).resolve()) == []
        assert main(["cluster", "stop", "--dir", d]) == 0  # a no-op, said so
        assert "nothing to stop" in capsys.readouterr().err
        assert main(["cluster", "status", "--dir", d]) == 6
        assert "keyscale: error: no cluster in" in capsys.readouterr().err
    finally:
        _stop_and_check(Path(d), daemons)


def _mapped_by_executors(worker: WorkerInfo, archive: Path) -> list[int]:
    """The worker's executor JVMs that have ``archive`` mapped into their memory."""
    out = []
    for pid in group_members(worker.pid, worker.started):
        proc = Path(f"/proc/{pid}")
        with contextlib.suppress(OSError):
            if b"CoarseGrainedExecutorBackend" in (proc / "cmdline").read_bytes() and str(archive) in (proc / "maps").read_text():
                out.append(pid)
    return out


def test_executors_map_the_folders_class_archive(cluster: Cluster, app: App) -> None:
    # The module's cluster started with class_archive=True: its first start in the folder made
    # the archive on a worker of its own (worker-1, gone since), then started the others.
    archive = cluster.folder / "executor-classes.jsa"
    assert cluster.info.executor_archive == str(archive) and archive.is_file()
    assert archive_problems(archive, cluster.folder / "conf") == []  # so a later start in the folder reuses it
    assert _processes_mentioning(cluster.folder / "work" / "worker-1") == []
    (worker,) = cluster.info.workers
    app.wait_cores(1, 60)
    assert app.ask("job")["ok"]
    assert _mapped_by_executors(worker, archive), "the executor did not map the archive"
    # The worker's own JVMs (another class path) keep Java's default archive: no warning in its log.
    assert "Unable to use shared archive" not in worker.log.read_text()


def test_a_class_archive_for_an_isolated_cluster_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ClusterError, match=r"^a class archive is not for an isolated cluster"):
        start_cluster(tmp_path / "c", isolated=True, class_archive=True)
    assert not (tmp_path / "c").exists()
