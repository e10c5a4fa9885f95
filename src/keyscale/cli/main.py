"""The ``keyscale`` command: its argparse table and entry point.

The handlers live by what they do: :mod:`keyscale.cli.run` (``keyscale run`` and its
options), :mod:`keyscale.cli.control` (commands that act on a running job),
:mod:`keyscale.cli.status` (commands that only read), :mod:`keyscale.cli.state` (state diff
and patch), :mod:`keyscale.cli.log` (logs), and the deployment, cluster and autoscaler
commands in their packages. :func:`build_parser` is the one table of them in the order
``keyscale --help`` shows (the CLI reference is generated from it), so it stays here, whole.

>>> a = build_parser().parse_args(["status", "jobs/clicks", "--json"])
>>> a.func is cmd_status, a.json
(True, True)
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from keyscale._logging import configure_logging
from keyscale.cli.control import (
    cmd_cancel,
    cmd_dashboard,
    cmd_rescale,
    cmd_savepoint,
    cmd_stop,
    cmd_upgrade,
)
from keyscale.cli.run import add_run_parser
from keyscale.cli.status import cmd_inspect, cmd_list, cmd_state_get, cmd_status, cmd_ui
from keyscale.errors import KeyscaleError, cli_exit


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="keyscale", description="Elastic, stateful stream processing on Spark.")
    p.add_argument("-v", "--verbose", action="store_true", help="show Spark's warnings too")
    sub = p.add_subparsers(dest="command", required=True)

    r = add_run_parser(sub)

    rs = sub.add_parser("rescale", help="change a running job's parallelism between two of its batches")
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
            help="object store setting (obstore config key, e.g. endpoint=http://127.0.0.1:9000, region=eu-west-1, "
                 "or upload_concurrency=N: parts of one upload in flight, 2 by default); "
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
