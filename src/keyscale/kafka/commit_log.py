"""The Kafka sink's commit log ``<topic>.keyscale-commits``: reading and writing its records.

One partition, compacted. Each record says that one output task of one batch committed its
transaction (the record is in that transaction): key ``<lineage>:<batch>:<task>``, value
``{"lineage", "batch", "task", "rows", "tasks", "epoch"}`` (``tasks``: how many output tasks
the batch was split into, None where Spark could not tell before running it; ``epoch``: the
run's epoch, 0 outside a job). Keys are unique per (lineage, batch, task), so compaction
keeps every record; retention would delete them, and a restart after that would write
again output that is already in the topic.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from keyscale.checkpoint.lineage import Action, Lineage, Marker, decide
from keyscale.errors import OutputError
from keyscale.kafka.client import KafkaConnectorError, connection_options

log = logging.getLogger("keyscale")

COMMIT_LOG_SUFFIX = ".keyscale-commits"
_KAFKA_DEFAULT_RETENTION_MS = 604_800_000  # 7 days


def record(lineage: str, batch: int, task: int, rows: int, tasks: int | None, epoch: int) -> tuple[bytes, bytes]:
    """A commit record's key and value.

    >>> record("L", 3, 1, 10, 4, 2)
    (b'L:3:1', b'{"lineage": "L", "batch": 3, "task": 1, "rows": 10, "tasks": 4, "epoch": 2}')
    """
    value = {"lineage": lineage, "batch": batch, "task": task, "rows": rows, "tasks": tasks, "epoch": epoch}
    return f"{lineage}:{batch}:{task}".encode(), json.dumps(value).encode()


def reader(bootstrap: str, options: Mapping[str, Any], isolation: str) -> Any:
    """A consumer that reads to partition ends (the commit log, output checks), with the
    connection settings of ``options``."""
    from confluent_kafka import Consumer

    return Consumer({"bootstrap.servers": bootstrap, "group.id": "keyscale", "enable.partition.eof": True,
                     "enable.auto.commit": False, "isolation.level": isolation, "log_level": 3,
                     **connection_options(options)})


def _parsed(value: bytes | None) -> dict[str, Any] | None:
    try:
        r = json.loads(value or b"")
    except ValueError:
        return None  # not a keyscale commit record
    return r if isinstance(r, dict) else None


def read(consumer: Any, topic: str, start: int, timeout: float = 30.0) -> Iterator[dict[str, Any]]:
    """Commit records of the commit log from ``start`` to its end (its last stable offset,
    for a ``read_committed`` consumer)."""
    yield from read_until(consumer, topic, start, None, timeout)


# The longest one turn of the read loop below waits for a record; a turn ends as soon as one
# comes, so the read ends as soon as it is at its end.
_CONSUME_WAIT_S = 0.05


def read_until(consumer: Any, topic: str, start: int, end: int | None, timeout: float) -> Iterator[dict[str, Any]]:
    """Commit records from ``start`` on, to the end: the first end-of-partition the consumer
    reaches (``end`` None), or the first at ``end`` or past it. A ``read_committed``
    consumer's end is the last stable offset, before a transaction still open; reading to
    an ``end`` past it waits (up to ``timeout``) for that transaction to end. A read to
    ``end`` ends once the consumer's position is there (every record before it delivered);
    an end the broker reported short (Tansu) is still past every committed record, since
    a transaction's marker follows its records (:func:`end_offset`)."""
    from confluent_kafka import KafkaError, TopicPartition

    if end is not None and max(start, 0) >= end:
        return  # nothing between them (an end-of-partition event would come after the fetch wait)
    consumer.assign([TopicPartition(topic, 0, max(start, 0))])
    deadline = time.monotonic() + timeout
    try:
        while True:
            # What is fetched already, or else the next record as soon as it comes with the rest
            # of its fetch: a batch consume() would wait its whole timeout for 1000 records a
            # commit log seldom has (55 ms of every Kafka sink task's check,
            # bench/kafka_task_cost.py). A short end (Tansu's) may end the read at the first
            # record of a record batch: the batch's other records come in the same fetch.
            msgs = consumer.consume(num_messages=1000, timeout=0)
            if not msgs and (first := consumer.poll(_CONSUME_WAIT_S)) is not None:
                msgs = [first, *consumer.consume(num_messages=1000, timeout=0)]
            if not msgs and time.monotonic() > deadline:
                held = f" to offset {end} (a transaction on it stayed open)" if end is not None else " to its end"
                raise KafkaConnectorError(f"Kafka commit log {topic!r} could not be read{held} within {timeout:.0f} s")
            for m in msgs:
                err = m.error()
                if err is None:
                    r = _parsed(m.value())
                    if r is not None:
                        yield r
                elif err.code() == KafkaError._PARTITION_EOF:
                    if end is None or (m.offset() or 0) >= end:
                        return
                elif not err.retriable():
                    raise KafkaConnectorError(f"Kafka commit log {topic!r}: {err.str()}")
            # Every record before the consumer's position is delivered (it moves past a
            # transaction's marker too): at ``end``, the read is done. The end-of-partition
            # event says the same, but only once a fetch at the end is answered, after the
            # broker's fetch.wait.max.ms (500 ms): ~1 s of every Kafka sink task, each batch.
            if end is not None and consumer.position([TopicPartition(topic, 0)])[0].offset >= end:
                return
    finally:
        consumer.unassign()


