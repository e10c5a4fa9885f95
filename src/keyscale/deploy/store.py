"""A deployment's state folder: desired spec, status, events, job directories, artifacts.

Layout::

    STATE_DIR/
      desired.json        what `keyscale apply` / `deployment stop` asked for (generation, state, spec)
      status.json         what the supervisor did and sees (written only by the supervisor)
      events.jsonl        one JSON object per line: every action, with its reason
      supervisor.pid      the supervisor's pid while it runs
      supervisor.lock     held (flock) by the one supervisor of the deployment
      supervisor.log      the supervisor's log
      apply.lock          serialises writers of desired.json
      artifacts/<sha>/    the applied copies of the job file (runs use these, not the original)
      jobs/<n>/           job directories, numbered in creation order
      logs/job-<n>.log    the output of the job processes run in jobs/<n>
      savepoints/         savepoints (unless the deployment file names another folder)

>>> import tempfile
>>> store = DeploymentStore(tempfile.mkdtemp())
>>> store.next_job_dir().name
'1'
>>> store.event("apply", "generation 1", generation=1)
>>> [e["message"] for e in store.events()]
['generation 1']
"""

from __future__ import annotations

import datetime as dt
import fcntl
import json
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from keyscale.checkpoint.jobdir import JobDir
from keyscale.deploy.plan import Current, Desired, DesiredState
from keyscale.deploy.spec import DeploymentError, DeploymentSpec
from keyscale.errors import KeyscaleError
from keyscale.storage.local import LocalStore, atomic_write_json, is_locked

__all__ = ["DeploymentState", "DeploymentStatus", "DeploymentStore"]


class DeploymentState:
    """The states a deployment is in (``status.json``'s ``state``)."""

    STARTING = "STARTING"  # a job process is starting (Spark session, restore)
    RUNNING = "RUNNING"
    UPGRADING = "UPGRADING"  # stopping the old job and starting the new spec
    RESTARTING = "RESTARTING"  # the job failed; waiting out the backoff
    STOPPING = "STOPPING"
    STOPPED = "STOPPED"
    FAILED = "FAILED"  # restart attempts exhausted

    ACTIVE = frozenset({STARTING, RUNNING, UPGRADING, RESTARTING, STOPPING})


@dataclass
class DeploymentStatus:
    """``status.json``: the supervisor's view of the deployment."""

    name: str = ""
    state: str = DeploymentState.STOPPED
    supervisor_pid: int | None = None
    observed_generation: int = 0  # the last desired generation with an outcome
    rejected_generation: int = 0  # a generation refused or failed: not retried
    outcome: dict[str, Any] | None = None  # {"generation", "ok", "message", "savepoint"?}
    running_spec: dict[str, Any] | None = None  # the spec the job runs (or last ran) with
    job_dir: str | None = None
    job_pid: int | None = None
    job_started_ms: int | None = None
    restored_from: str | None = None  # how the current job started: a checkpoint, a savepoint, empty
    last_exit: int | None = None
    restarts: int = 0  # restarts after failures, over the deployment's life
    failures: int = 0  # failed runs in a row (reset when a restarted job commits a checkpoint)
    state_since_ms: int = 0  # the last deliberate start from empty state (restore strategy NONE)
    savepoints: list[dict[str, Any]] = field(default_factory=list)  # taken by the supervisor
    message: str = ""
    updated_ms: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> DeploymentStatus:
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in known})

    def current(self) -> Current:
        """What :func:`~keyscale.deploy.plan.plan_action` needs to know of this status."""
        spec = DeploymentSpec.from_json(self.running_spec) if self.running_spec else None
        m = None
        if self.job_dir:
            jd = JobDir(self.job_dir)
            if jd.exists():
                try:
                    m = jd.identity().max_parallelism
                except KeyscaleError:
                    m = None
        return Current(spec, m, self.last_exit, self.failures, self.rejected_generation)

    def job_running(self) -> bool:
        """Is a process running the current job directory (whoever started it)?"""
        return bool(self.job_dir) and JobDir(str(self.job_dir)).is_running()


def _now_ms() -> int:
    return int(time.time() * 1000)


