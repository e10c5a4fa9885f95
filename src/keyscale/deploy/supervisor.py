"""The supervisor: one detached process per deployment that owns its job's lifecycle.

``keyscale apply`` starts it (:func:`keyscale.deploy.launch.start_supervisor`) when none runs. It runs the job as a
child process (``python -m keyscale.cli.main run ...``) and loops: it reads the desired
spec (``desired.json``), looks at the job (alive? serving its control API? committing?),
asks :func:`keyscale.deploy.plan.plan_action` what to do, does it, and records it in
``status.json`` and ``events.jsonl``. It ends when the deployment is STOPPED or FAILED.
SIGTERM or SIGINT cancel the job (no savepoint) and end the supervisor.

This module is the loop and one handler per planned action; what they do to the job
process (start, watch, adopt, stop) is :mod:`keyscale.deploy.keeper`, whose
:class:`~keyscale.deploy.keeper.JobKeeper` :class:`Supervisor` extends. What it decides is
pure and apart (:mod:`keyscale.deploy.plan`), as are the spec (:mod:`~keyscale.deploy.spec`),
the state folder (:mod:`~keyscale.deploy.store`) and the launcher (:mod:`~keyscale.deploy.launch`).

    python -m keyscale.deploy.supervisor STATE_DIR [--detach]

>>> s = Supervisor("/tmp/nonexistent-deployment")
>>> s.store.path.name
'nonexistent-deployment'
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from keyscale.checkpoint.jobdir import JobDir
from keyscale.deploy.keeper import POLL_SECONDS, JobKeeper, Outcome
from keyscale.deploy.plan import (
    Action,
    ActionKind,
    Desired,
    DesiredState,
    Restore,
    RestoreKind,
    plan_action,
)
from keyscale.deploy.spec import RestoreStrategy
from keyscale.deploy.store import DeploymentState
from keyscale.errors import KeyscaleError

__all__ = ["Outcome", "Supervisor", "main"]

log = logging.getLogger("keyscale.deploy")


class Supervisor(JobKeeper):
    """The reconciliation loop of one deployment (see the module docstring)."""

    def __init__(self, state_dir: str | os.PathLike[str]):
        super().__init__(state_dir)
        self._handlers: dict[ActionKind, Callable[[Action, Desired], Outcome | None]] = {
            ActionKind.NOTHING: self._nothing,
            ActionKind.START: self._start,
            ActionKind.RESCALE: self._rescale,
            ActionKind.UPDATE: self._update,
            ActionKind.UPGRADE: self._upgrade,
            ActionKind.REFUSE: self._refuse,
            ActionKind.RESTART: self._restart,
            ActionKind.FAIL: self._fail,
            ActionKind.STOP: self._stop,
            ActionKind.STOPPED: self._stopped,
        }

    # -- the loop ------------------------------------------------------------------------
    def run(self) -> int:
        """Supervise until the deployment is STOPPED or FAILED; the exit code of the process."""
        if not self.store.lock_supervisor():
            print(f"keyscale: another supervisor runs for {self.store.path} (pid {self.store.supervisor_pid()})", file=sys.stderr)
            return 1
        try:
            signal.signal(signal.SIGTERM, self._on_signal)
            signal.signal(signal.SIGINT, self._on_signal)
            desired = self._desired()
            self.status.name = desired.spec.name
            self.status.supervisor_pid = os.getpid()
            self.status.last_exit = None  # a new supervisor starts afresh: FAILED is retried
            self.status.failures = 0
            self._event("supervisor", f"supervisor started (pid {os.getpid()})", pid=os.getpid())
            self._adopt()
            self._save()
            while not self._step():
                time.sleep(POLL_SECONDS)
            return 0
        except Exception as e:
            self._event("supervisor-error", f"the supervisor failed: {type(e).__name__}: {e}; a running job keeps running (`keyscale apply` adopts it)")
            raise
        finally:
            self.status.supervisor_pid = None
            self._save()
            self._event("supervisor", f"supervisor ended (deployment {self.status.state})")
            self.store.unlock_supervisor()

    def _on_signal(self, signum: int, _frame: Any) -> None:
        if not self._terminate:
            self._terminate = True
            self.store.event("supervisor", f"received {signal.Signals(signum).name}: cancelling the job and ending the supervisor")

    def _step(self) -> bool:
        """One round of the loop; True when the supervisor should end."""
        desired = self._desired()
        alive = self._check_job()
        if alive and self.job is not None and not self.job.ready and desired.state is DesiredState.RUNNING:
            self._record(desired, self._await_ready())
            return False
        action = plan_action(self._current(), desired, alive)
        if action.kind is not ActionKind.NOTHING:
            log.info("generation %d: %s: %s", desired.generation, action.kind, action.reason)
        outcome = self._handlers[action.kind](action, desired)
        self._record(desired, outcome)
        self._save()
        return self.status.state in (DeploymentState.STOPPED, DeploymentState.FAILED)

    def _record(self, desired: Desired, outcome: Outcome | None) -> None:
        if outcome is None or self._terminate or desired.generation <= self.status.observed_generation:
            return
        self.status.observed_generation = desired.generation
        self.status.outcome = {"generation": desired.generation, "ok": outcome.ok, "message": outcome.message}
        if outcome.savepoint:
            self.status.outcome["savepoint"] = outcome.savepoint
        self._save()

    # -- the actions ---------------------------------------------------------------------
    def _nothing(self, action: Action, desired: Desired) -> Outcome | None:
        return Outcome(True, f"no change: {action.reason}")

    def _start(self, action: Action, desired: Desired) -> Outcome | None:
        assert action.spec is not None and action.restore is not None
        return self._launch(action.spec, action.restore, action.reason)

    def _update(self, action: Action, desired: Desired) -> Outcome | None:
        assert action.spec is not None
        self.status.running_spec = action.spec.to_json()
        self._event("update", action.reason, generation=desired.generation)
        return Outcome(True, action.reason)

    def _rescale(self, action: Action, desired: Desired) -> Outcome | None:
        from keyscale.runtime.control.server import call

        assert action.spec is not None and action.parallelism is not None and self.job is not None
        try:
            call(JobDir(self.job.job_dir), "POST", "/rescale", {"parallelism": action.parallelism}, timeout=60)
        except KeyscaleError as e:
            self.status.rejected_generation = desired.generation
            self._event("rescale-failed", f"{action.reason}: the job refused: {e}", generation=desired.generation)
            return Outcome(False, f"rescale to {action.parallelism} failed: {e}; the job keeps running at its parallelism")
        self.status.running_spec = action.spec.to_json()
        self._event("rescale", action.reason, generation=desired.generation, parallelism=action.parallelism)
        return Outcome(True, f"rescaling live to parallelism {action.parallelism} at the job's next batch (no restart; pid {self.job.pid})")

    def _refuse(self, action: Action, desired: Desired) -> Outcome | None:
        self.status.rejected_generation = desired.generation
        self._event("refused", action.reason, generation=desired.generation)
        if self.job is None:
            self.status.state = DeploymentState.STOPPED
        return Outcome(False, f"refused: {action.reason}")

    def _upgrade(self, action: Action, desired: Desired) -> Outcome | None:
        spec = action.spec
        assert spec is not None and self.job is not None
        jd = JobDir(self.job.job_dir)
        self.status.state = DeploymentState.UPGRADING
        self.status.message = action.reason
        self._save()
        self._event("upgrade", action.reason, generation=desired.generation)
        if not action.savepoint:
            self._stop_job(None)
            assert action.restore is not None
            return self._launch(spec, action.restore, f"STATELESS upgrade to generation {desired.generation}")
        if not jd.manifest_batches():
            self._event("upgrade", "the job has not committed a checkpoint yet, so it has no state to keep: stopping it without a savepoint")
            self._stop_job(None)
            return self._launch(spec, spec.restore_strategy, f"STATEFUL upgrade to generation {desired.generation} (no state yet)")
        try:
            sp = self._stop_job(self._savepoint_dest(spec, desired.generation))
        except KeyscaleError as e:
            self.status.rejected_generation = desired.generation
            self.status.state = DeploymentState.RUNNING
            self.status.message = ""
            msg = f"STATEFUL upgrade failed: the savepoint failed ({e}); the job keeps running its old spec"
            self._event("upgrade-failed", msg, generation=desired.generation)
            return Outcome(False, msg)
        assert sp is not None
        batch = self.status.savepoints[-1]["batch"]
        restore = Restore(RestoreKind.SAVEPOINT, sp, f"the upgrade's savepoint of batch {batch} ({sp})")
        out = self._launch(spec, restore, f"STATEFUL upgrade to generation {desired.generation}")
        return Outcome(out.ok, out.message, sp) if out is not None else None

    def _restart(self, action: Action, desired: Desired) -> Outcome | None:
        assert action.spec is not None
        self.status.state = DeploymentState.RESTARTING
        self.status.message = action.reason
        self._save()
        self._event("restart", action.reason, delay=action.delay, failures=self.status.failures)
        deadline = time.time() + action.delay
        while time.time() < deadline:
            if self._stop_requested():
                return None
            time.sleep(min(POLL_SECONDS, max(0.0, deadline - time.time())))
        self.status.restarts += 1
        return self._launch(action.spec, RestoreStrategy.LATEST_STATE, f"restart {self.status.failures} after a failure")

    def _fail(self, action: Action, desired: Desired) -> Outcome | None:
        self.status.state = DeploymentState.FAILED
        self.status.message = action.reason
        self._event("failed", f"deployment FAILED: {action.reason}")
        return Outcome(False, f"FAILED: {action.reason} (job log: {self.store.logs})")

    def _stop(self, action: Action, desired: Desired) -> Outcome | None:
        assert self.job is not None
        self.status.state = DeploymentState.STOPPING
        self._save()
        self._event("stop", action.reason, generation=desired.generation)
        try:
            sp = self._stop_job(self._savepoint_dest(desired.spec, desired.generation) if action.savepoint else None)
        except KeyscaleError as e:
            self.status.rejected_generation = desired.generation
            self.status.state = DeploymentState.RUNNING
            msg = f"stop with a savepoint failed: {e}; the job keeps running (stop without --savepoint cancels it)"
            self._event("stop-failed", msg, generation=desired.generation)
            return Outcome(False, msg)
        self.status.state = DeploymentState.STOPPED
        return Outcome(True, f"stopped{' with savepoint ' + sp if sp else ' (no savepoint)'}", sp)

    def _stopped(self, action: Action, desired: Desired) -> Outcome | None:
        if self.status.state != DeploymentState.STOPPED:
            self._event("stopped", action.reason)
        self.status.state = DeploymentState.STOPPED
        self.status.message = action.reason
        return Outcome(True, action.reason)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m keyscale.deploy.supervisor STATE_DIR [--detach]``."""
    p = argparse.ArgumentParser(prog="python -m keyscale.deploy.supervisor", description="Supervise one keyscale deployment.")
    p.add_argument("state_dir")
    p.add_argument("--detach", action="store_true", help="fork, and return at once in the parent")
    a = p.parse_args(argv)
    if a.detach and os.fork() > 0:
        return 0
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s supervisor: %(message)s"))
    for name in ("keyscale", "keyscale.deploy"):
        lg = logging.getLogger(name)
        lg.handlers[:] = [handler] if name == "keyscale" else []
        lg.setLevel(logging.INFO)
    return Supervisor(a.state_dir).run()


if __name__ == "__main__":
    sys.exit(main())
