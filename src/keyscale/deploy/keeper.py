"""What a deployment's supervisor does to its job process: start it (with the restore the
plan chose), watch it (alive, serving its control API, committing, how it ended), adopt one
an earlier supervisor left running, and stop it (a savepoint, a cancel, signals).

Apart from :mod:`keyscale.deploy.supervisor` (the reconciliation loop and one handler per
planned action) because this is the job process's lifetime, the same whichever action asks
for it: :class:`JobKeeper` holds the job, the deployment's recorded status and its events,
and :class:`~keyscale.deploy.supervisor.Supervisor` extends it with the loop.

>>> keeper = JobKeeper("/tmp/nonexistent-deployment")
>>> keeper.job is None, keeper.store.path.name
(True, 'nonexistent-deployment')
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from keyscale._subprocess import pid_exists
from keyscale.checkpoint.jobdir import JobDir
from keyscale.deploy.plan import (
    Current,
    Desired,
    DesiredState,
    Restore,
    RestoreKind,
    Snapshot,
    choose_restore,
)
from keyscale.deploy.spec import DeploymentError, DeploymentSpec, RestoreStrategy
from keyscale.deploy.store import DeploymentState, DeploymentStore
from keyscale.errors import KeyscaleError, StateError

log = logging.getLogger("keyscale.deploy")

POLL_SECONDS = 0.3
STOP_TIMEOUT = 600.0  # a savepoint plus the end of the current batch
KILL_GRACE = 60.0  # after SIGTERM, before SIGKILL


@dataclass(frozen=True)
class Outcome:
    """How a desired generation ended: shown by ``apply`` and ``deployment status``."""

    ok: bool
    message: str
    savepoint: str | None = None


@dataclass
class _Job:
    popen: subprocess.Popen[bytes] | None  # None: adopted from an earlier supervisor
    pid: int
    job_dir: Path
    log: Path
    log_offset: int
    ready: bool = False
    baseline: int = -1  # newest checkpoint when the job became ready
    progressed: bool = False
    expect_exit: bool = False  # the deployment is stopping it


def _now_ms() -> int:
    return int(time.time() * 1000)


def _sha(path: Path) -> str:
    from keyscale.deploy.spec import file_sha256

    return file_sha256(path)


class JobKeeper:
    """One deployment's job process and what is recorded of it (see the module docstring)."""

    def __init__(self, state_dir: str | os.PathLike[str]):
        self.store = DeploymentStore(state_dir)
        self.status = self.store.read_status()
        self.job: _Job | None = None
        self._terminate = False  # SIGTERM or SIGINT: cancel the job and end

    # -- bookkeeping ---------------------------------------------------------------------
    def _save(self) -> None:
        self.store.write_status(self.status)

    def _event(self, kind: str, message: str, **extra: Any) -> None:
        log.info("%s: %s", kind, message)
        self.store.event(kind, message, **extra)

    def _desired(self) -> Desired:
        d = self.store.read_desired()
        if d is None:
            raise DeploymentError(f"{self.store.desired_path} is missing")
        if self._terminate:
            return Desired(d.generation, DesiredState.CANCELLED, d.spec)
        return d

    def _stop_requested(self) -> bool:
        return self._terminate or self._desired().state is not DesiredState.RUNNING

    def _current(self) -> Current:
        return self.status.current()

    def _adopt(self) -> None:
        """Take over a job an earlier supervisor left running (that supervisor died)."""
        st = self.status
        if st.job_dir and st.job_pid:
            jd = JobDir(st.job_dir)
            if jd.is_running() and jd.lock_holder() == st.job_pid and pid_exists(st.job_pid):
                logf = self.store.job_log(Path(st.job_dir))
                size = logf.stat().st_size if logf.exists() else 0
                self.job = _Job(None, st.job_pid, Path(st.job_dir), logf, size)
                self.job.ready = self._serving(jd, st.job_pid)
                self._event("adopt", f"adopting the running job (pid {st.job_pid}) in {st.job_dir}")
                return
        st.job_pid = None

    # -- watching the job ----------------------------------------------------------------
    def _check_job(self) -> bool:
        """Is the job process alive? Records its exit if it just ended."""
        j = self.job
        if j is None:
            return False
        code: int | None
        if j.popen is not None:
            code = j.popen.poll()
            alive = code is None
        else:
            code = None
            alive = pid_exists(j.pid) and JobDir(j.job_dir).is_running()
        if alive:
            if j.ready and not j.progressed:
                batches = JobDir(j.job_dir).manifest_batches()
                if batches and batches[-1] > j.baseline:
                    j.progressed = True
                    if self.status.failures:
                        self._event("progress", f"the job committed checkpoint {batches[-1]}; the count of failures in a row ({self.status.failures}) is reset")
                        self.status.failures = 0
                        self._save()
            return True
        self._job_exited(j, code)
        return False

    def _job_exited(self, j: _Job, code: int | None) -> None:
        self.job = None
        self.status.job_pid = None
        shown = "unknown (adopted process)" if code is None else str(code)
        if code is not None and code < 0:
            shown += f" (killed by {signal.Signals(-code).name})" if -code in signal.valid_signals() else " (killed by a signal)"
        if j.expect_exit:
            self.status.last_exit = None
            self._event("job-exit", f"the job process {j.pid} in {j.job_dir} ended with exit code {shown} (stopped by the deployment)", exit_code=code)
        else:
            exit_code = -1 if code is None else code
            self.status.last_exit = exit_code
            if exit_code != 0:
                self.status.failures += 1
            err = self._last_error(j)
            self._event("job-exit", f"the job process {j.pid} in {j.job_dir} ended with exit code {shown}" + (f": {err}" if err else ""),
                        exit_code=exit_code, log=str(j.log))
        self._save()

    @staticmethod
    def _last_error(j: _Job) -> str:
        try:
            with open(j.log, "rb") as f:
                f.seek(j.log_offset)
                lines = f.read().decode(errors="replace").splitlines()
        except OSError:
            return ""
        errors = [ln for ln in lines if ln.startswith("keyscale: error:")]
        if errors:
            return errors[-1][len("keyscale: "):][:400]
        raised = [ln.strip() for ln in lines if re.match(r"^\w[\w.]*(Error|Exception)\b", ln.strip())]
        return raised[-1][:400] if raised else ""

    @staticmethod
    def _serving(jd: JobDir, pid: int) -> bool:
        """Does process ``pid`` hold the job directory and answer its control API?

        (A killed job leaves its control address behind: the answer must come from ``pid``.)
        """
        from keyscale.runtime.control.server import ADDRESS, call

        if jd.lock_holder() != pid or not jd.store.exists(ADDRESS) or not jd.is_running():
            return False
        try:
            return call(jd, "GET", "/status", timeout=5).get("pid") == pid
        except KeyscaleError:
            return False

    def _await_ready(self) -> Outcome | None:
        """Wait until the starting job serves its control API; None if it died or a stop came."""
        j = self.job
        assert j is not None
        jd = JobDir(j.job_dir)
        while True:
            if not self._check_job():
                return None
            if self._serving(jd, j.pid):
                j.ready = True
                batches = jd.manifest_batches()
                j.baseline = batches[-1] if batches else -1
                self.status.state = DeploymentState.RUNNING
                self.status.message = ""
                self._save()
                self._event("running", f"the job (pid {j.pid}) runs in {j.job_dir}")
                restarts = f" after {self.status.failures} failed run(s)" if self.status.failures else ""
                return Outcome(True, f"the job runs in {j.job_dir} (pid {j.pid}){restarts}; state: {self.status.restored_from}")
            if self._stop_requested():
                return None
            time.sleep(POLL_SECONDS)

    # -- starting ------------------------------------------------------------------------
    def _known_savepoints(self, spec: DeploymentSpec) -> list[Snapshot]:
        from keyscale.checkpoint.savepoint import METADATA_FILE, read_savepoint

        taken = {str(r["path"]): r.get("job_dir") for r in self.status.savepoints}
        out = []
        folder = spec.savepoint_dir
        for meta in sorted(folder.glob(f"*/{METADATA_FILE}")) if folder.is_dir() else []:
            try:
                info = read_savepoint(meta.parent, verify=False)
            except StateError as e:
                log.warning("ignoring savepoint %s: %s", meta.parent, e)
                continue
            out.append(Snapshot(str(info.path), info.batch, info.created_ms, taken.get(str(info.path))))
        return out

    def _latest_checkpoint(self) -> Snapshot | None:
        if not self.status.job_dir:
            return None
        jd = JobDir(self.status.job_dir)
        batches = jd.manifest_batches()
        if not batches:
            return None
        try:
            created = jd.read_manifest(batches[-1]).created_ms
        except StateError:  # damaged: the job falls back to an intact one when it resumes
            created = 0
        return Snapshot(jd.uri, batches[-1], created)

    def _launch(self, spec: DeploymentSpec, restore: Restore | RestoreStrategy, reason: str) -> Outcome | None:
        if isinstance(restore, RestoreStrategy):
            strategy = restore
            restore = choose_restore(strategy, self._latest_checkpoint(), self._known_savepoints(spec), self.status.state_since_ms)
            if strategy is RestoreStrategy.NONE:
                self.status.state_since_ms = _now_ms()
        if restore.kind is RestoreKind.RESUME:
            assert restore.path is not None
            job_dir = Path(restore.path)
        else:
            job_dir = self.store.next_job_dir()
        if not spec.artifact.exists() and spec.job_file.is_file() and _sha(spec.job_file) == spec.job_sha256:
            self.store.install_artifact(spec)
        if not spec.artifact.exists():
            self.status.state = DeploymentState.FAILED
            msg = f"the applied job file {spec.artifact} is gone (and {spec.job_file} changed); apply the deployment file again"
            self._event("failed", msg)
            return Outcome(False, msg)
        logf = self.store.job_log(job_dir)
        logf.parent.mkdir(parents=True, exist_ok=True)
        argv = spec.command(job_dir, restore.path if restore.kind is RestoreKind.SAVEPOINT else None, python=sys.executable)
        with open(logf, "ab") as out:
            offset = out.tell()
            out.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(argv)}\n".encode())
            out.flush()
            popen = subprocess.Popen(argv, cwd=spec.base_dir, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.job = _Job(popen, popen.pid, job_dir, logf, offset)
        st = self.status
        st.running_spec = spec.to_json()
        st.job_dir = str(job_dir)
        st.job_pid = popen.pid
        st.job_started_ms = _now_ms()
        st.restored_from = restore.reason
        st.last_exit = None
        st.state = DeploymentState.STARTING
        self._event("start", f"{reason}; state: {restore.reason}; job dir {job_dir} (pid {popen.pid}, log {logf})",
                    job_dir=str(job_dir), pid=popen.pid, restore=restore.kind.value, restore_path=restore.path)
        self._save()
        return self._await_ready()

    # -- stopping ------------------------------------------------------------------------
    def _signal(self, j: _Job, sig: signal.Signals) -> None:
        try:
            if j.popen is not None:
                j.popen.send_signal(sig)
            else:
                os.kill(j.pid, sig)
        except ProcessLookupError:
            pass

    def _wait_exit(self, j: _Job, timeout: float, termed: bool = False) -> None:
        """Wait for the job to end; then SIGTERM it (unless ``termed``), then SIGKILL it."""
        deadline = time.time() + timeout
        while self._check_job():
            if time.time() > deadline:
                if termed:
                    self._event("stop", f"the job (pid {j.pid}) did not end after SIGTERM; killing it")
                    self._signal(j, signal.SIGKILL)
                    deadline = time.time() + KILL_GRACE
                else:
                    self._event("stop", f"the job (pid {j.pid}) did not end within {timeout:.0f} s; sending SIGTERM")
                    self._signal(j, signal.SIGTERM)
                    termed = True
                    deadline = time.time() + KILL_GRACE
            time.sleep(POLL_SECONDS)

    def _savepoint_dest(self, spec: DeploymentSpec, generation: int) -> Path:
        spec.savepoint_dir.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%dT%H%M%S")
        dest = spec.savepoint_dir / f"{spec.name}-g{generation}-{stamp}"
        n = 1
        while dest.exists():
            n += 1
            dest = spec.savepoint_dir / f"{spec.name}-g{generation}-{stamp}-{n}"
        return dest

    def _stop_job(self, savepoint_dest: Path | None) -> str | None:
        """Stop the job (after a savepoint into ``savepoint_dest`` if given); its path.

        A refused savepoint raises :class:`KeyscaleError` and leaves the job running.
        """
        from keyscale.runtime.control.server import call

        j = self.job
        assert j is not None
        jd = JobDir(j.job_dir)
        j.expect_exit = True
        sp: str | None = None
        termed = False
        if savepoint_dest is not None:
            if not j.ready:
                j.expect_exit = False
                raise KeyscaleError("the job does not serve its control API yet, so no savepoint can be taken")
            try:
                sp = str(call(jd, "POST", "/stop", {"savepoint": True, "dest": str(savepoint_dest)}, timeout=STOP_TIMEOUT)["savepoint"])
            except KeyscaleError:
                j.expect_exit = False
                raise
        elif j.ready:
            try:
                call(jd, "POST", "/cancel", {}, timeout=60)
            except KeyscaleError as e:
                self._event("stop", f"the job's control API did not answer ({e}); sending SIGTERM")
                self._signal(j, signal.SIGTERM)
                termed = True
        else:
            self._signal(j, signal.SIGTERM)  # the job stops after its current batch, or before its first
            termed = True
        self._wait_exit(j, KILL_GRACE if termed else STOP_TIMEOUT, termed=termed)
        if sp is not None:
            from keyscale.checkpoint.savepoint import read_savepoint, write_savepoint

            info = read_savepoint(sp, verify=False)
            batches = jd.manifest_batches()
            if batches and batches[-1] > info.batch:
                # A batch that began while the job was stopping committed after the savepoint:
                # the savepoint is behind the job's final state. Save that state instead.
                assert savepoint_dest is not None
                later = savepoint_dest.with_name(savepoint_dest.name + f"-final-{batches[-1]}")
                with jd.locked():
                    rec = jd.recover()
                    assert rec.manifest is not None
                    sp = str(write_savepoint(jd, rec.manifest, later))
                self._event("savepoint", f"the job committed batch {rec.manifest.batch} after its savepoint of batch {info.batch} "
                            f"(a batch under way when it stopped); took a savepoint of its final checkpoint instead: {sp}")
                info = read_savepoint(sp, verify=False)
            self.status.savepoints.append({"path": str(info.path), "job_dir": jd.uri, "batch": info.batch, "created_ms": info.created_ms})
            self._event("savepoint", f"savepoint of batch {info.batch} of {jd.uri}: {info.path}", path=str(info.path), batch=info.batch)
        self._save()
        return sp
