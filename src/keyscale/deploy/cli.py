"""The deployment commands: ``keyscale apply`` and ``keyscale deployment status|stop``.

``keyscale``'s parser registers them with :func:`add_apply_parser` and
:func:`add_deployment_parsers`; :func:`main` runs them on their own (tests, scripts)::

    keyscale apply DEPLOYMENT.toml [--wait SECONDS] [--dry-run]
    keyscale deployment status DEPLOYMENT.toml|STATE_DIR [--json] [--events N]
    keyscale deployment stop DEPLOYMENT.toml|STATE_DIR [--savepoint] [--wait SECONDS]

Each handler returns an exit code and raises :class:`~keyscale.errors.KeyscaleError` for
anything the user can fix or should know (a refused change exits non-zero).

>>> import argparse
>>> p = argparse.ArgumentParser(prog="keyscale")
>>> sub = p.add_subparsers(dest="command")
>>> _ = add_apply_parser(sub); _ = add_deployment_parsers(sub)
>>> a = p.parse_args(["deployment", "stop", "d.toml", "--savepoint"])
>>> a.func is cmd_stop, a.savepoint
(True, True)
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from keyscale.checkpoint.jobdir import JobDir
from keyscale.deploy.file import load_deployment, state_dir_of
from keyscale.deploy.launch import start_supervisor
from keyscale.deploy.plan import Desired, DesiredState, plan_action
from keyscale.deploy.spec import DeploymentError, DeploymentSpec
from keyscale.deploy.store import DeploymentState, DeploymentStatus, DeploymentStore
from keyscale.deploy.supervisor import Outcome
from keyscale.errors import KeyscaleError, cli_exit

__all__ = [
    "add_apply_parser",
    "add_deployment_parsers",
    "cmd_apply",
    "cmd_status",
    "cmd_stop",
    "main",
    "status_dict",
    "wait_for_outcome",
]

DEFAULT_WAIT = 600.0


def add_apply_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``apply`` on ``subparsers`` (from ``ArgumentParser.add_subparsers``)."""
    ap: argparse.ArgumentParser = subparsers.add_parser(
        "apply", help="start a deployment, or bring a running one to its deployment file",
        description="Start the deployment described by a TOML file, or bring the running one to it: a parallelism "
        "change rescales live; a change of the job file, its args or run settings follows the upgrade strategy.",
    )
    ap.add_argument("deployment", help="the deployment file (TOML)")
    ap.add_argument("--wait", type=float, default=DEFAULT_WAIT, metavar="SECONDS",
                    help=f"wait up to this long for the change to be carried out (default {DEFAULT_WAIT:.0f}; 0: do not wait)")
    ap.add_argument("--dry-run", action="store_true", help="validate the file and print what would be done; change nothing")
    ap.set_defaults(func=cmd_apply)
    return ap


