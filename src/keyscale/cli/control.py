"""The commands that act on a job through its running process: ``keyscale rescale``,
``upgrade``, ``savepoint``, ``stop``, ``dashboard`` and ``cancel``.

Apart from ``keyscale run`` (:mod:`keyscale.cli.run`, the job's own process) and the
commands that only read (:mod:`keyscale.cli.status`) because each of these asks the
running job, through its control API (``POST`` with the job directory's secret), and waits
for what it asked for; ``rescale --restart --new-process`` and a stopped job's
``savepoint`` are the two that do the work here themselves.

>>> _savepoint_dest("s3://bucket/savepoints/sp-1")
's3://bucket/savepoints/sp-1'
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from keyscale.errors import KeyscaleError
from keyscale.storage import local_path, open_store, scheme_of


def _restart_rescale(a: argparse.Namespace) -> int:
    """Flink's `modify -p`: savepoint, stop, start again at the new parallelism."""
    import subprocess

    from keyscale.checkpoint.jobdir import JobDir, spark_cache_dir

    jd = JobDir(a.job_dir)
    run = jd.read_json("run.json")
    if not run:
        raise KeyscaleError(f"{jd.uri} does not say how its job was started (no run.json); restart it by hand with keyscale run")
    if not run.get("job_file"):
        raise KeyscaleError(f"the job in {jd.uri} was started from Python (Pipeline.start), not from a job file: "
                            "rescale it live (keyscale rescale DIR N, or handle.rescale(n)), or stop it and start it again from Python")
    if not getattr(a, "new_process", False):
        return _restart_in_place(a, jd, job_file=getattr(a, "new_job_file", None))
    # The job takes the savepoint before it stops; if that fails it keeps running untouched.
    resp = _ask_running_job(a.job_dir, "/stop", a.timeout, savepoint=True)
    print(f"keyscale: savepoint {resp['savepoint']} taken; stopping the job", file=sys.stderr)
    _wait_for_exit(a.job_dir, a.timeout)
    argv = [sys.executable, "-m", "keyscale.cli.main", "run", run["job_file"], "--job-dir", jd.uri, "-p", str(a.parallelism),
            "--master", run["master"], "--trigger-interval", run["trigger_interval"], "--retain", str(run["retain"]),
            "--compaction-chain", str(run["compaction_chain"]), "--state-backend", run.get("state_backend", "memory")]
    argv += ["--until-idle"] if run["until_idle"] else []
    argv += ["--async-checkpoints"] if run.get("async_checkpoints") else []
    argv += ["--wait-for-trigger"] if run.get("wait_for_trigger") else []
    argv += ["--latency-target", str(run["latency_target"])] if run.get("latency_target") else []
    for flag in ("control_host", "control_port", "metrics_token_file"):  # the environment's KEYSCALE_* are inherited
        if run.get(flag) is not None:
            argv += [f"--{flag.replace('_', '-')}", str(run[flag])]
    argv += ["--metrics-unauthenticated"] if run.get("metrics_unauthenticated") else []
    for opt in a.storage_option or []:
        argv += ["--storage-option", opt]
    for k, v in run["args"].items():
        argv += ["--set", f"{k}={v}"]
    for k, v in run.get("spark_conf", {}).items():
        argv += ["--conf", f"{k}={v}"]
    # Resumes from the checkpoint the savepoint was taken of (the same state); the savepoint stays as a fallback.
    job_log = (jd.path if jd.is_local else spark_cache_dir(jd.uri)) / "job.log"  # this host's log of the process it starts
    job_log.parent.mkdir(parents=True, exist_ok=True)
    with open(job_log, "a") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + a.timeout
    while not jd.is_running():
        if proc.poll() is not None:
            raise KeyscaleError(f"the restarted job exited with code {proc.returncode}; see {job_log} (savepoint: {resp['savepoint']})")
        if time.time() > deadline:
            raise KeyscaleError(f"the restarted job did not start within {a.timeout:.0f} s; see {job_log}")
        time.sleep(0.2)
    print(f"keyscale: job restarted at parallelism {a.parallelism} (pid {proc.pid}, log {job_log})")
    return 0


def _restart_in_place(a: argparse.Namespace, jd: Any, job_file: str | None) -> int:
    """Restart without a new JVM: the running `keyscale run` takes a savepoint, ends its query
    and starts the job again in the same Spark application (executors kept)."""
    from keyscale.runtime.control.server import call

    p = getattr(a, "parallelism", None)
    body: dict[str, Any] = {"parallelism": p}
    if job_file:
        body["job_file"] = str(os.path.abspath(job_file))
    resp = _ask_running_job(a.job_dir, "/restart", a.timeout, **body)
    print(f"keyscale: savepoint {resp['savepoint']} taken; restarting in the same Spark application", file=sys.stderr)
    deadline = time.time() + a.timeout
    while time.time() < deadline:
        time.sleep(0.2)
        try:
            st = call(jd, "GET", "/status", timeout=5)
        except KeyscaleError:
            continue  # between the two runs: no control API for a moment
        if st.get("state") == "running" and (p is None or all(o.get("parallelism") == p for o in st.get("operators", {}).values()
                                                              if "ranges" in o)):
            print(f"keyscale: job restarted{f' at parallelism {p}' if p else ''} (same process, pid {st.get('pid')})")
            return 0
        if st.get("state") == "failed":
            break
    raise KeyscaleError(f"the job in {jd.uri} did not restart within {a.timeout:.0f} s (savepoint: {resp['savepoint']}); see keyscale status {a.job_dir}")


