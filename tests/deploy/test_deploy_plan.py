"""The supervisor's pure decisions: plan_action and choose_restore (no Spark, no processes)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keyscale.deploy.plan import (
    ActionKind,
    Current,
    Desired,
    DesiredState,
    RestoreKind,
    Snapshot,
    choose_restore,
    plan_action,
)
from keyscale.deploy.spec import (
    RUN_FIELDS,
    DeploymentSpec,
    RestartStrategy,
    RestoreStrategy,
    UpgradeStrategy,
)

BASE = DeploymentSpec(
    name="counts", source=Path("/d/deployment.toml"), job_file=Path("/d/job.py"), job_sha256="a" * 64,
    args={"input": "in", "output": "out"}, parallelism=2, max_parallelism=16, state_dir=Path("/s"),
    savepoint_dir=Path("/s/savepoints"), restart=RestartStrategy(attempts=3, backoff_seconds=1, backoff_factor=2),
)


def spec(**changes: Any) -> DeploymentSpec:
    return dataclasses.replace(BASE, **changes)


def running(s: DeploymentSpec = BASE, **kw: Any) -> Current:
    return Current(spec=s, max_parallelism=16, **kw)


def want(s: DeploymentSpec, generation: int = 2, state: DesiredState = DesiredState.RUNNING) -> Desired:
    return Desired(generation, state, s)


# -- a running job ------------------------------------------------------------------------------


def test_same_spec_is_nothing() -> None:
    a = plan_action(running(), want(BASE), job_running=True)
    assert a.kind is ActionKind.NOTHING


@pytest.mark.parametrize("strategy", list(UpgradeStrategy))
def test_parallelism_only_rescales_live_whatever_the_upgrade_strategy(strategy: UpgradeStrategy) -> None:
    new = spec(parallelism=5, upgrade_strategy=strategy)
    a = plan_action(running(spec(upgrade_strategy=strategy)), want(new), job_running=True)
    assert a.kind is ActionKind.RESCALE and a.parallelism == 5 and a.spec == new
    assert "parallelism: 2 -> 5" in a.reason


def test_parallelism_above_the_key_groups_is_refused() -> None:
    a = plan_action(running(), want(spec(parallelism=17, max_parallelism=None)), job_running=True)
    # max_parallelism None in the file means "whatever the state has": only the parallelism counts.
    assert a.kind is ActionKind.REFUSE and "17 is larger than the 16 key groups" in a.reason


@pytest.mark.parametrize(
    "change",
    [
        {"args": {"input": "in", "output": "out2"}},
        {"job_sha256": "b" * 64},
        {"job_file": Path("/d/other_name.py")},
        {"master": "local[4]"},
        {"trigger_interval": "5 seconds"},
        {"retain": 9},
        {"compaction_chain": 4},
    ],
)
def test_run_setting_changes_follow_the_upgrade_strategy(change: dict[str, Any]) -> None:
    for strategy, kind, savepoint in [
        (UpgradeStrategy.STATEFUL, ActionKind.UPGRADE, True),
        (UpgradeStrategy.STATELESS, ActionKind.UPGRADE, False),
        (UpgradeStrategy.NONE, ActionKind.REFUSE, False),
    ]:
        new = spec(upgrade_strategy=strategy, **change)
        a = plan_action(running(spec(upgrade_strategy=strategy)), want(new), job_running=True)
        assert a.kind is kind, (change, strategy, a)
        assert a.savepoint is savepoint
        if kind is ActionKind.UPGRADE:
            assert a.spec == new
        if strategy is UpgradeStrategy.STATELESS:
            assert a.restore is RestoreStrategy.LATEST_STATE  # the desired restore strategy
        if strategy is UpgradeStrategy.NONE:
            assert "upgrade_strategy NONE" in a.reason and "keeps running" in a.reason


def test_stateless_upgrade_uses_the_desired_restore_strategy() -> None:
    new = spec(upgrade_strategy=UpgradeStrategy.STATELESS, restore_strategy=RestoreStrategy.NONE, args={"input": "x"})
    a = plan_action(running(), want(new), job_running=True)
    assert a.kind is ActionKind.UPGRADE and not a.savepoint and a.restore is RestoreStrategy.NONE


def test_the_desired_upgrade_strategy_governs() -> None:
    # Changing the strategy in the same apply as the code: the new strategy applies.
    a = plan_action(running(), want(spec(upgrade_strategy=UpgradeStrategy.NONE, args={})), job_running=True)
    assert a.kind is ActionKind.REFUSE
    a = plan_action(running(spec(upgrade_strategy=UpgradeStrategy.NONE)), want(spec(args={})), job_running=True)
    assert a.kind is ActionKind.UPGRADE and a.savepoint


def test_upgrade_with_a_new_parallelism_starts_at_it() -> None:
    new = spec(parallelism=7, args={"input": "in2"})
    a = plan_action(running(), want(new), job_running=True)
    assert a.kind is ActionKind.UPGRADE and a.spec is not None and a.spec.parallelism == 7


def test_max_parallelism_never_changes_under_state() -> None:
    a = plan_action(running(), want(spec(max_parallelism=32)), job_running=True)
    assert a.kind is ActionKind.REFUSE and "max_parallelism 32 differs from the 16 key groups" in a.reason
    stateless_empty = spec(max_parallelism=32, upgrade_strategy=UpgradeStrategy.STATELESS, restore_strategy=RestoreStrategy.NONE)
    assert plan_action(running(), want(stateless_empty), job_running=True).kind is ActionKind.UPGRADE
    # Unset in the file, or what the state has: nothing to upgrade.
    assert plan_action(running(), want(spec(max_parallelism=None)), job_running=True).kind is ActionKind.UPDATE
    assert plan_action(running(spec(max_parallelism=None)), want(BASE), job_running=True).kind is ActionKind.UPDATE
    assert plan_action(running(spec(max_parallelism=None)), want(spec(max_parallelism=None, args={})), job_running=True).kind is ActionKind.UPGRADE


@pytest.mark.parametrize(
    "change",
    [
        {"upgrade_strategy": UpgradeStrategy.STATELESS},
        {"restore_strategy": RestoreStrategy.NONE},
        {"restart": RestartStrategy(attempts=9)},
        {"savepoint_dir": Path("/elsewhere")},
        {"allow_non_restored_state": True},
    ],
)
def test_deployment_settings_only_update_the_record(change: dict[str, Any]) -> None:
    new = spec(**change)
    a = plan_action(running(), want(new), job_running=True)
    assert a.kind is ActionKind.UPDATE and a.spec == new


def test_a_refused_generation_is_not_retried_but_a_new_one_is_judged_again() -> None:
    bad = spec(upgrade_strategy=UpgradeStrategy.NONE, args={})
    assert plan_action(running(rejected_generation=2), want(bad, 2), job_running=True).kind is ActionKind.NOTHING
    assert plan_action(running(rejected_generation=2), want(bad, 3), job_running=True).kind is ActionKind.REFUSE
    assert plan_action(running(rejected_generation=2), want(BASE, 3), job_running=True).kind is ActionKind.NOTHING


def test_an_adopted_job_of_unknown_spec_takes_the_desired_one() -> None:
    assert plan_action(Current(), want(BASE), job_running=True).kind is ActionKind.UPDATE


# -- no job running -----------------------------------------------------------------------------


@pytest.mark.parametrize("restore", list(RestoreStrategy))
def test_start_uses_the_restore_strategy(restore: RestoreStrategy) -> None:
    s = spec(restore_strategy=restore)
    for current in (Current(), running(s)):  # first start, and a start after STOPPED/FAILED
        a = plan_action(current, want(s), job_running=False)
        assert a.kind is ActionKind.START and a.restore is restore and a.spec == s


def test_start_with_another_max_parallelism_is_refused_unless_state_is_dropped() -> None:
    a = plan_action(running(), want(spec(max_parallelism=64)), job_running=False)
    assert a.kind is ActionKind.REFUSE and "cannot start" in a.reason
    a = plan_action(running(), want(spec(max_parallelism=64, restore_strategy=RestoreStrategy.NONE)), job_running=False)
    assert a.kind is ActionKind.START


def test_failures_restart_with_backoff_then_fail() -> None:
    delays = []
    for failures in (1, 2, 3):
        a = plan_action(running(last_exit=1, failures=failures), want(BASE), job_running=False)
        assert a.kind is ActionKind.RESTART and a.restore is RestoreStrategy.LATEST_STATE and a.spec == BASE
        assert f"restart {failures} of 3" in a.reason
        delays.append(a.delay)
    assert delays == [1.0, 2.0, 4.0]
    a = plan_action(running(last_exit=-9, failures=4), want(BASE), job_running=False)
    assert a.kind is ActionKind.FAIL and "exit code -9" in a.reason and "all 3 restart attempts" in a.reason
    no_restarts = spec(restart=RestartStrategy(attempts=0))
    assert plan_action(running(no_restarts, last_exit=1, failures=1), want(no_restarts), False).kind is ActionKind.FAIL


def test_restart_runs_the_desired_spec_unless_it_was_refused() -> None:
    fixed = spec(job_sha256="f" * 64)
    # A crash-looping job is fixed by applying a new file: the next restart runs it.
    a = plan_action(running(last_exit=1, failures=1), want(fixed, 3), job_running=False)
    assert a.kind is ActionKind.RESTART and a.spec == fixed
    # A refused change does not sneak in through a restart.
    refused = spec(job_sha256="f" * 64, upgrade_strategy=UpgradeStrategy.NONE)
    a = plan_action(running(last_exit=1, failures=1, rejected_generation=3), want(refused, 3), job_running=False)
    assert a.kind is ActionKind.RESTART and a.spec == BASE


def test_a_job_that_ends_cleanly_by_itself_is_not_restarted() -> None:
    a = plan_action(running(last_exit=0), want(BASE), job_running=False)
    assert a.kind is ActionKind.STOPPED and "exit code 0" in a.reason


# -- stopping -----------------------------------------------------------------------------------


def test_stop_requests() -> None:
    a = plan_action(running(), want(BASE, state=DesiredState.SUSPENDED), job_running=True)
    assert a.kind is ActionKind.STOP and a.savepoint
    a = plan_action(running(), want(BASE, state=DesiredState.CANCELLED), job_running=True)
    assert a.kind is ActionKind.STOP and not a.savepoint
    for state in (DesiredState.SUSPENDED, DesiredState.CANCELLED):
        assert plan_action(running(last_exit=1, failures=9), want(BASE, state=state), job_running=False).kind is ActionKind.STOPPED
    # A stop whose savepoint failed is not retried in a loop: the job keeps running.
    a = plan_action(running(rejected_generation=2), want(BASE, 2, DesiredState.SUSPENDED), job_running=True)
    assert a.kind is ActionKind.NOTHING


# -- properties ---------------------------------------------------------------------------------

_CHANGES: dict[str, list[Any]] = {
    "parallelism": [1, 3, 16],
    "args": [{"input": "other"}],
    "job_sha256": ["c" * 64],
    "master": ["local[1]"],
    "max_parallelism": [None, 32],
    "upgrade_strategy": list(UpgradeStrategy),
    "restore_strategy": list(RestoreStrategy),
    "restart": [RestartStrategy(attempts=0), RestartStrategy(attempts=1)],
}


@st.composite
def _specs(draw: st.DrawFn) -> DeploymentSpec:
    chosen = draw(st.dictionaries(st.sampled_from(sorted(_CHANGES)), st.none(), max_size=4))
    return spec(**{k: draw(st.sampled_from(_CHANGES[k])) for k in chosen})


@settings(max_examples=400, deadline=None)
@given(
    cur=_specs(), new=_specs(), job_running=st.booleans(), last_exit=st.sampled_from([None, 0, 1, -9]),
    failures=st.integers(0, 3), state=st.sampled_from(list(DesiredState)), rejected=st.booleans(),
)
def test_plan_invariants(cur: DeploymentSpec, new: DeploymentSpec, job_running: bool, last_exit: int | None,
                         failures: int, state: DesiredState, rejected: bool) -> None:
    if last_exit not in (None, 0):
        failures = max(failures, 1)  # last_exit's failure is counted
    current = Current(cur, 16, None if job_running else last_exit, failures, 5 if rejected else 0)
    a = plan_action(current, Desired(5, state, new), job_running)
    changed = set(cur.changes(new))
    if state is not DesiredState.RUNNING:
        assert a.kind in ({ActionKind.STOP, ActionKind.NOTHING} if job_running else {ActionKind.STOPPED})
        return
    if job_running:
        assert a.kind not in {ActionKind.START, ActionKind.RESTART, ActionKind.FAIL, ActionKind.STOP, ActionKind.STOPPED}
        if rejected:
            assert a.kind is ActionKind.NOTHING
        run_changes = changed & set(RUN_FIELDS)
        if new.max_parallelism in (None, 16):  # unset, or what the state has: not a change
            run_changes.discard("max_parallelism")
        if a.kind is ActionKind.RESCALE:
            assert "parallelism" in changed and not run_changes
        if a.kind is ActionKind.UPGRADE:
            assert run_changes and new.upgrade_strategy is not UpgradeStrategy.NONE
            assert a.savepoint == (new.upgrade_strategy is UpgradeStrategy.STATEFUL)
        if not changed:
            assert a.kind is ActionKind.NOTHING
        if run_changes and new.upgrade_strategy is UpgradeStrategy.NONE and not rejected:
            assert a.kind is ActionKind.REFUSE
    else:
        assert a.kind in {ActionKind.START, ActionKind.RESTART, ActionKind.FAIL, ActionKind.STOPPED, ActionKind.REFUSE}
        if a.kind is ActionKind.RESTART:
            assert a.restore is RestoreStrategy.LATEST_STATE and 1 <= failures <= new.restart.attempts


def test_planning_is_fast() -> None:
    started = time.perf_counter()
    for _ in range(2000):
        plan_action(running(), want(spec(parallelism=3)), job_running=True)
    assert time.perf_counter() - started < 1.0


# -- choose_restore ---------------------------------------------------------------------------

CK = Snapshot("/s/jobs/2", batch=10, created_ms=5_000)


def test_restore_none_is_empty_whatever_exists() -> None:
    r = choose_restore(RestoreStrategy.NONE, CK, [Snapshot("/s/sp/a", 3, 9_000)])
    assert r.kind is RestoreKind.EMPTY and r.path is None


def test_latest_savepoint() -> None:
    sps = [Snapshot("/s/sp/a", 3, 1_000), Snapshot("/s/sp/c", 9, 3_000), Snapshot("/s/sp/b", 7, 2_000)]
    r = choose_restore(RestoreStrategy.LATEST_SAVEPOINT, CK, sps)
    assert r.kind is RestoreKind.SAVEPOINT and r.path == "/s/sp/c" and "batch 9" in r.reason
    r = choose_restore(RestoreStrategy.LATEST_SAVEPOINT, CK, [])
    assert r.kind is RestoreKind.EMPTY and "no savepoint" in r.reason  # the checkpoint does not count


def test_latest_state_takes_the_newest() -> None:
    older_sp = Snapshot("/s/sp/a", 99, 4_000)
    newer_sp = Snapshot("/s/sp/b", 2, 6_000)
    assert choose_restore(RestoreStrategy.LATEST_STATE, CK, [older_sp]).kind is RestoreKind.RESUME
    r = choose_restore(RestoreStrategy.LATEST_STATE, CK, [older_sp, newer_sp])
    assert r.kind is RestoreKind.SAVEPOINT and r.path == "/s/sp/b"
    assert choose_restore(RestoreStrategy.LATEST_STATE, CK, [Snapshot("/s/sp/t", 1, 5_000)]).kind is RestoreKind.RESUME  # tie
    assert choose_restore(RestoreStrategy.LATEST_STATE, None, [older_sp]).path == "/s/sp/a"
    r = choose_restore(RestoreStrategy.LATEST_STATE, None, [])
    assert r.kind is RestoreKind.EMPTY


def test_a_savepoint_of_the_current_job_dir_is_compared_by_batch() -> None:
    # stop --savepoint takes a savepoint after the last checkpoint of the same state: resume.
    same = Snapshot("/s/sp/stop", 10, 9_000, job_dir="/s/jobs/2")
    assert choose_restore(RestoreStrategy.LATEST_STATE, CK, [same]).kind is RestoreKind.RESUME
    ahead = Snapshot("/s/sp/stop", 11, 9_000, job_dir="/s/jobs/2")
    assert choose_restore(RestoreStrategy.LATEST_STATE, CK, [ahead]).kind is RestoreKind.SAVEPOINT


def test_savepoints_from_before_a_deliberate_reset_are_ignored() -> None:
    old = Snapshot("/s/sp/a", 3, 1_000)
    assert choose_restore(RestoreStrategy.LATEST_SAVEPOINT, None, [old], state_since_ms=2_000).kind is RestoreKind.EMPTY
    assert choose_restore(RestoreStrategy.LATEST_STATE, None, [old], state_since_ms=2_000).kind is RestoreKind.EMPTY
    assert choose_restore(RestoreStrategy.LATEST_STATE, None, [old], state_since_ms=1_000).kind is RestoreKind.SAVEPOINT
