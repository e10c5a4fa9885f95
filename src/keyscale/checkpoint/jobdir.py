"""The job directory: one job's identity, lock, checkpoints, state files and control inbox.

Layout::

    JOB_DIR/
      job.json                  identity: job name, max parallelism (fixed for life)
      lock                      held (flock) by the one process running the job
      status.json               written by the running job after each batch
      control/rescale.json      live rescale requests, read at the next batch
      control/secret            the running job's control API secret (0600, new each run)
      spark/                    Spark's streaming checkpoint (source positions, batch log)
      checkpoints/manifest-<batch>.json   one per committed batch (the commit point)
      checkpoints/intent-<batch>.json     parallelism and time fixed for a batch before it runs
      state/<uid>/...           state files written by tasks
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from keyscale.checkpoint import sparklog
from keyscale.checkpoint.files import (
    atomic_write_json,
    atomic_write_text,
    is_locked,
    verify_state_file,
)
from keyscale.checkpoint.manifest import Manifest
from keyscale.checkpoint.retention import checkpoints_to_keep
from keyscale.errors import JobDirError, StateError
from keyscale.storage import local_path

JOB_FILE = "job.json"


@dataclass(frozen=True)
class JobIdentity:
    name: str
    max_parallelism: int
    created_ms: int

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "max_parallelism": self.max_parallelism, "created_ms": self.created_ms}


@dataclass(frozen=True)
class Recovery:
    """What :meth:`JobDir.recover` found: the checkpoint to resume from, and what it skipped."""

    manifest: Manifest | None
    discarded: tuple[str, ...]  # one sentence per damaged checkpoint set aside
    empty_restart: bool = False  # no intact checkpoint: state starts empty, input is read again
    spark_set_aside: str | None = None  # where Spark's checkpoint went on an empty restart


class JobDir:
    """Paths and operations on one job directory."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = local_path(path, "job directory")
        self._lock_fd: int | None = None

    # -- layout ------------------------------------------------------------------------
    @property
    def spark_checkpoint(self) -> Path:
        return self.path / "spark"

    @property
    def spark_hidden(self) -> Path:
        """Spark offsets entries moved aside while lost batches replay one at a time."""
        return self.path / "spark-replay-hidden"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def control(self) -> Path:
        return self.path / "control"

    def manifest_path(self, batch: int) -> Path:
        return self.checkpoints / f"manifest-{batch:012d}.json"

    def intent_path(self, batch: int) -> Path:
        return self.checkpoints / f"intent-{batch:012d}.json"

    def state_dir(self, uid: str) -> Path:
        return self.path / "state" / uid

    # -- identity ------------------------------------------------------------------------
    def exists(self) -> bool:
        return (self.path / JOB_FILE).exists()

    def identity(self) -> JobIdentity:
        try:
            d = json.loads((self.path / JOB_FILE).read_text())
            return JobIdentity(str(d["name"]), int(d["max_parallelism"]), int(d.get("created_ms", 0)))
        except FileNotFoundError:
            raise JobDirError(f"{self.path} is not a keyscale job directory (no {JOB_FILE})") from None
        except (ValueError, KeyError) as e:
            raise JobDirError(f"{self.path / JOB_FILE} is damaged ({e})") from None

    def claim(self, name: str, max_parallelism: int | None, default_max_parallelism: int) -> JobIdentity:
        """Create the directory for job ``name`` or check that it is this job's."""
        if self.path.exists() and not self.path.is_dir():
            raise JobDirError(f"job directory {self.path} is a file")
        if self.exists():
            ident = self.identity()
            if ident.name != name:
                raise JobDirError(f"job directory {self.path} belongs to job '{ident.name}', not '{name}'; use another --job-dir")
            if max_parallelism is not None and max_parallelism != ident.max_parallelism:
                raise JobDirError(
                    f"job directory {self.path} has max parallelism {ident.max_parallelism}; it cannot change to "
                    f"{max_parallelism} on running state (re-key a savepoint instead)"
                )
            return ident
        if self.path.exists() and any(p.name != "lock" for p in self.path.iterdir()):
            raise JobDirError(f"{self.path} is not empty and is not a keyscale job directory")
        self.path.mkdir(parents=True, exist_ok=True)
        ident = JobIdentity(name, max_parallelism or default_max_parallelism, int(time.time() * 1000))
        for d in (self.checkpoints, self.control, self.path / "state"):
            d.mkdir(parents=True, exist_ok=True)
        atomic_write_json(self.path / JOB_FILE, ident.to_json())
        return ident

    # -- single writer -------------------------------------------------------------------
    def lock(self) -> None:
        """Take the job's lock or fail: never two processes running one job."""
        self.path.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise JobDirError(f"job directory {self.path} is in use by a running job (pid {self.lock_holder() or '?'}); stop it first") from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._lock_fd = fd

    def unlock(self) -> None:
        if self._lock_fd is not None:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None

    def is_running(self) -> bool:
        """True when some process holds the lock."""
        return is_locked(self.path / "lock")

    def lock_holder(self) -> int | None:
        try:
            return int((self.path / "lock").read_text().strip() or 0) or None
        except (FileNotFoundError, ValueError):
            return None

    @contextmanager
    def locked(self) -> Iterator[JobDir]:
        self.lock()
        try:
            yield self
        finally:
            self.unlock()

    # -- checkpoints ---------------------------------------------------------------------
    def manifest_batches(self) -> list[int]:
        if not self.checkpoints.exists():
            return []
        out = []
        for p in self.checkpoints.glob("manifest-*.json"):
            try:
                out.append(int(p.stem[len("manifest-") :]))  # batch -1: a savepoint without source positions
            except ValueError:
                continue
        return sorted(out)

    def read_manifest(self, batch: int) -> Manifest:
        path = self.manifest_path(batch)
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise StateError(f"checkpoint {batch} does not exist ({path})") from None
        except UnicodeDecodeError:
            raise StateError(f"checkpoint {batch} ({path.name}) is damaged (not UTF-8 text)") from None
        return Manifest.loads(text, where=f"checkpoint {batch} ({path.name})")

    def has_manifest(self, batch: int) -> bool:
        return self.manifest_path(batch).exists()

    def commit(self, manifest: Manifest) -> None:
        """The commit point of a batch: after this the batch has happened."""
        atomic_write_text(self.manifest_path(manifest.batch), manifest.dumps())

    def latest_manifest(self) -> Manifest | None:
        batches = self.manifest_batches()
        return self.read_manifest(batches[-1]) if batches else None

    def check_manifest(self, batch: int) -> tuple[Manifest | None, str | None]:
        """The manifest and None if it and all its files are intact, else (None, why)."""
        try:
            m = self.read_manifest(batch)
        except StateError as e:
            return None, str(e)
        for op in m.operators.values():
            for f in op.files:
                problem = verify_state_file(self.path, f)
                if problem:
                    return None, f"checkpoint {batch}: {problem}"
        return m, None

    def recover(self, allow_empty_restart: bool = False) -> Recovery:
        """Find the newest intact checkpoint; set damaged newer ones aside.

        Spark's commit log is rolled back to the checkpoint found; the runtime then replays
        every batch after it (:mod:`keyscale.runtime.recovery`). When no intact checkpoint is
        left but the job has committed batches, starting would lose its state: refused with a
        :class:`StateError` naming the damage, unless ``allow_empty_restart``: then the state
        starts empty and the input is read again from its beginning (Spark's checkpoint and
        the batch intents are set aside, renamed, not deleted).
        """
        damaged: list[tuple[int, str]] = []
        found: Manifest | None = None
        for batch in reversed(self.manifest_batches()):
            m, problem = self.check_manifest(batch)
            if m is not None:
                found = m
                break
            damaged.append((batch, problem or f"checkpoint {batch} is damaged"))
        discarded = tuple(why for _, why in damaged)
        committed_by_spark = sparklog.commit_batches(self.spark_checkpoint)
        empty = found is None and bool(damaged or committed_by_spark)
        if empty and not allow_empty_restart:
            damage = "; ".join(discarded) if damaged else (
                f"there is no checkpoint, yet Spark's log says batches up to {committed_by_spark[-1]} were committed"
            )
            raise StateError(
                f"no intact checkpoint is left in {self.checkpoints}: {damage}. Starting would lose the job's state; "
                "to start again with empty state, reading the input again from its beginning, run with --allow-empty-restart"
            )
        for batch, _ in damaged:
            bad = self.manifest_path(batch)
            bad.rename(bad.with_name(bad.name + ".damaged"))
        if empty:
            sparklog.restore_hidden(self.spark_checkpoint, self.spark_hidden)  # set aside whole
            aside = sparklog.set_aside(self.spark_checkpoint)
            stamp = int(time.time() * 1000)
            for p in self.checkpoints.glob("intent-*.json"):
                folder = self.checkpoints / f"intents.set-aside-{stamp}"
                folder.mkdir(exist_ok=True)
                p.rename(folder / p.name)
            return Recovery(None, discarded, empty_restart=True, spark_set_aside=str(aside) if aside else None)
        self.rollback_spark_commits(after=found.batch if found else -1)
        return Recovery(found, discarded)

    def rollback_spark_commits(self, after: int) -> list[int]:
        """Make Spark re-run every batch newer than ``after`` (its offsets are kept)."""
        return sparklog.remove_commits_after(self.spark_checkpoint, after)

    # -- batch intents -------------------------------------------------------------------
    def read_intent(self, batch: int) -> dict[str, Any] | None:
        try:
            return dict(json.loads(self.intent_path(batch).read_text()))
        except (FileNotFoundError, ValueError):
            return None

    def write_intent(self, batch: int, intent: dict[str, Any]) -> None:
        atomic_write_json(self.intent_path(batch), intent)

    # -- control -------------------------------------------------------------------------
    def request_rescale(self, parallelism: int, uid: str | None = None) -> None:
        """Ask the running job for a new parallelism, applied at its next batch."""
        self.control.mkdir(parents=True, exist_ok=True)
        req = self.read_rescale_requests()
        req[uid or "*"] = parallelism
        atomic_write_json(self.control / "rescale.json", req)

    def read_rescale_requests(self) -> dict[str, int]:
        try:
            return {str(k): int(v) for k, v in json.loads((self.control / "rescale.json").read_text()).items()}
        except (FileNotFoundError, ValueError):
            return {}

    def clear_rescale_requests(self) -> None:
        (self.control / "rescale.json").unlink(missing_ok=True)

    def append_event(self, event: dict[str, Any]) -> None:
        """One line of ``events.jsonl``: what the job decided or did, with its reason."""
        with open(self.path / "events.jsonl", "a") as f:
            f.write(json.dumps(event, sort_keys=True) + "\n")

    def read_events(self) -> list[dict[str, Any]]:
        try:
            lines = (self.path / "events.jsonl").read_text().splitlines()
        except FileNotFoundError:
            return []
        return [dict(json.loads(ln)) for ln in lines if ln.strip()]

    def write_status(self, status: dict[str, Any]) -> None:
        atomic_write_json(self.path / "status.json", status, durable=False)

    def read_status(self) -> dict[str, Any]:
        try:
            return dict(json.loads((self.path / "status.json").read_text()))
        except (FileNotFoundError, ValueError):
            return {}

    # -- retention -----------------------------------------------------------------------
    def retain(self, keep: int) -> int:
        """Keep the checkpoints :func:`checkpoints_to_keep` names (the newest ``keep`` and one
        that shares no state file with the newest); delete files no kept checkpoint needs.
        The intents of every batch after the oldest kept checkpoint stay: a fallback to it
        replays those batches as they first ran."""
        batches = self.manifest_batches()
        if len(batches) <= keep:
            return 0
        manifests: dict[int, Manifest] = {}
        for b in batches:
            try:
                manifests[b] = self.read_manifest(b)
            except StateError:
                continue  # a damaged one is never a fallback; it goes once it is old
        kept_batches = checkpoints_to_keep({b: [f.batch for op in m.operators.values() for f in op.files] for b, m in manifests.items()}, keep)
        kept_batches.update(batches[-keep:])
        needed = {f.path for b in kept_batches if b in manifests for op in manifests[b].operators.values() for f in op.files}
        oldest = min(kept_batches)
        removed = 0
        for b in batches:
            if b not in kept_batches:
                self.manifest_path(b).unlink(missing_ok=True)
        for p in self.checkpoints.glob("intent-*.json"):
            if int(p.stem[len("intent-") :]) < oldest:
                p.unlink(missing_ok=True)
        state_root = self.path / "state"
        if state_root.exists():
            for p in state_root.glob("*/[0-9]*"):
                rel = p.relative_to(self.path).as_posix()
                batch = int(p.name.split("-")[0].split(".")[0])
                if rel not in needed and batch < oldest:
                    p.unlink(missing_ok=True)  # state files (also other attempts' ones) and sidecar reports
                    removed += p.suffix == ".arrow"
        return removed

    def remove(self) -> None:
        shutil.rmtree(self.path)
