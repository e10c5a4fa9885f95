"""How the test broker's reads slow down as a partition's history grows (Tansu, in memory).

    PYTHONPATH=src .venv/bin/python bench/tansu_history.py                # 10, 60, 120, 180 s at 5,000/s
    PYTHONPATH=src .venv/bin/python bench/tansu_history.py --marks 10,60 --rate 20000

Why it matters: ``bench/latency.py`` runs an engine for minutes against one Tansu broker,
and every batch's end probe and read fetch from the end of partitions that keep growing.
If the broker answers more slowly as a partition grows, the later phases of a long run
measure the broker's history, not the engine; this script measures that without any
engine. A producer process writes ``--rate`` records/s (the latency bench's records and
producer settings: JSON values, ``linger.ms=5``) to a 4-partition topic. At each mark
(seconds since it started) this process times, five times each (medians printed):

- an end probe of the topic (``KafkaLog.end_offsets``, keyscale's own, as the jobs use it);
- a read of the last ``--records`` records of each partition (``KafkaLog.read_ranges_timed``,
  one consumer for the four ranges, as a small batch's stage task reads);

and the same two on a topic of the same broker that is only 3 s old (a second producer
writes it at the same rate for those 3 s): same broker, same load, short history.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from typing import Any

PARTITIONS = 4


def _produce(bootstrap: str, topic: str, rate: int, stop: Any) -> None:
    from confluent_kafka import Producer

    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, "log_level": 3})
    i, t0 = 0, time.time()
    while not stop.is_set():
        due = int((time.time() - t0) * rate)
        while i < due:
            k = b"user-%05d" % (i % 10_000)
            p.produce(topic, key=k, value=b'{"key":"%s","value":%d,"ts":"2026-01-01T00:00:00Z","seq":%d}' % (k, i % 100, i))
            i += 1
        p.poll(0)
        time.sleep(0.005)
    p.flush(30)


def _timed(log: Any, records: int, rounds: int = 5) -> tuple[float, float]:
    """Median ms of an end probe and of a read of the last ``records`` of each partition."""
    probes, reads = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        ends = log.end_offsets()
        probes.append((time.perf_counter() - t0) * 1000)
        t0 = time.perf_counter()
        log.read_ranges_timed([(p, max(0, ends[p] - records), ends[p]) for p in range(PARTITIONS)])
        reads.append((time.perf_counter() - t0) * 1000)
        time.sleep(0.2)
    return statistics.median(probes), statistics.median(reads)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rate", type=int, default=5000, help="records/s written to the long topic")
    ap.add_argument("--marks", default="10,60,120,180", help="seconds of history at which to measure")
    ap.add_argument("--records", type=int, default=500, help="records read at the end of each partition")
    a = ap.parse_args(argv)
    from confluent_kafka.admin import AdminClient, NewTopic

    from keyscale.kafka.broker import start_tansu
    from keyscale.kafka.source import KafkaLog, json_values

    marks = [float(m) for m in a.marks.split(",")]
    broker = start_tansu()
    stop = mp.Event()
    writer = None
    try:
        admin = AdminClient({"bootstrap.servers": broker.bootstrap, "log_level": 3})
        topics = ["long"] + [f"fresh{i}" for i in range(len(marks))]
        for f in admin.create_topics([NewTopic(t, PARTITIONS, 1) for t in topics]).values():
            f.result()
        time.sleep(0.5)
        decoder = json_values("key string, value long, ts timestamp")
        writer = mp.Process(target=_produce, args=(broker.bootstrap, "long", a.rate, stop))
        writer.start()
        long_log = KafkaLog(broker.bootstrap, "long", decoder, None, "earliest", None)
        print(f"Tansu, {a.rate:,} records/s to a {PARTITIONS}-partition topic; medians of 5 (ms):\n")
        print(f"| history | end probe | read of {PARTITIONS} x {a.records} records | on a topic 3 s old: end probe | read |")
        print("|---|---|---|---|---|")
        started = time.time()
        for i, mark in enumerate(marks):
            time.sleep(max(0.0, started + mark - time.time()))
            fresh_stop = mp.Event()
            fresh = mp.Process(target=_produce, args=(broker.bootstrap, f"fresh{i}", a.rate, fresh_stop))
            fresh.start()
            time.sleep(3)
            probe, read = _timed(long_log, a.records)
            fprobe, fread = _timed(KafkaLog(broker.bootstrap, f"fresh{i}", decoder, None, "earliest", None), a.records)
            fresh_stop.set()
            fresh.join(30)
            print(f"| {mark:.0f} s | {probe:.0f} | {read:.0f} | {fprobe:.0f} | {fread:.0f} |", flush=True)
    finally:
        stop.set()
        if writer is not None:
            writer.join(30)
        broker.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