class DeploymentStore:
    """Paths and small, atomic operations on one deployment's state folder."""

    def __init__(self, state_dir: str | os.PathLike[str]):
        self.path = Path(state_dir).absolute()
        self._lock_fd: int | None = None

    # -- layout ------------------------------------------------------------------------
    @property
    def desired_path(self) -> Path:
        return self.path / "desired.json"

    @property
    def status_path(self) -> Path:
        return self.path / "status.json"

    @property
    def events_path(self) -> Path:
        return self.path / "events.jsonl"

    @property
    def pid_path(self) -> Path:
        return self.path / "supervisor.pid"

    @property
    def supervisor_log(self) -> Path:
        return self.path / "supervisor.log"

    @property
    def jobs(self) -> Path:
        return self.path / "jobs"

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    def exists(self) -> bool:
        return self.desired_path.exists()

    # -- desired -----------------------------------------------------------------------
    def read_desired(self) -> Desired | None:
        try:
            d = json.loads(self.desired_path.read_text())
            return Desired(int(d["generation"]), DesiredState(d["state"]), DeploymentSpec.from_json(d["spec"]))
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError) as e:
            raise DeploymentError(f"{self.desired_path} is damaged ({type(e).__name__}: {e}); apply the deployment file again") from None

    def write_desired(self, desired: Desired) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        atomic_write_json(self.desired_path, {
            "generation": desired.generation, "state": desired.state.value,
            "spec": desired.spec.to_json(), "written_ms": _now_ms(),
        })

    @contextmanager
    def apply_lock(self) -> Iterator[None]:
        """Serialise the writers of ``desired.json`` (generations never collide)."""
        self.path.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path / "apply.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def install_artifact(self, spec: DeploymentSpec) -> Path:
        """Copy the job file to its content-addressed place (once); runs use the copy."""
        target = spec.artifact
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
            shutil.copyfile(spec.job_file, tmp)
            os.replace(tmp, target)
        return target

    # -- status ------------------------------------------------------------------------
    def read_status(self) -> DeploymentStatus:
        try:
            return DeploymentStatus.from_json(json.loads(self.status_path.read_text()))
        except (FileNotFoundError, ValueError, TypeError):
            return DeploymentStatus()

    def write_status(self, status: DeploymentStatus) -> None:
        status.updated_ms = _now_ms()
        atomic_write_json(self.status_path, status.to_json(), durable=False)

    # -- events ------------------------------------------------------------------------
    def event(self, kind: str, message: str, **extra: Any) -> None:
        """Append one event (one line, written by one ``write``)."""
        self.path.mkdir(parents=True, exist_ok=True)
        now = _now_ms()
        rec = {
            "time": dt.datetime.fromtimestamp(now / 1000, dt.UTC).isoformat(timespec="milliseconds"),
            "ms": now, "event": kind, "message": message, **extra,
        }
        line = (json.dumps(rec, sort_keys=False) + "\n").encode()
        fd = os.open(self.events_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)

    def events(self, last: int | None = None) -> list[dict[str, Any]]:
        try:
            lines = self.events_path.read_text().splitlines()
        except FileNotFoundError:
            return []
        out = []
        for line in lines[-last:] if last else lines:
            try:
                out.append(dict(json.loads(line)))
            except ValueError:
                continue
        return out

    # -- the supervisor ----------------------------------------------------------------
    def lock_supervisor(self) -> bool:
        """Take the supervisor lock; False if another supervisor holds it."""
        fd = LocalStore(self.path).try_lock("supervisor.lock")
        if fd is None:
            return False
        self._lock_fd = fd
        self.pid_path.write_text(str(os.getpid()))
        return True

    def unlock_supervisor(self) -> None:
        if self._lock_fd is not None:
            self.pid_path.unlink(missing_ok=True)
            LocalStore.unlock(self._lock_fd)
            self._lock_fd = None

    def supervisor_running(self) -> bool:
        """True while some process holds the supervisor lock (it dies with its process)."""
        return is_locked(self.path / "supervisor.lock")

    def supervisor_pid(self) -> int | None:
        try:
            return int(self.pid_path.read_text().strip())
        except (FileNotFoundError, ValueError):
            return None

    # -- job directories ---------------------------------------------------------------
    def job_numbers(self) -> list[int]:
        if not self.jobs.is_dir():
            return []
        return sorted(int(p.name) for p in self.jobs.iterdir() if p.name.isdigit())

    def next_job_dir(self) -> Path:
        """A job directory that does not exist yet: ``jobs/<n+1>``."""
        nums = self.job_numbers()
        return self.jobs / str((nums[-1] if nums else 0) + 1)

    def job_log(self, job_dir: Path) -> Path:
        return self.logs / f"job-{job_dir.name}.log"
