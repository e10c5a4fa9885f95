"""Kafka topics as a keyscale source: partitions read by keyscale's own reader tasks.

Spark's Kafka source is not in the pyspark wheel (its jars come only from Maven), and
its offsets live in Spark's checkpoint, which keyscale does not rescale. keyscale reads
Kafka itself, as it reads its partitioned log: :class:`KafkaLog` is a
:class:`~keyscale.sources.partitioned.PartitionedLog` over one topic, so everything the log
source does holds for Kafka (see :mod:`keyscale.sources.reader`):

- the (partition, offset) entries are split/merge operator state in keyscale's manifest,
  not the consumer group: a replayed batch reads exactly the same offsets, and on a
  rescale the entries are pooled and split (FLIP-8: no partition dropped, no reader idle);
- partitions added to the topic are picked up at the next batch;
- per-partition lag, event-time watermarks and idleness, and the autoscaler's backlog
  come from the end offsets;
- a topic deleted and created again (a new topic id), or offsets the topic no longer
  holds (retention deleted records before the job read them), stop the job with a
  message instead of skipping records.

Offsets in Kafka are not contiguous (transaction markers take offsets; compaction
removes records): a batch reads the records whose offsets are in its planned range.
Reads use ``isolation.level=read_committed`` unless the options say otherwise.

Records reach the job as Arrow columns through a *decoder*: none gives Spark's Kafka
columns (``key``, ``value`` binary, ``topic``, ``partition``, ``offset``,
``timestamp``); :func:`json_values` parses JSON values into typed columns; any object
with a ``schema`` (pyarrow) and ``__call__(raw: pa.Table) -> pa.Table`` over the raw
columns plugs in its own format (see :func:`kafka_decoder`).
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import pyarrow as pa

from keyscale._keywords import checked_keywords
from keyscale.errors import InputDataError, JobDefinitionError
from keyscale.kafka.client import (
    EAGER_CONNECTIONS,
    FetchEnds,
    KafkaConnectorError,
    connection_options,
    partition_count,
    reader_config,
    true_ends,
)
from keyscale.kafka.ranges import RAW_SCHEMA, read_ranges
from keyscale.sources.partitioned import AppendTimes, LogError, PartitionedLog
from keyscale.sources.reader import LogSource
from keyscale.state.types import arrow_schema

log = logging.getLogger(__name__)

__all__ = ["RAW_SCHEMA", "KafkaDecoder", "KafkaLog", "json_values", "kafka_decoder", "kafka_source"]

_METADATA = ("key", "topic", "partition", "offset", "timestamp")

class KafkaDecoder(Protocol):
    """Turns a batch of raw records (:data:`RAW_SCHEMA`) into the source's columns."""

    @property
    def schema(self) -> pa.Schema: ...

    def __call__(self, raw: pa.Table) -> pa.Table: ...


@dataclass(frozen=True)
class _FunctionDecoder:
    schema: pa.Schema
    fn: Callable[[pa.Table], pa.Table]

    def __call__(self, raw: pa.Table) -> pa.Table:
        return self.fn(raw)


def kafka_decoder(schema: str | pa.Schema, fn: Callable[[pa.Table], pa.Table]) -> KafkaDecoder:
    """Your own format: ``fn`` gets the raw records (:data:`RAW_SCHEMA`) of one partition's
    read and returns a table of ``schema`` (a Spark DDL string or Arrow schema), one row per
    record it keeps. Raise :class:`keyscale.errors.InputDataError` naming the offset for a
    record it cannot decode.

    >>> import pyarrow as pa, pyarrow.compute as pc
    >>> upper = kafka_decoder("word string", lambda raw: pa.table({"word": pc.utf8_upper(raw["value"].cast(pa.string()))}))
    >>> upper(pa.table({"value": pa.array([b"hi"], pa.binary())})).to_pylist()
    [{'word': 'HI'}]
    """
    return _FunctionDecoder(arrow_schema(schema), fn)


