"""Kafka -> keyed running count -> Kafka at P=2, on a real Kafka-protocol broker (Tansu).

    .venv/bin/python bench/kafka.py --repeats 3

Starts a private Tansu broker (keyscale.kafka.broker) on 127.0.0.1. The job is
``examples/kafka_running_count.py`` (JSON values {key, value, ts}, string keys
``user-<n>``, count and sum per key, KafkaSink with one transaction per task and batch).
The tasks take turns to commit (``KEYSCALE_KAFKA_SERIAL_COMMITS=1``, Tansu needs it)
unless the environment says otherwise; ``--compare-serial`` measures both.

1. Throughput: ``--records`` records produced first into a 4-partition topic, then the job
   runs until idle (8 batches' worth per partition cap): records/s = records / the job's wall
   time (in-process, Spark already started after the first repeat), and the steady rate
   (records / seconds of the batches after the first), medians over repeats.
2. Latency under a steady load, with a live rescale: a producer sends ``--rate`` records/s
   for ``--seconds`` s while the job runs; halfway, the job is asked for parallelism 3
   (``keyscale rescale``). A consumer reads the output with ``read_committed``. A record's
   latency is from its produce call to the arrival of the first output update of its key
   whose count includes it (p50, p99), for the whole run and for the 10 s after the rescale
   request. The largest gap between output arrivals is compared with the median batch time:
   a rescale without a gap in output beyond one batch keeps it below two batch times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any
from unittest import mock

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
JOB = ROOT / "examples" / "kafka_running_count.py"


def _topic(bootstrap: str, name: str, partitions: int) -> str:
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(name, partitions)])[name].result(timeout=30)
    return name


def _producer(bootstrap: str) -> Any:
    from confluent_kafka import Producer

    return Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, "partitioner": "murmur2_random", "log_level": 3})


def _event(i: int, keys: int) -> tuple[str, bytes]:
    key = f"user-{(i * 7919) % keys:05d}"
    return key, json.dumps({"key": key, "value": i % 100, "ts": "2026-01-01T00:00:00Z"}).encode()


def _run(bootstrap: str, src: str, out: str, job_dir: Path, parallelism: int, max_records: int, on_batch: Any = None) -> Any:
    from keyscale.runtime.driver.runner import JobRunner, RunOptions

    opts = RunOptions(job_file=str(JOB), job_dir=str(job_dir), parallelism=parallelism, until_idle=True,
                      args={"bootstrap": bootstrap, "input": src, "output": out, "max_records": str(max_records)})
    return JobRunner(opts, on_batch).run()


def throughput(bootstrap: str, tmp: Path, run: int, records: int, keys: int) -> dict[str, float]:
    src, out = _topic(bootstrap, f"tp-in-{run}", 4), _topic(bootstrap, f"tp-out-{run}", 4)
    p = _producer(bootstrap)
    for i in range(records):
        k, v = _event(i, keys)
        while True:
            try:
                p.produce(src, key=k.encode(), value=v)
                break
            except BufferError:
                p.poll(0.01)
    p.flush(60)
    started = time.perf_counter()
    summary = _run(bootstrap, src, out, tmp / f"tp-job-{run}", 2, max_records=records // 8)
    wall = time.perf_counter() - started
    steady = [b for b in summary.batches[1:] if b.records > 0]  # batch 0 pays for starting Python workers
    return {"records_per_s": records / wall, "wall_s": wall, "batches": float(len(summary.batches)),
            "steady_records_per_s": sum(b.records for b in steady) / sum(b.seconds for b in steady) if steady else float("nan")}


def latency(bootstrap: str, tmp: Path, run: int, rate: int, seconds: float, keys: int) -> dict[str, float]:
    from confluent_kafka import Consumer, KafkaError, TopicPartition

    src, out = _topic(bootstrap, f"lt-in-{run}", 4), _topic(bootstrap, f"lt-out-{run}", 4)
    produced: dict[str, list[float]] = defaultdict(list)  # key -> produce time of its n-th record
    arrivals: dict[str, list[tuple[int, float]]] = defaultdict(list)  # key -> (count, arrival)
    arrival_times: list[float] = []
    done = threading.Event()
    rescale_at: list[float] = []

    def produce() -> None:
        p = _producer(bootstrap)
        t0 = time.perf_counter()
        i = 0
        while (now := time.perf_counter()) - t0 < seconds:
            due = int((now - t0) * rate)
            while i < due:
                k, v = _event(i, keys)
                produced[k].append(time.perf_counter())
                p.produce(src, key=k.encode(), value=v)
                i += 1
            p.poll(0)
            time.sleep(0.005)
        p.flush(60)

    def consume() -> None:
        c = Consumer({"bootstrap.servers": bootstrap, "group.id": "bench", "isolation.level": "read_committed",
                      "enable.auto.commit": False, "fetch.wait.max.ms": 10, "log_level": 3})
        c.assign([TopicPartition(out, p, 0) for p in range(4)])
        while not done.is_set():
            for m in c.consume(num_messages=10_000, timeout=0.1):
                if m.error() is None:
                    now = time.perf_counter()
                    u = json.loads(m.value())
                    arrivals[u["key"]].append((int(u["count"]), now))
                    arrival_times.append(now)
                elif m.error().code() != KafkaError._PARTITION_EOF:
                    raise RuntimeError(m.error().str())
        c.close()

    from keyscale.checkpoint.jobdir import JobDir

    job_dir = tmp / f"lt-job-{run}"
    batch_seconds: list[float] = []
    started = time.perf_counter()

    def on_batch(rec: Any) -> None:
        batch_seconds.append(rec.seconds)
        if not rescale_at and time.perf_counter() - started > seconds / 2:
            rescale_at.append(time.perf_counter())
            JobDir(job_dir).request_rescale(3)

    producer = threading.Thread(target=produce)
    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    producer.start()
    time.sleep(1.0)  # the job starts with records waiting
    summary = _run(bootstrap, src, out, job_dir, 2, max_records=rate * 5, on_batch=on_batch)
    producer.join()
    time.sleep(2.0)
    done.set()
    consumer.join(10)
    lat, after = [], []
    for key, times in produced.items():
        updates = sorted(arrivals.get(key, []))
        j = 0
        for n, t in enumerate(times, start=1):
            while j < len(updates) and updates[j][0] < n:
                j += 1
            if j == len(updates):
                break  # not in the output (the job stopped first): left out
            lat.append(updates[j][1] - t)
            if rescale_at and rescale_at[0] <= t <= rescale_at[0] + 10:
                after.append(updates[j][1] - t)
    gaps = [b - a for a, b in zip(sorted(arrival_times), sorted(arrival_times)[1:], strict=False)]
    q = statistics.quantiles
    return {
        "p50_s": statistics.median(lat), "p99_s": q(lat, n=100)[98], "p99_after_rescale_s": q(after, n=100)[98] if len(after) > 100 else float("nan"),
        "max_gap_s": max(gaps) if gaps else float("nan"), "median_batch_s": statistics.median(batch_seconds),
        "measured": float(len(lat)), "rescales": float(len(summary.rescales)),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--records", type=int, default=400_000)
    ap.add_argument("--keys", type=int, default=10_000)
    ap.add_argument("--rate", type=int, default=5_000)
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument("--compare-serial", action="store_true",
                    help="each repeat runs the throughput job with parallel commits, then with serial ones (KEYSCALE_KAFKA_SERIAL_COMMITS)")
    ap.add_argument("--no-latency", action="store_true", help="skip the latency run")
    a = ap.parse_args(argv)
    from keyscale.kafka.broker import start_tansu
    from keyscale.kafka.sink import SERIAL_COMMITS_ENV

    # Tansu can stall read_committed readers when transactions end at once (its module
    # doc): serial commits unless the caller chose; --compare-serial runs both.
    os.environ.setdefault(SERIAL_COMMITS_ENV, "1")
    broker = start_tansu()
    tmp = Path(tempfile.mkdtemp(prefix="ks-kafka-bench-"))
    try:
        tps, lats, serial = [], [], []
        for r in range(a.repeats):
            with mock.patch.dict(os.environ, {SERIAL_COMMITS_ENV: "0"} if a.compare_serial else {}):
                tps.append(throughput(broker.bootstrap, tmp, r, a.records, a.keys))
            print(f"run {r} throughput{', parallel commits' if a.compare_serial else ''}: {tps[-1]}", flush=True)
            if a.compare_serial:
                with mock.patch.dict(os.environ, {SERIAL_COMMITS_ENV: "1"}):
                    serial.append(throughput(broker.bootstrap, tmp, r + a.repeats, a.records, a.keys))
                print(f"run {r} throughput, serial commits: {serial[-1]}", flush=True)
            if not a.no_latency:
                lats.append(latency(broker.bootstrap, tmp, r, a.rate, a.seconds, a.keys))
                print(f"run {r} latency: {lats[-1]}", flush=True)
        med = lambda rows, k: statistics.median(x[k] for x in rows)  # noqa: E731
        print(f"\nKafka -> running count -> Kafka, P=2, {a.records:,} records, {a.keys:,} string keys, medians of {a.repeats}:")
        print(f"  throughput: {med(tps, 'records_per_s'):,.0f} records/s end to end ({med(tps, 'wall_s'):.1f} s, {med(tps, 'batches'):.0f} batches); "
              f"steady batches {med(tps, 'steady_records_per_s'):,.0f} records/s")
        if serial:
            print(f"  serial commits: {med(serial, 'records_per_s'):,.0f} records/s end to end ({med(serial, 'wall_s'):.1f} s); "
                  f"steady batches {med(serial, 'steady_records_per_s'):,.0f} records/s "
                  f"({med(serial, 'steady_records_per_s') / med(tps, 'steady_records_per_s'):.2f}x of parallel commits)")
        if not lats:
            return 0
        print(f"  at {a.rate:,} records/s: latency p50 {med(lats, 'p50_s'):.2f} s, p99 {med(lats, 'p99_s'):.2f} s; "
              f"p99 in the 10 s after a live rescale 2->3: {med(lats, 'p99_after_rescale_s'):.2f} s")
        print(f"  largest gap between output arrivals {med(lats, 'max_gap_s'):.2f} s; median batch {med(lats, 'median_batch_s'):.2f} s")
    finally:
        broker.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
