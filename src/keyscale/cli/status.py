"""The commands that show jobs and their state without changing them: ``keyscale status``,
``list``, ``ui``, ``inspect`` and ``state get``.

Apart from the commands that act on a running job (:mod:`keyscale.cli.control`) because
these read what a job directory, a folder of them or a savepoint holds, whether a job runs
or not, and ask no job for anything (``state get`` reads the checkpoint's files by byte range).

>>> import tempfile
>>> import argparse
>>> cmd_list(argparse.Namespace(folder=tempfile.mkdtemp()))  # doctest: +ELLIPSIS
no keyscale jobs under ...
0
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

from keyscale.errors import KeyscaleError
from keyscale.runtime.control.jobstatus import find_jobs, status_dict


def cmd_ui(a: argparse.Namespace) -> int:
    """Serve the folder page until interrupted."""
    from keyscale.cli.folder import FolderServer

    find_jobs(a.folder)  # a folder that is not one fails now, with its name
    server = FolderServer(a.folder, a.port)
    print(server.login_url)
    print(f"keyscale: the jobs under {a.folder}; open this link within 2 minutes (it works once); Ctrl-C to stop", file=sys.stderr)
    serve_until_interrupted(server.close)
    return 0


def serve_until_interrupted(close: Callable[[], None]) -> None:
    """Block until Ctrl-C or SIGTERM, then ``close`` the server that serves meanwhile (its
    own threads): ``keyscale ui``, ``keyscale state serve``."""

    def _interrupt(_signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _interrupt)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        close()


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
        print(f"  rescale pending (applied between two batches): {want}")
    committing = f" (batch {st['checkpoint_committing']} committing)" if st.get("checkpoint_committing") is not None else ""
    print(f"  max parallelism (key groups): {st['max_parallelism']}; last checkpoint: {st['last_checkpoint']}{committing}; "
          f"kept: {st['checkpoints']}")
    if "watermark" in st:
        print(f"  watermark: {st['watermark']}")
    lat = st.get("latency")
    if lat:
        print(f"  end-to-end latency (batch {lat['batch']}, {lat['records']:,} records, from {lat['append_time']}): "
              f"p50 {lat['p50_seconds']:.3f} s, p99 {lat['p99_seconds']:.3f} s, max {lat['max_seconds']:.3f} s")
        if lat.get("lag_seconds") is not None:
            print(f"  lag: {lat['lag_seconds']:.3f} s (how long the oldest record of batch {lat['batch']} had waited when the batch began)")
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
