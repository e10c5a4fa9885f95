"""Starting a deployment's supervisor from a command (``keyscale apply``, ``deployment
stop``): launched detached, then waited for until it runs or has already ended.
The supervisor itself is :mod:`keyscale.deploy.supervisor`.
"""

from __future__ import annotations

import subprocess
import sys
import time

from keyscale.deploy.spec import DeploymentError
from keyscale.deploy.store import DeploymentStore

__all__ = ["start_supervisor"]


def _ended_since(store: DeploymentStore, offset: int) -> bool:
    """Whether a supervisor wrote its last words to the log after ``offset``."""
    try:
        with open(store.supervisor_log, "rb") as f:
            f.seek(offset)
            return b"supervisor ended" in f.read()
    except OSError:
        return False


def start_supervisor(store: DeploymentStore, timeout: float = 60) -> int:
    """Start the deployment's supervisor, detached (own session, log file); its pid.

    The launched process forks and exits at once, so the supervisor is nobody's child:
    it outlives ``keyscale apply`` and never becomes a zombie of it. ``desired.json`` must
    exist (``keyscale apply`` writes it first)::

        store = DeploymentStore("deployments/counts")
        if not store.supervisor_running():
            pid = start_supervisor(store)
    """
    store.path.mkdir(parents=True, exist_ok=True)
    log_start = store.supervisor_log.stat().st_size if store.supervisor_log.exists() else 0
    with open(store.supervisor_log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "keyscale.deploy.supervisor", str(store.path), "--detach"],
            cwd=store.path, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )
    proc.wait(timeout=timeout)
    deadline = time.time() + timeout
    while time.time() < deadline:
        pid = store.supervisor_pid()
        if store.supervisor_running() and pid:
            return pid
        if _ended_since(store, log_start):
            # It had little to do and has finished already (a stop with nothing running, a
            # job that fails at once): its pid file is gone, its start event says who it was.
            started = [e for e in store.events(20) if e.get("event") == "supervisor" and "pid" in e]
            return pid or (int(started[-1]["pid"]) if started else 0)
        time.sleep(0.1)
    tail = store.supervisor_log.read_text(errors="replace").strip().splitlines()[-1:] if store.supervisor_log.exists() else []
    raise DeploymentError(f"the supervisor of {store.path} did not start within {timeout:.0f} s{': ' + tail[0] if tail else ''} (see {store.supervisor_log})")