def cmd_upgrade(a: argparse.Namespace) -> int:
    """A new version of the job's code, restarted in the same Spark application from its checkpoint."""
    from keyscale.checkpoint.jobdir import JobDir

    jd = JobDir(a.job_dir)
    if not jd.is_running():
        raise KeyscaleError(f"no job is running in {jd.uri}; start the new code with keyscale run {a.job_file} --job-dir {a.job_dir}")
    return _restart_in_place(a, jd, job_file=a.job_file)


def cmd_rescale(a: argparse.Namespace) -> int:
    from keyscale.checkpoint.jobdir import JobDir
    from keyscale.state.keygroups import check_parallelism

    jd = JobDir(a.job_dir)
    ident = jd.identity()
    check_parallelism(a.parallelism, ident.max_parallelism)
    if a.restart:
        return _restart_rescale(a)
    if not jd.is_running():
        raise KeyscaleError(
            f"job in {jd.uri} is not running; restart it at the new parallelism with: keyscale run JOBFILE --job-dir {a.job_dir} -p {a.parallelism}"
        )
    before = jd.latest_manifest()
    _ask_running_job(a.job_dir, "/rescale", 60, parallelism=a.parallelism, operator=a.operator)
    print(f"keyscale: asked job '{ident.name}' to rescale{' ' + repr(a.operator) if a.operator else ''} to {a.parallelism}; it applies between two batches")
    if a.wait:
        deadline = time.time() + a.wait
        start = before.batch if before else -1
        while time.time() < deadline:
            m = jd.latest_manifest()
            if m and m.batch > start and all(op.parallelism == a.parallelism for uid, op in m.operators.items() if a.operator in (None, uid)):
                print(f"keyscale: batch {m.batch} ran at parallelism {a.parallelism}")
                return 0
            time.sleep(0.2)
        raise KeyscaleError(f"no batch ran at parallelism {a.parallelism} within {a.wait} s (the job may be idle)")
    return 0


def _ask_running_job(job_dir: str, path: str, timeout: float, **body: Any) -> dict[str, Any]:
    from keyscale.checkpoint.jobdir import JobDir
    from keyscale.runtime.control.server import call

    jd = JobDir(job_dir)
    jd.identity()
    if not jd.is_running():
        raise KeyscaleError(f"no job is running in {jd.uri}")
    return call(jd, "POST", path, body, timeout=timeout)


def _wait_for_exit(job_dir: str, timeout: float) -> None:
    from keyscale.checkpoint.jobdir import JobDir

    jd = JobDir(job_dir)
    deadline = time.time() + timeout
    while jd.is_running():
        if time.time() > deadline:
            raise KeyscaleError(f"the job in {jd.uri} has not stopped within {timeout:.0f} s")
        time.sleep(0.2)


def _savepoint_dest(dest: str | None) -> str | None:
    """A ``--dest`` as the running job must see it: a relative local path is made absolute
    here (the job runs in its own working directory); URIs stay as they are."""
    if dest is None or scheme_of(dest) is not None:
        return dest
    return str(local_path(dest, "savepoint destination"))


def cmd_savepoint(a: argparse.Namespace) -> int:
    from keyscale.checkpoint.jobdir import JobDir
    from keyscale.checkpoint.savepoint import text_progress, write_savepoint

    jd = JobDir(a.job_dir)
    ident = jd.identity()
    dest = _savepoint_dest(a.dest)
    if jd.is_running():
        resp = _ask_running_job(a.job_dir, "/savepoint", a.timeout, dest=dest)
        print(resp["savepoint"])
        return 0
    with jd.locked():
        rec = jd.recover()
        if rec.manifest is None:
            raise KeyscaleError(f"job '{ident.name}' in {jd.uri} has no checkpoint to save")
        default = f"savepoints/savepoint-{rec.manifest.batch:012d}-{int(time.time() * 1000)}"
        target = open_store(dest, "savepoint destination") if dest else jd.store.sub(default)
        path = write_savepoint(jd, rec.manifest, target, progress=text_progress("savepoint"))
    print(path)
    return 0


def cmd_stop(a: argparse.Namespace) -> int:
    resp = _ask_running_job(a.job_dir, "/stop", a.timeout, savepoint=a.savepoint or a.drain, drain=a.drain, dest=_savepoint_dest(a.dest))
    if resp.get("savepoint"):
        print(resp["savepoint"])
    _wait_for_exit(a.job_dir, a.timeout)
    print(f"keyscale: job in {a.job_dir} stopped", file=sys.stderr)
    return 0


def cmd_dashboard(a: argparse.Namespace) -> int:
    """A one-time link to the running job's dashboard (the browser cannot send the secret)."""
    resp = _ask_running_job(a.job_dir, "/ui/token", 30)
    print(resp["url"])
    print(f"keyscale: open this link within {resp['expires_in_seconds']:.0f} s; it works once and logs this browser in "
          "until the job stops", file=sys.stderr)
    return 0


def cmd_cancel(a: argparse.Namespace) -> int:
    _ask_running_job(a.job_dir, "/cancel", a.timeout)
    _wait_for_exit(a.job_dir, a.timeout)
    print(f"keyscale: job in {a.job_dir} cancelled", file=sys.stderr)
    return 0
