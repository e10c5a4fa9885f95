"""Kafka clients as keyscale uses them: settings, errors, and the true end of partitions.

keyscale's own settings are applied under the user's ``options`` (which win), except
those the exactly-once protocols depend on: a user setting that contradicts one of those
is an error naming it, never silently replaced.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

from keyscale.sources.partitioned import LogError

# Settings keyscale's readers need: without them a reader cannot tell the end of a
# partition (EOF events) and would commit offsets the manifest does not know about.
_READER_REQUIRED = {"enable.partition.eof": "true", "enable.auto.commit": "false", "enable.auto.offset.store": "false"}
_READER_DEFAULTS = {
    "group.id": "keyscale",  # librdkafka wants one; keyscale never joins the group (it assigns partitions itself)
    "isolation.level": "read_committed",
    # How long the broker may take to gather a fetch's records. Tansu 0.6 answers a fetch
    # whose storage read outlasts it with no records and no error, even with the records
    # there: at 50 ms, on a busy broker, every fetch of a planned range came back empty
    # (docs/design.md "Kafka", chaos run K4).
    "fetch.wait.max.ms": "500",
    "log_level": "3",
}

# For the clients keyscale makes and drops every batch (the driver's one-call consumers: the
# end probe, the partition count; each sink task's transactional producer), under the
# user's options (docs/design.md, "Clients made every batch"): connect to each broker as soon
# as it is known. With librdkafka's sparse connections, a client whose bootstrap broker has
# just named the cluster's brokers waits ~50 ms before connecting to the one it needs (the
# transaction coordinator, a partition's leader): most of a sink task's producer set-up
# (55 of 60 ms) and 3-8 ms of a ~21 ms end probe, against a local broker. Such a client talks to
# most of a topic's brokers anyway.
EAGER_CONNECTIONS = {"enable.sparse.connections": "false"}


class KafkaConnectorError(LogError):
    """A Kafka broker, topic or setting keyscale cannot work with."""


def reader_config(bootstrap: str, options: Mapping[str, Any] | None, what: str) -> dict[str, Any]:
    """Consumer settings: keyscale's defaults, the user's ``options`` over them, and the
    settings keyscale's offsets depend on (a contradicting option is an error)."""
    opts = {k: (str(v).lower() if isinstance(v, bool) else str(v) if isinstance(v, int | float) else v) for k, v in (options or {}).items()}
    for key, needed in _READER_REQUIRED.items():
        if key in opts and str(opts[key]).lower() != needed:
            raise KafkaConnectorError(f"{what}: option {key}={opts[key]!r} cannot be served: keyscale's readers need {key}={needed}")
    if "bootstrap.servers" in opts and opts["bootstrap.servers"] != bootstrap:
        raise KafkaConnectorError(f"{what}: option bootstrap.servers={opts['bootstrap.servers']!r} contradicts bootstrap={bootstrap!r}")
    return {**_READER_DEFAULTS, **opts, **_READER_REQUIRED, "bootstrap.servers": bootstrap}


# What Kafka's record format (v2) adds to a record's key and value: its length, attributes,
# timestamp and offset deltas, key and value lengths, and header count, as varints.
RECORD_OVERHEAD_BYTES = 10
# Settings that bound a fetch's size: a user who sets any of them sets them all.
_DEFAULT_FETCH_MAX_BYTES = 52_428_800  # librdkafka's fetch.max.bytes
_FETCH_SIZE_KEYS = ("fetch.max.bytes", "max.partition.fetch.bytes", "message.max.bytes", "receive.message.max.bytes")


def range_fetch_limit(records: int, bytes_per_record: float | None, options: Mapping[str, Any]) -> dict[str, Any]:
    """Fetch-size settings for a consumer that reads one planned range of ``records``
    records, each about ``bytes_per_record`` bytes (the last read's mean; None when there is
    none yet: no limit).

    Why: Tansu 0.6 answers a fetch only once it has read the fetch's byte limit or its max
    wait has passed, reading on past the range into records appended meanwhile. At the end
    of a long partition that is written to all the time, it reads on for the whole wait
    (500 ms, :data:`_READER_DEFAULTS`): measured in a job at 5,000 records/s, a read of
    ~1,500 records took ~510 ms from 68,000 offsets a partition on (docs/design.md, "Kafka").
    Asking for 10 % and 1 KiB more than the range holds ends the fetch there; a broker
    that answers with what it has (Kafka) is not slowed by a limit above the range, and
    one below it costs a second fetch. The user's own fetch sizes, if set, win.

    >>> range_fetch_limit(1_000, 90.0, {})["fetch.max.bytes"]
    100024
    >>> range_fetch_limit(1_000, None, {}), range_fetch_limit(1_000, 90.0, {"fetch.max.bytes": 10**6})
    ({}, {})
    >>> range_fetch_limit(10**6, 1_000.0, {})  # more than librdkafka fetches at once anyway
    {}
    """
    if bytes_per_record is None or any(k in options for k in _FETCH_SIZE_KEYS):
        return {}
    limit = max(1_000, math.ceil(records * bytes_per_record * 11 / 10) + 1_024)
    if limit >= _DEFAULT_FETCH_MAX_BYTES:
        return {}  # librdkafka's own limit is the lower one
    # librdkafka wants fetch.max.bytes >= message.max.bytes (at least 1,000), and
    # receive.message.max.bytes (default 100 MB) >= fetch.max.bytes + 512, which holds below 50 MiB.
    return {"fetch.max.bytes": limit, "max.partition.fetch.bytes": limit, "message.max.bytes": min(limit, 1_000_000)}


