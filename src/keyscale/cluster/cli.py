"""The ``keyscale cluster`` commands: a Spark standalone cluster on this machine.

``keyscale``'s parser registers them with :func:`add_cluster_parsers`::

    keyscale cluster start --dir D [--workers N] [--cores C] [--memory 1g]   # prints the master URL
    keyscale cluster start --dir D --isolated [--worker-user NAME]  # workers as another user (root only)
    keyscale cluster status --dir D [--json]
    keyscale cluster add-worker --dir D [--cores C] [--memory 1g]            # prints the worker's id
    keyscale cluster stop-worker --dir D WORKER_ID [--kill] [--grace S]
    keyscale cluster stop --dir D

Then run jobs on it with ``keyscale run JOB --master spark://127.0.0.1:PORT``. Each handler
returns an exit code and raises :class:`~keyscale.errors.ClusterError` for anything the
user can fix (the CLI prints it as one line).

>>> import argparse
>>> p = argparse.ArgumentParser(prog="keyscale")
>>> _ = add_cluster_parsers(p.add_subparsers(dest="command"))
>>> a = p.parse_args(["cluster", "stop-worker", "--dir", "c", "worker-2", "--kill"])
>>> a.func is cmd_stop_worker, a.worker_id, a.kill
(True, 'worker-2', True)
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from keyscale.cluster.local import (
    DEFAULT_GRACE,
    DEFAULT_TIMEOUT,
    ClusterStatus,
    add_worker,
    cluster_status,
    start_cluster,
    stop_cluster,
    stop_worker,
)

__all__ = [
    "add_cluster_parsers",
    "cmd_add_worker",
    "cmd_start",
    "cmd_status",
    "cmd_stop",
    "cmd_stop_worker",
    "format_status",
]


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def cmd_start(a: argparse.Namespace) -> int:
    info = start_cluster(a.dir, workers=a.workers, cores=a.cores, memory=a.memory, timeout=a.timeout,
                         isolated=a.isolated, worker_user=a.worker_user, class_archive=a.class_archive)  # fmt: skip
    as_user = f" running as user {info.worker_user}" if info.worker_user else ""
    as_user += f", executors starting with the class archive {info.executor_archive}" if info.executor_archive else ""
    print(
        f"keyscale: Spark master {info.master_url} (web UI {info.webui_url}) with "
        f"{_plural(len(info.workers), 'worker')} x {_plural(a.cores, 'core')}, {a.memory} each{as_user}; "
        f"logs and state in {info.folder}; run jobs with: keyscale run JOB --master {info.master_url}",
        file=sys.stderr,
    )
    print(info.master_url)
    return 0


def cmd_stop(a: argparse.Namespace) -> int:
    if stop_cluster(a.dir, grace=a.grace):
        print(f"keyscale: cluster in {a.dir} stopped", file=sys.stderr)
    else:
        print(f"keyscale: no cluster is running in {a.dir}; nothing to stop", file=sys.stderr)
    return 0


def format_status(st: ClusterStatus) -> str:
    """The text ``keyscale cluster status`` prints.

    >>> from pathlib import Path
    >>> print(format_status(ClusterStatus(Path("/c"), "spark://127.0.0.1:1", "http://127.0.0.1:2", False,
    ...                                   dead_processes=("master",))))
    cluster in /c: master spark://127.0.0.1:1 is not answering (processes gone: master)
    """
    if not st.running:
        gone = f" (processes gone: {', '.join(st.dead_processes)})" if st.dead_processes else ""
        return f"cluster in {st.folder}: master {st.master_url} is not answering{gone}"
    lines = [
        f"cluster in {st.folder}: master {st.master_url} (web UI {st.webui_url})",
        f"  {_plural(len(st.alive_workers), 'alive worker')}, {_plural(st.total_cores, 'core')} "
        f"({st.cores_used} in use); applications: {', '.join(st.applications) or 'none'}",
    ]
    for w in st.workers:
        lines.append(
            f"  {w.id or '-':10} {w.state:8} {_plural(w.cores, 'core'):8} ({w.cores_used} used) "
            f"{w.memory_mb} MB  {w.host}:{w.port}  {w.spark_id}"
        )
    if st.dead_processes:
        lines.append(f"  recorded but gone: {', '.join(st.dead_processes)}")
    return "\n".join(lines)


def cmd_status(a: argparse.Namespace) -> int:
    st = cluster_status(a.dir)
    print(json.dumps(st.to_dict(), indent=1) if a.json else format_status(st))
    return 0 if st.running else 1


def cmd_add_worker(a: argparse.Namespace) -> int:
    w = add_worker(a.dir, cores=a.cores, memory=a.memory, timeout=a.timeout)
    print(f"keyscale: {w.id} registered ({_plural(w.cores, 'core')}, {w.memory}, pid {w.pid}, log {w.log})", file=sys.stderr)
    print(w.id)
    return 0


def cmd_stop_worker(a: argparse.Namespace) -> int:
    w = stop_worker(a.dir, a.worker_id, kill=a.kill, grace=a.grace)
    how = "killed" if a.kill else "stopped"
    print(f"keyscale: {w.id} {how} ({_plural(w.cores, 'core')} gone)", file=sys.stderr)
    return 0


def add_cluster_parsers(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``cluster start|stop|status|add-worker|stop-worker`` on ``subparsers``."""
    c: argparse.ArgumentParser = subparsers.add_parser(
        "cluster", help="a Spark standalone cluster on this machine: start, stop, add or remove workers",
        description="A Spark standalone master and workers on 127.0.0.1, from the PySpark install; "
        "state (cluster.json), logs and work dirs in --dir.",
    )  # fmt: skip
    csub = c.add_subparsers(dest="cluster_command", required=True)

    def with_dir(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("--dir", required=True, metavar="D", help="the cluster's folder (cluster.json, logs, work dirs)")
        return p

    st = with_dir(csub.add_parser("start", help="start a master and workers; prints the master URL"))
    st.add_argument("--workers", type=int, default=1, help="number of workers (default 1)")
    st.add_argument("--cores", type=int, default=1, help="cores per worker (default 1)")
    st.add_argument("--memory", default="1g", help="memory per worker for executors (default 1g)")
    st.add_argument("--isolated", action="store_true",
                    help="run the workers and their executors as the user keyscale-worker (created if absent; needs root) "
                    "with their own dirs, so tasks cannot read the driver's private local files")
    st.add_argument("--worker-user", metavar="NAME", help="with --isolated: this user instead of keyscale-worker (implies --isolated)")
    st.add_argument("--class-archive", action="store_true",
                    help="executors start with a class archive of their own (D/executor-classes.jsa; the first start in a "
                    "folder makes it, about a minute): new executors come to speed sooner. Not with --isolated")
    st.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, help=argparse.SUPPRESS)
    st.set_defaults(func=cmd_start)

    so = with_dir(csub.add_parser("stop", help="stop the workers (and their executors) and the master"))
    so.add_argument("--grace", type=float, default=DEFAULT_GRACE, help="seconds before SIGKILL (default %(default)s)")
    so.set_defaults(func=cmd_stop)

    ss = with_dir(csub.add_parser("status", help="alive workers, cores and applications, as the master sees them"))
    ss.add_argument("--json", action="store_true")
    ss.set_defaults(func=cmd_status)

    aw = with_dir(csub.add_parser("add-worker", help="start one more worker; prints its id"))
    aw.add_argument("--cores", type=int, default=1, help="cores (default 1)")
    aw.add_argument("--memory", default="1g", help="memory for executors (default 1g)")
    aw.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, help=argparse.SUPPRESS)
    aw.set_defaults(func=cmd_add_worker)

    sw = with_dir(csub.add_parser("stop-worker", help="stop one worker and its executors, like a machine going away"))
    sw.add_argument("worker_id", metavar="WORKER_ID", help="as printed by start/add-worker/status, e.g. worker-2")
    sw.add_argument("--kill", action="store_true", help="SIGKILL at once (abrupt loss) instead of SIGTERM")
    sw.add_argument("--grace", type=float, default=DEFAULT_GRACE, help="seconds before SIGKILL (default %(default)s)")
    sw.set_defaults(func=cmd_stop_worker)
    return c