@dataclass(frozen=True)
class JsonValues:
    """JSON object values parsed into typed columns (see :func:`json_values`)."""

    value_schema: pa.Schema
    metadata: tuple[str, ...]
    on_error: Literal["fail", "skip"]

    @property
    def schema(self) -> pa.Schema:
        fields = list(self.value_schema)
        for m in self.metadata:
            t = pa.string() if m == "key" else RAW_SCHEMA.field(m).type
            fields.append(pa.field(f"kafka_{m}", t))
        return pa.schema(fields)

    def _parse(self, values: Sequence[bytes | None]) -> pa.Table:
        import pyarrow.json as pj

        # One JSON document per line: newlines inside a document can only be whitespace.
        lines = b"\n".join(b"{}" if v is None else v.replace(b"\n", b" ").replace(b"\r", b" ") for v in values)
        opts = pj.ParseOptions(explicit_schema=self.value_schema, unexpected_field_behavior="ignore")
        t = pj.read_json(io.BytesIO(lines + b"\n"), parse_options=opts)
        if t.num_rows != len(values):
            raise pa.ArrowInvalid(f"{len(values)} values gave {t.num_rows} rows")
        return t.select(self.value_schema.names).cast(self.value_schema)

    def __call__(self, raw: pa.Table) -> pa.Table:
        values = raw.column("value").to_pylist()
        keep = None
        try:
            parsed = self._parse(values) if values else self.value_schema.empty_table()
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            # Find the records at fault, one by one (only batches with a bad record pay).
            good: list[int] = []
            bad: list[tuple[int, Exception]] = []
            for i, v in enumerate(values):
                try:
                    self._parse([v])
                    good.append(i)
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as err:
                    bad.append((i, err))
            if self.on_error == "fail":
                i, e = bad[0]
                raise InputDataError(
                    f"Kafka topic {raw['topic'][i].as_py()!r}, partition {raw['partition'][i].as_py()}, offset {raw['offset'][i].as_py()}: "
                    f"the value is not a JSON object of ({_ddl(self.value_schema)}): {str(e).splitlines()[0][:300]}; value: {_preview(values[i])} "
                    f"(json_values(..., on_error='skip') drops and counts such records)"
                ) from None
            keep = pa.array(good, pa.int64())
            parsed = self._parse([values[i] for i in good]) if good else self.value_schema.empty_table()
        source = raw if keep is None else raw.take(keep)
        for m in self.metadata:
            col = source.column(m)
            if m == "key":
                try:
                    col = col.cast(pa.string())
                except pa.ArrowInvalid:
                    raise InputDataError(f"Kafka topic {raw['topic'][0].as_py()!r}: a record key is not UTF-8 text; leave 'key' out of metadata") from None
            parsed = parsed.append_column(f"kafka_{m}", col)
        return parsed


def json_values(schema: str | pa.Schema, metadata: Sequence[str] = (), on_error: Literal["fail", "skip"] = "fail") -> JsonValues:
    """Values that are JSON objects, parsed into the columns of ``schema`` (Spark DDL or
    Arrow): fields the schema does not name are ignored, missing ones are null, ISO-8601
    text parses into timestamps. ``metadata`` adds Kafka's own columns as ``kafka_<name>``
    (``key`` as text, ``topic``, ``partition``, ``offset``, ``timestamp``). A value that is
    not such an object fails the batch naming its partition and offset, or with
    ``on_error="skip"`` is dropped and counted (``skipped_records`` in the batch's report).

    >>> dec = json_values("user string, n long", metadata=["offset"])
    >>> raw = pa.table({"value": pa.array([b'{"user": "ann", "n": 2}'], pa.binary()), "offset": pa.array([7], pa.int64())})
    >>> dec(raw).to_pylist()
    [{'user': 'ann', 'n': 2, 'kafka_offset': 7}]
    """
    s = arrow_schema(schema)
    for m in metadata:
        if m not in _METADATA:
            raise JobDefinitionError(f"json_values: metadata {m!r} is not one of {', '.join(_METADATA)}")
        if f"kafka_{m}" in s.names:
            raise JobDefinitionError(f"json_values: column 'kafka_{m}' of the schema clashes with Kafka's metadata column of that name")
    if on_error not in ("fail", "skip"):
        raise JobDefinitionError(f"json_values: on_error must be 'fail' or 'skip', not {on_error!r}")
    return JsonValues(s, tuple(metadata), on_error)


