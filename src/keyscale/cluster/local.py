"""A Spark standalone cluster on this machine: one master and any number of workers.

Every daemon is the PySpark install's own ``bin/spark-class`` (so the cluster runs exactly
the Spark version of the driver), started as a subprocess in its own session, bound to
127.0.0.1 on free ports (never 7077/8080: several clusters and test runs can share the
machine). Everything lives in a folder the caller chooses::

    FOLDER/cluster.json          master URL, web UI URL, PIDs, ports, cores of every daemon
    FOLDER/logs/master.log       the master's output
    FOLDER/logs/worker-N.log     each worker's output
    FOLDER/work/worker-N/        each worker's work dir (executor logs: app-*/N/stderr)
    FOLDER/conf/                 an empty SPARK_CONF_DIR: no spark-defaults of the user leak in

``cluster.json`` exists while a cluster started there has not been stopped. Starting is
finished when the master answers on its web UI's JSON (``/json/``) and every worker is
listed there as ALIVE; a daemon that exits or does not come up in time is a
:class:`~keyscale.errors.ClusterError` naming its log file, and whatever was started is
stopped again. A worker is stopped like a machine being shut down (SIGTERM, then SIGKILL
of its whole process group, executors included, after a grace period) or, with
``kill=True``, like a machine that vanishes (SIGKILL of the group at once). Processes are
only ever signalled by the PIDs recorded here, after checking the PID still belongs to
the process that was started (its start time), so a reused PID is never touched.

Example (needs Java; takes a few seconds)::

    >>> from keyscale.cluster import start_cluster, add_worker, cluster_status, stop_cluster
    >>> info = start_cluster("/tmp/ks-cluster", workers=1, cores=1)      # doctest: +SKIP
    >>> info.master_url                                                  # doctest: +SKIP
    'spark://127.0.0.1:41393'
    >>> add_worker("/tmp/ks-cluster", cores=2).cores                     # doctest: +SKIP
    2
    >>> cluster_status("/tmp/ks-cluster").total_cores                    # doctest: +SKIP
    3
    >>> stop_cluster("/tmp/ks-cluster")                                  # doctest: +SKIP
    True
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from keyscale.cluster import isolation
from keyscale.cluster.processes import (
    HOST,
    alive,
    free_ports,
    spark_home,
    start_time,
    terminate,
)
from keyscale.cluster.records import ClusterInfo, ClusterStatus, WorkerInfo, WorkerStatus
from keyscale.errors import ClusterError

__all__ = [
    "DEFAULT_GRACE",
    "DEFAULT_TIMEOUT",
    "HOST",
    "STATE_FILE",
    "ClusterInfo",
    "ClusterStatus",
    "WorkerInfo",
    "WorkerStatus",
    "add_worker",
    "cluster_status",
    "read_cluster",
    "spark_home",
    "start_cluster",
    "stop_cluster",
    "stop_worker",
]

STATE_FILE = "cluster.json"
DEFAULT_TIMEOUT = 90.0
"""Seconds to wait for a daemon to come up (a JVM start is 2-5 s; a shared CI box is slower)."""
DEFAULT_GRACE = 10.0
"""Seconds a SIGTERMed daemon gets before its process group is SIGKILLed."""

MASTER_CLASS = "org.apache.spark.deploy.master.Master"
WORKER_CLASS = "org.apache.spark.deploy.worker.Worker"
# Heartbeats are every timeout/4; master and workers must agree on it. A worker whose
# process dies is noticed at once anyway (its connection to the master closes).
WORKER_TIMEOUT_S = 20
# No port retries: a port taken between choosing it and binding it fails fast, and the
# daemon is started again on new ports, so the recorded ports are always the real ones.
_COMMON_OPTS = f"-Dspark.port.maxRetries=0 -Dspark.worker.timeout={WORKER_TIMEOUT_S}"
_MASTER_OPTS = _COMMON_OPTS + " -Dspark.master.rest.enabled=false"
_WORKER_OPTS = _COMMON_OPTS
_DAEMON_MEMORY = "512m"
_START_ATTEMPTS = 3
_MEMORY_RE = re.compile(r"^[1-9][0-9]*[mMgG]$")




def _env(folder: Path, home: Path) -> dict[str, str]:
    env = dict(os.environ)
    for name in ("SPARK_MASTER_OPTS", "SPARK_WORKER_OPTS", "SPARK_DAEMON_JAVA_OPTS", "SPARK_MASTER_HOST",
                 "SPARK_MASTER_PORT", "SPARK_MASTER_WEBUI_PORT", "SPARK_WORKER_PORT", "SPARK_WORKER_WEBUI_PORT",
                 "SPARK_WORKER_CORES", "SPARK_WORKER_MEMORY", "SPARK_WORKER_INSTANCES"):  # fmt: skip
        env.pop(name, None)
    env.update(
        SPARK_HOME=str(home),
        SPARK_LOCAL_IP=HOST,
        SPARK_CONF_DIR=str(folder / "conf"),
        SPARK_LOG_DIR=str(folder / "logs"),
        SPARK_WORKER_DIR=str(folder / "work"),
        SPARK_DAEMON_MEMORY=_DAEMON_MEMORY,
        SPARK_MASTER_OPTS=_MASTER_OPTS,
        SPARK_WORKER_OPTS=_WORKER_OPTS,
    )
    return env


def _spawn(folder: Path, cls: str, args: list[str], log: Path, iso: _Isolation | None = None,
           worker_id: str = "") -> subprocess.Popen[bytes]:
    home = spark_home()
    if not (os.environ.get("JAVA_HOME") or shutil.which("java")):
        raise ClusterError("Spark needs Java: install Java 17 or set JAVA_HOME")
    for sub in ("conf", "logs", "work"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    argv = ["bash", str(home / "bin" / "spark-class"), cls, *args]
    env = _env(folder, home)
    cwd = folder
    if iso is not None:
        # The worker is the user's process from the start (the JVM is this PID, exec'd by
        # unshare/sh/setpriv), so recorded PIDs and process groups mean the same as without.
        cwd = iso.dirs(worker_id)
        env = isolation.isolated_env(env, iso.user, cwd)
        argv = isolation.isolated_command(argv, iso.user, iso.hidden, cwd / ".mnt")
    with open(log, "ab") as out:
        return subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            cwd=cwd, env=env, start_new_session=True,
        )  # fmt: skip


@dataclass(frozen=True)
class _Isolation:
    """How the workers of an isolated cluster are started (see :mod:`keyscale.cluster.isolation`)."""

    folder: Path
    user: isolation.WorkerUser
    hidden: dict[Path, list[Path]]

    def dirs(self, worker_id: str) -> Path:
        return isolation.worker_dirs(self.user, self.folder, worker_id)

    @classmethod
    def prepare(cls, folder: Path, user_name: str) -> _Isolation:
        """Create or find the user, work out what to bind back, and check it can import keyscale."""
        user = isolation.ensure_worker_user(user_name)
        home = spark_home()
        python = isolation.executors_python()
        env = _env(folder, home)
        hidden = isolation.hidden_folders(isolation.needed_paths(python, env, home), user)
        iso = cls(folder, user, hidden)
        check = iso.dirs("check")
        try:
            isolation.check_worker_python(user, hidden, check / ".mnt", isolation.isolated_env(env, user, check), python)
        finally:
            shutil.rmtree(check, ignore_errors=True)
        return iso


def _isolation(info: ClusterInfo) -> _Isolation | None:
    return None if info.worker_user is None else _Isolation.prepare(info.folder, info.worker_user)


def _bind_failed(log: Path, offset: int) -> bool:
    try:
        with open(log, "rb") as f:
            f.seek(offset)
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return False
    return "Address already in use" in text or "could not bind" in text.lower()


def _log_size(log: Path) -> int:
    try:
        return log.stat().st_size
    except OSError:
        return 0


# --- the master's JSON -------------------------------------------------------------------


def _master_json(webui_port: int, timeout: float = 2.0) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(f"http://{HOST}:{webui_port}/json/", timeout=timeout) as resp:
            data = json.loads(resp.read().decode("utf-8"))
    except (urllib.error.URLError, OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _alive_worker_ports(data: dict[str, Any]) -> set[int]:
    return {int(w.get("port", -1)) for w in data.get("workers", []) if w.get("state") == "ALIVE"}


# --- the state file ----------------------------------------------------------------------


def _folder(folder: str | os.PathLike[str]) -> Path:
    return Path(folder).expanduser().resolve()


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """Serialise changes to one folder's cluster (start, add, stop) across processes."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".cluster.lock", "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def read_cluster(folder: str | os.PathLike[str]) -> ClusterInfo | None:
    """The cluster recorded in ``folder``, or ``None`` if none was started there (or it was stopped).

    >>> import tempfile
    >>> read_cluster(tempfile.mkdtemp()) is None
    True
    """
    path = _folder(folder)
    try:
        text = (path / STATE_FILE).read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ClusterError(f"cannot read {path / STATE_FILE}: {e.strerror or e}") from None
    try:
        return ClusterInfo.from_dict(path, json.loads(text))
    except (ValueError, KeyError, TypeError) as e:
        raise ClusterError(f"{path / STATE_FILE} is damaged ({e}); stop its processes by hand and delete it") from None


