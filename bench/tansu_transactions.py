"""What a Kafka broker tells consumers about aborted transactions: a raw Fetch, not a client's view.

    PYTHONPATH=src .venv/bin/python bench/tansu_transactions.py            # a private Tansu
    PYTHONPATH=src .venv/bin/python bench/tansu_transactions.py --bootstrap HOST:PORT

A ``read_committed`` consumer hides an aborted transaction's records only with the broker's
help (KIP-98): the Fetch response carries the partition's ``last_stable_offset`` and an
``aborted_transactions`` list (producer id, first offset), and the log holds a control batch
(an ABORT or COMMIT marker) where each transaction ended. A check of Kafka output can tell
committed records from aborted ones honestly only from what the broker really provides, so
this script asks the broker directly (Fetch v4, hand-encoded: no client library filters the
answer) after four transactions on one partition:

1. committed (``commit_transaction``);
2. aborted by its producer (``abort_transaction``) after its records were flushed;
3. left open by a producer SIGKILLed after its flush, then fenced by a new producer with the
   same ``transactional.id`` (``init_transactions``), which aborts it;
4. committed again (so every marker above is followed by a committed record).

It prints, per isolation level, the high watermark, the last stable offset, the aborted
transactions list, and every batch (offsets, producer id, transactional/control flags, the
marker's type), then what a ``read_committed`` confluent-kafka consumer returns.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

from chaos_kafka import raw_fetch

TOPIC = "tansu-txn-check"


# -- the transactions -------------------------------------------------------------------------------


def _producer(bootstrap: str, txn_id: str) -> Any:
    from confluent_kafka import Producer

    p = Producer({"bootstrap.servers": bootstrap, "transactional.id": txn_id, "transaction.timeout.ms": 60_000, "log_level": 3})
    p.init_transactions(30)
    return p


def _send(p: Any, label: str, n: int = 3) -> None:
    p.begin_transaction()
    for i in range(n):
        p.produce(TOPIC, value=f"{label}-{i}".encode(), partition=0)
    p.flush(30)


def child(bootstrap: str) -> None:
    """Transaction 3's producer: sends, flushes, says so, then waits to be SIGKILLed."""
    p = _producer(bootstrap, "check-killed")
    _send(p, "killed-then-fenced")
    print("flushed", flush=True)
    time.sleep(600)


def read_committed_view(bootstrap: str) -> list[str]:
    from confluent_kafka import Consumer, KafkaError, TopicPartition

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "check", "isolation.level": "read_committed",
                  "enable.partition.eof": True, "enable.auto.commit": False, "log_level": 3})
    c.assign([TopicPartition(TOPIC, 0, 0)])
    seen: list[str] = []
    deadline = time.monotonic() + 20
    try:
        while time.monotonic() < deadline:
            for m in c.consume(100, timeout=0.5):
                if m.error() is None:
                    seen.append(f"{m.offset()}:{m.value().decode()}")
                elif m.error().code() == KafkaError._PARTITION_EOF:
                    return seen
    finally:
        c.close()
    return seen


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bootstrap", help="a broker to ask (default: start a private Tansu)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child)
        return 0
    broker = None
    if args.bootstrap:
        bootstrap = args.bootstrap
    else:
        from keyscale.kafka.broker import find_tansu, start_tansu

        broker = start_tansu()
        bootstrap = broker.bootstrap
        version = subprocess.run([str(find_tansu()), "--version"], capture_output=True, text=True).stdout.strip()
        print(f"broker: {version} at {bootstrap}")
    try:
        from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

        admin = AdminClient({"bootstrap.servers": bootstrap})
        admin.create_topics([NewTopic(TOPIC, 1)])[TOPIC].result(30)
        p1 = _producer(bootstrap, "check-a")
        _send(p1, "committed-1")
        p1.commit_transaction(30)
        _send(p1, "aborted-by-producer")
        p1.abort_transaction(30)
        kid = subprocess.Popen([sys.executable, __file__, "--child", bootstrap], stdout=subprocess.PIPE, text=True, env=os.environ)
        assert kid.stdout is not None and kid.stdout.readline().strip() == "flushed"
        os.kill(kid.pid, signal.SIGKILL)
        kid.wait()
        open_view = raw_fetch(bootstrap, TOPIC, 0, 1)
        print("\nwhile transaction 3 is open (its producer killed, not yet fenced), read_committed fetch:")
        print(f"  high_watermark {open_view['high_watermark']}, last_stable_offset {open_view['last_stable_offset']}")
        p3 = _producer(bootstrap, "check-killed")  # same transactional.id: fences the dead producer, aborting its transaction
        p3.close() if hasattr(p3, "close") else None
        _send(p1, "committed-2")
        p1.commit_transaction(30)
        time.sleep(1)
        for isolation, name in ((0, "read_uncommitted"), (1, "read_committed")):
            r = raw_fetch(bootstrap, TOPIC, 0, isolation)
            print(f"\nraw Fetch v4, isolation {name}:")
            print(f"  error {r['error_code']}, high_watermark {r['high_watermark']}, last_stable_offset {r['last_stable_offset']}, "
                  f"aborted_transactions {'null' if r['aborted_transactions_null'] else r['aborted_transactions']}")
            for b in r["batches"]:
                print("  " + json.dumps({k: v for k, v in b.items() if k != "record_offsets"}))
        print("\nconfluent-kafka consumer, isolation.level=read_committed, sees:")
        for v in read_committed_view(bootstrap):
            print(f"  {v}")
    finally:
        if broker is not None:
            broker.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
