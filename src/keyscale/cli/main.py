"""The ``keyscale`` command: run and control jobs, savepoints, deployments, the autoscaler simulator.

The module's size is earned: one short handler per subcommand and the argparse table
(:func:`build_parser`) the CLI reference is generated from."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

from keyscale._logging import configure_logging
from keyscale.errors import KeyscaleError, cli_exit
from keyscale.runtime.control.jobstatus import find_jobs, status_dict
from keyscale.runtime.control.settings import add_control_arguments, control_options
from keyscale.runtime.driver.session import parse_spark_conf
from keyscale.storage import local_path, open_store, scheme_of


def _autoscaler_config(options: list[str], lo: int, hi: int | None) -> Any:
    """AutoscalerConfig from ``--autoscaler-option NAME=VALUE`` (field names of AutoscalerConfig)."""
    import dataclasses

    from keyscale.scaling.policy import AutoscalerConfig

    fields = {f.name: f for f in dataclasses.fields(AutoscalerConfig)}
    values: dict[str, Any] = {"min_parallelism": lo, "max_parallelism": hi}
    for opt in options:
        name, sep, raw = opt.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or name not in fields:
            raise KeyscaleError(f"--autoscaler-option {opt!r}: expected NAME=VALUE with NAME one of {', '.join(sorted(fields))}")
        default = getattr(AutoscalerConfig(), name)
        try:
            values[name] = (raw.lower() in ("1", "true", "yes")) if isinstance(default, bool) else type(default)(raw) if default is not None else int(raw)
        except ValueError:
            raise KeyscaleError(f"--autoscaler-option {opt!r}: {raw!r} is not a valid value for {name}") from None
    try:
        return AutoscalerConfig(**values)
    except ValueError as e:
        raise KeyscaleError(f"autoscaler options: {e}") from None


def _slo(text: str | None) -> Any:
    """``--slo`` parsed (an error names the text), or None."""
    from keyscale.scaling.slo import parse_slo

    return None if text is None else parse_slo(text)


def cmd_run(a: argparse.Namespace) -> int:
    from keyscale.checkpoint.jobdir import JobDir
    from keyscale.runtime.control.server import control_api
    from keyscale.runtime.driver.jobargs import parse_sets, resolve_args
    from keyscale.runtime.driver.runner import JobRunner, RunOptions

    args = resolve_args(JobDir(a.job_dir), parse_sets(a.set), a.unset, use_kept=not a.no_stored_args)
    opts = RunOptions(
        job_file=a.job_file, job_dir=a.job_dir, parallelism=a.parallelism, max_parallelism=a.max_parallelism,
        master=a.master, until_idle=a.until_idle, args=args, trigger_interval=a.trigger_interval,
        retain=a.retain, max_chain=a.compaction_chain, max_file_age=a.max_file_age, fault=a.fault,
        from_savepoint=a.from_savepoint, allow_non_restored_state=a.allow_non_restored_state,
        allow_empty_restart=a.allow_empty_restart,
        scaling=a.scaling, autoscaler_mode=a.autoscaler, drain_at_end=a.drain_at_end,
        scaling_min=a.scaling_min, scaling_max=a.scaling_max,
        autoscaler=_autoscaler_config(a.autoscaler_option, a.scaling_min, a.scaling_max), slo=_slo(a.slo),
        spark_conf=parse_spark_conf(a.conf), state_backend=a.state_backend, async_checkpoints=a.async_checkpoints,
        latency_target=a.latency_target, wait_for_trigger=a.wait_for_trigger, **control_options(a),
    )
    log = logging.getLogger("keyscale")
    while True:
        runner = JobRunner(opts, serve=control_api(opts))

        def _graceful(signum: int, _frame: Any, runner: JobRunner = runner) -> None:
            log.info("received %s; stopping after the current batch", signal.Signals(signum).name)
            runner.stop()

        signal.signal(signal.SIGTERM, _graceful)
        signal.signal(signal.SIGINT, _graceful)
        s = runner.run()
        req = runner.restart_request
        if req is None:
            break
        # keyscale rescale --restart / keyscale upgrade: the same process, JVM and executors;
        # only the query starts again, from the checkpoint the savepoint was taken of.
        opts = dataclasses.replace(opts, parallelism=req["parallelism"] or opts.parallelism, job_file=req["job_file"] or opts.job_file,
                                   from_savepoint=None, fault=None)
        log.info("restarting job '%s' in the same Spark application (parallelism %s, %s)", s.job, opts.parallelism or "as checkpointed", opts.job_file)
    rescales = "; ".join(f"batch {b}: '{u}' {f}->{t}" for b, u, f, t in s.rescales) or "none"
    print(
        f"keyscale: job '{s.job}' processed {len(s.batches)} batches ({s.records:,} records); "
        f"replays skipped: {len(s.skipped)}; live rescales: {rescales}; "
        f"parallelism now {', '.join(f'{u}={p}' for u, p in s.parallelism.items())}"
    )
    return 0


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
    print(f"keyscale: asked job '{ident.name}' to rescale{' ' + repr(a.operator) if a.operator else ''} to {a.parallelism}; it applies at the next batch")
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


def cmd_ui(a: argparse.Namespace) -> int:
    """Serve the folder page until interrupted."""
    from keyscale.cli.folder import FolderServer

    find_jobs(a.folder)  # a folder that is not one fails now, with its name
    server = FolderServer(a.folder, a.port)
    print(server.login_url)
    print(f"keyscale: the jobs under {a.folder}; open this link within 2 minutes (it works once); Ctrl-C to stop", file=sys.stderr)
    def _interrupt(_signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _interrupt)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
    return 0


def cmd_cancel(a: argparse.Namespace) -> int:
    _ask_running_job(a.job_dir, "/cancel", a.timeout)
    _wait_for_exit(a.job_dir, a.timeout)
    print(f"keyscale: job in {a.job_dir} cancelled", file=sys.stderr)
    return 0


def cmd_status(a: argparse.Namespace) -> int:
    from keyscale.runtime.task import counters

    st = status_dict(a.job_dir)
    if a.json:
        print(json.dumps(st, indent=1))
        return 0
    state = f"{st['state']} (pid {st['pid']})" if st["running"] else st["state"]
    print(f"job '{st['job']}' in {st['job_dir']}: {state}")
    if st["state"] == "failed" and st["last_error"]:
        err = st["last_error"]
        print(f"  failed at batch {err['batch']} ({time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(err['time_ms'] / 1000))} UTC): {err['message']}")
        print("  (the traceback: keyscale status --json)")
    if st["pending_rescale"]:
        want = ", ".join(f"{'all operators' if u == '*' else repr(u)} -> {p}" for u, p in st["pending_rescale"]["parallelism"].items())
        print(f"  rescale pending (applied at the next batch): {want}")
    committing = f" (batch {st['checkpoint_committing']} committing)" if st.get("checkpoint_committing") is not None else ""
    print(f"  max parallelism (key groups): {st['max_parallelism']}; last checkpoint: {st['last_checkpoint']}{committing}; "
          f"kept: {st['checkpoints']}")
    if "watermark" in st:
        print(f"  watermark: {st['watermark']}")
    lat = st.get("latency")
    if lat:
        print(f"  end-to-end latency (batch {lat['batch']}, {lat['records']:,} records, from {lat['append_time']}): "
              f"p50 {lat['p50_seconds']:.3f} s, p99 {lat['p99_seconds']:.3f} s, max {lat['max_seconds']:.3f} s")
    size = st.get("batch_size")
    if size:
        limit = "no limit" if size["records"] is None else f"at most {size['records']:,} records ({size['limited_by']})"
        print(f"  batch size for the {size['target_seconds']:g} s latency target: {limit}; target met: {'yes' if size['meets_target'] else 'no'}: {size['reason']}")
    sc = st.get("scaling") or {}
    if sc.get("slo"):
        share = "not measured yet" if sc.get("slo_attainment") is None else f"{sc['slo_attainment']:.1%} of {sc['slo_batches']} batches within it"
        print(f"  autoscaler ({sc.get('autoscaler')}), SLO {sc['slo']}: {share}")
        for uid, d in sc.get("last_decisions", {}).items():
            print(f"    '{uid}', batch {d.get('batch')}: {d.get('reason')}")
    for uid, total in st["counters"]["total"].items():
        last = st["counters"]["last_batch"].get(uid)
        print(f"  records not processed normally by '{uid}': {counters.summary(total)} in all" + (f"; last batch: {counters.summary(last)}" if last else ""))
    for uid, op in st["operators"].items():
        if "operator_state" in op:
            ostate = op["operator_state"]
            lag = f", lag {op['lag']:,} records" if "lag" in op else ""
            print(f"  operator '{uid}': parallelism {op['parallelism']} (operator state){lag}")
            for i, parts in enumerate(ostate.get("readers", [])):
                print(f"    reader {i}: " + (", ".join(f"partition {p} at offset {o:,}" for p, o in parts.items()) or "no partitions"))
            for name, e in ostate.items():
                if isinstance(e, dict) and "mode" in e:
                    print(f"    list state '{name}' ({e['mode']}): entries per subtask {e['entries_per_subtask']}")
            if "broadcast_entries" in ostate:
                print(f"    broadcast state: {ostate['broadcast_entries']} entries")
            continue
        print(f"  operator '{uid}': parallelism {op['parallelism']}, states {op['states']}, {op['state_files']} state files")
        for s in op["subtasks"]:
            keys = f", {s['state_keys']:,} keys" if "state_keys" in s else ""
            print(f"    subtask {s['subtask']}: key groups {s['key_groups']}, ~{s['state_bytes']:,} bytes{keys}")
    for o in st.get("outputs", []):
        of = f" of '{o['from']}'" if o["from"] else ""
        print(f"  {'output' if o['kind'] == 'output' else o['kind']}{of}: {o['sink']}")
    return 0


def cmd_list(a: argparse.Namespace) -> int:
    found = find_jobs(a.folder)
    if not found:
        print(f"no keyscale jobs under {a.folder}")
        return 0
    print(f"{'job':24} {'state':12} {'checkpoint':>10}  parallelism  directory")
    for d in found:
        try:
            st = status_dict(str(d))
        except KeyscaleError as e:
            print(f"{'?':24} {'unreadable':12} {'':>10}  {'':11}  {d} ({e})")
            continue
        par = ", ".join(f"{u}={o['parallelism']}" for u, o in st["operators"].items()) or "-"
        state = st["state"]
        last = "-" if st["last_checkpoint"] is None else str(st["last_checkpoint"])
        print(f"{st['job']:24} {state:12} {last:>10}  {par:11}  {d}")
    return 0


def cmd_inspect(a: argparse.Namespace) -> int:
    from keyscale.state_processor import inspect_savepoint

    print(inspect_savepoint(a.savepoint))
    return 0


def cmd_state_get(a: argparse.Namespace) -> int:
    from keyscale.state_processor import StateLookup

    answers = StateLookup(a.job_dir).get_many(a.uid, a.keys, a.checkpoint)
    for answer in answers:
        print(json.dumps(answer, indent=None if a.compact else 2, ensure_ascii=False))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="keyscale", description="Elastic, stateful stream processing on Spark.")
    p.add_argument("-v", "--verbose", action="store_true", help="show Spark's warnings too")
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="run a job file")
    r.add_argument("job_file")
    r.add_argument("--job-dir", required=True, help="the job's state and checkpoints")
    r.add_argument("-p", "--parallelism", type=int, help="subtasks per keyed operator (default: as checkpointed, else 1)")
    r.add_argument("--max-parallelism", type=int, help="number of key groups, fixed at the first run")
    r.add_argument("--master", default="local[2]", help="Spark master URL (default local[2])")
    r.add_argument("--until-idle", action="store_true", help="process all available input, then exit")
    r.add_argument("--drain-at-end", action="store_true",
                   help="with --until-idle: end with a drain batch (watermark at the end of time: every timer and window fires)")
    r.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="an argument for the job, read in build() with ctx.arg(NAME) (repeatable). A name the job does not "
                        "read is an error. A job directory keeps the arguments of its last successful start (its first batch "
                        "committed, or it ended without an error) and a later run reuses them: give --set only to change one")
    r.add_argument("--unset", action="append", default=[], metavar="NAME",
                   help="drop an argument the job directory keeps from its last successful start (repeatable)")
    r.add_argument("--no-stored-args", action="store_true",
                   help="use only this command's --set arguments, none of those the job directory keeps "
                        "(deployments pass this: their file lists every argument)")
    r.add_argument("--conf", action="append", default=[], metavar="NAME=VALUE",
                   help="a Spark setting for the job's session (repeatable); wins over keyscale's defaults (docs/reference/spark-settings.md)")
    r.add_argument("--trigger-interval", default="1 second",
                   help="a log source's job runs a batch at least this often, and back to back while records wait (default 1 second)")
    r.add_argument("--wait-for-trigger", action="store_true",
                   help="a log source's job runs one batch per trigger interval at most, as Spark's processing-time trigger "
                        "(default: the next batch starts as soon as records wait)")
    r.add_argument("--latency-target", metavar="DURATION",
                   help="size a log source's batches for this end-to-end latency (e.g. 1s, 500ms): each batch reads at most what "
                        "half of it allows, and never less than keeps up with the input; a source's own max_records_per_batch, "
                        "if smaller, stays (the status's batch_size says which limit holds)")
    r.add_argument("--retain", type=int, default=3, help="checkpoints to keep (default 3)")
    r.add_argument("--compaction-chain", type=int, default=8, metavar="N",
                   help="write a snapshot of a subtask's key groups when restoring them would read N files (default 8)")
    r.add_argument("--async-checkpoints", action="store_true",
                   help="a batch's state files upload while the next batch runs; its checkpoint commits once they are stored "
                        "(docs/guides/async-checkpoints.md)")
    r.add_argument("--state-backend", choices=["memory", "rocksdb"], default="memory",
                   help="where keyed stages keep their state: memory (default) or rocksdb on the executors' local disk "
                        "(a stage's own state_backend= wins; docs/guides/state-backends.md)")
    r.add_argument("--scaling", choices=["fixed", "reactive", "auto"], default="fixed",
                   help="reactive: parallelism follows the executor cores Spark has; auto: the autoscaler watches every batch (default fixed)")
    r.add_argument("--scaling-min", type=int, default=1, metavar="N", help="lowest parallelism reactive mode and the autoscaler choose (default 1)")
    r.add_argument("--scaling-max", type=int, metavar="N", help="highest parallelism they choose (default: the number of key groups)")
    r.add_argument("--autoscaler-option", action="append", default=[], metavar="NAME=VALUE",
                   help="an autoscaler setting, e.g. stabilization_seconds=10 or scale_down_delay_seconds=30 (see AutoscalerConfig)")
    r.add_argument("--slo", metavar="KIND=DURATION",
                   help="with --scaling auto: the target the autoscaler sizes for, 'latency=5s' (p99 end to end over its "
                        "metrics window) or 'lag=30s' (age of the oldest unread record); it then forecasts the input rate "
                        "from the job's history and scales ahead of it")
    r.add_argument("--autoscaler", choices=["off", "recommend", "active"], default="recommend",
                   help="with --scaling auto: recommend records decisions (status, events.jsonl) without acting; active applies them live")
    r.add_argument("--from-savepoint", metavar="SP", help="start a new job directory from a savepoint (any -p in 1..M)")
    r.add_argument("--allow-non-restored-state", action="store_true", help="drop state of operators the job no longer has")
    r.add_argument("--max-file-age", type=int, default=32, metavar="BATCHES",
                   help="a subtask writes a snapshot when its oldest state file is this many batches old (bounds a fallback's replay; default 32)")
    r.add_argument("--allow-empty-restart", action="store_true",
                   help="when no intact checkpoint is left, start again with empty state and read the input again from its beginning")
    add_control_arguments(r)
    r.add_argument("--fault", help=argparse.SUPPRESS)
    r.set_defaults(func=cmd_run)

    rs = sub.add_parser("rescale", help="change a running job's parallelism at its next batch")
    rs.add_argument("job_dir")
    rs.add_argument("-p", "--parallelism", type=int, required=True)
    rs.add_argument("--operator", help="only this operator uid (default: all keyed operators)")
    rs.add_argument("--wait", type=float, default=0, help="wait up to this many seconds for a batch at the new parallelism")
    rs.add_argument("--restart", action="store_true",
                    help="instead of live: savepoint, end the query, start it again at the new parallelism in the same Spark application")
    rs.add_argument("--new-process", action="store_true", help="with --restart: a new keyscale run process (a new JVM) instead")
    rs.add_argument("--timeout", type=float, default=600, help=argparse.SUPPRESS)
    rs.set_defaults(func=cmd_rescale)

    up = sub.add_parser("upgrade", help="run new code of a running job: savepoint, then restart in the same Spark application")
    up.add_argument("job_dir")
    up.add_argument("job_file", help="the new job file (same NAME and operator uids: its state is restored by uid)")
    up.add_argument("-p", "--parallelism", type=int, help="also change the parallelism")
    up.add_argument("--timeout", type=float, default=600, help=argparse.SUPPRESS)
    up.set_defaults(func=cmd_upgrade)

    st = sub.add_parser("status", help="parallelism, checkpoints, key-group ranges and state size")
    st.add_argument("job_dir")
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=cmd_status)

    sp = sub.add_parser("savepoint", help="take a savepoint (running job: at its next batch boundary; stopped job: of its last checkpoint)")
    sp.add_argument("job_dir")
    sp.add_argument("--dest", help="where to write the savepoint: a folder, file:// or s3:// location (default JOB_DIR/savepoints/savepoint-<batch>-<time>)")
    sp.add_argument("--timeout", type=float, default=600)
    sp.set_defaults(func=cmd_savepoint)

    so = sub.add_parser("stop", help="stop a running job at a batch boundary")
    so.add_argument("job_dir")
    so.add_argument("--savepoint", action="store_true", help="take a savepoint first and print its path")
    so.add_argument("--drain", action="store_true",
                    help="end with one more batch whose watermark is at the end of time (every event-time timer and window fires), then a savepoint; the job cannot resume after it")
    so.add_argument("--dest", help="where to write the savepoint: a folder, file:// or s3:// location")
    so.add_argument("--timeout", type=float, default=600)
    so.set_defaults(func=cmd_stop)

    da = sub.add_parser("dashboard", help="print a one-time link to a running job's web dashboard")
    da.add_argument("job_dir")
    da.set_defaults(func=cmd_dashboard)

    ui = sub.add_parser("ui", help="a web page of every job under a folder, linking to their dashboards")
    ui.add_argument("folder")
    ui.add_argument("--port", type=int, default=0, help="default: any free port")
    ui.set_defaults(func=cmd_ui)

    ca = sub.add_parser("cancel", help="stop a running job without a savepoint")
    ca.add_argument("job_dir")
    ca.add_argument("--timeout", type=float, default=120)
    ca.set_defaults(func=cmd_cancel)

    ls = sub.add_parser("list", help="jobs under a folder: running or not, last checkpoint, parallelism")
    ls.add_argument("folder", nargs="?", default=".")
    ls.set_defaults(func=cmd_list)

    ins = sub.add_parser("inspect", help="summarise a savepoint: operators, states, keys and bytes per key-group range")
    ins.add_argument("savepoint", help="the savepoint: a folder, file:// or s3:// location")
    ins.set_defaults(func=cmd_inspect)

    sta = sub.add_parser("state", help="look at a job's keyed state")
    state_sub = sta.add_subparsers(dest="state_command", required=True)
    sg = state_sub.add_parser(
        "get", help="what keys of an operator hold at the last committed checkpoint (JSON, one answer per key)",
        description="Reads only each key's key group of the checkpoint's state files, by byte range (local disk or "
                    "object store), whether the job runs or not. A key without state answers found: false.")
    sg.add_argument("job_dir")
    sg.add_argument("--uid", required=True, help="the keyed operator's uid")
    sg.add_argument("keys", nargs="+", metavar="KEY",
                    help="a key, parsed as the operator's key type (a key of several columns as a JSON array: '[\"ann\", 3]')")
    sg.add_argument("--checkpoint", type=int, metavar="BATCH", help="this committed checkpoint instead of the last one")
    sg.add_argument("--compact", action="store_true", help="one line of JSON per key")
    sg.set_defaults(func=cmd_state_get)
    from keyscale.cli.state import add_state_edit_parsers

    state_edits = add_state_edit_parsers(state_sub)

    from keyscale.deploy.cli import add_apply_parser, add_deployment_parsers

    add_apply_parser(sub)
    add_deployment_parsers(sub)

    from keyscale.cluster.cli import add_cluster_parsers

    add_cluster_parsers(sub)

    from keyscale.cli.log import add_log_parsers
    add_log_parsers(sub)

    from keyscale.scaling.simulate import add_simulate_parser

    for located in (r, rs, st, sp, so, ca, ls, ins, sg, *state_edits):  # every command that opens a job dir, savepoint or folder
        located.add_argument(
            "--storage-option", action="append", default=[], metavar="KEY=VALUE",
            help="object store setting (obstore config key, e.g. endpoint=http://127.0.0.1:9000, region=eu-west-1); "
                 "after the AWS_*/GOOGLE_*/AZURE_* environment variables",
        )
    auto = sub.add_parser("autoscaler", help="the autoscaler's policy, without Spark")
    add_simulate_parser(auto.add_subparsers(dest="autoscaler_command", required=True))
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    configure_logging()
    from keyscale.storage import parse_storage_options, set_storage_options

    if a.verbose:
        os.environ["KEYSCALE_SPARK_LOG_LEVEL"] = "WARN"
    try:
        set_storage_options(parse_storage_options(getattr(a, "storage_option", None) or []))
        return int(a.func(a))
    except KeyscaleError as e:
        return cli_exit(e)


if __name__ == "__main__":
    sys.exit(main())
