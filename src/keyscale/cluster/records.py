"""What ``keyscale cluster`` records of a local cluster (``cluster.json``) and reports of it
(``cluster_status``): plain frozen records, no processes, no I/O.

    >>> from pathlib import Path
    >>> from keyscale.cluster.records import WorkerInfo
    >>> w = WorkerInfo("worker-1", 4242, 2, "1g", 40001, 40002, Path("logs/worker-1.log"), Path("work/worker-1"))
    >>> WorkerInfo.from_dict(w.to_dict()) == w      # as written to and read from cluster.json
    True
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from keyscale.errors import ClusterError


@dataclass(frozen=True)
class WorkerInfo:
    """A worker started by keyscale (one entry of ``cluster.json``).

    Attributes:
        id: keyscale's name for it, ``worker-N`` (N is never reused within a cluster).
        pid: the worker JVM's PID; it leads a process group holding its executors.
        cores: cores it offers to applications.
        memory: memory it offers to executors (e.g. ``"1g"``).
        port: its RPC port; the master lists it under this port.
        webui_port: its web UI port.
        log: its output.
        work_dir: its work dir (executor logs).
        started: the process's start time (clock ticks since boot; 0 if unknown), which
            tells the process apart from a later one that reuses the PID.
    """

    id: str
    pid: int
    cores: int
    memory: str
    port: int
    webui_port: int
    log: Path
    work_dir: Path
    started: int = 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (as in ``cluster.json``)."""
        return {
            "id": self.id, "pid": self.pid, "cores": self.cores, "memory": self.memory,
            "port": self.port, "webui_port": self.webui_port, "log": str(self.log),
            "work_dir": str(self.work_dir), "started": self.started,
        }  # fmt: skip

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> WorkerInfo:
        return cls(
            id=str(d["id"]), pid=int(d["pid"]), cores=int(d["cores"]), memory=str(d["memory"]),
            port=int(d["port"]), webui_port=int(d["webui_port"]), log=Path(d["log"]),
            work_dir=Path(d["work_dir"]), started=int(d.get("started", 0)),
        )  # fmt: skip


@dataclass(frozen=True)
class ClusterInfo:
    """A cluster as recorded in ``FOLDER/cluster.json``.

    ``master_url`` (``spark://127.0.0.1:PORT``) is what applications connect to
    (``keyscale run --master ...``); ``webui_url`` serves the master's status page and its
    JSON (``webui_url + "/json/"``).
    """

    folder: Path
    master_url: str
    webui_url: str
    master_pid: int
    master_port: int
    webui_port: int
    master_log: Path
    master_started: int = 0
    workers: tuple[WorkerInfo, ...] = ()
    next_worker: int = 1
    worker_user: str | None = None
    """The Unix user the workers run as when the cluster is isolated (:mod:`keyscale.cluster.isolation`)."""
    executor_archive: str | None = None
    """The class archive the workers' executors start with (``start_cluster(class_archive=True)``)."""

    @property
    def cores(self) -> int:
        """Cores of the recorded workers (whether or not the master sees them alive)."""
        return sum(w.cores for w in self.workers)

    def worker(self, worker_id: str) -> WorkerInfo:
        """The recorded worker ``worker_id``; :class:`ClusterError` naming the known ones if absent."""
        for w in self.workers:
            if w.id == worker_id:
                return w
        known = ", ".join(w.id for w in self.workers) or "none"
        raise ClusterError(f"no worker {worker_id!r} in the cluster in {self.folder} (workers: {known})")

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (what ``cluster.json`` holds)."""
        return {
            "master_url": self.master_url,
            "webui_url": self.webui_url,
            "master": {
                "pid": self.master_pid, "port": self.master_port, "webui_port": self.webui_port,
                "log": str(self.master_log), "started": self.master_started,
            },
            "workers": [w.to_dict() for w in self.workers],
            "next_worker": self.next_worker,
            "worker_user": self.worker_user,
            "executor_archive": self.executor_archive,
        }  # fmt: skip

    @classmethod
    def from_dict(cls, folder: Path, d: dict[str, Any]) -> ClusterInfo:
        m = d["master"]
        return cls(
            folder=folder, master_url=str(d["master_url"]), webui_url=str(d["webui_url"]),
            master_pid=int(m["pid"]), master_port=int(m["port"]), webui_port=int(m["webui_port"]),
            master_log=Path(m["log"]), master_started=int(m.get("started", 0)),
            workers=tuple(WorkerInfo.from_dict(w) for w in d.get("workers", [])),
            next_worker=int(d.get("next_worker", 1)),
            worker_user=None if d.get("worker_user") is None else str(d["worker_user"]),
            executor_archive=None if d.get("executor_archive") is None else str(d["executor_archive"]),
        )  # fmt: skip


@dataclass(frozen=True)
class WorkerStatus:
    """A worker as the master sees it (one entry of the master's ``/json/``).

    ``id`` is keyscale's name when the worker was started from this folder, else ``None``.
    """

    id: str | None
    spark_id: str
    host: str
    port: int
    state: str
    cores: int
    cores_used: int
    memory_mb: int

    @property
    def alive(self) -> bool:
        return self.state == "ALIVE"


@dataclass(frozen=True)
class ClusterStatus:
    """What the master reports now; ``running`` is False when it does not answer.

    >>> s = ClusterStatus(Path("/c"), "spark://127.0.0.1:1", "http://127.0.0.1:2", True,
    ...                   (WorkerStatus("worker-1", "w-1", "127.0.0.1", 3, "ALIVE", 2, 1, 1024),
    ...                    WorkerStatus(None, "w-0", "127.0.0.1", 4, "DEAD", 4, 0, 1024)))
    >>> len(s.alive_workers), s.total_cores, s.cores_used
    (1, 2, 1)
    """

    folder: Path
    master_url: str
    webui_url: str
    running: bool
    workers: tuple[WorkerStatus, ...] = ()
    applications: tuple[str, ...] = ()
    dead_processes: tuple[str, ...] = field(default=())
    """Recorded daemons (``master``, ``worker-N``) whose process is gone."""

    @property
    def alive_workers(self) -> tuple[WorkerStatus, ...]:
        return tuple(w for w in self.workers if w.alive)

    @property
    def total_cores(self) -> int:
        """Cores of the alive workers: what applications can get."""
        return sum(w.cores for w in self.alive_workers)

    @property
    def cores_used(self) -> int:
        return sum(w.cores_used for w in self.alive_workers)

    def to_dict(self) -> dict[str, Any]:
        return {
            "folder": str(self.folder),
            "master_url": self.master_url,
            "webui_url": self.webui_url,
            "running": self.running,
            "alive_workers": len(self.alive_workers),
            "total_cores": self.total_cores,
            "cores_used": self.cores_used,
            "workers": [
                {"id": w.id, "spark_id": w.spark_id, "host": w.host, "port": w.port, "state": w.state,
                 "cores": w.cores, "cores_used": w.cores_used, "memory_mb": w.memory_mb}
                for w in self.workers
            ],
            "applications": list(self.applications),
            "dead_processes": list(self.dead_processes),
        }  # fmt: skip
