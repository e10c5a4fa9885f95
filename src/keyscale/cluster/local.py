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
    FOLDER/executor-classes.jsa  with class_archive=True: the executors' class archive

``cluster.json`` exists while a cluster started there has not been stopped. Starting is
finished when the master answers on its web UI's JSON (``/json/``) and every worker is
listed there as ALIVE; a daemon that exits or does not come up in time is a
:class:`~keyscale.errors.ClusterError` naming its log file, and whatever was started is
stopped again. A worker is stopped like a machine being shut down (SIGTERM, then SIGKILL
of its whole process group, executors included, after a grace period) or, with
``kill=True``, like a machine that vanishes (SIGKILL of the group at once). Processes are
only ever signalled by the PIDs recorded here, after checking the PID still belongs to
the process that was started (its start time), so a reused PID is never touched.

This module is what a caller does with a cluster (start it, add or stop a worker, stop
it, ask its status); the daemons themselves are started and stopped by
:mod:`keyscale.cluster.daemons`, and ``cluster.json`` and the folder's lock are
:mod:`keyscale.cluster.statefile`.

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

import logging
import os
import re
import time
from dataclasses import replace

from keyscale.cluster import isolation
from keyscale.cluster.daemons import (
    Isolation,
    alive_worker_ports,
    isolation_for,
    master_json,
    remove_scratch,
    start_master,
    start_workers,
    stop_all,
)
from keyscale.cluster.processes import HOST, alive, spark_home, terminate
from keyscale.cluster.records import ClusterInfo, ClusterStatus, WorkerInfo, WorkerStatus
from keyscale.cluster.statefile import (
    STATE_FILE,
    cluster_folder,
    locked,
    read_cluster,
    require,
    require_running,
    write_state,
)
from keyscale.errors import ClusterError, KeyscaleError

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

DEFAULT_TIMEOUT = 90.0
"""Seconds to wait for a daemon to come up (a JVM start is 2-5 s; a shared CI box is slower)."""
DEFAULT_GRACE = 10.0
"""Seconds a SIGTERMed daemon gets before its process group is SIGKILLed."""

log = logging.getLogger("keyscale")

_MEMORY_RE = re.compile(r"^[1-9][0-9]*[mMgG]$")


def _check_args(cores: int, memory: str) -> None:
    if cores < 1:
        raise ClusterError(f"worker cores must be at least 1, got {cores}")
    if not _MEMORY_RE.match(memory):
        raise ClusterError(f"worker memory {memory!r} must look like 512m or 1g")


