"""``keyscale run``: its options and the process that runs a job file until it ends; and
``keyscale class-archive``, which makes the archive such a process's JVM can start with.

Apart from the commands that act on a job already running (:mod:`keyscale.cli.control`) and
those that only read (:mod:`keyscale.cli.status`) because this one is the job's own
process: it owns the run loop (a restart in place runs the job again here) and most of the
options, so its half of the argparse table is here too.

>>> import argparse
>>> r = add_run_parser(argparse.ArgumentParser(prog="keyscale").add_subparsers(dest="command"))
>>> a = r.parse_args(["job.py", "--job-dir", "jobs/clicks", "-p", "4"])
>>> a.func is cmd_run, a.parallelism, a.state_backend
(True, 4, 'memory')
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
from typing import Any

from keyscale.errors import KeyscaleError
from keyscale.runtime.control.settings import add_control_arguments, control_options
from keyscale.runtime.driver.session import parse_spark_conf


def add_run_parser(sub: Any) -> argparse.ArgumentParser:
    """Register ``keyscale run`` on the ``keyscale`` command's subparsers; returns its parser."""
    r: argparse.ArgumentParser = sub.add_parser("run", help="run a job file")
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
                   help="no key group's restore reads more than N files: each is snapshotted once every N batches, a large "
                        "state a slice a batch (default 8)")
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

    ca = sub.add_parser(
        "class-archive", help="make a class archive that Spark's driver JVM starts faster with (KEYSCALE_CLASS_ARCHIVE)",
        description="Runs a small keyed job in a JVM that writes the classes it loaded to ARCHIVE as it exits (about a minute); "
                    "sessions keyscale starts with KEYSCALE_CLASS_ARCHIVE=ARCHIVE set map it instead of loading them again. "
                    "Good for this machine's Java and Spark jars only: make it again after changing either.")
    ca.add_argument("archive", help="the archive file to write (e.g. ~/.cache/keyscale/spark-classes.jsa)")
    ca.set_defaults(func=cmd_class_archive)
    return r


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


def cmd_class_archive(a: argparse.Namespace) -> int:
    from keyscale.classarchive import create_archive

    create_archive(a.archive)
    return 0


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