def connection_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """The settings of a client's ``options`` that say how to reach and log in to the
    brokers (security, SASL, TLS, sockets, client id): what every other client keyscale
    opens for the same connector (admin, commit log readers) needs too."""
    return {k: v for k, v in options.items() if k.startswith(("security.", "sasl.", "ssl.", "socket.", "client."))}


def partition_count(admin_or_consumer: Any, topic: str, bootstrap: str, timeout: float = 10.0) -> int:
    """The topic's number of partitions; a clear error when it does not exist."""
    try:
        # All topics, not list_topics(topic): asking for one topic by name lets a broker
        # with auto-creation on (Tansu) create it, and a typo would become a new topic.
        md = admin_or_consumer.list_topics(timeout=timeout)
    except Exception as e:
        raise KafkaConnectorError(f"Kafka broker {bootstrap} did not answer for topic {topic!r}: {e}") from None
    t = md.topics.get(topic)
    if t is None or t.error is not None or not t.partitions:
        reason = t.error.str() if t is not None and t.error is not None else "no such topic"
        raise KafkaConnectorError(f"Kafka topic {topic!r} on {bootstrap} cannot be read: {reason}")
    return len(t.partitions)


class FetchEnds:
    """librdkafka's statistics callback (``stats_cb``), kept for the end probe: per
    partition of ``topic``, the end the consumer's latest Fetch response reported.

    That end is the response's last stable offset under ``read_committed`` (its high
    watermark under ``read_uncommitted``, or from a broker that sends no stable offset):
    librdkafka keeps it as the partition's ``ls_offset``, the offset at which it raises the
    end-of-partition event, and shows it nowhere but in its statistics.
    ``get_watermark_offsets(cached=True)`` is no substitute: it is the response's *high
    watermark*, which under ``read_committed`` can be past an open transaction's records.
    ``settings()`` go into the consumer's configuration; librdkafka then calls this object
    every ``interval_ms`` from the consumer's ``consume()``.
    """

    def __init__(self, topic: str, interval_ms: int = 100) -> None:
        self.topic = topic
        self.interval_ms = interval_ms
        self.ends: dict[int, int] = {}
        self.reports = 0

    def settings(self) -> dict[str, Any]:
        return {"statistics.interval.ms": str(self.interval_ms), "stats_cb": self}

    def __call__(self, stats: str) -> None:
        self.reports += 1
        try:
            partitions = json.loads(stats)["topics"][self.topic]["partitions"]
        except (ValueError, KeyError, TypeError):
            return  # no fetch of the topic yet (or statistics of another shape): nothing learnt
        for key, part in partitions.items():
            end = part.get("ls_offset") if isinstance(part, dict) else None
            # Negative: no Fetch response for the partition yet (-1001), or librdkafka's
            # internal partition -1 for messages not yet assigned to one.
            if isinstance(end, int) and end >= 0 and int(key) >= 0:
                self.ends[int(key)] = end

    def end(self, partition: int) -> int | None:
        return self.ends.get(partition)


# How long one consume() of the end probe waits: it returns when this is up (or 100
# messages came), so it bounds each turn of the probe's loop, and a probe at an idle end
# takes about one turn after the answer (0.2 s here was most of a probe: 2 a batch).
_PROBE_WAIT_S = 0.02