def end_offset(consumer: Any, topic: str) -> int:
    """The commit log's end as the broker reports it to ``consumer``: its last stable
    offset for a ``read_committed`` one, its high watermark for a ``read_uncommitted`` one.
    Never past the true end; Tansu may report less (the first offset of its last record
    batch + 1), which is still past every record whose transaction committed, since the
    transaction's commit marker follows it."""
    from confluent_kafka import TopicPartition

    return int(consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=10, cached=False)[1])


def read_committed_to_end(bootstrap: str, options: Mapping[str, Any], topic: str, start: int, timeout: float) -> Iterator[dict[str, Any]]:
    """The committed records from ``start`` to the high watermark seen now: past the stable
    offset where a transaction still open holds it (waiting up to ``timeout`` for it to
    end), so that no record committed before this call is missed."""
    probe = reader(bootstrap, options, "read_uncommitted")  # read_committed, ListOffsets answers the stable offset
    try:
        end = end_offset(probe, topic)
    finally:
        probe.close()
    consumer = reader(bootstrap, options, "read_committed")
    try:
        yield from read_until(consumer, topic, start, end, timeout)
    finally:
        consumer.close()


def committed_before(bootstrap: str, options: Mapping[str, Any], topic: str, start: int, lineage: str, batch: int, task: int,
                     timeout: float) -> bool:
    """Whether (``batch``, ``task``) of ``lineage`` committed already, in any epoch: an
    earlier attempt of the task (a task retry, a stage retry whose attempt number is 0
    again, a zombie run's task). Called after the task's ``init_transactions``, which ended
    every earlier attempt's transaction (committed or aborted), so reading to the high
    watermark seen now finds its record if there is one; a sibling's transaction still open
    before that holds the stable offset, and the read waits for it (up to ``timeout``)."""
    return any(r.get("lineage") == lineage and r.get("batch") == batch and r.get("task") == task
               for r in read_committed_to_end(bootstrap, options, topic, start, timeout))


# -- the topic: compacted -----------------------------------------------------------------------


def retention_problem(config: Mapping[str, str]) -> str | None:
    """What in a commit log's topic settings lets the broker delete commit records; None if
    nothing does (``cleanup.policy=compact``, or no time or size limit).

    >>> retention_problem({"cleanup.policy": "compact"}) is None
    True
    >>> retention_problem({"cleanup.policy": "delete", "retention.ms": "604800000"})
    'has cleanup.policy=delete and retention.ms=604800000 (7 days)'
    >>> retention_problem({"cleanup.policy": "compact,delete", "retention.ms": "-1", "retention.bytes": "-1"}) is None
    True
    >>> retention_problem({})
    "does not report its cleanup.policy (Kafka's default: delete, after retention.ms=604800000, 7 days)"
    """
    policy = (config.get("cleanup.policy") or "").replace(" ", "")
    if not policy:
        return f"does not report its cleanup.policy (Kafka's default: delete, after retention.ms={_KAFKA_DEFAULT_RETENTION_MS}, 7 days)"
    if policy == "compact":
        return None
    ms, size = config.get("retention.ms"), config.get("retention.bytes")
    limits = []
    if ms is None:
        limits.append(f"retention.ms not reported (Kafka's default: {_KAFKA_DEFAULT_RETENTION_MS}, 7 days)")
    elif int(ms) >= 0:
        limits.append(f"retention.ms={ms} ({int(ms) / 86_400_000:g} days)")
    if size is not None and int(size) >= 0:
        limits.append(f"retention.bytes={size}")
    return f"has cleanup.policy={policy} and {' and '.join(limits)}" if limits else None


