"""What point lookups cost a running job (issue 37), and how fast they answer, by the way
they are asked: batch times and lookup latency in phases of one run, in turn.

    PYTHONPATH=src .venv/bin/python bench/lookup_load.py --keys 200000 --records 20000 --rate 50
    PYTHONPATH=src .venv/bin/python bench/lookup_load.py --keys 10000000 --phases none,thread,control,serve
    PYTHONPATH=src .venv/bin/python bench/lookup_load.py --keys 10000000 --phases none,serve,thread --seaweedfs
    PYTHONPATH=src .venv/bin/python bench/lookup_load.py --keys 10000000 --phases none,thread --rounds 6 --seaweedfs
    PYTHONPATH=src .venv/bin/python bench/lookup_load.py --keys 10000000 --phases none,thread --rounds 6 --seaweedfs --seaweedfs-read-cache 256
    PYTHONPATH=src .venv/bin/python bench/lookup_load.py --keys 10000000 --phases none --rounds 1 --phase-batches 40   # batch times alone

The job is ``examples/log_count.py`` (a local partitioned log, 2 partitions, -> running
count and sum per key, operator ``totals`` -> ``ParquetSink``) at -p 2, run by a
``JobRunner`` in this process with batches back to back (trigger interval 1 ms) and its
control API on. Its first batch reads every one of ``--keys`` string keys once (the state);
after each batch the ``on_batch`` callback appends ``--records`` records of random keys, so
every batch reads as many (a steady input). After ``--warmup`` batches the run goes through
``--phases`` in turn, ``--phase-batches`` batches each, ``--rounds`` times; a phase issues
``--rate`` lookups a second of a random key (9 in 10 present) by one of these ways:

- ``none``: no lookups (the job alone);
- ``thread``: a thread of the job's process calls ``JobRunner.lookup_state`` (what
  ``JobHandle.state`` runs);
- ``control``: a client process asks the job's control API (``GET /state/<uid>``, in the
  job's driver process; it closes the connection after each answer);
- ``serve``: the same client asks ``keyscale state serve JOB_DIR`` (a process of its own,
  started by the script, ``--max-age 1``), on one kept connection.

With ``--seaweedfs`` the job directory (its checkpoints, so the state every lookup reads)
is on a private SeaweedFS S3 server started for the run; the log and the output stay on
local disk.

A phase's first batch is left out of the batch times (it may have started before the
phase's switch). Printed as JSON: per phase the median batch time (``BatchRecord.seconds``)
and each round's median, against ``none``'s, the lookups made and their p50/p99 latency,
the load average at the end of each phase (the machine is shared), the machine's busy CPU
seconds a batch (all cores, every process) and the job's driver process's (this one: its
lookups in ``thread`` and ``control`` among them; the JVM and the Python workers are processes
of their own), for ``thread`` the lookup thread's own CPU time a lookup, and, with
``--seaweedfs``, the S3 server's and
the requests the job's process made of the store a batch (its lookups' among them), and the
batches in which a subtask loaded key groups from the checkpoint instead of catching up a copy.

Per way, ``paired_against_none`` compares each of its phases with the ``none`` phases on
either side (see :func:`paired`); for ``none`` itself, the noise of that comparison. Keep
``--phase-batches`` a multiple of the job's snapshot period (8 batches, the default
compaction chain), so that every phase holds as many snapshot batches (4-6 s at 10M keys
on S3) as the others; more rounds (``--rounds 6``) narrow the interval.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from procs import cpu_seconds

HERE = Path(__file__).resolve().parent
JOB = HERE.parent / "examples" / "log_count.py"


WAYS = ("none", "thread", "control", "serve")


def _client(urls: dict[str, str], secrets: dict[str, str], keys: int, rate: float, phase: Any, done: Any, out: Any) -> None:
    """A client process: ``rate`` lookups a second to ``urls[way]`` (with ``secrets[way]``)
    while a phase ``way`` of ``urls`` runs; puts {way: [ms, ...]} on ``out`` when ``done``."""
    import http.client
    from urllib.parse import urlsplit

    # One connection per way, kept: the control API closes it after each answer (HTTP/1.0)
    # and http.client opens it again; keyscale state serve keeps it open (HTTP/1.1).
    conns = {way: http.client.HTTPConnection(urlsplit(url).netloc, timeout=30) for way, url in urls.items()}
    pick = random.Random(2)
    ms: dict[str, list[float]] = {way: [] for way in urls}
    nxt = time.perf_counter()
    while not done.is_set():
        way = WAYS[phase.value] if phase.value >= 0 else "none"
        if way not in urls:
            time.sleep(0.02)
            nxt = time.perf_counter()
            continue
        key = f"user-{pick.randrange(keys):09d}" if pick.random() < 0.9 else f"absent-{pick.randrange(10**9)}"
        t0 = time.perf_counter()
        try:
            conns[way].request("GET", f"/state/totals?key={key}", headers={"Authorization": f"Bearer {secrets[way]}"})
            r = conns[way].getresponse()
            r.read()
            if r.status != 200:
                raise OSError(f"HTTP {r.status}")
        except (OSError, http.client.HTTPException) as e:  # no checkpoint yet (404), a refused connection: not counted
            print(f"lookup failed ({way}): {e}", file=sys.stderr)
            conns[way].close()
            time.sleep(0.1)
            continue
        ms[way].append((time.perf_counter() - t0) * 1000)
        nxt += 1 / rate
        time.sleep(max(0.0, nxt - time.perf_counter()))
    out.put(ms)


def _serve(job_dir: str, token_file: Path) -> tuple[subprocess.Popen[str], str]:
    """``keyscale state serve`` of the job directory, and its URL."""
    proc = subprocess.Popen([sys.executable, "-m", "keyscale.cli.main", "state", "serve", job_dir, "--token-file",
                             str(token_file), "--max-age", "1"], stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    line = proc.stderr.readline()
    found = re.search(r" at (http://\S+) ", line)
    if found is None:
        proc.kill()
        sys.exit(f"lookup_load: keyscale state serve did not start: {line}{proc.stderr.read()}")
    return proc, found.group(1)


def _pct(values: list[float], q: float) -> float | None:
    v = sorted(values)
    return round(v[min(len(v) - 1, int(q * len(v)))], 2) if v else None


def _spread(seconds: list[float]) -> dict[str, float] | None:
    """Every measured batch's time: median, 90th and 99th percentile, the longest and the
    mean (a snapshot of a large state shows in the tail, not the median)."""
    if not seconds:
        return None
    import numpy as np

    p50, p90, p99 = np.percentile(seconds, [50, 90, 99])
    return {"p50": round(float(p50), 3), "p90": round(float(p90), 3), "p99": round(float(p99), 3),
            "max": round(max(seconds), 3), "mean": round(statistics.mean(seconds), 3)}


def paired(in_turn: list[tuple[str, float]], way: str) -> dict[str, Any] | None:
    """Each phase ``way`` against the ``none`` phases on either side of it (the mean of the
    nearest before and after; one when at an end): the ratios, their median and a 90 %
    bootstrap interval of that median. A load on the machine that drifts over the run moves
    a phase and its neighbours alike, so it mostly leaves the ratio. For ``none`` itself each
    ``none`` phase against the ``none`` phases before and after it: the ratio two phases
    with the same load give, the measure's own noise.

    >>> paired([("none", 1.0), ("thread", 1.1), ("none", 1.0), ("thread", 1.3), ("none", 1.2)], "thread")["ratios"]
    [1.1, 1.182]
    """
    ratios = []
    nones = [i for i, (p, _) in enumerate(in_turn) if p == "none"]
    for i, (p, t) in enumerate(in_turn):
        if p != way:
            continue
        before = [j for j in nones if j < i]
        after = [j for j in nones if j > i]
        around = [in_turn[j][1] for j in (before[-1:] + after[:1])]
        if around:
            ratios.append(t / statistics.mean(around))
    if not ratios:
        return None
    import numpy as np

    draws = np.random.default_rng(0).choice(ratios, size=(2000, len(ratios)))
    lo, hi = np.percentile(np.median(draws, axis=1), [5, 95])
    return {"ratios": [round(r, 3) for r in ratios], "median": round(statistics.median(ratios), 3),
            "interval_90": [round(float(lo), 3), round(float(hi), 3)]}


def run(a: argparse.Namespace, tmp: Path, job_dir: str | None = None, s3_pid: int | None = None) -> dict[str, Any]:
    """The phases of one run, its files in folder ``tmp``; ``job_dir``: where the job keeps
    its state (a folder in ``tmp`` when None); ``s3_pid``: the S3 server's process, whose CPU
    is reported per phase."""
    import multiprocessing as mp

    import pyarrow as pa

    from keyscale.runtime.batch.jobstate import RunOptions
    from keyscale.runtime.control.auth import read_secret
    from keyscale.runtime.control.server import control_api
    from keyscale.runtime.driver.runner import JobRunner
    from keyscale.sources.local_log import LocalLog

    phases = a.phases.split(",")
    unknown = set(phases) - set(WAYS)
    if unknown:
        sys.exit(f"lookup_load: --phases {a.phases}: unknown {sorted(unknown)} (known: {', '.join(WAYS)})")
    log = LocalLog.create(str(tmp / "log"), "key string, value long, ts timestamp", partitions=2)
    rnd = random.Random(0)

    def append(keys: list[str]) -> None:
        now = dt.datetime.now(dt.UTC)
        half = len(keys) // 2
        for part, ks in enumerate((keys[:half], keys[half:])):
            log.append(part, pa.table({"key": ks, "value": list(range(len(ks))), "ts": pa.array([now] * len(ks), pa.timestamp("us", tz="UTC"))}))

    append([f"user-{i:09d}" for i in range(a.keys)])
    batches_total = a.warmup + len(phases) * a.rounds * a.phase_batches
    phase_of: list[str] = []  # per batch after the warm-up: the phase it started in
    reloads: list[int] = []  # batches after the warm-up in which a subtask loaded key groups from the checkpoint
    loads: list[dict[str, Any]] = []
    cpu: dict[str, list[float]] = {}  # per phase: CPU seconds of the machine, the S3 server and this (the driver's) process, wall seconds, batches
    requests: dict[str, dict[str, int]] = {}
    mark: dict[str, Any] = {}  # at the last phase switch: "cpu" (machine CPU, server CPU, driver CPU, wall clock) and the store's "requests"
    thread_ms: list[float] = []
    thread_cpu_ms: list[float] = []  # the lookup thread's own CPU time a lookup
    ctx = mp.get_context("spawn")
    current = ctx.Value("i", -1)  # the phase's index in WAYS, read by the thread and the client process
    done, client_done, out = threading.Event(), ctx.Event(), ctx.Queue()
    runner: JobRunner | None = None
    client: Any = None
    server: subprocess.Popen[str] | None = None
    where = job_dir or str(tmp / "job")
    token_file = tmp / "serve-token"
    token_file.write_text("bench-token")

    def phase(i: int) -> str:  # batch i (0-based, counting from the warm-up's end)
        return phases[(i // a.phase_batches) % len(phases)]

    ended_count = [0]

    def on_batch(rec: Any) -> None:
        nonlocal client, server
        ended_count[0] += 1
        ended = ended_count[0]
        if ended == 1 and client is None:  # the control API and a checkpoint are there now
            urls: dict[str, str] = {}
            if "control" in phases and runner is not None:
                urls["control"] = runner.jobdir.read_json("control/http.json")["url"]
            if "serve" in phases:
                server, urls["serve"] = _serve(where, token_file)
            secrets = {"control": read_secret(runner.jobdir.store) if runner is not None else "", "serve": "bench-token"}
            if urls:
                client = ctx.Process(target=_client, args=(urls, secrets, a.keys, a.rate, current, client_done, out), daemon=True)
                client.start()
        if ended > a.warmup:
            i = ended - a.warmup - 1  # the batch that just ended
            phase_of.append(phase(i))
            status = runner.job.committed.status if runner is not None else None
            subtasks = ((status or {}).get("operators", {}).get("totals") or {}).get("subtasks", [])
            if any(sub["loaded_key_groups"] for sub in subtasks):
                reloads.append(rec.batch)
            if (i + 1) % a.phase_batches == 0:
                loads.append({"phase": phase(i), "load_average": os.getloadavg()})
            current.value = WAYS.index(phase(i + 1))
        if ended >= a.warmup and (ended - a.warmup) % a.phase_batches == 0:  # the warm-up or a phase ended
            now = (cpu_seconds(), cpu_seconds(s3_pid) if s3_pid else 0.0, cpu_seconds(os.getpid()), time.perf_counter())
            counted = dict(getattr(runner.jobdir.store, "requests", {})) if runner is not None else {}
            if mark:
                ended_phase = phase(ended - a.warmup - 1)
                got = requests.setdefault(ended_phase, {})
                for k, v in counted.items():
                    got[k] = got.get(k, 0) + v - mark["requests"].get(k, 0)
                used = cpu.setdefault(ended_phase, [0.0, 0.0, 0.0, 0.0, 0])
                for k in range(4):
                    used[k] += now[k] - mark["cpu"][k]
                used[4] += a.phase_batches
            mark.update(cpu=now, requests=counted)
        append([f"user-{rnd.randrange(a.keys):09d}" for _ in range(a.records)])
        if ended >= batches_total and runner is not None:
            current.value = -1
            runner.stop()

    def lookups() -> None:
        pick = random.Random(1)
        nxt = time.perf_counter()
        while not done.is_set():
            if current.value != WAYS.index("thread"):
                time.sleep(0.02)
                nxt = time.perf_counter()
                continue
            key = f"user-{pick.randrange(a.keys):09d}" if pick.random() < 0.9 else f"absent-{pick.randrange(10**9)}"
            t0, c0 = time.perf_counter(), time.thread_time()
            assert runner is not None
            try:
                runner.lookup_state("totals", [key])
            except Exception as e:  # no checkpoint yet: not counted
                print(f"lookup failed: {e}", file=sys.stderr)
                continue
            thread_ms.append((time.perf_counter() - t0) * 1000)
            thread_cpu_ms.append((time.thread_time() - c0) * 1000)
            nxt += 1 / a.rate
            time.sleep(max(0.0, nxt - time.perf_counter()))

    opts = RunOptions(job_file=str(JOB), job_dir=where, parallelism=2, trigger_interval="1 millisecond",
                      args={"log": str(tmp / "log"), "output": str(tmp / "out")})
    runner = JobRunner(opts, on_batch=on_batch, serve=control_api(opts))
    worker = threading.Thread(target=lookups, daemon=True)
    worker.start()
    ms: dict[str, list[float]] = {"thread": thread_ms}
    try:
        runner.run()
    finally:
        done.set()
        client_done.set()
        worker.join(timeout=10)
        if client is not None:
            ms.update(out.get(timeout=60))
            client.join(timeout=10)
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
    recs = runner.summary.batches[a.warmup : a.warmup + len(phase_of)]
    by: dict[str, list[float]] = {p: [] for p in phases}
    per_phase: dict[str, list[float]] = {p: [] for p in phases}
    in_turn: list[tuple[str, float]] = []  # every phase's median batch time, in the order the phases ran
    for start in range(0, len(recs), a.phase_batches):
        side = phase_of[start]
        times = [r.seconds for r in recs[start + 1 : start + a.phase_batches]]  # the phase's first batch left out
        if times:
            by[side].extend(times)
            per_phase[side].append(statistics.median(times))
            in_turn.append((side, statistics.median(times)))
    base = statistics.median(by["none"]) if by.get("none") else None
    result: dict[str, Any] = {"keys": a.keys, "records_per_batch": a.records, "rate": a.rate, "phase_batches": a.phase_batches,
                              "rounds": a.rounds, "phases": {}, "loads": loads,
                              "batches": len(recs), "batches_with_a_reload": reloads,
                              "batch_seconds": [[p, round(r.seconds, 3)] for p, r in zip(phase_of, recs, strict=False)],
                              "batch_seconds_spread": _spread([r.seconds for r in recs])}
    for p in phases:
        median = statistics.median(by[p]) if by[p] else None
        entry: dict[str, Any] = {"median_batch_s": round(median, 3) if median else None,
                                 "phase_medians_s": [round(x, 3) for x in per_phase[p]],
                                 "batch_against_none": round(median / base, 3) if median and base else None,
                                 "paired_against_none": paired(in_turn, p)}
        if p in cpu:  # the machine's busy cores over the phase, and what the S3 server took of them
            machine, s3, driver, wall, n = cpu[p]
            entry |= {"machine_cpu_s_per_batch": round(machine / n, 3), "busy_cores": round(machine / wall, 2),
                      "driver_cpu_s_per_batch": round(driver / n, 3)}
            if s3_pid:
                entry |= {"s3_server_cpu_s_per_batch": round(s3 / n, 3),
                          "driver_requests_per_batch": {k: round(v / n, 1) for k, v in sorted(requests.get(p, {}).items())}}
        if p != "none":
            lat = ms.get(p, [])
            entry |= {"lookups": len(lat), "lookup_p50_ms": _pct(lat, 0.5), "lookup_p99_ms": _pct(lat, 0.99)}
            if p == "thread" and thread_cpu_ms:
                entry |= {"lookup_cpu_ms_mean": round(statistics.fmean(thread_cpu_ms), 3)}
        result["phases"][p] = entry
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, default=200_000)
    ap.add_argument("--records", type=int, default=20_000, help="records appended after each batch")
    ap.add_argument("--rate", type=float, default=50.0, help="lookups a second in the B phases")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--phase-batches", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--phases", default="none,thread", help=f"comma-separated, in turn: {', '.join(WAYS)}")
    ap.add_argument("--seaweedfs", action="store_true", help="the job's state on a private SeaweedFS S3 server started for the run")
    ap.add_argument("--seaweedfs-read-cache", type=int, default=0, metavar="MB",
                    help="that server with 1 MB chunks and a read cache of MB megabytes (keyscale.storage.seaweed.start_seaweedfs)")
    a = ap.parse_args()
    if a.seaweedfs_read_cache and not a.seaweedfs:
        ap.error("--seaweedfs-read-cache is a setting of the --seaweedfs server")
    # Gone at the end: a run at 10M keys leaves ~1.2 GB of log, output and state.
    with tempfile.TemporaryDirectory(prefix="ks-lookup-load-") as scratch:
        tmp = Path(scratch)
        if not a.seaweedfs:
            print(json.dumps(run(a, tmp)), flush=True)
            return
        from keyscale.storage.seaweed import serving_bucket

        with serving_bucket(tmp / "s3", "bench", a.seaweedfs_read_cache) as server:  # its settings also reach the server and client processes
            print(json.dumps(run(a, tmp, "s3://bench/job", server.pid)), flush=True)


if __name__ == "__main__":
    main()
