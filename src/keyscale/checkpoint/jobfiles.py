"""The job directory without its checkpoints: where its files are, whose job it is, which
run writes it (the single-writer lock and epochs), and the small files a run and the tools
exchange (status and heartbeat, events, rescale requests).

Apart from :mod:`keyscale.checkpoint.jobdir` (manifests and commit, recovery, batch intents,
retention) because this half is about runs, not batches: ``keyscale status``, ``keyscale
rescale`` and a deployment's supervisor use it on a job directory that no run holds, and
none of it reads a checkpoint. :class:`~keyscale.checkpoint.jobdir.JobDir` extends
:class:`JobFiles`; everyone names ``JobDir``. The files (see ``jobdir``'s docstring for all)::

    job.json                  identity: job name, max parallelism (fixed for life), lineages
    epochs/<n>.json           run n's claim (created only if absent)
    lock                      local disk only: held (flock) by the one process running the job
    status.json               written by the running job (its heartbeat on an object store)
    control/rescale.json      live rescale requests, read at the next batch
    events.jsonl | events/    what the job decided (autoscaler, rescales), with reasons

>>> import tempfile
>>> files = JobFiles(tempfile.mkdtemp())
>>> files.claim("clicks", None, 128)
JobIdentity(name='clicks', max_parallelism=128, created_ms=...)
>>> files.request_rescale(4); files.read_rescale_requests()
{'*': 4}
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from keyscale._env import env_number
from keyscale._subprocess import pid_exists
from keyscale.checkpoint.fence import EPOCHS, Fence, epoch_key
from keyscale.errors import JobDirError, StorageError
from keyscale.storage import LocalStore, Store, open_store

log = logging.getLogger("keyscale")

JOB_FILE = "job.json"


def takeover_after() -> float:
    """Seconds after its last heartbeat (status.json) that a job on an object store, where
    there is no lock, is taken to be gone, so that a new run may claim its job directory:
    ``KEYSCALE_TAKEOVER_AFTER``, 30 by default."""
    return env_number("KEYSCALE_TAKEOVER_AFTER", 30, "seconds", above=0)


def heartbeat_every() -> float:
    """Seconds between a running job's heartbeats: a third of :func:`takeover_after`, so that
    a late write or two does not let another run take over a live job."""
    return takeover_after() / 3


def json_bytes(obj: object) -> bytes:
    """An object of the job directory as its bytes (indented, keys sorted)."""
    return json.dumps(obj, indent=1, sort_keys=True).encode()


def batch_of(name: str, prefix: str) -> int | None:
    """The number in a file name ``<prefix><n>.json``; None for another name.

    >>> batch_of("manifest-000000000012.json", "manifest-"), batch_of("lock", "")
    (12, None)
    """
    try:
        return int(name[len(prefix):].split(".")[0]) if name.startswith(prefix) and name.endswith(".json") else None
    except ValueError:
        return None


@dataclass(frozen=True)
class JobIdentity:
    name: str
    max_parallelism: int
    created_ms: int

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "max_parallelism": self.max_parallelism, "created_ms": self.created_ms}


def spark_cache_dir(uri: str) -> Path:
    """The local folder where Spark's checkpoint of a job directory on an object store lives
    while the job runs (Spark writes only local or Hadoop paths; keyscale mirrors it)."""
    base = Path(os.environ.get("KEYSCALE_SPARK_CACHE", Path.home() / ".cache" / "keyscale" / "spark"))
    return base / hashlib.sha256(uri.encode()).hexdigest()[:16]


class JobFiles:
    """One job directory on a store (local path, ``file://``, ``s3://``, ...), as runs see it."""

    def __init__(self, location: str | os.PathLike[str] | Store):
        self.store = open_store(location, "job directory")
        self.uri = self.store.url()  # a plain path on local disk, a URI otherwise
        self._lock_fd: int | None = None
        self._local_id = uuid.uuid4().hex[:8]
        self.epoch = 0  # this process's run, once claimed

    def __str__(self) -> str:
        return self.uri

    # -- layout ------------------------------------------------------------------------
    @property
    def is_local(self) -> bool:
        return isinstance(self.store, LocalStore)

    @property
    def path(self) -> Path:
        """The local folder (only for a job directory on local disk)."""
        root = self.store.local_root
        if root is None:
            raise StorageError(f"job directory {self.uri} is not on local disk")
        return root

    @property
    def spark_checkpoint(self) -> Path:
        """Spark's streaming checkpoint (source positions, batch log): always a local folder.
        For a job directory on an object store, a folder of this process (a run that takes
        over never shares one with the run it fenced), rebuilt from the job directory."""
        if self.is_local:
            return self.path / "spark"
        return spark_cache_dir(self.uri) / f"run-{os.getpid()}-{self._local_id}" / "spark"

    @property
    def spark_hidden(self) -> Path:
        """Spark offsets entries moved aside while lost batches replay one at a time."""
        return self.spark_checkpoint.with_name("spark-replay-hidden")

    # -- identity ------------------------------------------------------------------------
    def exists(self) -> bool:
        return self.store.exists(JOB_FILE)

    def read_job_file(self) -> dict[str, Any]:
        text = self.store.get_text(JOB_FILE)
        if text is None:
            raise JobDirError(f"{self.uri} is not a keyscale job directory (no {JOB_FILE})")
        try:
            return dict(json.loads(text))
        except ValueError as e:
            raise JobDirError(f"{self.store.url(JOB_FILE)} is damaged ({e})") from None

    def write_job_file(self, d: dict[str, Any]) -> None:
        self.store.put(JOB_FILE, json_bytes(d))

    def identity(self) -> JobIdentity:
        d = self.read_job_file()
        try:
            return JobIdentity(str(d["name"]), int(d["max_parallelism"]), int(d.get("created_ms", 0)))
        except (ValueError, KeyError) as e:
            raise JobDirError(f"{self.store.url(JOB_FILE)} is damaged ({e})") from None

    def claim(self, name: str, max_parallelism: int | None, default_max_parallelism: int) -> JobIdentity:
        """Create the directory for job ``name`` or check that it is this job's."""
        root = self.store.local_root
        if root is not None and root.exists() and not root.is_dir():
            raise JobDirError(f"job directory {self.uri} is a file")
        if self.exists():
            ident = self.identity()
            if ident.name != name:
                raise JobDirError(f"job directory {self.uri} belongs to job '{ident.name}', not '{name}'; use another --job-dir")
            if max_parallelism is not None and max_parallelism != ident.max_parallelism:
                raise JobDirError(
                    f"job directory {self.uri} has max parallelism {ident.max_parallelism}; it cannot change to "
                    f"{max_parallelism} on running state (re-key a savepoint instead)"
                )
            return ident
        if any(n != "lock" for n in self.store.list_names("")):
            raise JobDirError(f"{self.uri} is not empty and is not a keyscale job directory")
        ident = JobIdentity(name, max_parallelism or default_max_parallelism, int(time.time() * 1000))
        if not self.store.create(JOB_FILE, json_bytes(ident.to_json())):
            return self.claim(name, max_parallelism, default_max_parallelism)  # another process just made it
        return ident

    # -- single writer: a local lock, and epochs everywhere --------------------------------
    def lock(self) -> None:
        """Become the job's one writer or fail: never two runs committing to one job.

        On local disk a ``flock`` tells a second process that the job is running. On an
        object store the running job's heartbeat does (a run whose heartbeat is older than
        ``KEYSCALE_TAKEOVER_AFTER`` seconds is taken to be gone). Either way the new run
        claims the next epoch; an older run that wakes up is fenced at its next commit.
        """
        if isinstance(self.store, LocalStore):
            fd = self.store.try_lock("lock")
            if fd is None:
                raise JobDirError(f"job directory {self.uri} is in use by a running job (pid {self.lock_holder() or '?'}); stop it first")
            os.ftruncate(fd, 0)
            os.write(fd, str(os.getpid()).encode())
            self._lock_fd = fd
        else:
            st = self.read_status()
            if self._alive(st):
                age = time.time() - int(st.get("updated_ms", 0)) / 1000
                raise JobDirError(
                    f"job directory {self.uri} is in use by a running job (pid {st.get('pid', '?')} on {st.get('host', '?')}, "
                    f"last heartbeat {age:.0f} s ago); stop it first (a job that died is taken over {takeover_after():.0f} s "
                    "after its last heartbeat: KEYSCALE_TAKEOVER_AFTER)"
                )
        self.claim_epoch()

    def claim_epoch(self) -> int:
        """Create the next epoch object: from now on every older run is fenced."""
        known = [b for n in self.store.list_names(EPOCHS) if (b := batch_of(n, "")) is not None]
        n = max(known, default=0) + 1
        who = {"pid": os.getpid(), "host": socket.gethostname(), "started_ms": int(time.time() * 1000), "run": uuid.uuid4().hex}
        while not self.store.create(epoch_key(n), json_bytes(who)):
            n += 1
        self.epoch = n
        return n

    @property
    def fence(self) -> Fence:
        """This run's epoch, as writers of its effects (sinks, their tasks) check it."""
        return Fence(self.store, self.epoch)

    def check_epoch(self, doing: str) -> None:
        """Raise :class:`FencedError` if a newer run claimed the job directory (one HEAD)."""
        self.fence.check(doing)

    def unlock(self) -> None:
        if self._lock_fd is not None:
            LocalStore.unlock(self._lock_fd)
            self._lock_fd = None

    @staticmethod
    def _alive(status: dict[str, Any]) -> bool:
        """A fresh heartbeat, unless it is of a process of this host that is gone (a crashed
        job restarted on the same machine need not wait for its heartbeat to go stale)."""
        if not status.get("running") or time.time() * 1000 - int(status.get("updated_ms", 0)) >= takeover_after() * 1000:
            return False
        if status.get("host") == socket.gethostname() and isinstance(status.get("pid"), int):
            return pid_exists(status["pid"])
        return True

    def is_running(self) -> bool:
        """True when some process runs the job (local: holds the lock; else: a fresh heartbeat)."""
        if isinstance(self.store, LocalStore):
            return self.store.is_locked("lock")
        return self._alive(self.read_status())

    def lock_holder(self) -> int | None:
        if isinstance(self.store, LocalStore):
            try:
                return int((self.store.get_text("lock") or "").strip() or 0) or None
            except ValueError:
                return None
        st = self.read_status()
        return int(st["pid"]) if self._alive(st) and "pid" in st else None

    @contextmanager
    def locked(self) -> Iterator[Self]:
        self.lock()
        try:
            yield self
        finally:
            self.unlock()

    # -- small JSON objects ----------------------------------------------------------------
    def read_json(self, key: str) -> dict[str, Any]:
        """An object of the job directory as JSON; {} when absent or unreadable."""
        try:
            text = self.store.get_text(key)
            return dict(json.loads(text)) if text else {}
        except (ValueError, TypeError, StorageError):
            return {}

    def write_json(self, key: str, obj: object, durable: bool = True) -> None:
        self.store.put(key, json_bytes(obj), durable)

    # -- control -------------------------------------------------------------------------
    def request_rescale(self, parallelism: int, uid: str | None = None) -> None:
        """Ask the running job for a new parallelism, applied at its next batch."""
        req = self.read_rescale_requests()
        req[uid or "*"] = parallelism
        self.write_json("control/rescale.json", req)

    def read_rescale_requests(self) -> dict[str, int]:
        try:
            return {str(k): int(v) for k, v in self.read_json("control/rescale.json").items()}
        except (TypeError, ValueError):
            return {}

    def clear_rescale_requests(self) -> None:
        """Take the requests (read first): not a fenced run's to take, they are for the newer run."""
        self.check_epoch("taking the rescale requests")  # a tool (epoch 0) is never fenced: no request
        self.store.delete("control/rescale.json")

    def append_event(self, event: dict[str, Any]) -> None:
        """One event: what the job decided or did, with its reason (a line of ``events.jsonl``
        on local disk; an object under ``events/`` on an object store, which cannot append)."""
        line = json.dumps(event, sort_keys=True)
        if isinstance(self.store, LocalStore):
            self.store.append("events.jsonl", (line + "\n").encode())
        else:
            self.store.put(f"events/{int(time.time() * 1000):013d}-{uuid.uuid4().hex[:6]}.json", line.encode(), durable=False)

    def read_events(self) -> list[dict[str, Any]]:
        if isinstance(self.store, LocalStore):
            lines = (self.store.get_text("events.jsonl") or "").splitlines()
        else:
            lines = [self.store.get_text(o.key) or "" for o in self.store.list("events")]
        return [dict(json.loads(ln)) for ln in lines if ln.strip()]

    def write_status(self, status: dict[str, Any]) -> None:
        """The job's status (on an object store also its heartbeat: see :meth:`lock`), with
        this run's epoch. ``status.json`` is shared by every run of the job: a run that a newer
        one took over raises :class:`FencedError` and writes nothing (its status would tell
        ``lock`` and ``keyscale status`` that the live run stopped). The check and the write
        are two requests: a run paused between them writes one stale status, which the live
        run's next heartbeat (:func:`heartbeat_every`) replaces; on local disk the lock keeps
        a second run from starting at all."""
        if self.epoch:
            self.check_epoch("writing its status")
            status = {**status, "epoch": self.epoch, "host": socket.gethostname()}
        self.write_json("status.json", status, durable=False)

    def read_status(self) -> dict[str, Any]:
        return self.read_json("status.json")
