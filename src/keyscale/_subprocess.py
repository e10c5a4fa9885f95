"""Processes: child servers that keyscale starts for tests, examples and benchmarks
(SeaweedFS, Tansu), each in its own process group, stopped by that group, and killed with
the process that started it; and :func:`pid_exists`, the one probe of whether a pid is
running (the job directory's heartbeat, the cluster's and the deployment supervisor's
process records use it)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess


def pid_exists(pid: int) -> bool:
    """Whether a process ``pid`` exists: signal 0 reaches it, or it is another user's
    (``PermissionError``: alive, only not ours to signal).

    >>> pid_exists(os.getpid())
    True
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_group(process: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM to the process's own group, SIGKILL after ``grace`` s; idempotent. A group
    whose leader is gone is killed too (what is left in it is still ours)."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    else:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)


def die_with_parent() -> None:
    """In the child before exec: get SIGKILL when the starting process dies (Linux), so a
    run killed hard (CI timeout, kill -9) leaves no server behind with its ports taken."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