def ensure(admin: Any, output: str, topic: str) -> None:
    """Create the commit log ``topic`` of the sink's ``output`` topic (one partition,
    ``cleanup.policy=compact``), or check an existing one's settings: if retention can
    delete its records, a warning names the topic and the setting to change (a warning, not
    an error: a job whose restarts never come later than the retention is safe, and an
    operator may not be allowed to change topic settings)."""
    from confluent_kafka.admin import ConfigResource, NewTopic, ResourceType  # type: ignore[attr-defined]

    futures = admin.create_topics([NewTopic(topic, 1, config={"cleanup.policy": "compact"})])
    try:
        futures[topic].result(timeout=30)
        log.info("created Kafka topic %r (compacted): keyscale's commit log of the Kafka topic %r", topic, output)
        return
    except Exception as e:
        if "TOPIC_ALREADY_EXISTS" not in str(e) and "already exists" not in str(e).lower():
            raise OutputError(f"Kafka sink (topic {output!r}): cannot create its commit log topic {topic!r}: {e}") from None
    try:
        answer = admin.describe_configs([ConfigResource(ResourceType.TOPIC, topic)])
        config = {k: str(v.value) for f in answer.values() for k, v in f.result(timeout=30).items() if v.value is not None}
    except Exception as e:  # a broker that does not answer DescribeConfigs: said, not fatal
        log.warning("Kafka sink (topic %r): could not read the settings of its commit log %r (%s); make sure it is compacted "
                    "(cleanup.policy=compact)", output, topic, e)
        return
    problem = retention_problem(config)
    if problem:
        log.warning(
            "Kafka sink (topic %r): its commit log %r %s: a restart after its records are deleted writes output again that "
            "consumers already saw. Set cleanup.policy=compact on it (kafka-configs.sh --alter --entity-type topics "
            "--entity-name %s --add-config cleanup.policy=compact)", output, topic, problem, topic)


# -- lineages -------------------------------------------------------------------------------------


def other_output(records: Iterable[Mapping[str, Any]], mine: Lineage, committed: int) -> list[str]:
    """The output in the topic that ``mine`` does not own, by the lineage rules of every sink
    (:func:`keyscale.checkpoint.lineage.decide`), as phrases for a warning: an ancestor's
    batches after its fork batch (superseded: this lineage writes those batches again), and
    batches of lineages that are not this one's ancestors (another job on the topic, or this
    job before it started without its checkpoint). Kafka output cannot be moved aside, so
    both stay visible to consumers.

    >>> me = Lineage("b" * 32, {"a" * 32: 2})
    >>> recs = [{"lineage": "a" * 32, "batch": n} for n in range(6)] + [{"lineage": "x" * 32, "batch": 7}]
    >>> other_output(recs, me, 2)  # doctest: +NORMALIZE_WHITESPACE
    ['lineage aaaaaaaaaaaaaaaa: batches 3-5, superseded (this run descends from it at batch 2 and writes them again)',
     'lineage xxxxxxxxxxxxxxxx: batch 7, of another lineage (another job on this topic, or this job before a start
      without its checkpoint)']
    """
    superseded: dict[str, set[int]] = {}
    foreign: dict[str, set[int]] = {}
    for r in records:
        lid, batch = r.get("lineage"), r.get("batch")
        if not isinstance(lid, str) or not isinstance(batch, int):
            continue
        action = decide(True, Marker(lid), batch, mine, committed)
        if action is Action.SUPERSEDE:
            superseded.setdefault(lid, set()).add(batch)
        elif action is Action.REFUSE:
            foreign.setdefault(lid, set()).add(batch)
    out = [f"lineage {lid[:16]}: {_batches(b)}, superseded (this run descends from it at batch {mine.ancestors[lid]} and writes them again)"
           for lid, b in sorted(superseded.items())]
    out += [f"lineage {lid[:16]}: {_batches(b)}, of another lineage (another job on this topic, or this job before a start without its checkpoint)"
            for lid, b in sorted(foreign.items())]
    return out


def _batches(batches: Iterable[int]) -> str:
    """``batch 3``, ``batches 3-5``, ``batches 1, 3-5``.

    >>> _batches([5, 3, 4, 1]), _batches([2])
    ('batches 1, 3-5', 'batch 2')
    """
    ns = sorted(set(batches))
    runs: list[list[int]] = []
    for n in ns:
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    text = ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)
    return f"batch {text}" if len(ns) == 1 else f"batches {text}"
