"""``keyscale state diff``, ``keyscale state patch`` and ``keyscale state serve``: compare and
edit keyed state offline, and answer lookups of a job's state from a process of their own.

Exit codes of ``state diff`` follow diff(1): 0 when the two sides hold the same keys with
the same values, 1 when they differ, and a keyscale error's code (2 and up) when it could
not compare them.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from keyscale.errors import InputDataError, KeyscaleError

log = logging.getLogger("keyscale")

#: ``keyscale state diff``'s exit code when the sides differ (0: equal; errors: 2 and up).
DIFFERENT = 1


def cmd_state_diff(a: argparse.Namespace) -> int:
    from keyscale.state_processor.diff import diff_savepoints

    if a.samples < 0:
        raise InputDataError(f"--samples {a.samples}: give 0 or more")
    d = diff_savepoints(a.a, a.b, a.uid, samples=a.samples, checkpoint_a=a.checkpoint_a, checkpoint_b=a.checkpoint_b)
    print(json.dumps(d.to_json(), indent=1, ensure_ascii=False) if a.json else d.text())
    return 0 if d.equal else DIFFERENT


def cmd_state_patch(a: argparse.Namespace) -> int:
    from keyscale.state_processor.patch import Edit, parse_edit_lines, parse_set, patch_state

    edits: list[Edit] = [parse_set(s) for s in a.set]
    edits += [Edit(k, None) for k in a.delete]
    for name in a.from_file:
        try:
            lines = Path(name).read_text().splitlines()
        except OSError as e:
            raise InputDataError(f"--from-file {name}: {e.strerror or e}") from None
        edits += parse_edit_lines(lines, name)
    path = patch_state(a.src, a.output, a.uid, edits=edits, note=a.note)
    print(path)
    return 0


def cmd_state_serve(a: argparse.Namespace) -> int:
    from keyscale.cli.status import serve_until_interrupted
    from keyscale.runtime.control.lookups import LookupServer
    from keyscale.runtime.control.settings import BearerToken

    token = BearerToken(file=a.token_file, origin="--token-file", kind="state lookup") if a.token_file is not None else None
    server = LookupServer(a.job_dir, a.host, a.port, token, a.unauthenticated, a.max_age)
    try:
        newest = f"checkpoint {server.lookup.manifest().batch} now"
    except KeyscaleError as e:  # no checkpoint yet: the job may be starting; /health answers 503 until one commits
        newest = str(e)
    who = "without credentials" if a.unauthenticated else f"with the token of {a.token_file}"
    log.info("state lookups of %s at %s (GET /state/<uid>?key=KEY %s; %s); stop with Ctrl-C or SIGTERM",
             a.job_dir, server.url, who, newest)
    serve_until_interrupted(server.close)
    log.info("state lookups of %s stopped", a.job_dir)
    return 0


def add_state_edit_parsers(state_sub: Any) -> list[argparse.ArgumentParser]:
    """``state diff``, ``state patch`` and ``state serve`` under ``keyscale state``; returns their parsers."""
    sd = state_sub.add_parser(
        "diff", help="keys of an operator only in A, only in B, and changed (savepoints or job directories' checkpoints)",
        description="Compares operator UID's keyed state in A and B: savepoints, or job directories (their last committed "
                    "checkpoint, or --checkpoint-a/-b), at any parallelism and max parallelism. Prints counts and samples. "
                    "Exit code: 0 equal, 1 different, 2 or more when they could not be compared.")
    sd.add_argument("a", metavar="A", help="a savepoint or a job directory (local, file:// or s3://)")
    sd.add_argument("b", metavar="B", help="a savepoint or a job directory (local, file:// or s3://)")
    sd.add_argument("--uid", required=True, help="the keyed operator's uid")
    sd.add_argument("--checkpoint-a", type=int, metavar="BATCH", help="with a job directory as A: this checkpoint instead of the last")
    sd.add_argument("--checkpoint-b", type=int, metavar="BATCH", help="with a job directory as B: this checkpoint instead of the last")
    sd.add_argument("--samples", type=int, default=10, metavar="N", help="keys shown of each kind (default 10)")
    sd.add_argument("--json", action="store_true", help="the counts and samples as one JSON object")
    sd.set_defaults(func=cmd_state_diff)

    sp = state_sub.add_parser(
        "patch", help="write a new savepoint from SRC with keys of an operator set, changed or deleted (checked against its state types)",
        description="Every key and value is checked against the operator's key and state types before anything is written; "
                    "the new savepoint (-o, a new location outside any job directory's checkpoints) records who patched it, "
                    "when, and what. Restore a job from it with keyscale run --from-savepoint.")
    sp.add_argument("src", metavar="SRC", help="the savepoint to start from (local, file:// or s3://)")
    sp.add_argument("--uid", required=True, help="the keyed operator's uid")
    sp.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                    help="set states of a key, e.g. 'ann={\"total\": 5}' (a key of several columns as a JSON array; "
                         "states not named keep their values; null clears one) (repeatable)")
    sp.add_argument("--delete", action="append", default=[], metavar="KEY", help="delete a key and all its state (repeatable)")
    sp.add_argument("--from-file", action="append", default=[], metavar="FILE",
                    help="edits as JSON lines: {\"key\": K, \"set\": {...}} or {\"key\": K, \"delete\": true} (repeatable)")
    sp.add_argument("-o", "--output", required=True, metavar="DST", help="where to write the new savepoint (must not exist)")
    sp.add_argument("--note", help="a note kept in the patch's record (why)")
    sp.set_defaults(func=cmd_state_patch)

    ss = state_sub.add_parser(
        "serve", help="answer GET /state/<uid>?key=... for a job directory from a process of its own (running job or not)",
        description="Serves the control API's point lookups (the same answers, from the last committed checkpoint) in a "
                    "process apart from the job, so lookups cost its driver nothing and go on while it stops or restarts. "
                    "Reads the job directory only. GET /health answers 200 once there is a checkpoint.")
    ss.add_argument("job_dir", metavar="JOB_DIR", help="the job directory (local, file:// or s3://)")
    ss.add_argument("--host", default="127.0.0.1", metavar="ADDRESS", help="address to listen on (default 127.0.0.1)")
    ss.add_argument("--port", type=int, default=0, metavar="PORT", help="port (default: any free port, printed at start)")
    auth = ss.add_mutually_exclusive_group(required=True)
    auth.add_argument("--token-file", metavar="FILE",
                      help="requests must carry 'Authorization: Bearer <the file's content>' (read again at each request)")
    auth.add_argument("--unauthenticated", action="store_true", help="answer anyone who can connect (the operator's explicit choice)")
    ss.add_argument("--max-age", type=float, default=1.0, metavar="SECONDS",
                    help="list the newest checkpoint at most this often (default 1): an answer is at most this much older")
    ss.set_defaults(func=cmd_state_serve)
    return [sd, sp, ss]
