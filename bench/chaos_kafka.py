"""Kafka in and out for ``bench/chaos.py`` (issue 32): the input topic and its producer, output
topics, and reading output back by what the broker wrote, not by what a client shows.

**Input** (``--source kafka``): a topic of ``--partitions`` partitions on a private Tansu
broker, filled by :class:`KafkaProducerThread` at ``--rate`` records/s (JSON values ``key``,
``value``, ``ts``; Kafka key = the record's key, partitioned with the Java clients'
murmur2). The producer is idempotent and not transactional, so every record it wrote is
readable; the job reads the topic with keyscale's own Kafka source, and the harness's model
reads it whole through :class:`~keyscale.kafka.source.KafkaLog` (the same ``PartitionedLog``
interface as keyscale's log), so the check stays a model of the whole input.

**Output** (``--sink kafka``): each job directory writes its windows to its own topic with
``KafkaSink`` (the job stamps each row with its batch number, so a replay's row can be told
from a re-emission of a window). A ``read_committed`` consumer cannot be the check on Tansu
0.6: it serves aborted transactions' records (``bench/tansu_transactions.py`` shows the raw
Fetch: ``aborted_transactions`` always empty, last stable offset = high watermark once no
transaction is open). But Tansu does write Kafka's control batches into the log, a COMMIT or
ABORT marker per producer id where each transaction ended, and a raw Fetch returns them. So
:func:`read_transactional` reads the raw log (a hand-encoded Fetch v4: no client filters the
answer) and decides, as a KIP-98 broker's aborted-transaction index does from the same
markers, which records are committed: a transactional record is committed iff the next
control batch of its producer id on that partition is a COMMIT. Records of transactions still
open (no marker yet) are counted apart. Nothing of keyscale's own (commit records, manifests)
takes part in deciding which output counts.
"""

from __future__ import annotations

import io
import json
import random
import socket
import struct
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

INPUT_DDL = "key string, value long, ts timestamp"


# -- a minimal Fetch v4 (the first version with isolation_level and aborted_transactions) ------------


def _str(s: str) -> bytes:
    b = s.encode()
    return struct.pack(">h", len(b)) + b


def _fetch_request(topic: str, partition: int, offset: int, isolation: int, correlation: int) -> bytes:
    body = struct.pack(">iiiib", -1, 200, 1, 4 << 20, isolation)  # replica, max wait ms, min bytes, max bytes, isolation
    body += struct.pack(">i", 1) + _str(topic) + struct.pack(">i", 1) + struct.pack(">iqi", partition, offset, 4 << 20)
    header = struct.pack(">hhi", 1, 4, correlation) + _str("keyscale-chaos")  # Fetch = api key 1, version 4
    msg = header + body
    return struct.pack(">i", len(msg)) + msg


