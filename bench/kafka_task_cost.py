"""What one Kafka sink task pays every batch besides its records (issue 35's profile).

    PYTHONPATH=src .venv/bin/python bench/kafka_task_cost.py --rounds 60 --records 3000

Against a local Tansu broker (started here, in memory), the calls a ``KafkaSink`` task
makes per batch (``keyscale/kafka/sink.py`` ``_write_task``), timed one by one: a new
transactional producer and its ``init_transactions`` (which fences the task's earlier
attempts), the commit-log check (``commit_log.committed_before``: has this batch's task
committed already?), and the transaction itself (``--records`` records and the commit
record, flushed and committed). The producer is made as the sink makes it (connected by a
metadata request first, ``_transactional_producer``) and, beside it, plainly (its
``init_transactions`` at once). Prints each step's median over the rounds after the first
two, how many took over 400 ms, the slowest, and with ``--verbose`` every round's milliseconds.
"""

from __future__ import annotations

import argparse
import statistics
import time

from keyscale.kafka import commit_log
from keyscale.kafka.broker import start_tansu
from keyscale.kafka.sink import _producer_settings, _transactional_producer

LOG = "out" + commit_log.COMMIT_LOG_SUFFIX


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--records", type=int, default=3000)
    ap.add_argument("--verbose", action="store_true")
    a = ap.parse_args()
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

    broker = start_tansu()
    try:
        admin = AdminClient({"bootstrap.servers": broker.bootstrap})
        for topic, parts in (("out", 2), (LOG, 1)):
            admin.create_topics([NewTopic(topic, parts, 1)])[topic].result()
        steps: dict[str, list[float]] = {"plain producer + init_transactions": [], "connected producer + init_transactions": [],
                                         "commit-log check": [], f"transaction of {a.records}": []}
        for batch in range(a.rounds):
            t = time.perf_counter()
            plain = Producer(_producer_settings(broker.bootstrap, {}, "bench-task-1", 60_000))
            plain.init_transactions(60)
            steps["plain producer + init_transactions"].append(time.perf_counter() - t)
            plain.close()
            t0 = time.perf_counter()
            p = _transactional_producer(broker.bootstrap, {}, "bench-task-0", 60_000)
            p.init_transactions(60)
            t1 = time.perf_counter()
            commit_log.committed_before(broker.bootstrap, {}, LOG, 0, "bench", batch, 0, 30)
            t2 = time.perf_counter()
            p.begin_transaction()
            for j in range(a.records):
                p.produce("out", value=b'{"key":"k%d","count":%d}' % (j, batch), key=b"k%d" % j)
            key, value = commit_log.record("bench", batch, 0, a.records, 2, 0)
            p.produce(LOG, key=key, value=value, partition=0)
            p.flush(60)
            p.commit_transaction(60)
            t3 = time.perf_counter()
            p.close()  # as the task does
            for xs, x in zip(list(steps.values())[1:], (t1 - t0, t2 - t1, t3 - t2), strict=True):
                xs.append(x)
        for name, xs in steps.items():
            print(f"{name}: median {1000 * statistics.median(xs[2:]):.1f} ms, {sum(x > 0.4 for x in xs)} of {len(xs)} over 400 ms, "
                  f"slowest {1000 * max(xs):.0f} ms" + (f"; rounds (ms): {[round(1000 * x) for x in xs]}" if a.verbose else ""))
    finally:
        broker.stop()


if __name__ == "__main__":
    main()
