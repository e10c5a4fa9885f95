"""What point lookups cost a running job (issue 37): its batch times with and without a
thread issuing ``--rate`` lookups a second, in the same run, A B A B.

    PYTHONPATH=src .venv/bin/python bench/lookup_load.py --keys 200000 --records 20000 --rate 50

The job is ``examples/log_count.py`` (a local partitioned log, 2 partitions, -> running
count and sum per key, operator ``totals`` -> ``ParquetSink``) at -p 2, run by a
``JobRunner`` in this process with batches back to back (trigger interval 1 ms). Its first
batch reads every one of ``--keys`` string keys once (the state); after each batch the
``on_batch`` callback appends ``--records`` records of random keys, so every batch reads
as many (a steady input). After ``--warmup`` batches the run alternates phases of
``--phase-batches`` batches: A without lookups, B with a thread calling
``JobRunner.lookup_state`` (what ``JobHandle.state`` and ``GET /state/<uid>`` run) on a
random key (9 in 10 present) ``--rate`` times a second, ``--rounds`` times (A B A B ...).
A phase's first batch is left out (it may have started before the phase's switch).

Printed as JSON: per side the median batch time (``BatchRecord.seconds``) and the median
of each phase's median, their ratio B/A, the lookups made and their p50/p99 latency, and
the load average at the end of each phase (the machine is shared).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
JOB = HERE.parent / "examples" / "log_count.py"


def run(a: argparse.Namespace) -> dict[str, Any]:
    import pyarrow as pa

    from keyscale.runtime.batch.jobstate import RunOptions
    from keyscale.runtime.driver.runner import JobRunner
    from keyscale.sources.local_log import LocalLog

    tmp = Path(tempfile.mkdtemp(prefix="ks-lookup-load-"))
    log = LocalLog.create(str(tmp / "log"), "key string, value long, ts timestamp", partitions=2)
    rnd = random.Random(0)

    def append(keys: list[str]) -> None:
        now = dt.datetime.now(dt.UTC)
        half = len(keys) // 2
        for part, ks in enumerate((keys[:half], keys[half:])):
            log.append(part, pa.table({"key": ks, "value": list(range(len(ks))), "ts": pa.array([now] * len(ks), pa.timestamp("us", tz="UTC"))}))

    append([f"user-{i:09d}" for i in range(a.keys)])
    batches_total = a.warmup + 2 * a.rounds * a.phase_batches
    phase_of: list[str] = []  # per batch after the warm-up: "A" or "B", as the phase was when it started
    loads: list[dict[str, Any]] = []
    lookup_ms: list[float] = []
    lookups_on = threading.Event()
    runner: JobRunner | None = None
    done = threading.Event()

    def phase(i: int) -> str:  # batch i (0-based, counting from the warm-up's end)
        return "AB"[(i // a.phase_batches) % 2]

    ended_count = [0]

    def on_batch(rec: Any) -> None:
        ended_count[0] += 1
        ended = ended_count[0]
        if ended > a.warmup:
            i = ended - a.warmup - 1  # the batch that just ended
            phase_of.append(phase(i))
            if (i + 1) % a.phase_batches == 0:
                loads.append({"phase": phase(i), "load_average": os.getloadavg()})
            nxt = phase(i + 1)
            if nxt == "B":
                lookups_on.set()
            else:
                lookups_on.clear()
        append([f"user-{rnd.randrange(a.keys):09d}" for _ in range(a.records)])
        if ended >= batches_total and runner is not None:
            lookups_on.clear()
            runner.stop()

    def lookups() -> None:
        pick = random.Random(1)
        nxt = time.perf_counter()
        while not done.is_set():
            if not lookups_on.wait(0.1):
                nxt = time.perf_counter()
                continue
            key = f"user-{pick.randrange(a.keys):09d}" if pick.random() < 0.9 else f"absent-{pick.randrange(10**9)}"
            t0 = time.perf_counter()
            assert runner is not None
            try:
                runner.lookup_state("totals", [key])
            except Exception as e:  # no checkpoint yet: not counted
                print(f"lookup failed: {e}", file=sys.stderr)
                continue
            lookup_ms.append((time.perf_counter() - t0) * 1000)
            nxt += 1 / a.rate
            time.sleep(max(0.0, nxt - time.perf_counter()))

    opts = RunOptions(job_file=str(JOB), job_dir=str(tmp / "job"), parallelism=2, trigger_interval="1 millisecond",
                      args={"log": str(tmp / "log"), "output": str(tmp / "out")})
    runner = JobRunner(opts, on_batch=on_batch)
    worker = threading.Thread(target=lookups, daemon=True)
    worker.start()
    try:
        runner.run()
    finally:
        done.set()
        worker.join(timeout=10)
    recs = runner.summary.batches[a.warmup : a.warmup + len(phase_of)]
    by: dict[str, list[float]] = {"A": [], "B": []}
    per_phase: dict[str, list[float]] = {"A": [], "B": []}
    for start in range(0, len(recs), a.phase_batches):
        side = phase_of[start]
        times = [r.seconds for r in recs[start + 1 : start + a.phase_batches]]  # the phase's first batch left out
        if times:
            by[side].extend(times)
            per_phase[side].append(statistics.median(times))
    lat = sorted(lookup_ms)
    out = {
        "keys": a.keys, "records_per_batch": a.records, "rate": a.rate, "phase_batches": a.phase_batches, "rounds": a.rounds,
        "A_no_lookups": {"median_batch_s": round(statistics.median(by["A"]), 3), "phase_medians_s": [round(x, 3) for x in per_phase["A"]]},
        "B_lookups": {"median_batch_s": round(statistics.median(by["B"]), 3), "phase_medians_s": [round(x, 3) for x in per_phase["B"]]},
        "ratio_B_over_A": round(statistics.median(by["B"]) / statistics.median(by["A"]), 3),
        "lookups": len(lat),
        "lookup_p50_ms": round(lat[len(lat) // 2], 2) if lat else None,
        "lookup_p99_ms": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 2) if lat else None,
        "loads": loads,
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, default=200_000)
    ap.add_argument("--records", type=int, default=20_000, help="records appended after each batch")
    ap.add_argument("--rate", type=float, default=50.0, help="lookups a second in the B phases")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--phase-batches", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    print(json.dumps(run(ap.parse_args())), flush=True)


if __name__ == "__main__":
    main()