def _recv(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(min(n - len(out), 1 << 20))
        if not chunk:
            raise ConnectionError("the broker closed the connection")
        out += chunk
    return bytes(out)


def _varint(buf: io.BytesIO) -> int:
    shift = value = 0
    while True:
        b = buf.read(1)[0]
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return (value >> 1) ^ -(value & 1)  # zigzag


def _skip_bytes(buf: io.BytesIO) -> bytes | None:
    n = _varint(buf)
    return buf.read(n) if n >= 0 else None


def parse_batches(records: bytes) -> list[dict[str, Any]]:
    """The record batches (magic 2) of a Fetch response's records field: offsets, producer
    id, transactional and control flags, a control batch's marker (ABORT/COMMIT), the values."""
    out: list[dict[str, Any]] = []
    buf = io.BytesIO(records)
    while buf.tell() + 12 <= len(records):
        base, length = struct.unpack(">qi", buf.read(12))
        body = buf.read(length)
        if len(body) < length:
            break  # a partial batch at the end of the response: fetched again from its offset
        b = io.BytesIO(body)
        _epoch, magic, _crc, attrs, last_delta, _t0, _t1, pid, _pepoch, _seq, count = struct.unpack(">ibIhiqqqhii", b.read(49))
        if attrs & 0x07:
            raise ValueError(f"batch at offset {base} is compressed (attributes {attrs}): not decoded here")
        batch: dict[str, Any] = {"offsets": [base, base + last_delta], "producer_id": pid, "records": count,
                                 "transactional": bool(attrs & 0x10), "control": bool(attrs & 0x20), "magic": magic}
        values: list[str | None] = []
        offsets: list[int] = []
        for _ in range(count):
            _varint(b)  # record length
            b.read(1)  # attributes
            _varint(b)  # timestamp delta
            delta = _varint(b)
            key = _skip_bytes(b)
            value = _skip_bytes(b)
            for _h in range(_varint(b)):
                _skip_bytes(b)
                _skip_bytes(b)
            if attrs & 0x20:  # a control record's key: version int16, type int16 (0 ABORT, 1 COMMIT)
                kind = struct.unpack(">hh", (key or b"")[:4])[1]
                batch["marker"] = {0: "ABORT", 1: "COMMIT"}.get(kind, kind)
            else:
                offsets.append(base + delta)
                values.append(value.decode(errors="replace") if value is not None else None)
        if not attrs & 0x20:
            batch["values"] = values
            batch["record_offsets"] = offsets
        out.append(batch)
    return out


def raw_fetch(bootstrap: str, topic: str, partition: int, isolation: int, timeout: float = 60.0) -> dict[str, Any]:
    """Every batch of one partition from offset 0 to the high watermark, as the broker sends
    it (``isolation`` 0 read_uncommitted, 1 read_committed), with the last response's high
    watermark, last stable offset and the union of its ``aborted_transactions`` lists. A
    read that cannot reach its end (read_committed: the last stable offset) in ``timeout`` s
    is an error, not a short read."""
    host, port = bootstrap.rsplit(":", 1)
    result: dict[str, Any] = {"batches": [], "aborted_transactions": [], "aborted_transactions_null": False}
    offset = 0
    deadline = time.monotonic() + timeout
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        correlation = 0
        while time.monotonic() < deadline:
            correlation += 1
            sock.sendall(_fetch_request(topic, partition, offset, isolation, correlation))
            size = struct.unpack(">i", _recv(sock, 4))[0]
            buf = io.BytesIO(_recv(sock, size))
            _corr, _throttle, ntopics = struct.unpack(">iii", buf.read(12))
            if ntopics != 1:
                raise ValueError(f"Fetch answered {ntopics} topics")
            buf.read(struct.unpack(">h", buf.read(2))[0])
            (nparts,) = struct.unpack(">i", buf.read(4))
            if nparts != 1:
                raise ValueError(f"Fetch answered {nparts} partitions")
            _p, err, high, lso = struct.unpack(">ihqq", buf.read(22))
            (naborted,) = struct.unpack(">i", buf.read(4))
            for _ in range(max(naborted, 0)):
                a = dict(zip(("producer_id", "first_offset"), struct.unpack(">qq", buf.read(16)), strict=True))
                if a not in result["aborted_transactions"]:
                    result["aborted_transactions"].append(a)
            result["aborted_transactions_null"] |= naborted < 0
            (rlen,) = struct.unpack(">i", buf.read(4))
            batches = parse_batches(buf.read(max(rlen, 0)))
            result.update({"error_code": err, "high_watermark": high, "last_stable_offset": lso})
            result["batches"] += batches
            if err:
                raise ValueError(f"{topic}[{partition}]: Fetch at offset {offset} answered error code {err}")
            end = lso if isolation == 1 and lso >= 0 else high  # read_committed is served up to the stable offset
            if not batches:
                if offset >= end:
                    break
                # Tansu 0.6 now and then answers a fetch inside a record batch with no records and
                # no error (docs/reliability.md, run L): ask again; never read less than there is.
                time.sleep(0.1)
                continue
            offset = batches[-1]["offsets"][1] + 1
            if offset >= end:
                break
        else:
            raise TimeoutError(f"{topic}[{partition}]: not read to its high watermark in {timeout:.0f} s")
    return result


@dataclass
class TransactionalView:
    """A topic's records split by the markers the broker wrote."""

    committed: list[str | None] = field(default_factory=list)
    aborted: list[str | None] = field(default_factory=list)
    open: list[str | None] = field(default_factory=list)  # no marker yet for their producer id
    served_read_committed: list[str | None] = field(default_factory=list)  # what the broker serves a read_committed fetch
    markers: dict[str, int] = field(default_factory=dict)


def read_transactional(bootstrap: str, topic: str, partitions: int) -> TransactionalView:
    """Each record of ``topic`` as committed, aborted or open, from the control batches in the
    raw log (see the module doc); plus what a ``read_committed`` Fetch is served (the broker's
    last stable offset and aborted-transaction list applied, as a KIP-98 client would)."""
    view = TransactionalView()
    for p in range(partitions):
        raw = raw_fetch(bootstrap, topic, p, 0, timeout=600)
        pending: dict[int, list[str | None]] = defaultdict(list)
        for b in raw["batches"]:
            pid = int(b["producer_id"])
            if b["control"]:
                marker = str(b.get("marker"))
                view.markers[marker] = view.markers.get(marker, 0) + 1
                (view.committed if marker == "COMMIT" else view.aborted).extend(pending.pop(pid, []))
            elif b["transactional"]:
                pending[pid].extend(b["values"])
            else:
                view.committed.extend(b["values"])
        for values in pending.values():
            view.open.extend(values)
        served = raw_fetch(bootstrap, topic, p, 1, timeout=600)
        lso = int(served["last_stable_offset"])
        aborted_from = {int(a["producer_id"]): int(a["first_offset"]) for a in served["aborted_transactions"]}
        for b in served["batches"]:
            if b["control"]:
                continue
            skip = b["transactional"] and int(b["producer_id"]) in aborted_from and b["offsets"][0] >= aborted_from[int(b["producer_id"])]
            if not skip:
                view.served_read_committed.extend(v for v, o in zip(b["values"], b["record_offsets"], strict=True) if lso < 0 or o < lso)
    return view


# -- topics -------------------------------------------------------------------------------------


def create_topic(bootstrap: str, topic: str, partitions: int) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 3})
    admin.create_topics([NewTopic(topic, partitions)])[topic].result(30)