def add_deployment_parsers(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``deployment status`` and ``deployment stop`` on ``subparsers``."""
    d: argparse.ArgumentParser = subparsers.add_parser("deployment", help="status and stop of a deployment (see `keyscale apply`)")
    dsub = d.add_subparsers(dest="deployment_command", required=True)
    st = dsub.add_parser("status", help="desired and running spec, state, job, restarts, last events")
    st.add_argument("target", metavar="DEPLOYMENT.toml|STATE_DIR")
    st.add_argument("--json", action="store_true")
    st.add_argument("--events", type=int, default=10, metavar="N", help="show the last N events (default 10)")
    st.set_defaults(func=cmd_status)
    so = dsub.add_parser("stop", help="stop the deployment's job and its supervisor")
    so.add_argument("target", metavar="DEPLOYMENT.toml|STATE_DIR")
    so.add_argument("--savepoint", action="store_true", help="take a savepoint first (into the savepoint folder) and print its path")
    so.add_argument("--wait", type=float, default=DEFAULT_WAIT, metavar="SECONDS", help=f"wait up to this long (default {DEFAULT_WAIT:.0f})")
    so.set_defaults(func=cmd_stop)
    return d


# -- waiting for the supervisor -----------------------------------------------------------------


def wait_for_outcome(store: DeploymentStore, generation: int, timeout: float) -> Outcome:
    """Wait until the supervisor records the outcome of ``generation`` (restarting it if it ended).

    A supervisor that ended before handling ``generation`` (it was finishing a STOPPED or
    FAILED deployment when the new generation arrived) is started again, twice at most::

        outcome = wait_for_outcome(DeploymentStore("deployments/counts"), 7, timeout=600)
        print(outcome.ok, outcome.message)
    """
    deadline = time.time() + timeout
    restarts = 0
    while True:
        st = store.read_status()
        if st.outcome is not None and st.observed_generation >= generation:
            if int(st.outcome["generation"]) > generation:
                return Outcome(True, f"superseded by generation {st.outcome['generation']} (applied meanwhile)")
            return Outcome(bool(st.outcome["ok"]), str(st.outcome["message"]), st.outcome.get("savepoint"))
        if not store.supervisor_running():
            st = store.read_status()
            if st.observed_generation >= generation:
                continue
            if restarts >= 2:
                raise DeploymentError(f"the supervisor of {store.path} ended without carrying out generation {generation}; see {store.supervisor_log}")
            start_supervisor(store)
            restarts += 1
        if time.time() > deadline:
            raise DeploymentError(
                f"generation {generation} was not carried out within {timeout:.0f} s; the supervisor keeps working on it "
                f"(keyscale deployment status {store.path})"
            )
        time.sleep(0.2)


# -- apply --------------------------------------------------------------------------------------


def cmd_apply(a: argparse.Namespace) -> int:
    """``keyscale apply``: write the desired spec, start the supervisor if none runs, wait."""
    spec = load_deployment(a.deployment)
    store = DeploymentStore(spec.state_dir)
    prev = store.read_desired()
    if prev is not None and prev.spec.name != spec.name:
        raise DeploymentError(f"{spec.source}: name: state_dir {store.path} holds deployment '{prev.spec.name}', not '{spec.name}'; give each deployment its own state_dir")
    if a.dry_run:
        st = store.read_status()
        current = st.current()
        if not store.supervisor_running():
            current = type(current)(current.spec, current.max_parallelism, None, 0, current.rejected_generation)
        action = plan_action(current, Desired((prev.generation if prev else 0) + 1, DesiredState.RUNNING, spec), st.job_running())
        print(f"keyscale: deployment '{spec.name}' ({st.state}): would {action.kind}: {action.reason}")
        return 0
    with store.apply_lock():
        store.install_artifact(spec)
        prev = store.read_desired()
        generation = (prev.generation if prev else 0) + 1
        changes = prev.spec.describe_changes(spec) if prev is not None else "first apply"
        # Before the spec: the supervisor acts on it at once, and its event must follow this one.
        store.event("apply", f"generation {generation} from {spec.source}: {changes}", generation=generation)
        store.write_desired(Desired(generation, DesiredState.RUNNING, spec))
    if not store.supervisor_running():
        pid = start_supervisor(store)
        print(f"keyscale: started the supervisor of deployment '{spec.name}' (pid {pid}; log {store.supervisor_log})", file=sys.stderr)
    if a.wait <= 0:
        print(f"keyscale: deployment '{spec.name}': generation {generation} applied; see `keyscale deployment status {spec.source}`")
        return 0
    outcome = wait_for_outcome(store, generation, a.wait)
    if not outcome.ok:
        raise DeploymentError(f"deployment '{spec.name}' generation {generation}: {outcome.message}")
    print(f"keyscale: deployment '{spec.name}' generation {generation}: {outcome.message}")
    return 0


# -- stop ---------------------------------------------------------------------------------------


def _store_of(target: str) -> tuple[DeploymentStore, Desired]:
    store = DeploymentStore(state_dir_of(target))
    desired = store.read_desired()
    if desired is None:
        raise DeploymentError(f"no deployment in {store.path} (it was never applied)")
    return store, desired


def cmd_stop(a: argparse.Namespace) -> int:
    """``keyscale deployment stop``: stop the job (after a savepoint) and the supervisor."""
    store, desired = _store_of(a.target)
    name = desired.spec.name
    st = store.read_status()
    if not store.supervisor_running() and not st.job_running():
        print(f"keyscale: deployment '{name}' is not running ({st.state})", file=sys.stderr)
        return 0
    state = DesiredState.SUSPENDED if a.savepoint else DesiredState.CANCELLED
    with store.apply_lock():
        desired = store.read_desired() or desired
        generation = desired.generation + 1
        store.write_desired(Desired(generation, state, desired.spec))
    store.event("stop-request", f"generation {generation}: stop {'with' if a.savepoint else 'without'} a savepoint", generation=generation)
    if not store.supervisor_running():
        start_supervisor(store)  # it adopts the job left running and stops it
    outcome = wait_for_outcome(store, generation, a.wait)
    if not outcome.ok:
        raise DeploymentError(f"deployment '{name}': {outcome.message}")
    deadline = time.time() + 60
    while store.supervisor_running() and time.time() < deadline:
        time.sleep(0.1)
    if outcome.savepoint:
        print(outcome.savepoint)
    print(f"keyscale: deployment '{name}' {outcome.message}", file=sys.stderr)
    return 0


# -- status -------------------------------------------------------------------------------------


def _spec_summary(spec: DeploymentSpec) -> dict[str, Any]:
    return {
        "job": f"{spec.job_file} (sha256 {spec.job_sha256[:12]})",
        "parallelism": spec.parallelism,
        "max_parallelism": spec.max_parallelism,
        "args": spec.args,
        "master": spec.master,
        "upgrade_strategy": spec.upgrade_strategy.value,
        "restore_strategy": spec.restore_strategy.value,
        "restart": spec.restart.to_json(),
    }


def status_dict(target: str, events: int = 10) -> dict[str, Any]:
    """Everything ``keyscale deployment status`` shows, as JSON-ready data."""
    store, desired = _store_of(target)
    st: DeploymentStatus = store.read_status()
    sup = store.supervisor_running()
    running = DeploymentSpec.from_json(st.running_spec) if st.running_spec else None
    state = st.state
    if not sup and state in DeploymentState.ACTIVE:
        state = f"UNKNOWN (the supervisor is not running; last known state {st.state})"
    job: dict[str, Any] | None = None
    if st.job_dir:
        jd = JobDir(st.job_dir)
        batches = jd.manifest_batches()
        par: dict[str, int] = {}
        if batches:
            try:
                m = jd.read_manifest(batches[-1])
                par = {uid: op.parallelism for uid, op in m.operators.items()}
            except KeyscaleError:
                par = {}
        job = {
            "job_dir": st.job_dir, "running": jd.is_running(), "pid": jd.lock_holder() if jd.is_running() else None,
            "started": _time(st.job_started_ms), "state_from": st.restored_from,
            "last_checkpoint": batches[-1] if batches else None, "parallelism": par,
        }
    return {
        "name": desired.spec.name,
        "state_dir": str(store.path),
        "state": state,
        "message": st.message,
        "supervisor": {"running": sup, "pid": store.supervisor_pid() if sup else None, "log": str(store.supervisor_log)},
        "job": job,
        "restarts": st.restarts,
        "failures_in_a_row": st.failures,
        "desired": {"generation": desired.generation, "state": desired.state.value, "spec": _spec_summary(desired.spec)},
        "running": _spec_summary(running) if running else None,
        "differences": running.describe_changes(desired.spec) if running else "nothing runs",
        "outcome": st.outcome,
        "savepoints": st.savepoints,
        "events": store.events(events),
    }


def _time(ms: int | None) -> str | None:
    return None if ms is None else dt.datetime.fromtimestamp(ms / 1000).isoformat(sep=" ", timespec="seconds")


def cmd_status(a: argparse.Namespace) -> int:
    """``keyscale deployment status``."""
    d = status_dict(a.target, a.events)
    if a.json:
        print(json.dumps(d, indent=1))
        return 0
    sup = d["supervisor"]
    print(f"deployment '{d['name']}' ({d['state_dir']}): {d['state']}" + (f" - {d['message']}" if d["message"] else ""))
    print(f"  supervisor: {'pid ' + str(sup['pid']) if sup['running'] else 'not running'} (log {sup['log']})")
    j = d["job"]
    if j:
        par = ", ".join(f"{u}={p}" for u, p in j["parallelism"].items()) or "-"
        run = f"running (pid {j['pid']})" if j["running"] else "not running"
        print(f"  job: {run} in {j['job_dir']}; last checkpoint {j['last_checkpoint']}; parallelism {par}")
        print(f"       started {j['started']} from {j['state_from']}")
    print(f"  restarts: {d['restarts']} (failures in a row: {d['failures_in_a_row']})")
    des = d["desired"]
    print(f"  desired (generation {des['generation']}, {des['state']}): {_line(des['spec'])}")
    print(f"  running: {_line(d['running']) if d['running'] else '-'}")
    print(f"  desired vs running: {'same' if d['differences'] == 'no change' else d['differences']}")
    if d["outcome"]:
        o = d["outcome"]
        print(f"  last outcome: generation {o['generation']}: {'ok' if o['ok'] else 'NOT DONE'}: {o['message']}")
    if d["events"]:
        print("  last events:")
        for e in d["events"]:
            print(f"    {e['time']} {e['event']}: {e['message']}")
    return 0


def _line(s: dict[str, Any]) -> str:
    args = " ".join(f"{k}={v}" for k, v in s["args"].items())
    r = s["restart"]
    return (
        f"{s['job']}, parallelism {s['parallelism']}" + (f" (max {s['max_parallelism']})" if s["max_parallelism"] else "")
        + f", args [{args}], {s['master']}, upgrade {s['upgrade_strategy']}, restore {s['restore_strategy']}, "
        f"restart {r['attempts']}x from {r['backoff_seconds']:g} s (x{r['backoff_factor']:g})"
    )


# -- standalone -------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """A parser with just the deployment commands (``keyscale`` registers them in its own)."""
    p = argparse.ArgumentParser(prog="keyscale", description="keyscale deployments")
    sub = p.add_subparsers(dest="command", required=True)
    add_apply_parser(sub)
    add_deployment_parsers(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run one deployment command, as ``keyscale`` would; the exit code.

    >>> main(["deployment", "status", "/nonexistent/deployment.toml"])
    2
    """
    a = build_parser().parse_args(argv)
    try:
        return int(a.func(a))
    except KeyscaleError as e:
        return cli_exit(e)


if __name__ == "__main__":
    sys.exit(main())
