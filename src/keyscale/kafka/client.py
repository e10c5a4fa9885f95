"""Kafka clients as keyscale uses them: settings, errors, and the true end of partitions.

keyscale's own settings are applied under the user's ``options`` (which win), except
those the exactly-once protocols depend on: a user setting that contradicts one of those
is an error naming it, never silently replaced.
"""

from __future__ import annotations

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
    "fetch.wait.max.ms": "50",
    "log_level": "3",
}


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


def true_ends(consumer: Any, topic: str, partitions: Sequence[int], known: Mapping[int, int], timeout: float = 10.0) -> list[int]:
    """Per partition, the offset after its last readable record (the last stable offset
    under ``read_committed``), as a fetch reports it.

    ListOffsets is asked first; some brokers (Tansu 0.6) answer it with the first offset
    of the last record batch + 1, which is never past the true end. A fetch from there
    (or from the end seen before, if further) reports the true end: an end-of-partition
    event at it, or the fetch's high watermark once a record arrives. The fetch is capped
    small; the records it returns are dropped (the readers read them).
    """
    from confluent_kafka import KafkaError, TopicPartition

    start: dict[int, int] = {}
    for p in partitions:
        try:
            _, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout, cached=False)
        except Exception as e:
            raise KafkaConnectorError(f"Kafka topic {topic!r}, partition {p}: the broker did not tell its end offset: {e}") from None
        start[p] = max(int(high), known.get(p, 0), 0)
    consumer.assign([TopicPartition(topic, p, o) for p, o in start.items()])
    ends: dict[int, int] = {}
    deadline = time.monotonic() + timeout
    while len(ends) < len(start):
        if time.monotonic() > deadline:
            missing = sorted(set(start) - set(ends))
            raise KafkaConnectorError(f"Kafka topic {topic!r}: no answer on the end of partitions {missing} within {timeout:.0f} s")
        for m in consumer.consume(num_messages=len(start), timeout=0.2):
            p = m.partition()
            if p in ends:
                continue
            err = m.error()
            if err is None:
                ends[p] = max(int(consumer.get_watermark_offsets(TopicPartition(topic, p), cached=True)[1]), m.offset() + 1)
            elif err.code() == KafkaError._PARTITION_EOF:
                ends[p] = int(m.offset())
            elif not err.retriable():
                raise KafkaConnectorError(f"Kafka topic {topic!r}, partition {p}: {err.str()}")
            if p in ends:
                consumer.incremental_unassign([TopicPartition(topic, p)])
    consumer.unassign()
    return [ends[p] for p in partitions]
