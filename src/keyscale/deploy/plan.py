"""The supervisor's decisions, as pure functions: what to do, and which state to start from.

:func:`plan_action` compares what runs with what is desired and returns one
:class:`Action`; :func:`choose_restore` picks the state a job starts from. Neither touches
the file system or a process, so every rule of ``docs/deployments.md`` is tested in
milliseconds; the supervisor (:mod:`keyscale.deploy.supervisor`) carries the actions out.

>>> from pathlib import Path
>>> old = DeploymentSpec("c", Path("/d/c.toml"), Path("/d/job.py"), "a" * 64, parallelism=2)
>>> new = DeploymentSpec("c", Path("/d/c.toml"), Path("/d/job.py"), "a" * 64, parallelism=4)
>>> plan_action(Current(spec=old, max_parallelism=128), Desired(2, DesiredState.RUNNING, new), job_running=True)
Action(kind=<ActionKind.RESCALE: 'RESCALE'>, reason='parallelism: 2 -> 4: rescaling live (no restart)', ...)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from keyscale.deploy.spec import RUN_FIELDS, DeploymentSpec, RestoreStrategy, UpgradeStrategy

__all__ = [
    "Action",
    "ActionKind",
    "Current",
    "Desired",
    "DesiredState",
    "Restore",
    "RestoreKind",
    "Snapshot",
    "choose_restore",
    "plan_action",
]


class DesiredState(StrEnum):
    """What the user wants of the deployment (Ververica Platform's ``spec.state``)."""

    RUNNING = "RUNNING"  # keyscale apply
    SUSPENDED = "SUSPENDED"  # keyscale deployment stop --savepoint
    CANCELLED = "CANCELLED"  # keyscale deployment stop


@dataclass(frozen=True)
class Desired:
    """The desired spec as ``apply`` (or ``deployment stop``) last wrote it."""

    generation: int
    state: DesiredState
    spec: DeploymentSpec


@dataclass(frozen=True)
class Current:
    """What the supervisor knows about the job it runs (or last ran)."""

    spec: DeploymentSpec | None = None  # the spec the job runs (or last ran) with
    max_parallelism: int | None = None  # key groups of the current job directory's state
    last_exit: int | None = None  # exit code of a job process that ended by itself; None: none since the last start
    failures: int = 0  # failed runs in a row, including ``last_exit``'s
    rejected_generation: int = 0  # a desired generation refused or failed: not retried


class ActionKind(StrEnum):
    NOTHING = "NOTHING"  # the job runs the desired spec (or a refused change is pending)
    START = "START"  # no job runs: start one per ``restore``
    RESCALE = "RESCALE"  # only the parallelism changed: live, through the control API
    UPDATE = "UPDATE"  # only deployment settings changed: record them, leave the job
    UPGRADE = "UPGRADE"  # stop (with a savepoint if ``savepoint``) and start the new spec
    REFUSE = "REFUSE"  # the change is not allowed: record why, leave the job
    RESTART = "RESTART"  # the job failed: start it again after ``delay`` seconds
    FAIL = "FAIL"  # the job failed and no restart attempt is left
    STOP = "STOP"  # stop the job (with a savepoint if ``savepoint``)
    STOPPED = "STOPPED"  # nothing runs and nothing should: the supervisor ends


@dataclass(frozen=True)
class Action:
    """One step of the supervisor, with the reason recorded in the events file."""

    kind: ActionKind
    reason: str
    spec: DeploymentSpec | None = field(default=None, repr=False)  # the spec to run or record
    parallelism: int | None = field(default=None, repr=False)  # RESCALE
    savepoint: bool = field(default=False, repr=False)  # UPGRADE, STOP: take a savepoint while stopping
    restore: RestoreStrategy | None = field(default=None, repr=False)  # START, RESTART, UPGRADE without savepoint
    delay: float = field(default=0.0, repr=False)  # RESTART

    def __repr__(self) -> str:
        return f"Action(kind={self.kind!r}, reason={self.reason!r}, ...)"


def _max_parallelism_conflict(current: Current, spec: DeploymentSpec, keeps_state: bool) -> str | None:
    if not keeps_state or spec.max_parallelism is None or current.max_parallelism is None:
        return None
    if spec.max_parallelism == current.max_parallelism:
        return None
    return (
        f"max_parallelism {spec.max_parallelism} differs from the {current.max_parallelism} key groups of the "
        "deployment's state, which never change on restore; re-key a savepoint "
        "(keyscale.state_processor.rekey_savepoint) or start without state (restore_strategy NONE)"
    )


def plan_action(current: Current, desired: Desired, job_running: bool) -> Action:
    """The one next step that brings what runs closer to ``desired``.

    ``job_running`` says whether a job process is alive (and serving its control API).
    The rules (``docs/deployments.md``):

    - desired SUSPENDED/CANCELLED: stop a running job (with a savepoint if SUSPENDED), else done;
    - no job, none failed: START per the desired restore strategy;
    - the job ended by itself with exit code 0 (someone stopped it): STOPPED, not restarted;
    - the job failed: RESTART with LATEST_STATE after the restart strategy's backoff, or FAIL
      once ``attempts`` restarts in a row have failed;
    - a running job whose generation was refused or failed before: NOTHING (not retried);
    - only ``parallelism`` changed: RESCALE live (whatever the upgrade strategy: no restart);
    - a run setting changed (job file content, args, master, ...): per the *desired* upgrade
      strategy, UPGRADE with a savepoint (STATEFUL), UPGRADE without one (STATELESS) or
      REFUSE (NONE); with the parallelism changed too, the new job starts at the new one;
    - only deployment settings changed (strategies, savepoint folder), or ``max_parallelism``
      was unset or set to what the state has: UPDATE.

    >>> from pathlib import Path
    >>> spec = DeploymentSpec("c", Path("/d/c.toml"), Path("/d/job.py"), "a" * 64)
    >>> plan_action(Current(), Desired(1, DesiredState.RUNNING, spec), job_running=False).kind
    <ActionKind.START: 'START'>
    >>> a = plan_action(Current(spec=spec, last_exit=1, failures=2), Desired(1, DesiredState.RUNNING, spec), False)
    >>> a.kind, a.delay, a.restore
    (<ActionKind.RESTART: 'RESTART'>, 2.0, <RestoreStrategy.LATEST_STATE: 'LATEST_STATE'>)
    """
    if desired.state is not DesiredState.RUNNING:
        return _stop(current, desired, job_running)
    if not job_running:
        return _start_or_restart(current, desired)
    return _change_running(current, desired)


def _stop(current: Current, desired: Desired, job_running: bool) -> Action:
    """Desired SUSPENDED or CANCELLED: stop a running job, else done."""
    if job_running and desired.generation == current.rejected_generation:
        return Action(ActionKind.NOTHING, f"the stop of generation {desired.generation} failed; the job keeps running")
    if job_running:
        with_sp = desired.state is DesiredState.SUSPENDED
        return Action(ActionKind.STOP, f"desired state {desired.state}: stopping the job {'with' if with_sp else 'without'} a savepoint", savepoint=with_sp)
    return Action(ActionKind.STOPPED, f"desired state {desired.state} and no job runs")


def _start_or_restart(current: Current, desired: Desired) -> Action:
    """Desired RUNNING and no job runs: start it, restart it after a failure, or give up."""
    spec = desired.spec
    if current.last_exit is None:
        why = "starting the deployment" if current.spec is None else "starting the deployment again"
        conflict = _max_parallelism_conflict(current, spec, spec.restore_strategy is not RestoreStrategy.NONE)
        if conflict:
            return Action(ActionKind.REFUSE, f"cannot start: {conflict}")
        return Action(ActionKind.START, f"{why} (restore strategy {spec.restore_strategy})", spec=spec, restore=spec.restore_strategy)
    if current.last_exit == 0:
        return Action(ActionKind.STOPPED, "the job ended by itself with exit code 0 (stopped outside the deployment); `keyscale apply` starts it again")
    # A refused change does not sneak in through a restart: the job restarts as it ran.
    run = current.spec if (current.spec is not None and desired.generation == current.rejected_generation) else spec
    attempts = spec.restart.attempts
    if current.failures > attempts:
        return Action(
            ActionKind.FAIL,
            f"the job failed (exit code {current.last_exit}) and all {attempts} restart attempts in a row failed",
        )
    delay = spec.restart.delay(current.failures)
    return Action(
        ActionKind.RESTART,
        f"the job failed (exit code {current.last_exit}); restart {current.failures} of {attempts} in {delay:g} s from the latest state",
        spec=run, restore=RestoreStrategy.LATEST_STATE, delay=delay,
    )


def _change_running(current: Current, desired: Desired) -> Action:
    """Desired RUNNING and a job runs: what its spec's changes call for (nothing, a live
    rescale, an upgrade, a refusal, or only the deployment's record)."""
    spec = desired.spec
    if current.spec is None:
        return Action(ActionKind.UPDATE, "adopting a running job whose spec is unknown as the desired spec", spec=spec)
    if desired.generation == current.rejected_generation:
        return Action(ActionKind.NOTHING, f"generation {desired.generation} was refused; the job keeps running its spec")
    changed = current.spec.changes(spec)
    if not changed:
        return Action(ActionKind.NOTHING, "the job runs the desired spec", spec=spec)
    what = current.spec.describe_changes(spec)
    run_changes = [c for c in changed if c in RUN_FIELDS]
    if "max_parallelism" in run_changes and spec.max_parallelism in (None, current.max_parallelism):
        run_changes.remove("max_parallelism")  # unset, or what the state has: nothing to do
    if run_changes:
        strategy = spec.upgrade_strategy
        if strategy is UpgradeStrategy.NONE:
            return Action(ActionKind.REFUSE, f"upgrade_strategy NONE: refusing {what}; the job keeps running as it is")
        stateful = strategy is UpgradeStrategy.STATEFUL
        conflict = _max_parallelism_conflict(current, spec, stateful or spec.restore_strategy is not RestoreStrategy.NONE)
        if conflict:
            return Action(ActionKind.REFUSE, f"refusing {what}: {conflict}")
        if stateful:
            return Action(ActionKind.UPGRADE, f"{what}: STATEFUL upgrade (stop with a savepoint, start from it)", spec=spec, savepoint=True)
        return Action(
            ActionKind.UPGRADE, f"{what}: STATELESS upgrade (stop without a savepoint, restore strategy {spec.restore_strategy})",
            spec=spec, restore=spec.restore_strategy,
        )
    if "parallelism" in changed:
        m = current.max_parallelism
        if m is not None and spec.parallelism > m:
            return Action(ActionKind.REFUSE, f"parallelism {spec.parallelism} is larger than the {m} key groups (max parallelism) of the running job")
        return Action(ActionKind.RESCALE, f"{what}: rescaling live (no restart)", spec=spec, parallelism=spec.parallelism)
    return Action(ActionKind.UPDATE, f"{what}: nothing the running job needs to change for", spec=spec)


# -- restore ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Snapshot:
    """A checkpoint (``path`` = its job directory) or a savepoint (``path`` = its folder)."""

    path: str
    batch: int
    created_ms: int
    job_dir: str | None = None  # a savepoint's job directory, when the deployment took it


class RestoreKind(StrEnum):
    RESUME = "RESUME"  # keyscale run on the current job directory (its latest checkpoint)
    SAVEPOINT = "SAVEPOINT"  # a new job directory from ``path``
    EMPTY = "EMPTY"  # a new job directory with empty state


@dataclass(frozen=True)
class Restore:
    kind: RestoreKind
    path: str | None
    reason: str


def _newer(sp: Snapshot, ckpt: Snapshot) -> bool:
    if sp.job_dir is not None and sp.job_dir == ckpt.path:
        return sp.batch > ckpt.batch  # a savepoint of this very job directory: compare batches
    return sp.created_ms > ckpt.created_ms


def choose_restore(
    strategy: RestoreStrategy,
    checkpoint: Snapshot | None,
    savepoints: Sequence[Snapshot],
    state_since_ms: int = 0,
) -> Restore:
    """The state a job starts from under ``strategy``.

    ``checkpoint`` is the latest checkpoint of the current job directory (if any);
    ``savepoints`` are the deployment's savepoints. Savepoints created before
    ``state_since_ms`` are ignored: that is when the deployment last started from empty
    state on purpose (restore strategy NONE), so state thrown away then never comes back by
    itself. On a tie the checkpoint wins (resuming needs no copy).

    >>> ck = Snapshot("/s/jobs/1", 7, 1_000)
    >>> sp = Snapshot("/s/savepoints/a", 5, 2_000)
    >>> choose_restore(RestoreStrategy.LATEST_STATE, ck, [sp]).kind
    <RestoreKind.SAVEPOINT: 'SAVEPOINT'>
    >>> choose_restore(RestoreStrategy.LATEST_STATE, ck, [sp], state_since_ms=1_500).kind
    <RestoreKind.SAVEPOINT: 'SAVEPOINT'>
    >>> choose_restore(RestoreStrategy.LATEST_STATE, ck, [sp], state_since_ms=3_000).kind
    <RestoreKind.RESUME: 'RESUME'>
    >>> choose_restore(RestoreStrategy.LATEST_SAVEPOINT, ck, []).kind
    <RestoreKind.EMPTY: 'EMPTY'>
    """
    if strategy is RestoreStrategy.NONE:
        return Restore(RestoreKind.EMPTY, None, "restore strategy NONE: empty state")
    eligible = [s for s in savepoints if s.created_ms >= state_since_ms]
    latest_sp = max(eligible, key=lambda s: (s.created_ms, s.batch), default=None)
    if strategy is RestoreStrategy.LATEST_SAVEPOINT:
        if latest_sp is None:
            return Restore(RestoreKind.EMPTY, None, "LATEST_SAVEPOINT: no savepoint yet, empty state")
        return Restore(RestoreKind.SAVEPOINT, latest_sp.path, f"LATEST_SAVEPOINT: savepoint of batch {latest_sp.batch} ({latest_sp.path})")
    if checkpoint is not None and (latest_sp is None or not _newer(latest_sp, checkpoint)):
        return Restore(RestoreKind.RESUME, checkpoint.path, f"LATEST_STATE: checkpoint {checkpoint.batch} of {checkpoint.path}")
    if latest_sp is not None:
        return Restore(RestoreKind.SAVEPOINT, latest_sp.path, f"LATEST_STATE: savepoint of batch {latest_sp.batch} ({latest_sp.path})")
    return Restore(RestoreKind.EMPTY, None, "LATEST_STATE: no checkpoint or savepoint yet, empty state")
