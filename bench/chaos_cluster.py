"""A standalone cluster for ``bench/chaos.py`` (``--cluster N``, issue 32): keyscale's own
``keyscale cluster`` code starts a master and N one-core workers in the work folder, every
start of the job runs on it (``--master spark://...``), and the fault ``kill-executor``
SIGKILLs one executor JVM of the job's application while it runs a batch.

An executor that vanishes mid-stage takes its running tasks and its shuffle files with it
(no external shuffle service): Spark reruns the lost tasks, and a later stage that needs the
lost map output fails with ``FetchFailed`` and its parent stage is submitted again, with
attempt numbers of its tasks starting at 0 again (issue 32, case 5). The standalone master
starts a new executor for the application on the freed worker. :func:`stage_retries` counts
what Spark's scheduler recorded about it in its event log (:func:`event_log_conf`).

Executors are found in the worker's process group (the worker JVM leads it; its executors
and their Python workers are in it), and only those whose command line names the job's
current application (the master's newest running one: a paused run's older application
keeps its executors, and they are not the fault's target).
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from typing import Any

from procs import cmdline, ppid

EXECUTOR_CLASS = "CoarseGrainedExecutorBackend"


class ChaosCluster:
    """``workers`` one-core workers (1 GB each: one 512 MB executor per worker) in ``folder``."""

    def __init__(self, folder: Path, workers: int) -> None:
        from keyscale.cluster import start_cluster

        self.folder = folder
        self.info = start_cluster(folder, workers=workers, cores=1, memory="1g")

    @property
    def master_url(self) -> str:
        return self.info.master_url

    def current_app(self) -> str | None:
        """The id of the newest running application (the job's current run)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.info.webui_port}/json/", timeout=5) as resp:
                data: dict[str, Any] = json.loads(resp.read().decode())
        except (OSError, ValueError):
            return None
        apps = [a for a in data.get("activeapps", []) if a.get("state") in ("RUNNING", "WAITING")]
        return str(max(apps, key=lambda a: a.get("starttime", 0))["id"]) if apps else None

    def processes(self) -> list[int]:
        """Every process of every worker's group: workers, executors, Python workers."""
        from keyscale.cluster import read_cluster
        from keyscale.cluster.processes import group_members

        info = read_cluster(self.folder)
        return [p for w in (info.workers if info else ()) for p in group_members(w.pid, w.started)]

    def executors(self, app: str) -> list[int]:
        """The executor JVMs of application ``app``."""
        return [p for p in self.processes() if EXECUTOR_CLASS in (c := cmdline(p)) and f"--app-id {app}" in c]

    def python_workers(self, app: str) -> list[int]:
        """The Python workers (``pyspark.daemon`` and its forks) under ``app``'s executors."""
        return [p for ps in self.python_workers_by_executor(app).values() for p in ps]

    def busy_executors(self, app: str, window: float = 0.5) -> list[int]:
        """``app``'s executors whose Python workers used CPU during ``window`` seconds: they
        are running tasks of a stage (keyscale's stages run Python; an idle executor's
        Python daemon uses none, while the JVM alone can, for its JIT and GC)."""
        by_exec = self.python_workers_by_executor(app)
        before = {e: cpu_ticks(ps) for e, ps in by_exec.items()}
        time.sleep(window)
        return [e for e, ps in by_exec.items() if cpu_ticks(ps) - before[e] >= 3]

    def python_workers_by_executor(self, app: str) -> dict[int, list[int]]:
        execs = set(self.executors(app))
        out: dict[int, list[int]] = {e: [] for e in execs}
        for p in self.processes():
            c = cmdline(p)
            if "pyspark.daemon" not in c and "pyspark.worker" not in c:
                continue
            parent: int | None = p
            for _ in range(4):  # daemon -> executor, or fork -> daemon -> executor
                parent = ppid(parent) if parent is not None else None
                if parent is None:
                    break
                if parent in execs:
                    out[parent].append(p)
                    break
        return out

    def stop(self) -> None:
        from keyscale.cluster import stop_cluster

        stop_cluster(self.folder, grace=5.0)


def event_log_conf(folder: Path) -> list[str]:
    """``keyscale run`` options that make Spark write its event log into ``folder``: the
    scheduler's own record of every task's end (with its failure reason) and every stage
    attempt, which the driver's console log does not give (keyscale turns Spark's task
    failure reports off unless Spark's log is verbose)."""
    folder.mkdir(parents=True, exist_ok=True)
    return ["--conf", "spark.eventLog.enabled=true", "--conf", "spark.eventLog.compress=false", "--conf", f"spark.eventLog.dir=file://{folder}"]


def stage_retries(folder: Path) -> dict[str, int]:
    """From the Spark event logs in ``folder`` (one file per application): executors removed,
    tasks that ended with ``ExecutorLostFailure`` or ``FetchFailed``, and stage attempts
    after the first (``Stage Attempt ID`` >= 1: a stage resubmitted after lost map output)."""
    out = {"applications": 0, "executors_removed": 0, "tasks_executor_lost": 0, "tasks_fetch_failed": 0, "stage_retries": 0}
    # Spark 4 writes rolling event logs: a folder per application, ``events_<n>_<app>`` files in it.
    for f in sorted(folder.rglob("events_*")) if folder.exists() else []:
        out["applications"] += f.name.startswith("events_1_")
        with open(f, errors="replace") as lines:
            for line in lines:
                if '"SparkListenerTaskEnd"' in line and '"Reason"' in line:
                    reason = json.loads(line).get("Task End Reason", {}).get("Reason")
                    if reason == "ExecutorLostFailure":
                        out["tasks_executor_lost"] += 1
                    elif reason == "FetchFailed":
                        out["tasks_fetch_failed"] += 1
                elif '"SparkListenerStageSubmitted"' in line:
                    if int(json.loads(line).get("Stage Info", {}).get("Stage Attempt ID", 0)) >= 1:
                        out["stage_retries"] += 1
                elif '"SparkListenerExecutorRemoved"' in line:
                    out["executors_removed"] += 1
    return out


def cpu_ticks(pids: list[int]) -> int:
    """CPU time (user + system, clock ticks) the processes used so far."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            rest = stat[stat.rindex(")") + 2:].split()
            total += int(rest[11]) + int(rest[12])
        except (OSError, ValueError, IndexError):
            continue
    return total