def _write_state(info: ClusterInfo) -> None:
    path = info.folder / STATE_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(info.to_dict(), indent=1) + "\n")
    os.replace(tmp, path)


def _require(folder: Path) -> ClusterInfo:
    info = read_cluster(folder)
    if info is None:
        raise ClusterError(f"no cluster in {folder}; start one with: keyscale cluster start --dir {folder}")
    return info


def _require_running(folder: Path) -> ClusterInfo:
    info = _require(folder)
    if not alive(info.master_pid, info.master_started):
        raise ClusterError(
            f"the Spark master of the cluster in {folder} is not running (see {info.master_log}); "
            f"stop the cluster and start it again"
        )
    return info


# --- starting --------------------------------------------------------------------------


def _check_args(cores: int, memory: str) -> None:
    if cores < 1:
        raise ClusterError(f"worker cores must be at least 1, got {cores}")
    if not _MEMORY_RE.match(memory):
        raise ClusterError(f"worker memory {memory!r} must look like 512m or 1g")


def _start_master(folder: Path, timeout: float) -> ClusterInfo:
    log = folder / "logs" / "master.log"
    for attempt in range(_START_ATTEMPTS):
        port, webui = free_ports(2)
        offset = _log_size(log)
        proc = _spawn(folder, MASTER_CLASS, ["--host", HOST, "--port", str(port), "--webui-port", str(webui)], log)
        info = ClusterInfo(
            folder=folder, master_url=f"spark://{HOST}:{port}", webui_url=f"http://{HOST}:{webui}",
            master_pid=proc.pid, master_port=port, webui_port=webui, master_log=log,
            master_started=start_time(proc.pid),
        )  # fmt: skip
        _write_state(info)  # recorded at once: a crash of this process leaves it stoppable
        deadline = time.monotonic() + timeout
        while True:
            code = proc.poll()
            if code is not None:
                if attempt + 1 < _START_ATTEMPTS and _bind_failed(log, offset):
                    break  # a port was taken meanwhile: again, on new ports
                raise ClusterError(f"the Spark master exited with code {code} while starting; see {log}")
            data = _master_json(webui)
            if data is not None and data.get("status") == "ALIVE":
                return info
            if time.monotonic() > deadline:
                terminate(proc.pid, info.master_started, grace=2.0, kill=False)
                raise ClusterError(f"the Spark master did not come up within {timeout:.0f} s; see {log}")
            time.sleep(0.2)
    raise ClusterError(f"the Spark master could not bind free ports in {_START_ATTEMPTS} attempts; see {log}")  # pragma: no cover