def start_cluster(
    folder: str | os.PathLike[str],
    workers: int = 1,
    cores: int = 1,
    memory: str = "1g",
    *,
    timeout: float = DEFAULT_TIMEOUT,
    isolated: bool = False,
    worker_user: str | None = None,
    class_archive: bool = False,
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

    ``class_archive=True`` starts the workers' executors with a class archive of their own
    (``FOLDER/executor-classes.jsa``): the classes an executor loads, mapped from one file,
    so that new executors come to speed sooner (docs/benchmarks.md, "The executor wait").
    The first start in a folder makes it, with one worker and a small job (about a minute);
    later starts reuse it while it fits this Java and Spark (:mod:`keyscale.classarchive`).
    Not with ``isolated``: each isolated worker's executors have a class path of their own.

    >>> start_cluster("/tmp/ks-c", workers=0, cores=0)
    Traceback (most recent call last):
    ...
    keyscale.errors.ClusterError: worker cores must be at least 1, got 0
    """
    _check_args(cores, memory)
    if workers < 0:
        raise ClusterError(f"the number of workers must be 0 or more, got {workers}")
    if class_archive and (isolated or worker_user):
        raise ClusterError("a class archive is not for an isolated cluster: each isolated worker's executors have a class path "
                           "of their own (start it without --class-archive)")
    path = cluster_folder(folder)
    with locked(path):
        old = read_cluster(path)
        if old is not None:
            if alive(old.master_pid, old.master_started):
                raise ClusterError(
                    f"a cluster is already running in {path} (master {old.master_url}, pid {old.master_pid}); "
                    f"stop it first: keyscale cluster stop --dir {path}"
                )
            stop_all(old, grace=2.0)  # stale record: make sure nothing of it is left
            (path / STATE_FILE).unlink(missing_ok=True)
        user = worker_user or (isolation.DEFAULT_WORKER_USER if isolated else None)
        iso = Isolation.prepare(path, user) if user is not None else None
        try:
            info = replace(start_master(path, timeout), worker_user=user)
            write_state(info)
            if class_archive:
                info = _with_executor_archive(info, memory, timeout)
            return start_workers(info, workers, cores, memory, timeout, iso)
        except BaseException:
            started = read_cluster(path)  # everything launched is recorded at once
            if started is not None:
                stop_all(started, grace=2.0)
            (path / STATE_FILE).unlink(missing_ok=True)
            raise


EXECUTOR_ARCHIVE = "executor-classes.jsa"


def _with_executor_archive(info: ClusterInfo, memory: str, timeout: float) -> ClusterInfo:
    """``info`` with its executors' class archive: the folder's, or one made now by a job on
    a worker of its own (stopped after it, so that every worker is started with the archive)."""
    from keyscale.classarchive import archive_problems, create_executor_archive

    archive = info.folder / EXECUTOR_ARCHIVE
    conf_dir = info.folder / "conf"
    try:
        remake = bool(archive_problems(archive, conf_dir))
    except (KeyscaleError, ValueError):  # a stamp this keyscale cannot read: make the archive again
        remake = True
    if remake:
        info = start_workers(info, 1, 1, memory, timeout, None)
        (maker,) = info.workers
        try:
            create_executor_archive(archive, info.master_url, conf_dir, progress=lambda said: log.info("%s", said))
        finally:
            terminate(maker.pid, maker.started, grace=2.0, kill=False)
            remove_scratch(info, maker)
            info = replace(info, workers=())
            write_state(info)
    info = replace(info, executor_archive=str(archive))
    write_state(info)
    return info


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
    path = cluster_folder(folder)
    with locked(path):
        info = require_running(path)
        before = {w.id for w in info.workers}
        try:
            info = start_workers(info, 1, cores, memory, timeout, isolation_for(info))
        except BaseException:
            now = read_cluster(path) or info
            for w in now.workers:
                if w.id not in before:
                    terminate(w.pid, w.started, grace=2.0, kill=False)
            write_state(replace(now, workers=tuple(w for w in now.workers if w.id in before)))
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
    path = cluster_folder(folder)
    with locked(path):
        info = require(path)
        w = info.worker(worker_id)
        terminate(w.pid, w.started, grace=grace, kill=kill)
        remove_scratch(info, w)
        write_state(replace(info, workers=tuple(x for x in info.workers if x.id != worker_id)))
    if alive(info.master_pid, info.master_started):
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            data = master_json(info.webui_port)
            if data is None or w.port not in alive_worker_ports(data):
                break
            time.sleep(0.1)
    return w


def stop_cluster(folder: str | os.PathLike[str], *, grace: float = DEFAULT_GRACE) -> bool:
    """Stop the workers (with their executors) and the master in ``folder``.

    Returns ``False`` (and does nothing) when no cluster is recorded there. Logs stay;
    ``cluster.json`` is removed, so the folder can start a new cluster.
    """
    path = cluster_folder(folder)
    with locked(path):
        info = read_cluster(path)
        if info is None:
            return False
        stop_all(info, grace)
        (path / STATE_FILE).unlink(missing_ok=True)
        return True


def cluster_status(folder: str | os.PathLike[str], *, timeout: float = 5.0) -> ClusterStatus:
    """Workers, cores and applications as the master of the cluster in ``folder`` reports them now.

    :class:`ClusterError` if no cluster is recorded there; ``running=False`` if the master
    does not answer within ``timeout`` seconds.
    """
    path = cluster_folder(folder)
    info = require(path)
    dead = [] if alive(info.master_pid, info.master_started) else ["master"]
    dead += [w.id for w in info.workers if not alive(w.pid, w.started)]
    data = master_json(info.webui_port, timeout=timeout) if "master" not in dead else None
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
