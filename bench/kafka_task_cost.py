"""What Kafka costs a batch besides its records: a sink task's calls and the driver's end probe (issue 35's profile).

    PYTHONPATH=src .venv/bin/python bench/kafka_task_cost.py --rounds 40 --records 2000

Against a local Tansu broker (started here, in memory), timed one by one, with keyscale's
client settings and, beside them, with librdkafka's sparse connections (its default, which
keyscale's ``EAGER_CONNECTIONS`` turns off; given as a user option, which wins):

- the calls a ``KafkaSink`` task makes per batch (``keyscale/kafka/sink.py`` ``_write_task``):
  a new transactional producer and its ``init_transactions`` (which fences the task's
  earlier attempts), the commit-log check (``commit_log.committed_before``: has this
  batch's task committed already?), and the transaction itself (``--records`` records and
  the commit record, flushed and committed). The producer is made as the sink makes it
  (connected by a metadata request first, ``_transactional_producer``) and, beside it,
  plainly (its ``init_transactions`` at once);
- the driver's end probe (``KafkaLog.end_offsets``, twice a batch: the plan and the status)
  of a 4-partition topic while a producer thread sends ~5,000 records/s to it; also as it
  was before 4e7bfd9: sparse connections and librdkafka's statistics every 100 ms.

Prints each step's median over the rounds after the first two, how many took over 400 ms,
the slowest, and with ``--verbose`` every round's milliseconds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import threading
import time
from typing import Any

from keyscale.kafka import commit_log
from keyscale.kafka import source as kafka_source
from keyscale.kafka.broker import start_tansu
from keyscale.kafka.client import FetchEnds
from keyscale.kafka.sink import _producer_settings, _transactional_producer
from keyscale.kafka.source import KafkaLog

LOG = "out" + commit_log.COMMIT_LOG_SUFFIX
SPARSE = {"enable.sparse.connections": True}  # librdkafka's default


def _produce(bootstrap: str, topic: str, stop: threading.Event) -> None:
    """~5,000 records/s to ``topic`` until ``stop``."""
    from confluent_kafka import Producer

    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, "log_level": 3})
    i = 0
    while not stop.is_set():
        for _ in range(50):
            p.produce(topic, json.dumps({"key": f"user-{i % 10_000}", "value": i}).encode(), key=f"user-{i % 10_000}".encode())
            i += 1
        p.poll(0)
        time.sleep(0.01)
    p.flush(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--records", type=int, default=3000)
    ap.add_argument("--verbose", action="store_true")
    a = ap.parse_args()
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

    broker = start_tansu()
    stop = threading.Event()
    try:
        admin = AdminClient({"bootstrap.servers": broker.bootstrap})
        for topic, parts in (("out", 2), (LOG, 1), ("in", 4)):
            admin.create_topics([NewTopic(topic, parts, 1)])[topic].result()
        steps: dict[str, list[float]] = {}

        def timed(name: str, fn: Any) -> Any:
            t = time.perf_counter()
            out = fn()
            steps.setdefault(name, []).append(time.perf_counter() - t)
            return out

        for batch in range(a.rounds):
            for how, options in (("keyscale's settings", {}), ("sparse connections", SPARSE)):
                def plain(options: dict[str, Any] = options) -> None:
                    p = Producer(_producer_settings(broker.bootstrap, options, "bench-task-1", 60_000))
                    p.init_transactions(60)
                    p.close()

                timed(f"plain producer + init_transactions, {how}", plain)
                p = timed(f"connected producer + init_transactions, {how}", lambda options=options: _init(
                    _transactional_producer(broker.bootstrap, options, "bench-task-0", 60_000)))
                timed("commit-log check", lambda batch=batch: commit_log.committed_before(
                    broker.bootstrap, {}, LOG, 0, "bench", batch, 0, 30))
                timed(f"transaction of {a.records}", lambda p=p, batch=batch: _transaction(p, batch, a.records))
                p.close()  # as the task does
        threading.Thread(target=_produce, args=(broker.bootstrap, "in", stop), daemon=True).start()
        time.sleep(2)
        for _ in range(a.rounds):
            for how, options in (("keyscale's settings", {}), ("sparse connections", SPARSE)):
                log = KafkaLog(broker.bootstrap, "in", options=options)
                timed(f"end probe of 4 partitions at ~5,000 records/s, {how}", log.end_offsets)
            with _statistics_every_100_ms():
                log = KafkaLog(broker.bootstrap, "in", options=SPARSE)
                timed("end probe of 4 partitions at ~5,000 records/s, sparse connections and statistics every 100 ms "
                      "(before 4e7bfd9)", log.end_offsets)
        for name, xs in steps.items():
            print(f"{name}: median {1000 * statistics.median(xs[2:]):.1f} ms, {sum(x > 0.4 for x in xs)} of {len(xs)} over 400 ms, "
                  f"slowest {1000 * max(xs):.0f} ms" + (f"; rounds (ms): {[round(1000 * x) for x in xs]}" if a.verbose else ""))
    finally:
        stop.set()
        time.sleep(0.1)
        broker.stop()


class _FetchEndsEvery100ms(FetchEnds):
    def __init__(self, topic: str, interval_ms: int = 100) -> None:
        super().__init__(topic, 100)


@contextlib.contextmanager
def _statistics_every_100_ms() -> Any:
    """The end probe's statistics interval as it was before 4e7bfd9 (100 ms, whatever the
    partitions), for the probe made inside the block."""
    kafka_source.FetchEnds = _FetchEndsEvery100ms  # type: ignore[attr-defined]
    try:
        yield
    finally:
        kafka_source.FetchEnds = FetchEnds  # type: ignore[attr-defined]


def _init(p: Any) -> Any:
    p.init_transactions(60)
    return p


def _transaction(p: Any, batch: int, records: int) -> None:
    p.begin_transaction()
    for j in range(records):
        p.produce("out", value=b'{"key":"k%d","count":%d}' % (j, batch), key=b"k%d" % j)
    key, value = commit_log.record("bench", batch, 0, records, 2, 0)
    p.produce(LOG, key=key, value=value, partition=0)
    p.flush(60)
    p.commit_transaction(60)


if __name__ == "__main__":
    main()
