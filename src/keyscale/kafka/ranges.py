"""Reading planned ranges of a Kafka topic's partitions: the raw records
(:data:`RAW_SCHEMA`), exactly each range, past transactions' markers, with one consumer
for all the ranges of a read (a consumer's start and a fetch's round trip for each
partition in turn were most of a small batch's read). Decoding them, and the log's other
calls, are :class:`~keyscale.kafka.source.KafkaLog`'s."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from keyscale.kafka.client import RECORD_OVERHEAD_BYTES, range_fetch_limit
from keyscale.sources.partitioned import LogError

_RAW_FIELDS: list[pa.Field[Any]] = [
    pa.field("key", pa.binary()), pa.field("value", pa.binary()), pa.field("topic", pa.string()), pa.field("partition", pa.int32()),
    pa.field("offset", pa.int64()), pa.field("timestamp", pa.timestamp("ms", tz="UTC")),
]
RAW_SCHEMA = pa.schema(_RAW_FIELDS)
READ_TIMEOUT_S = 60.0  # no progress for this long on a planned range: the read fails with a message
# Per (bootstrap, topic), the mean size of a record in this process's last read of it (key,
# value and the record format's overhead): the next read's fetch limit (range_fetch_limit).
# Module-level, so that it outlives the KafkaLog a task unpickles: Spark reuses its Python
# workers across batches.
_RECORD_BYTES: dict[tuple[str, str], float] = {}


@dataclass
class _RangeRead:
    """One partition's range being read: where the read is, what it got."""

    partition: int
    start: int
    end: int
    position: int = -1
    progress: float = field(default_factory=time.monotonic)  # when the position last moved
    kind: str = "kafka CreateTime"
    keys: list[bytes | None] = field(default_factory=list)
    values: list[bytes | None] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    stamps: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.position = max(self.position, self.start)

    def move(self, position: int, now: float) -> None:
        if position > self.position:
            self.position, self.progress = position, now

    def table(self, topic: str) -> pa.Table:
        n = len(self.offsets)
        return pa.table({
            "key": pa.array(self.keys, pa.binary()), "value": pa.array(self.values, pa.binary()),
            "topic": pa.array([topic] * n, pa.string()), "partition": pa.array([self.partition] * n, pa.int32()),
            "offset": pa.array(self.offsets, pa.int64()), "timestamp": pa.array(self.stamps, pa.timestamp("ms", tz="UTC")),
        }, schema=RAW_SCHEMA)


def read_ranges(
    config: Mapping[str, Any], bootstrap: str, topic: str, options: Mapping[str, Any], ranges: Sequence[tuple[int, int, int]],
    low: Callable[[int], int], gone: Callable[[int, int, int], LogError],
) -> list[tuple[pa.Table, str]]:
    """Per range ``(partition, start, end)`` of ``topic``, the raw records with offsets in
    ``[start, end)`` and the kind of their timestamps, read by one consumer (``config``)
    assigned to all the partitions (each range's partition once). ``low(p)``: the
    partition's first offset still held; ``gone(p, start, end)``: the error when a range's
    records are no longer there."""
    from confluent_kafka import Consumer, TopicPartition

    reads = {p: _RangeRead(p, start, end) for p, start, end in ranges if end > start}
    if len(reads) != len([r for r in ranges if r[2] > r[1]]):
        raise ValueError(f"Kafka topic {topic!r}: two ranges of one partition in one read: {list(ranges)}")
    if reads:
        # Fetch sizes for all the ranges together, and a partition's for the largest
        # (range_fetch_limit: why). With a limit for the sum there is one for the largest.
        size = _RECORD_BYTES.get((bootstrap, topic))
        limits = range_fetch_limit(sum(r.end - r.start for r in reads.values()), size, options)
        if limits:
            one = range_fetch_limit(max(r.end - r.start for r in reads.values()), size, options)
            limits.update({k: one[k] for k in ("max.partition.fetch.bytes", "message.max.bytes")})
        c = Consumer({**config, **limits})
        try:
            c.assign([TopicPartition(topic, r.partition, r.start) for r in reads.values()])
            _consume(c, topic, reads, low, gone)
        finally:
            c.close()
    out = []
    for p, start, end in ranges:
        r = reads.get(p) if end > start else None
        out.append((RAW_SCHEMA.empty_table(), "kafka CreateTime") if r is None else (r.table(topic), r.kind))
    tables = [t for t, _ in out if t.num_rows]
    if tables:
        n = sum(t.num_rows for t in tables)
        size = sum(pc.sum(pc.binary_length(t.column(c))).as_py() or 0 for t in tables for c in ("key", "value"))
        _RECORD_BYTES[(bootstrap, topic)] = size / n + RECORD_OVERHEAD_BYTES
    return out


def _consume(c: Any, topic: str, reads: dict[int, _RangeRead], low: Callable[[int], int], gone: Callable[[int, int, int], LogError]) -> None:
    """Consume until every range of ``reads`` is read to its end."""
    from confluent_kafka import TIMESTAMP_LOG_APPEND_TIME, KafkaError, TopicPartition

    left = dict(reads)
    while left:
        # A short wait: fewer records than asked for come when transaction markers
        # take offsets, and consume() would wait all of it before returning them.
        msgs = c.consume(num_messages=min(10_000, max(sum(r.end - r.position for r in left.values()), 1)), timeout=0.05)
        now = time.monotonic()
        for m in msgs:
            r = left.get(m.partition())
            if r is None:
                continue
            err = m.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    r.move(int(m.offset() or 0), now)
                    continue
                if err.code() == KafkaError.OFFSET_OUT_OF_RANGE:
                    raise gone(r.partition, r.start, r.end)
                if err.retriable():
                    continue
                raise LogError(f"Kafka topic {topic!r}, partition {r.partition}: {err.str()}")
            off = int(m.offset() or 0)
            if off >= r.end:
                r.move(r.end, now)
                continue
            if not r.offsets and off > r.start and low(r.partition) > r.start:
                raise gone(r.partition, r.start, r.end)
            r.keys.append(m.key())
            r.values.append(m.value())
            r.offsets.append(off)
            ts_type, ts = m.timestamp()
            r.stamps.append(int(ts))
            if ts_type == TIMESTAMP_LOG_APPEND_TIME:
                r.kind = "kafka LogAppendTime"
            r.move(off + 1, now)
        if msgs:
            # Past a transaction's marker (no record of its own), where the next read
            # starts: the range is read once that is at its end.
            waiting = [r for r in left.values() if r.position < r.end]
            if waiting:
                for r, tp in zip(waiting, c.position([TopicPartition(topic, r.partition) for r in waiting]), strict=True):
                    r.move(min(r.end, int(tp.offset)), now)
        for r in list(left.values()):
            if r.position >= r.end:
                del left[r.partition]
            elif now - r.progress > READ_TIMEOUT_S:
                raise LogError(
                    f"Kafka topic {topic!r}, partition {r.partition}: read stopped at offset {r.position} of the planned "
                    f"range [{r.start}, {r.end}) ({READ_TIMEOUT_S:.0f} s without a record)"
                )
