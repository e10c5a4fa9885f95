"""A reader task's per-record cost: one batch's read of a Kafka topic, timed by part (issue 35).

    PYTHONPATH=src .venv/bin/python bench/kafka_read.py [--records 50000] [--rounds 15]

Starts a private Tansu broker (in memory), writes ``--records`` records per partition in
the latency benchmark's format (4 partitions; JSON values ``{"key", "value", "ts", "seq"}``,
string keys ``user-<n>``), then reads a batch of ``--records`` offsets split over the 4
partitions the way a reader task does (``KafkaLog.read_ranges_timed``: one consumer for
the ranges, then ``json_values`` decoding), ``--rounds`` times, from offsets spread over the
history. Prints the median seconds of the whole read and of its two parts (the consume loop
into Python lists; the decode into typed columns), and microseconds per record. A B: run it
with ``PYTHONPATH`` at each tree's ``src``.
"""

from __future__ import annotations

import argparse
import statistics
import time

PARTITIONS = 4


def _fill(bootstrap: str, topic: str, per_partition: int, keys: int) -> None:
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, PARTITIONS)])[topic].result(timeout=30)
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20, "log_level": 3})
    i = 0
    for part in range(PARTITIONS):
        for _ in range(per_partition):
            k = b"user-%05d" % (i * 7919 % keys)
            v = b'{"key":"%s","value":%d,"ts":"2026-01-01T00:00:00Z","seq":%d}' % (k, i % 100, i)
            while True:
                try:
                    p.produce(topic, key=k, value=v, partition=part)
                    break
                except BufferError:
                    p.poll(0.01)
            i += 1
    p.flush(60)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=50_000, help="offsets a read covers (all partitions)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--keys", type=int, default=10_000)
    a = ap.parse_args(argv)

    from keyscale.kafka import ranges as kafka_ranges
    from keyscale.kafka.broker import start_tansu
    from keyscale.kafka.source import KafkaLog, json_values

    broker = start_tansu()
    try:
        per = a.records // PARTITIONS
        _fill(broker.bootstrap, "in", per * 3, a.keys)
        log = KafkaLog(broker.bootstrap, "in", decoder=json_values("key string, value long, ts timestamp"))
        consume_s: list[float] = []
        real_consume = kafka_ranges._consume

        def timed_consume(*args: object, **kw: object) -> None:
            t = time.perf_counter()
            real_consume(*args, **kw)  # type: ignore[arg-type]
            consume_s.append(time.perf_counter() - t)

        kafka_ranges._consume = timed_consume  # type: ignore[assignment]
        whole, decode = [], []
        for r in range(a.rounds):
            start = (r * per // 3) % (2 * per)
            ranges = [(p, start, start + per) for p in range(PARTITIONS)]
            t0 = time.perf_counter()
            raws = log._read_raw(ranges)
            t1 = time.perf_counter()
            rows = sum(log._decode(raw).num_rows for raw, _ in raws)
            t2 = time.perf_counter()
            assert rows == per * PARTITIONS, rows
            whole.append(t2 - t0)
            decode.append(t2 - t1)
        skip = 2  # the first reads warm the broker's and the client's caches
        med = {k: statistics.median(v[skip:]) for k, v in (("read", whole), ("consume loop", consume_s), ("decode", decode))}
        n = per * PARTITIONS
        print(f"{n:,} records a read, {a.rounds - skip} rounds after {skip}: " + ", ".join(
            f"{k} {v * 1000:.1f} ms ({v / n * 1e6:.2f} us/record)" for k, v in med.items()))
    finally:
        broker.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
