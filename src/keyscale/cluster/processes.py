"""The processes of a local cluster's daemons: found by PID and start time (a reused PID is
never touched), stopped with their whole process group, and the Spark they run.

Pure process plumbing on Linux's /proc, apart from the cluster's records and state file
(``keyscale.cluster.local``)::

    >>> from keyscale.cluster.processes import alive, start_time
    >>> import os
    >>> alive(os.getpid(), start_time(os.getpid()))
    True
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import socket
import time
from pathlib import Path

from keyscale._subprocess import pid_exists
from keyscale.errors import ClusterError

HOST = "127.0.0.1"


def spark_home() -> Path:
    """The PySpark package folder: a Spark distribution with ``bin/spark-class`` and ``jars/``.

    It is used even when ``SPARK_HOME`` points elsewhere: the daemons must run the same
    Spark version as the driver.
    """
    spec = importlib.util.find_spec("pyspark")
    if spec is None or spec.origin is None:
        raise ClusterError("pyspark is not installed in this Python environment")
    home = Path(spec.origin).parent
    if not (home / "bin" / "spark-class").is_file():
        raise ClusterError(f"the PySpark install at {home} has no bin/spark-class")
    return home


def proc_stat(pid: int) -> tuple[str, int, int] | None:
    """``(state, process group, start time)`` of ``pid`` from /proc, or None if it does not exist."""
    try:
        data = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    except OSError:
        return None
    rest = data[data.rindex(")") + 2 :].split()
    return rest[0], int(rest[2]), int(rest[19])


def has_proc() -> bool:
    return Path("/proc/self/stat").exists()


def reap(pid: int) -> None:
    """Collect ``pid``'s exit status if it is our child (no zombie left behind)."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def alive(pid: int, started: int) -> bool:
    """Whether the process started as ``pid`` at ``started`` is still running."""
    if pid <= 0:
        return False
    if not has_proc():  # pragma: no cover - keyscale targets Linux
        return pid_exists(pid)
    st = proc_stat(pid)
    if st is None:
        return False
    state, _pgrp, start = st
    if state in ("Z", "X"):
        reap(pid)
        return False
    return not (started and start != started)


def group_members(pgid: int, started: int) -> list[int]:
    """Running processes of the process group ``pgid`` (led by the process we started).

    If a process with PID ``pgid`` exists but is not the one we started, the group is
    someone else's: the kernel does not reuse a PID while it still names a process group,
    so our group is empty by then.
    """
    if not has_proc():  # pragma: no cover
        return [pgid] if alive(pgid, started) else []
    lead = proc_stat(pgid)
    if lead is not None and started and lead[2] != started:
        return []
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        st = proc_stat(int(entry.name))
        if st is not None and st[1] == pgid and st[0] not in ("Z", "X"):
            members.append(int(entry.name))
    return members


def wait_gone(pid: int, started: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while alive(pid, started):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def terminate(pid: int, started: int, *, grace: float, kill: bool) -> None:
    """Stop the daemon ``pid`` and everything in its process group (its executors)."""
    if not kill and alive(pid, started):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        wait_gone(pid, started, grace)
    deadline = time.monotonic() + max(grace, 5.0)
    while group_members(pid, started):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        if time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    reap(pid)


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on 127.0.0.1 right now."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((HOST, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def start_time(pid: int) -> int:
    st = proc_stat(pid)
    return st[2] if st else 0
