"""A job file run by ``spark-submit`` (or ``python job.py``): :func:`main`.

``spark-submit`` makes the SparkSession from the user's ``--master`` and ``--conf``s;
``main(build)`` builds the pipeline on it and runs it with :meth:`keyscale.Pipeline.start`,
taking ``keyscale run``'s options from the command line after the job file. keyscale adds
no Spark setting of its own to such a session.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

from keyscale._keywords import checked_keywords
from keyscale._logging import configure_logging
from keyscale.errors import KeyscaleError
from keyscale.runtime.control.settings import add_control_arguments, control_options

__all__ = ["main"]


def _parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Run this keyscale job on the SparkSession spark-submit made.")
    p.add_argument("--job-dir", required=True, help="where the job keeps its state (a folder or s3://...)")
    p.add_argument("-p", "--parallelism", type=int, help="subtasks per keyed operator (default: as checkpointed, else 1)")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="a job argument, read in build() with ctx.arg(NAME) (repeatable); a name the job does not read is an error")
    p.add_argument("--until-idle", action="store_true", help="stop once the input is read")
    p.add_argument("--trigger-interval", default="1 second")
    p.add_argument("--from-savepoint", help="start a new job directory from this savepoint")
    p.add_argument("--max-parallelism", type=int)
    add_control_arguments(p)
    return p


@checked_keywords
def main(build: Callable[[Any], Any], argv: Sequence[str] | None = None) -> int:
    """Run the job ``build`` defines, under spark-submit or plain Python; returns 0 when it
    stopped cleanly (SIGTERM/SIGINT stop it after the current batch), else the
    error's exit code (as ``keyscale run``).

    In a job file::

        if __name__ == "__main__":
            raise SystemExit(ks.main(build))

    then ``spark-submit --master spark://host:7077 --conf spark.executor.memory=2g job.py
    --job-dir s3://bucket/jobs/rc -p 4 --set input=...``.
    """
    from pyspark.sql import SparkSession

    from keyscale._jobcontext import JobArgs, JobContext
    from keyscale._steps import JobGraph
    from keyscale.runtime.control.handle import start_job
    from keyscale.runtime.driver.jobargs import check_args_read, parse_sets

    code = getattr(build, "__code__", None)
    module_file = Path(code.co_filename if code is not None else sys.argv[0])
    name = str(getattr(build, "__globals__", {}).get("NAME", module_file.stem))
    a = _parser(module_file.name).parse_args(argv)
    configure_logging()
    log = logging.getLogger("keyscale")
    try:
        spark = SparkSession.builder.getOrCreate()  # spark-submit's master and --conf; nothing of keyscale's
        args = parse_sets(a.set)
        ctx = JobContext(spark, dict(args))
        pipeline = build(ctx)
        if not isinstance(pipeline, JobGraph):
            raise KeyscaleError(f"build() in {module_file} returned {type(pipeline).__name__}, not a keyscale Pipeline (end it with .sink(...))")
        # Every argument is given on this command line (ks.main reuses none a job directory keeps): one the job does not read is an error.
        check_args_read(args, cast(JobArgs, ctx.args).read, {})
        job = start_job(pipeline, a.job_dir, a.parallelism, name=name, until_idle=a.until_idle, trigger_interval=a.trigger_interval,
                             from_savepoint=a.from_savepoint, max_parallelism=a.max_parallelism, args=args,
                             **control_options(a))

        def _graceful(signum: int, _frame: Any) -> None:
            log.info("received %s; stopping after the current batch", signal.Signals(signum).name)
            job._job.stop()

        signal.signal(signal.SIGTERM, _graceful)
        signal.signal(signal.SIGINT, _graceful)
        while not job.await_termination(1.0):
            pass
        s = job.summary
        print(f"keyscale: job '{s.job}' processed {len(s.batches)} batches ({s.records:,} records)")
        return 0
    except KeyscaleError as e:
        print(f"keyscale: error: {e}", file=sys.stderr)
        return e.exit_code
