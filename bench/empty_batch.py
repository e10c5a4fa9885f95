"""The fixed cost of a batch (issue 35, item 2): per-batch wall time of a job with almost no input.

    PYTHONPATH=src .venv/bin/python bench/empty_batch.py --batches 40 --records 0
    PYTHONPATH=src .venv/bin/python bench/empty_batch.py --compare /work/main/src src --rounds 2   # A B A B
    PYTHONPATH=src .venv/bin/python bench/empty_batch.py --spark                                   # Spark's own
    PYTHONPATH=src .venv/bin/python bench/empty_batch.py --compare /work/main/src src --with-spark   # A B Spark, twice
    PYTHONPATH=src .venv/bin/python bench/empty_batch.py --batches 20 --profile    # + Py4J calls, Spark jobs/stages/tasks

The job is ``examples/log_count.py`` (a local partitioned log, 2 partitions, -> running
count and sum per key -> ``ParquetSink``) at -p 2, run by a ``JobRunner`` in this process
with the trigger interval at 1 ms, so batches run back to back. After each batch the
``on_batch`` callback appends ``--records`` records to the log, so the next batch reads
exactly those (0: an empty batch, which still runs every subtask, writes its intent,
manifest, the sink's marker and the status). The first ``--warmup`` batches (Spark's and
the Python workers' start) are left out; printed: the median of the batch's own time
(``run_batch``), of the cycle (from one batch's end to the next's: the batch plus what
the loop does between batches) and, where the runner records them (``history``'s
``steps``), the median seconds of each step of the commit protocol.

``--compare A B`` runs the same measurement in fresh processes with ``PYTHONPATH=A`` and
``PYTHONPATH=B`` alternately (A B A B ...: the machine's load falls on both alike) and
prints each run and the medians per side. ``--spark``: Spark's own stateful aggregation
(rate source at 1 row/s, ``groupBy(key).count()``, update mode, ``noop`` sink, trigger
as fast as it goes): the median ``triggerExecution`` of its micro-batches.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
JOB = ROOT / "examples" / "log_count.py"


def one(batches: int, records: int, warmup: int, interval: str, parallelism: int, rate: float = 0.0, profile: bool = False) -> dict[str, Any]:
    """Run the job for ``warmup + batches`` batches; the medians of the batches after the warm-up.
    With ``profile``, also per batch after the warm-up: the driver's Py4J round trips and the
    Spark jobs, stages and tasks it launched (Spark's status tracker).
    With ``rate``, a producer thread appends that many records a second (every 20 ms) from
    the warm-up's end on, and each record's latency is measured: from its append to the end of
    the commit of the batch that read it (the ``on_batch`` callback, after the manifest)."""
    import pyarrow as pa

    from keyscale.runtime.batch.jobstate import RunOptions
    from keyscale.runtime.driver.runner import JobRunner
    from keyscale.sources.local_log import LocalLog

    tmp = Path(tempfile.mkdtemp(prefix="ks-empty-"))
    log = LocalLog.create(str(tmp / "log"), "key string, value long, ts timestamp", partitions=2)
    sent = [0]

    def append(n: int) -> None:
        import datetime as dt

        now = dt.datetime.now(dt.UTC)
        for part in range(2):
            k = n // 2 + (n % 2 if part == 0 else 0)
            if k:
                log.append(part, pa.table({"key": [f"k{(sent[0] + i) % 1000}" for i in range(k)], "value": list(range(k)),
                                           "ts": pa.array([now] * k, pa.timestamp("us", tz="UTC"))}))
                sent[0] += k

    append(records)
    ends: list[float] = []
    runner: JobRunner | None = None
    appended: list[list[tuple[int, float]]] = [[], []]  # per partition: (offset after the append, its time)
    latencies: list[float] = []
    seen = [0, 0]  # per partition: records whose latency is known
    producing = threading.Event()
    py4j = [0]  # Py4J round trips so far (with profile)
    marks: dict[str, Any] = {}
    if profile:
        from py4j import clientserver

        send = clientserver.ClientServerConnection.send_command

        def counted(self: Any, command: str) -> Any:
            py4j[0] += 1
            return send(self, command)

        clientserver.ClientServerConnection.send_command = counted  # type: ignore[method-assign]

    def produce() -> None:
        import datetime as dt

        producing.wait()
        start, n = time.perf_counter(), 0
        while runner is not None and not runner.stop_requested():
            due = int((time.perf_counter() - start) * rate) - n
            for part in range(2):
                k = due // 2 + (due % 2 if part == 0 else 0)
                if k:
                    now, t = dt.datetime.now(dt.UTC), time.perf_counter()
                    _, end = log.append(part, pa.table({"key": [f"k{(n + i) % 1000}" for i in range(k)], "value": list(range(k)),
                                                        "ts": pa.array([now] * k, pa.timestamp("us", tz="UTC"))}))
                    appended[part].append((end, t))
            n += due
            time.sleep(0.02)

    def measure(now: float) -> None:
        from keyscale.sources.reader import from_state

        assert runner is not None
        m = runner.job.committed.manifest
        positions = from_state(m.operators["reader"].operator_state) if m is not None else None
        for p, off in (e for entries in positions or [] for e in entries):
            while appended[p] and appended[p][0][0] <= off:
                end, t = appended[p].pop(0)
                latencies.extend([now - t] * (end - seen[p]))
                seen[p] = end

    def on_batch(rec: Any) -> None:
        now = time.perf_counter()
        ends.append(now)
        if rate:
            measure(now)
        append(records)
        if profile and len(ends) in (warmup, warmup + batches) and runner is not None:
            marks[f"py4j_{len(ends)}"] = py4j[0]
            marks[f"jobs_{len(ends)}"] = list(runner.job.spark.sparkContext.statusTracker().getJobIdsForGroup(None))
        if len(ends) == warmup:
            seen[:] = [int(e) for e in log.end_offsets()]
            producing.set()
        if len(ends) >= warmup + batches and runner is not None:
            runner.stop()

    opts = RunOptions(job_file=str(JOB), job_dir=str(tmp / "job"), parallelism=parallelism, trigger_interval=interval,
                      args={"log": str(tmp / "log"), "output": str(tmp / "out")})
    runner = JobRunner(opts, on_batch=on_batch)
    done: list[BaseException] = []

    def run() -> None:
        try:
            runner.run()
        except BaseException as e:  # reported below
            done.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    if rate:
        threading.Thread(target=produce, daemon=True).start()
    t.join()
    if done:
        raise done[0]
    prof = _spark_profile(runner, marks, warmup, batches) if profile else {}
    hist = list(runner.job.history.batches)[warmup:]
    recs = runner.summary.batches[warmup:]
    cycles = [b - a for a, b in zip(ends[warmup:], ends[warmup + 1:], strict=False)]
    steps: dict[str, list[float]] = {}
    for h in hist:
        for k, v in (h.get("steps") or {}).items():
            steps.setdefault(k, []).append(v)
    return {
        "batches": len(recs), "records_per_batch": statistics.median(r.records for r in recs),
        "batch_s": statistics.median(r.seconds for r in recs), "cycle_s": statistics.median(cycles) if cycles else None,
        "steps": {k: round(statistics.median(v), 4) for k, v in steps.items()},
        **({"latency_p50_s": round(_quantile(latencies, 0.5), 3), "latency_p99_s": round(_quantile(latencies, 0.99), 3),
            "latency_records": len(latencies)} if latencies else {}),
        **prof,
    }


def _spark_profile(runner: Any, marks: dict[str, Any], warmup: int, batches: int) -> dict[str, Any]:
    """Per batch after the warm-up: Py4J round trips (the profile's own status-tracker calls
    at the two marks excepted), Spark jobs, stages and tasks (each stage's tasks)."""
    tracker = runner.job.spark.sparkContext.statusTracker()
    before, after = set(marks[f"jobs_{warmup}"]), marks[f"jobs_{warmup + batches}"]
    jobs = [j for j in after if j not in before]
    stages: list[tuple[str, int]] = []
    for j in jobs:
        info = tracker.getJobInfo(j)
        for sid in info.stageIds if info else []:
            st = tracker.getStageInfo(sid)
            if st is not None:
                stages.append((st.name.split(" at ")[0], st.numTasks))
    return {"py4j_per_batch": (marks[f"py4j_{warmup + batches}"] - marks[f"py4j_{warmup}"]) / batches,
            "spark_jobs_per_batch": len(jobs) / batches, "spark_stages_per_batch": len(stages) / batches,
            "spark_tasks_per_batch": sum(n for _, n in stages) / batches,
            "stage_tasks": sorted({f"{name}: {n}" for name, n in stages})}


def _quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def spark_baseline(batches: int, warmup: int) -> dict[str, Any]:
    """Spark's own stateful aggregation, almost empty micro-batches: median triggerExecution."""
    from pyspark.sql import functions as F

    from keyscale.runtime.driver.session import spark_session

    spark = spark_session("local[2]")
    tmp = tempfile.mkdtemp(prefix="ks-spark-empty-")
    df = spark.readStream.format("rate").option("rowsPerSecond", 1).load().select((F.col("value") % 1000).cast("string").alias("key"))
    q = (df.groupBy("key").count().writeStream.outputMode("update").format("noop").option("checkpointLocation", tmp)
         .trigger(processingTime="0 seconds").start())
    while q.lastProgress is None or q.lastProgress["batchId"] < warmup + batches:
        time.sleep(0.2)
    q.stop()
    prog = [p for p in q.recentProgress if p["batchId"] >= warmup]
    return {"batches": len(prog), "batch_s": statistics.median(p["durationMs"]["triggerExecution"] / 1000 for p in prog),
            "records_per_batch": statistics.median(p["numInputRows"] for p in prog)}


def compare(a: str, b: str, rounds: int, argv: list[str], spark: bool = False) -> None:
    """A B A B (with ``spark``: A B Spark A B Spark, Spark's run with ``PYTHONPATH=B``)."""
    runs: dict[str, list[dict[str, Any]]] = {a: [], b: [], **({"spark": []} if spark else {})}
    for r in range(rounds):
        for src in runs:
            env = {**os.environ, "PYTHONPATH": b if src == "spark" else src}
            extra = ["--spark"] if src == "spark" else []
            out = subprocess.run([sys.executable, __file__, "--json", *argv, *extra], env=env, capture_output=True, text=True, check=False)
            if out.returncode != 0:
                sys.stderr.write(out.stderr[-4000:])
                raise SystemExit(f"the run with PYTHONPATH={src} failed")
            res = json.loads(out.stdout.strip().splitlines()[-1])
            runs[src].append(res)
            if src == "spark":
                print(f"round {r + 1} spark: batch {res['batch_s']:.3f} s (its median triggerExecution), load {_load()}", flush=True)
                continue
            lat = f", latency p50 {res['latency_p50_s']:.3f} s p99 {res['latency_p99_s']:.3f} s" if "latency_p50_s" in res else ""
            print(f"round {r + 1} {src}: batch {res['batch_s']:.3f} s, cycle {res['cycle_s']:.3f} s{lat}, steps {res['steps']}, "
                  f"load {_load()}", flush=True)
    for src, rs in runs.items():
        lat = (f", latency p50 {statistics.median(x['latency_p50_s'] for x in rs):.3f} s p99 {statistics.median(x['latency_p99_s'] for x in rs):.3f} s"
               if all("latency_p50_s" in x for x in rs) else "")
        cycle = f", cycle {statistics.median(x['cycle_s'] for x in rs):.3f} s" if src != "spark" else ""
        ratio = (f", {statistics.median(x['batch_s'] for x in rs) / statistics.median(x['batch_s'] for x in runs['spark']):.2f}x Spark's"
                 if spark and src != "spark" else "")
        print(f"{src}: median over {len(rs)} runs: batch {statistics.median(x['batch_s'] for x in rs):.3f} s{cycle}{lat}{ratio}")


def _load() -> str:
    """The 1-minute load average (``uptime``'s first figure)."""
    return f"{os.getloadavg()[0]:.1f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--records", type=int, default=0, help="records appended after each batch (read by the next)")
    ap.add_argument("--interval", default="1 millisecond", help="the trigger interval")
    ap.add_argument("-p", "--parallelism", type=int, default=2)
    ap.add_argument("--rate", type=float, default=0.0, help="records/s appended by a producer; latency measured")
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    ap.add_argument("--profile", action="store_true", help="also Py4J round trips and Spark jobs, stages, tasks per batch")
    ap.add_argument("--spark", action="store_true", help="Spark's own stateful aggregation instead")
    ap.add_argument("--compare", nargs=2, metavar=("SRC_A", "SRC_B"), help="A B A B in fresh processes, PYTHONPATH=SRC")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--with-spark", action="store_true", help="with --compare: Spark's own empty micro-batch in each round too")
    a = ap.parse_args(argv)
    if a.compare:
        passed = ["--batches", str(a.batches), "--warmup", str(a.warmup), "--records", str(a.records), "--interval", a.interval,
                  "-p", str(a.parallelism), "--rate", str(a.rate)]
        compare(a.compare[0], a.compare[1], a.rounds, passed, a.with_spark)
        return 0
    res = spark_baseline(a.batches, a.warmup) if a.spark else one(a.batches, a.records, a.warmup, a.interval, a.parallelism, a.rate, a.profile)
    if a.json:
        print(json.dumps(res))
    else:
        for k, v in res.items():
            print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