def _launch_worker(
    info: ClusterInfo, worker_id: str, cores: int, memory: str, iso: _Isolation | None
) -> tuple[subprocess.Popen[bytes], WorkerInfo, int]:
    folder = info.folder
    log = folder / "logs" / f"{worker_id}.log"
    if iso is None:
        work = folder / "work" / worker_id
        work.mkdir(parents=True, exist_ok=True)
    else:
        work = iso.dirs(worker_id) / "work"  # the worker user's: the cluster folder may be closed to it
    port, webui = free_ports(2)
    offset = _log_size(log)
    args = [info.master_url, "--host", HOST, "--port", str(port), "--webui-port", str(webui),
            "--cores", str(cores), "--memory", memory, "--work-dir", str(work)]  # fmt: skip
    proc = _spawn(folder, WORKER_CLASS, args, log, iso, worker_id)
    w = WorkerInfo(worker_id, proc.pid, cores, memory, port, webui, log, work, start_time(proc.pid))
    return proc, w, offset


def _start_workers(
    info: ClusterInfo, count: int, cores: int, memory: str, timeout: float, iso: _Isolation | None
) -> ClusterInfo:
    """Start ``count`` workers at once and wait until the master lists all of them ALIVE.

    ``cluster.json`` records each one as soon as it is launched. On failure the caller
    stops what is recorded.
    """
    pending: dict[str, tuple[subprocess.Popen[bytes], WorkerInfo, int, int]] = {}
    for _ in range(count):
        wid = f"worker-{info.next_worker}"
        proc, w, offset = _launch_worker(info, wid, cores, memory, iso)
        info = replace(info, workers=(*info.workers, w), next_worker=info.next_worker + 1)
        pending[wid] = (proc, w, offset, 1)
        _write_state(info)
    deadline = time.monotonic() + timeout
    while pending:
        data = _master_json(info.webui_port)
        registered = _alive_worker_ports(data) if data is not None else set()
        for wid, (proc, w, offset, attempts) in list(pending.items()):
            if w.port in registered:
                del pending[wid]
                continue
            code = proc.poll()
            if code is None:
                continue
            if attempts < _START_ATTEMPTS and _bind_failed(w.log, offset):
                proc2, w2, offset2 = _launch_worker(info, wid, cores, memory, iso)
                info = replace(info, workers=tuple(w2 if x.id == wid else x for x in info.workers))
                _write_state(info)
                pending[wid] = (proc2, w2, offset2, attempts + 1)
                continue
            raise ClusterError(f"Spark worker {wid} exited with code {code} while starting; see {w.log}")
        if not pending:
            break
        if time.monotonic() > deadline:
            wid, (_p, w, _o, _a) = next(iter(pending.items()))
            raise ClusterError(
                f"Spark worker {wid} did not register with the master within {timeout:.0f} s; see {w.log}"
            )
        time.sleep(0.2)
    return info