def true_ends(consumer: Any, topic: str, partitions: Sequence[int], known: Mapping[int, int], timeout: float = 10.0,
              fetch_ends: FetchEnds | None = None) -> list[int]:
    """Per partition, the offset after its last readable record (the last stable offset
    under ``read_committed``), as a Fetch response reports it.

    ``consumer`` should be made with ``fetch_ends.settings()`` in its configuration (see
    :class:`FetchEnds`); without ``fetch_ends`` only the end-of-partition event counts.

    Why a fetch: ListOffsets, asked first, is answered by some brokers (Tansu 0.6) with the
    first offset of the partition's last record batch + 1, short of the end, and would
    leave records unread until more arrive. A fetch from there (or from the end seen
    before, if further) learns the end from the response: librdkafka raises the
    end-of-partition event when a fetch at the end is answered, and keeps the end each
    response reports (``fetch_ends``). The first of the two decides. The end-of-partition
    event alone is not enough on Tansu: it answers some fetches for an offset inside a
    record batch with no records and no error (docs/reliability.md, run L), so a fetch
    that starts inside the last batch may never get to the end; and a fetch that starts
    past the stable offset (Tansu's ListOffsets can answer inside an open transaction's
    batch) is never at the end either. Records the fetch returns are dropped (the readers
    read them); a record at offset ``o`` makes the end at least ``o + 1``.

    What the end is for, and why it is never past uncommitted data: it ends the ranges a
    batch plans (``reader.plan_batch``), written to the batch's intent before any record is
    read and read again as they are by a replay; a job that starts at ``latest`` starts
    there; the next start checks the committed positions against it; lag is measured to
    it. Under ``read_committed`` every record below the last stable offset is decided
    (committed, or aborted), so a range that ends there holds the same records whenever it
    is read, which is what a replay relies on, and its read never waits. An end past an
    open transaction's first record would put undecided records in the range: the read
    would wait at the stable offset until the transaction ends (and fail after
    ``READ_TIMEOUT_S``, every time on a broker whose stable offset is stuck, as Tansu's can
    be), and a job starting there at ``latest`` would never read that transaction's
    records once committed. So the end is always an end a fetch response reported
    (librdkafka's ``ls_offset``: the stable offset under ``read_committed``), or a record's
    offset + 1 under the isolation level the readers use; neither is past the stable
    offset, and the stable offset never moves back, so an end from an earlier response is
    at worst short, never past: records below the true end but past it are read by the
    next batch. Never the high watermark (``get_watermark_offsets(cached=True)``), which is
    past an open transaction's records. When no response reports an end within
    ``timeout`` (the broker does not answer fetches), the probe fails naming the topic and
    partitions: a guess would be worse than no batch.
    """
    from confluent_kafka import KafkaError, TopicPartition

    start = _fetch_from(consumer, topic, partitions, known, timeout)
    consumer.assign([TopicPartition(topic, p, o) for p, o in start.items()])
    ends: dict[int, int] = {}
    seen: dict[int, int] = {}  # partition -> after the last record the fetch returned
    deadline = time.monotonic() + timeout
    while len(ends) < len(start):
        if time.monotonic() > deadline:
            missing = sorted(set(start) - set(ends))
            raise KafkaConnectorError(f"Kafka topic {topic!r}: no answer on the end of partitions {missing} within {timeout:.0f} s")
        done: list[int] = []
        for m in consumer.consume(num_messages=max(len(start), 100), timeout=_PROBE_WAIT_S):
            p = m.partition()
            if p in ends:
                continue
            err = m.error()
            if err is None:
                seen[p] = max(seen.get(p, 0), int(m.offset()) + 1)
            elif err.code() == KafkaError._PARTITION_EOF:
                ends[p] = int(m.offset())
                done.append(p)
            elif not err.retriable():
                raise KafkaConnectorError(f"Kafka topic {topic!r}, partition {p}: {err.str()}")
        # The statistics (served by consume() above) carry the end of the latest response,
        # whether it held records, none, or the end-of-partition event.
        for p in start:
            reported = fetch_ends.end(p) if fetch_ends is not None else None
            if p not in ends and reported is not None:
                ends[p] = max(reported, seen.get(p, 0))
                done.append(p)
        if done:
            consumer.incremental_unassign([TopicPartition(topic, p) for p in done])
    consumer.unassign()
    return [ends[p] for p in partitions]


def _fetch_from(consumer: Any, topic: str, partitions: Sequence[int], known: Mapping[int, int], timeout: float) -> dict[int, int]:
    """Per partition, where the end probe's fetch starts: the end ListOffsets tells, or the
    end seen before (``known``) where that is further (see :func:`true_ends`).

    One ListOffsets request for all the partitions (``offsets_for_times`` at the "latest"
    timestamp, -1), not one a partition: a request costs the broker time that grows with the
    partition (Tansu: 4 partitions of ~110,000 offsets, 42 ms one by one against 22 ms in one
    request, docs/benchmarks.md "Latency: the table again"), and the probe runs between
    every two batches."""
    from confluent_kafka import TopicPartition

    try:
        answered = consumer.offsets_for_times([TopicPartition(topic, p, -1) for p in partitions], timeout=timeout)
    except Exception as e:
        raise KafkaConnectorError(f"Kafka topic {topic!r}, partitions {list(partitions)}: the broker did not tell their end offsets: {e}") from None
    start: dict[int, int] = {}
    for tp in answered:
        if tp.error is not None:
            raise KafkaConnectorError(f"Kafka topic {topic!r}, partition {tp.partition}: the broker did not tell its end offset: {tp.error}")
        start[tp.partition] = max(int(tp.offset), known.get(tp.partition, 0), 0)
    missing = sorted(set(partitions) - set(start))
    if missing:
        raise KafkaConnectorError(f"Kafka topic {topic!r}, partitions {missing}: the broker did not tell their end offsets")
    return start
