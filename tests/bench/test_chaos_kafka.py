"""The chaos harness's reading of Kafka output (bench/chaos_kafka.py) against a real broker:
records are told committed, aborted or open by the control batches the broker wrote, not by
what a ``read_committed`` client is served (on Tansu 0.6 that includes aborted records)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from typing import Any

from conftest import ROOT, new_topic

# bench/ holds scripts with generic names: on sys.path only for this import.
sys.path.insert(0, str(ROOT / "bench"))
try:
    import chaos_kafka
finally:
    sys.path.remove(str(ROOT / "bench"))


def _producer(bootstrap: str, txn_id: str) -> Any:
    from confluent_kafka import Producer

    p = Producer({"bootstrap.servers": bootstrap, "transactional.id": txn_id, "log_level": 3})
    p.init_transactions(30)
    return p


def _row(key: str, batch: int) -> bytes:
    return json.dumps({"key": key, "window_start": "2026-01-01T00:00:00+00:00", "count": 1, "total": 5, "last": 1, "batch": batch}).encode()


def test_committed_aborted_and_fenced_transactions_are_told_apart(kafka_broker: Any) -> None:
    b = kafka_broker.bootstrap
    topic = new_topic(b, 2, "chaosout")
    p = _producer(b, f"{topic}-a")
    p.begin_transaction()
    p.produce(topic, _row("committed", 0), partition=0)
    p.produce(topic, _row("committed", 0), partition=1)
    p.commit_transaction(30)
    p.begin_transaction()
    p.produce(topic, _row("aborted", 1), partition=0)
    p.flush(30)
    p.abort_transaction(30)
    # A producer killed inside its transaction, then fenced by a new one with its transactional.id.
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from confluent_kafka import Producer
        p = Producer({{"bootstrap.servers": {b!r}, "transactional.id": "{topic}-k", "log_level": 3}})
        p.init_transactions(30)
        p.begin_transaction()
        p.produce({topic!r}, {_row("fenced", 2)!r}, partition=1)
        p.flush(30)
        print("flushed", flush=True)
        time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline().strip() == "flushed"
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    _producer(b, f"{topic}-k")  # fences: the broker writes an ABORT marker
    open_p = _producer(b, f"{topic}-o")
    open_p.begin_transaction()
    open_p.produce(topic, _row("open", 3), partition=0)
    open_p.flush(30)

    view = chaos_kafka.read_transactional(b, topic, 2)
    keys = {name: sorted(json.loads(v)["key"] for v in vals if v) for name, vals in
            (("committed", view.committed), ("aborted", view.aborted), ("open", view.open))}
    assert keys == {"committed": ["committed", "committed"], "aborted": ["aborted", "fenced"], "open": ["open"]}
    assert view.markers == {"COMMIT": 2, "ABORT": 2}
    open_p.abort_transaction(30)


def test_the_model_reads_the_whole_input_topic(kafka_broker: Any) -> None:
    import time

    b = kafka_broker.bootstrap
    topic = new_topic(b, 3, "chaosin")
    gen = chaos_kafka.KafkaProducerThread(b, topic, rate=300, keys=5, seed=1)
    gen.start()
    time.sleep(1.5)
    undelivered = gen.stop()
    df = chaos_kafka.input_frame(b, topic, 3)
    assert undelivered == 0 and len(df) == gen.produced > 0
    assert set(df.columns) == {"key", "value", "ts"} and df["value"].between(1, 100).all()