def _ddl(schema: pa.Schema) -> str:
    return ", ".join(f"{f.name} {f.type}" for f in schema)


def _preview(value: bytes | None) -> str:
    if value is None:
        return "null"
    text = value[:120].decode("utf-8", errors="replace")
    return repr(text + ("..." if len(value) > 120 else ""))


class KafkaLog(PartitionedLog):
    """One Kafka topic read as a partitioned log (see the module doc).

    Pickles to its settings (clients are created where it is used: the driver plans,
    reader tasks read).

    >>> log = KafkaLog("127.0.0.1:9092", "clicks", decoder=json_values("user string"))  # doctest: +SKIP
    >>> log.end_offsets()  # doctest: +SKIP
    [120, 97, 143, 110]
    """

    def __init__(self, bootstrap: str, topic: str, decoder: KafkaDecoder | None = None, options: Mapping[str, Any] | None = None,
                 starting_offsets: Literal["earliest", "latest"] = "earliest", commit_group: str | None = None) -> None:
        if not bootstrap or not topic:
            raise JobDefinitionError("a Kafka source needs a bootstrap address and a topic")
        if starting_offsets not in ("earliest", "latest"):
            raise JobDefinitionError(f"Kafka topic {topic!r}: starting_offsets must be 'earliest' or 'latest', not {starting_offsets!r}")
        self.bootstrap = bootstrap
        self.topic = topic
        self.decoder = decoder
        self.options = dict(options or {})
        self.starting_offsets = starting_offsets
        self.commit_group = commit_group
        self._config = reader_config(bootstrap, self.options, f"Kafka topic {topic!r}")
        self._known: dict[int, int] = {}
        self._skipped = 0

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("_known", "_skipped")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._known = {}
        self._skipped = 0

    @contextmanager
    def _client(self, extra: Mapping[str, Any] | None = None) -> Iterator[Any]:
        """A consumer for one call (closed after it: one left open would keep reconnecting
        to a broker that is gone once the job ends), connecting without librdkafka's
        sparse-connection wait (``EAGER_CONNECTIONS``, under the user's options); ``extra``
        settings over the reader's."""
        from confluent_kafka import Consumer

        c = Consumer({**EAGER_CONNECTIONS, **self._config, **(extra or {})})
        try:
            yield c
        finally:
            c.close()

    @property
    def schema(self) -> pa.Schema:
        return self.decoder.schema if self.decoder is not None else RAW_SCHEMA

    @property
    def uri(self) -> str:
        return f"kafka://{self.bootstrap}/{self.topic}"

    def num_partitions(self) -> int:
        with self._client() as c:
            return partition_count(c, self.topic, self.bootstrap)

    def end_offsets(self) -> list[int]:
        # The end each fetch response reports (librdkafka's statistics), reported about every
        # millisecond a partition, from 10 to 100 ms: a report's size grows with the
        # partitions, and a probe waits up to one interval for it (at 100 ms, half the
        # probe: with sparse connections too, 63 ms a probe before against 21 ms now, against a
        # local broker taking 5,000 records/s, bench/kafka_task_cost.py).
        fetch_ends = FetchEnds(self.topic, interval_ms=min(max(len(self._known), 10), 100))
        # An empty answer still reports the end, so the probe need not wait for records:
        # a short wait keeps the probe at the end of an idle partition quick (10 ms: the
        # probe takes ~25 ms on an idle topic, 50 ms took ~65; it runs once or twice a batch).
        quick = {} if "fetch.wait.max.ms" in self.options else {"fetch.wait.max.ms": "10"}
        with self._client({**fetch_ends.settings(), **quick}) as c:
            ends = true_ends(c, self.topic, range(partition_count(c, self.topic, self.bootstrap)), self._known, fetch_ends=fetch_ends)
        self._known = dict(enumerate(ends))
        return ends

    def first_offsets(self) -> list[int]:
        """Where a job starts reading each partition: its first record still held
        (``earliest``) or its end (``latest``)."""
        if self.starting_offsets == "latest":
            return self.end_offsets()
        with self._client() as c:
            return [self._low(p, c) for p in range(partition_count(c, self.topic, self.bootstrap))]

    def _low(self, p: int, client: Any = None) -> int:
        from confluent_kafka import TopicPartition

        try:
            with self._client() if client is None else nullcontext(client) as c:
                return int(c.get_watermark_offsets(TopicPartition(self.topic, p), timeout=10, cached=False)[0])
        except Exception as e:
            raise KafkaConnectorError(f"Kafka topic {self.topic!r}, partition {p}: the broker did not tell its first offset: {e}") from None

    def identity(self) -> str | None:
        """The topic's id (Kafka 2.8+): a topic deleted and created again gets another."""
        from confluent_kafka import TopicCollection
        from confluent_kafka.admin import AdminClient

        try:
            admin = AdminClient({"bootstrap.servers": self.bootstrap, **connection_options(self.options)})  # kept alive until the answer
            tid = admin.describe_topics(TopicCollection([self.topic]))[self.topic].result(timeout=10).topic_id
        except Exception:
            return None  # a broker without topic ids: offsets are checked against the ends only
        return None if tid is None else str(tid)

    def fingerprints(self) -> bool:
        # The offset before a committed one may be a transaction marker, which reads as no
        # record: the last-record check of the log source does not apply.
        return False

    def read(self, partition: int, start: int, end: int) -> pa.Table:
        """The records with offsets in ``[start, end)``, decoded."""
        return self._decode(self._read_raw([(partition, start, end)])[0][0])

    def read_timed(self, partition: int, start: int, end: int) -> tuple[pa.Table, AppendTimes | None]:
        return self.read_ranges_timed([(partition, start, end)])[0]

    def read_ranges_timed(self, ranges: Sequence[tuple[int, int, int]]) -> list[tuple[pa.Table, AppendTimes | None]]:
        """The records of each range, with their Kafka timestamps as append times: the
        broker's append time where the topic says ``message.timestamp.type=LogAppendTime``,
        else the producer's ``CreateTime`` (said in ``clock``); records of a skip decoder
        count too. One consumer reads all the ranges at once (a consumer's start and a
        fetch's round trip for each partition in turn were most of a small batch's read)."""
        out: list[tuple[pa.Table, AppendTimes | None]] = []
        for raw, kind in self._read_raw(ranges):
            ms = raw.column("timestamp").cast(pa.int64()).to_numpy(zero_copy_only=False).astype("float64")
            ms[ms < 0] = float("nan")  # a record without a timestamp (-1): not measured
            out.append((self._decode(raw), AppendTimes(ms / 1000.0, kind)))
        return out

    def _decode(self, raw: pa.Table) -> pa.Table:
        if self.decoder is None:
            return raw
        out = self.decoder(raw)
        if isinstance(self.decoder, JsonValues):
            self._skipped += raw.num_rows - out.num_rows
        return out

    def _read_raw(self, ranges: Sequence[tuple[int, int, int]]) -> list[tuple[pa.Table, str]]:
        return read_ranges(self._config, self.bootstrap, self.topic, self.options, ranges, self._low, self._gone)

    def positions_committed(self, positions: dict[int, int]) -> None:
        """With ``commit_group``: commit the job's positions to that consumer group, so
        lag monitors (kafka-consumer-groups, Burrow...) see the job. Best effort: a failure
        is logged, never fails the job (the positions that count are in the manifest)."""
        if not self.commit_group:
            return
        from confluent_kafka import Consumer, TopicPartition

        try:
            c = Consumer({**self._config, "group.id": self.commit_group})
            try:
                c.commit(offsets=[TopicPartition(self.topic, p, o) for p, o in sorted(positions.items())], asynchronous=False)
            finally:
                c.close()
        except Exception as e:
            log.warning("Kafka topic %r: committing positions to consumer group %r for monitoring failed: %s", self.topic, self.commit_group, e)

    def take_skipped(self) -> int:
        n, self._skipped = self._skipped, 0
        return n

    def _gone(self, partition: int, start: int, end: int) -> LogError:
        return LogError(
            f"Kafka topic {self.topic!r}, partition {partition}: records from offset {start} (planned [{start}, {end})) are no longer "
            f"on the broker (its first offset is now {self._low(partition)}): retention deleted them before the job read them, or the "
            "topic was recreated. The job stops so that no record is skipped without a sign; to go on from what the topic still "
            "holds, take a savepoint and restart the source under a new uid (--allow-non-restored-state)."
        )

    def append(self, partition: int, table: pa.Table) -> tuple[int, int]:
        raise LogError(f"{self.uri}: keyscale reads Kafka topics; produce to them with a Kafka producer (or write with ks.kafka.KafkaSink)")

    def add_partitions(self, n: int) -> int:
        from confluent_kafka.admin import AdminClient, NewPartitions  # type: ignore[attr-defined]

        total = self.num_partitions() + n
        admin = AdminClient({"bootstrap.servers": self.bootstrap, **connection_options(self.options)})
        futures = admin.create_partitions([NewPartitions(self.topic, total)])
        try:
            futures[self.topic].result(timeout=30)
        except Exception as e:
            raise LogError(f"Kafka topic {self.topic!r}: adding partitions failed: {e}") from None
        return total

    def describe(self) -> str:
        return f"Kafka topic {self.topic!r} on {self.bootstrap}, {self.num_partitions()} partitions, columns ({_ddl(self.schema)})"