def _stop_all(info: ClusterInfo, grace: float) -> None:
    """SIGTERM every recorded daemon at once, then wait and SIGKILL leftovers (workers first)."""
    for w in info.workers:
        if alive(w.pid, w.started):
            with contextlib.suppress(ProcessLookupError):
                os.kill(w.pid, signal.SIGTERM)
    for w in info.workers:
        terminate(w.pid, w.started, grace=grace, kill=False)
        _remove_scratch(info, w)
    terminate(info.master_pid, info.master_started, grace=grace, kill=False)


def _remove_scratch(info: ClusterInfo, w: WorkerInfo) -> None:
    """An isolated worker's dirs after it stopped: logs to the cluster folder, the rest deleted."""
    if info.worker_user is not None:
        isolation.retire_worker_dirs(w.work_dir.parent, info.folder / "work" / w.id)


def start_cluster(
    folder: str | os.PathLike[str],
    workers: int = 1,
    cores: int = 1,
    memory: str = "1g",
    *,
    timeout: float = DEFAULT_TIMEOUT,
    isolated: bool = False,
    worker_user: str | None = None,
) -> ClusterInfo:
    """Start a master and ``workers`` workers of ``cores`` cores and ``memory`` each in ``folder``.

    Returns when the master is up and every worker has registered with it. A cluster still
    running in ``folder`` is a :class:`ClusterError` (stop it first); a record left by a
    cluster whose processes are all gone (a reboot) is replaced. Worker memory is what the
    worker offers to executors: at least ``cores`` times the executors' memory (512m with
    :func:`keyscale.cluster.spark_conf_for_cluster`) for every core to get an executor.

    ``isolated=True`` runs the workers (their executors and Python workers too) as the
    Unix user ``worker_user`` (default ``keyscale-worker``, created if absent; giving
    ``worker_user`` implies ``isolated``) with their own dirs, so tasks cannot read the
    driver's private local folders; needs root. Workers added later are isolated too. See
    :mod:`keyscale.cluster.isolation`.

    >>> start_cluster("/tmp/ks-c", workers=0, cores=0)
    Traceback (most recent call last):
    ...
    keyscale.errors.ClusterError: worker cores must be at least 1, got 0
    """
    _check_args(cores, memory)
    if workers < 0:
        raise ClusterError(f"the number of workers must be 0 or more, got {workers}")
    path = _folder(folder)
    with _locked(path):
        old = read_cluster(path)
        if old is not None:
            if alive(old.master_pid, old.master_started):
                raise ClusterError(
                    f"a cluster is already running in {path} (master {old.master_url}, pid {old.master_pid}); "
                    f"stop it first: keyscale cluster stop --dir {path}"
                )
            _stop_all(old, grace=2.0)  # stale record: make sure nothing of it is left
            (path / STATE_FILE).unlink(missing_ok=True)
        user = worker_user or (isolation.DEFAULT_WORKER_USER if isolated else None)
        iso = _Isolation.prepare(path, user) if user is not None else None
        try:
            info = replace(_start_master(path, timeout), worker_user=user)
            _write_state(info)
            return _start_workers(info, workers, cores, memory, timeout, iso)
        except BaseException:
            started = read_cluster(path)  # everything launched is recorded at once
            if started is not None:
                _stop_all(started, grace=2.0)
            (path / STATE_FILE).unlink(missing_ok=True)
            raise