class KafkaProducerThread(threading.Thread):
    """The input's generator: ``rate`` records/s over ``keys`` keys into ``topic`` (a daemon
    thread; :meth:`stop` flushes). Values 1..100 and keys drawn from ``random.Random(seed)``;
    ``ts`` is the wall clock when the record is produced (event time in order, as the log
    generator's)."""

    def __init__(self, bootstrap: str, topic: str, rate: float, keys: int, seed: int) -> None:
        super().__init__(daemon=True, name="chaos-kafka-producer")
        from confluent_kafka import Producer

        self.producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "linger.ms": 20,
                                  "partitioner": "murmur2_random", "log_level": 3})
        self.topic, self.rate, self.keys = topic, rate, keys
        self.rng = random.Random(seed)
        self._stop_event = threading.Event()
        self.produced = 0
        self.failed = 0

    def _delivered(self, err: Any, _msg: Any) -> None:
        if err is not None:
            self.failed += 1

    def run(self) -> None:
        t0 = time.monotonic()
        while not self._stop_event.is_set():
            due = int((time.monotonic() - t0) * self.rate)
            while self.produced < due:
                ts = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
                key = f"k{self.rng.randrange(self.keys)}"
                value = json.dumps({"key": key, "value": self.rng.randint(1, 100), "ts": ts})
                try:
                    self.producer.produce(self.topic, key=key.encode(), value=value.encode(), on_delivery=self._delivered)
                except BufferError:
                    self.producer.poll(0.05)
                    continue
                self.produced += 1
            self.producer.poll(0.05)

    def stop(self) -> int:
        """Stop and flush; returns the records not delivered (they are not in the topic, so
        the model, which reads the topic, does not expect them either)."""
        self._stop_event.set()
        self.join(30)
        return int(self.producer.flush(60)) + self.failed


# -- the output read back ------------------------------------------------------------------------

OUTPUT_COLUMNS = ["key", "window_start", "count", "total", "last", "batch"]


def _frame(values: list[str | None]) -> Any:
    import pandas as pd

    rows = [json.loads(v) for v in values if v is not None]
    return pd.DataFrame(rows, columns=OUTPUT_COLUMNS) if rows else pd.DataFrame(columns=OUTPUT_COLUMNS)


def _tasks(values: list[str | None]) -> set[tuple[str, int, int]]:
    out = set()
    for v in values:
        r = json.loads(v or "null")
        if isinstance(r, dict):
            out.add((str(r.get("lineage")), int(r.get("batch", -1)), int(r.get("task", -1))))
    return out


def kafka_rows(bootstrap: str, topic: str, partitions: int) -> tuple[Any, dict[str, Any]]:
    """The output rows of ``topic`` whose transactions the broker marked committed (pandas,
    :data:`OUTPUT_COLUMNS`), and what else the topic holds: aborted and open records, the
    markers, what a ``read_committed`` fetch is served (Tansu: the aborted records too) and
    its rows written twice, and the sink's commit records by their transactions' markers.
    ``aborted_never_committed`` counts (batch, task) outputs whose commit record is only in
    aborted transactions: a broker that hides aborted records (KIP-98) hides those commit
    records from the sink's retry check too, so the task is written again; Tansu serves
    them, the check skips the task, and its rows are lost by this honest reading. Figures
    for the report, not part of the decision which rows count."""
    view = read_transactional(bootstrap, topic, partitions)
    served = _frame(view.served_read_committed)
    commits = read_transactional(bootstrap, topic + ".keyscale-commits", 1)
    committed_tasks, aborted_tasks = _tasks(commits.committed), _tasks(commits.aborted)
    info = {
        "records_committed": len(view.committed), "records_aborted": len(view.aborted), "records_open": len(view.open),
        "markers": view.markers,
        "read_committed_view": {"rows": len(served), "rows_written_twice": int(served.duplicated(["key", "window_start", "batch"]).sum())},
        "commit_records": {"committed": len(committed_tasks), "aborted": len(aborted_tasks),
                           "aborted_never_committed": len(aborted_tasks - committed_tasks), "open": len(commits.open)},
    }
    return _frame(view.committed), info


def input_frame(bootstrap: str, topic: str, partitions: int) -> Any:
    """The input topic's records (pandas: key, value, ts as ISO text) for the model, read raw to
    each partition's high watermark: not through ListOffsets and a client's end probe, which
    Tansu's empty fetch answers can hang (run L). The producer is not transactional, so every
    record counts; a transactional or aborted record here would be an error of the harness."""
    import pandas as pd

    view = read_transactional(bootstrap, topic, partitions)
    if view.aborted or view.open:
        raise ValueError(f"input topic {topic!r} holds transactional records ({len(view.aborted)} aborted, {len(view.open)} open)")
    rows = [json.loads(v) for v in view.committed if v is not None]
    return pd.DataFrame(rows, columns=["key", "value", "ts"]) if rows else pd.DataFrame(columns=["key", "value", "ts"])