@checked_keywords
def kafka_source(
    bootstrap: str, topic: str, uid: str = "source", *, decoder: KafkaDecoder | None = None, options: Mapping[str, Any] | None = None,
    max_records_per_batch: int | None = None, parallelism: int | None = None, starting_offsets: Literal["earliest", "latest"] = "earliest",
    commit_group: str | None = None,
) -> LogSource:
    """A Kafka topic as a job's source, read by ``parallelism`` reader tasks; give the result
    to :func:`keyscale.stream`.

    ``decoder``: :func:`json_values` (JSON object values into typed columns), your own
    (:func:`kafka_decoder`), or None for Spark's Kafka columns (key, value, topic,
    partition, offset, timestamp). ``options``: confluent-kafka consumer settings
    (security, timeouts...); keyscale reads with ``isolation.level=read_committed`` unless
    they say otherwise. ``max_records_per_batch`` caps what one batch reads from each
    partition. ``starting_offsets``: where a new job (or a partition it has never read)
    starts: the first record the topic holds, or its end.

    The offsets are keyscale's state (in its checkpoints and savepoints), not the
    consumer group's. ``commit_group``: also commit them to this consumer group after
    each checkpoint, for monitoring tools that read group offsets (never read back).

    ``ks.stream(ks.kafka.kafka_source("broker:9092", "clicks", uid="clicks", decoder=ks.kafka.json_values("user string, ts timestamp")))``
    """
    if isinstance(topic, list | tuple):
        if len(topic) != 1:
            raise JobDefinitionError(f"kafka_source '{uid}': one topic per source (got {list(topic)}); read several topics with one source each")
        topic = topic[0]
    if max_records_per_batch is not None and max_records_per_batch < 1:
        raise JobDefinitionError(f"source '{uid}': max_records_per_batch must be at least 1")
    return LogSource(KafkaLog(bootstrap, topic, decoder, options, starting_offsets, commit_group), uid, parallelism, max_records_per_batch)