def add_worker(
    folder: str | os.PathLike[str],
    cores: int = 1,
    memory: str = "1g",
    *,
    timeout: float = DEFAULT_TIMEOUT,
) -> WorkerInfo:
    """Start one more worker in the cluster in ``folder``; returns when the master lists it ALIVE.

    Running applications get executors on it right away, up to their limit (see
    :mod:`keyscale.cluster.executors`).
    """
    _check_args(cores, memory)
    path = _folder(folder)
    with _locked(path):
        info = _require_running(path)
        before = {w.id for w in info.workers}
        try:
            info = _start_workers(info, 1, cores, memory, timeout, _isolation(info))
        except BaseException:
            now = read_cluster(path) or info
            for w in now.workers:
                if w.id not in before:
                    terminate(w.pid, w.started, grace=2.0, kill=False)
            _write_state(replace(now, workers=tuple(w for w in now.workers if w.id in before)))
            raise
        (new,) = (w for w in info.workers if w.id not in before)
        return new


def stop_worker(
    folder: str | os.PathLike[str],
    worker_id: str,
    *,
    kill: bool = False,
    grace: float = DEFAULT_GRACE,
    wait: float = 15.0,
) -> WorkerInfo:
    """Stop worker ``worker_id`` and its executors; returns its record.

    ``kill=False`` is an orderly shutdown (SIGTERM: the worker stops its executors), with
    SIGKILL of the whole process group after ``grace`` seconds; ``kill=True`` SIGKILLs the
    group at once, like a machine that disappears. Waits up to ``wait`` seconds for the
    master to stop listing it as ALIVE (it notices at once when the connection drops).
    """
    path = _folder(folder)
    with _locked(path):
        info = _require(path)
        w = info.worker(worker_id)
        terminate(w.pid, w.started, grace=grace, kill=kill)
        _remove_scratch(info, w)
        _write_state(replace(info, workers=tuple(x for x in info.workers if x.id != worker_id)))
    if alive(info.master_pid, info.master_started):
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            data = _master_json(info.webui_port)
            if data is None or w.port not in _alive_worker_ports(data):
                break
            time.sleep(0.1)
    return w


def stop_cluster(folder: str | os.PathLike[str], *, grace: float = DEFAULT_GRACE) -> bool:
    """Stop the workers (with their executors) and the master in ``folder``.

    Returns ``False`` (and does nothing) when no cluster is recorded there. Logs stay;
    ``cluster.json`` is removed, so the folder can start a new cluster.
    """
    path = _folder(folder)
    with _locked(path):
        info = read_cluster(path)
        if info is None:
            return False
        _stop_all(info, grace)
        (path / STATE_FILE).unlink(missing_ok=True)
        return True


def cluster_status(folder: str | os.PathLike[str], *, timeout: float = 5.0) -> ClusterStatus:
    """Workers, cores and applications as the master of the cluster in ``folder`` reports them now.

    :class:`ClusterError` if no cluster is recorded there; ``running=False`` if the master
    does not answer within ``timeout`` seconds.
    """
    path = _folder(folder)
    info = _require(path)
    dead = [] if alive(info.master_pid, info.master_started) else ["master"]
    dead += [w.id for w in info.workers if not alive(w.pid, w.started)]
    data = _master_json(info.webui_port, timeout=timeout) if "master" not in dead else None
    if data is None:
        return ClusterStatus(path, info.master_url, info.webui_url, False, dead_processes=tuple(dead))
    by_port = {w.port: w.id for w in info.workers}
    workers = tuple(
        WorkerStatus(
            id=by_port.get(int(w.get("port", -1))),
            spark_id=str(w.get("id", "")), host=str(w.get("host", "")), port=int(w.get("port", -1)),
            state=str(w.get("state", "")), cores=int(w.get("cores", 0)), cores_used=int(w.get("coresused", 0)),
            memory_mb=int(w.get("memory", 0)),
        )
        for w in data.get("workers", [])
    )
    apps = tuple(str(a.get("name", a.get("id", ""))) for a in data.get("activeapps", []))
    return ClusterStatus(path, info.master_url, info.webui_url, True, workers, apps, tuple(dead))
