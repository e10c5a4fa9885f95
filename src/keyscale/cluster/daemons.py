"""The Spark daemons of a local cluster: starting a master and workers, waiting until the
master lists them ALIVE, and stopping them.

Each daemon is the PySpark install's own ``bin/spark-class`` in its own session, bound to
127.0.0.1 on free ports (started again on new ports when one was taken meanwhile, so the
recorded ports are always the real ones); workers of an isolated cluster run as another
Unix user (:mod:`keyscale.cluster.isolation`). Every launch is recorded in
``cluster.json`` at once (:mod:`keyscale.cluster.statefile`), so a crash of the starting
process leaves it stoppable. The operations built on them are :mod:`keyscale.cluster.local`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from keyscale.cluster import isolation
from keyscale.cluster.processes import HOST, alive, free_ports, spark_home, start_time, terminate
from keyscale.cluster.records import ClusterInfo, WorkerInfo
from keyscale.cluster.statefile import write_state
from keyscale.errors import ClusterError

__all__ = [
    "MASTER_CLASS",
    "WORKER_CLASS",
    "WORKER_TIMEOUT_S",
    "Isolation",
    "alive_worker_ports",
    "isolation_for",
    "master_json",
    "remove_scratch",
    "start_master",
    "start_workers",
    "stop_all",
]

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


# --- one daemon ---------------------------------------------------------------------------


def _env(folder: Path, home: Path, executor_archive: str | None = None) -> dict[str, str]:
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
    if executor_archive is not None:
        # Executors inherit their worker's environment, and Java's launcher puts this variable
        # before the command line's options: a job's own spark.executor.extraJavaOptions win.
        # The worker's own JVM and the launcher JVM spark-class runs first (other class paths)
        # keep Java's default archive instead.
        env["JDK_JAVA_OPTIONS"] = f"{env.get('JDK_JAVA_OPTIONS', '')} -XX:SharedArchiveFile={executor_archive}".strip()
        env["SPARK_WORKER_OPTS"] = f"{_WORKER_OPTS} {_java_default_archive()}"
        env["SPARK_LAUNCHER_OPTS"] = f"{env.get('SPARK_LAUNCHER_OPTS', '')} {_java_default_archive()}".strip()
    return env


def _java_default_archive() -> str:
    """The option that gives a JVM Java's own class archive back (off if it has none)."""
    java = os.environ.get("JAVA_HOME") or (str(Path(w).resolve().parent.parent) if (w := shutil.which("java")) else "")
    base = Path(java) / "lib" / "server" / "classes.jsa"
    return f"-XX:SharedArchiveFile={base}" if java and base.is_file() else "-Xshare:off"


def _spawn(folder: Path, cls: str, args: list[str], log: Path, iso: Isolation | None = None,
           worker_id: str = "", executor_archive: str | None = None) -> subprocess.Popen[bytes]:
    home = spark_home()
    if not (os.environ.get("JAVA_HOME") or shutil.which("java")):
        raise ClusterError("Spark needs Java: install Java 17 or set JAVA_HOME")
    for sub in ("conf", "logs", "work"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    argv = ["bash", str(home / "bin" / "spark-class"), cls, *args]
    env = _env(folder, home, executor_archive)
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
class Isolation:
    """How the workers of an isolated cluster are started (see :mod:`keyscale.cluster.isolation`)."""

    folder: Path
    user: isolation.WorkerUser
    hidden: dict[Path, list[Path]]

    def dirs(self, worker_id: str) -> Path:
        return isolation.worker_dirs(self.user, self.folder, worker_id)

    @classmethod
    def prepare(cls, folder: Path, user_name: str) -> Isolation:
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


def isolation_for(info: ClusterInfo) -> Isolation | None:
    return None if info.worker_user is None else Isolation.prepare(info.folder, info.worker_user)


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


def master_json(webui_port: int, timeout: float = 2.0) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(f"http://{HOST}:{webui_port}/json/", timeout=timeout) as resp:
            data = json.loads(resp.read().decode("utf-8"))
    except (urllib.error.URLError, OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def alive_worker_ports(data: dict[str, Any]) -> set[int]:
    return {int(w.get("port", -1)) for w in data.get("workers", []) if w.get("state") == "ALIVE"}


# --- starting and stopping ----------------------------------------------------------------


def start_master(folder: Path, timeout: float) -> ClusterInfo:
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
        write_state(info)  # recorded at once: a crash of this process leaves it stoppable
        deadline = time.monotonic() + timeout
        while True:
            code = proc.poll()
            if code is not None:
                if attempt + 1 < _START_ATTEMPTS and _bind_failed(log, offset):
                    break  # a port was taken meanwhile: again, on new ports
                raise ClusterError(f"the Spark master exited with code {code} while starting; see {log}")
            data = master_json(webui)
            if data is not None and data.get("status") == "ALIVE":
                return info
            if time.monotonic() > deadline:
                terminate(proc.pid, info.master_started, grace=2.0, kill=False)
                raise ClusterError(f"the Spark master did not come up within {timeout:.0f} s; see {log}")
            time.sleep(0.2)
    raise ClusterError(f"the Spark master could not bind free ports in {_START_ATTEMPTS} attempts; see {log}")  # pragma: no cover


def _launch_worker(
    info: ClusterInfo, worker_id: str, cores: int, memory: str, iso: Isolation | None
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
    proc = _spawn(folder, WORKER_CLASS, args, log, iso, worker_id, info.executor_archive)
    w = WorkerInfo(worker_id, proc.pid, cores, memory, port, webui, log, work, start_time(proc.pid))
    return proc, w, offset


def start_workers(
    info: ClusterInfo, count: int, cores: int, memory: str, timeout: float, iso: Isolation | None
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
        write_state(info)
    deadline = time.monotonic() + timeout
    while pending:
        data = master_json(info.webui_port)
        registered = alive_worker_ports(data) if data is not None else set()
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
                write_state(info)
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


def stop_all(info: ClusterInfo, grace: float) -> None:
    """SIGTERM every recorded daemon at once, then wait and SIGKILL leftovers (workers first)."""
    for w in info.workers:
        if alive(w.pid, w.started):
            with contextlib.suppress(ProcessLookupError):
                os.kill(w.pid, signal.SIGTERM)
    for w in info.workers:
        terminate(w.pid, w.started, grace=grace, kill=False)
        remove_scratch(info, w)
    terminate(info.master_pid, info.master_started, grace=grace, kill=False)


def remove_scratch(info: ClusterInfo, w: WorkerInfo) -> None:
    """An isolated worker's dirs after it stopped: logs to the cluster folder, the rest deleted."""
    if info.worker_user is not None:
        isolation.retire_worker_dirs(w.work_dir.parent, info.folder / "work" / w.id)
