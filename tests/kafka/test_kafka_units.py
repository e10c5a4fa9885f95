"""The pure parts of the Kafka connectors: settings, encoding and decoding (no broker)."""

from __future__ import annotations

import json
import math
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

from keyscale.errors import InputDataError, JobDefinitionError
from keyscale.kafka.client import KafkaConnectorError, range_fetch_limit, reader_config
from keyscale.kafka.sink import KafkaSink, encode_values
from keyscale.kafka.source import RAW_SCHEMA, json_values, kafka_source

texts = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=20)
ints = st.integers(min_value=-(2**62), max_value=2**62)


@given(st.lists(st.tuples(texts, st.none() | ints, st.none() | texts), max_size=30))
def test_sink_json_values_decode_back_to_the_same_rows(rows: list[tuple[str, int | None, str | None]]) -> None:
    table = pa.table({"key": [r[0] for r in rows], "n": pa.array([r[1] for r in rows], pa.int64()), "s": pa.array([r[2] for r in rows], pa.string())})
    keys, values = encode_values(table, "key", None)
    assert [k.decode() if k is not None else None for k in keys] == table.column("key").to_pylist()
    raw = pa.table({"value": pa.array(values, pa.binary()), "offset": pa.array(range(len(rows)), pa.int64())})
    decoded = json_values("key string, n long, s string")(raw)
    assert decoded.to_pylist() == table.to_pylist()
    assert [json.loads(v) for v in values if v is not None] == table.to_pylist()


def test_decoder_keeps_row_count_for_null_values_and_multiline_json() -> None:
    raw = pa.table({"value": pa.array([b'{\n"n": 1\n}', None, b'{"n": 3, "other": [1]}', b'{"n":\r\n4}\r\n'], pa.binary())})
    assert json_values("n long")(raw).column("n").to_pylist() == [1, None, 3, 4]


def test_a_value_that_is_not_json_is_named_by_its_offset_or_skipped() -> None:
    values = [b'{"n": 1}', b'{"n": 2', b'{"n": 3}', b"[4]", b'{"n": 5}']
    raw = pa.table({"value": pa.array(values, pa.binary()), "topic": ["t"] * 5, "partition": pa.array([2] * 5, pa.int32()),
                    "offset": pa.array(range(40, 45), pa.int64())})
    with pytest.raises(InputDataError, match=r"^Kafka topic 't', partition 2, offset 41: the value is not a JSON object of \(n int64\).*value: '\{\"n\": 2'"):
        json_values("n long")(raw)
    assert json_values("n long", metadata=["offset"], on_error="skip")(raw).to_pylist() == [
        {"n": 1, "kafka_offset": 40}, {"n": 3, "kafka_offset": 42}, {"n": 5, "kafka_offset": 44}]


def test_reader_settings_keyscale_depends_on_cannot_be_overridden() -> None:
    cfg = reader_config("b:9092", {"isolation.level": "read_uncommitted", "security.protocol": "SSL"}, "source 'x'")
    assert cfg["isolation.level"] == "read_uncommitted"  # the user's choice is kept
    assert cfg["enable.partition.eof"] == "true" and cfg["bootstrap.servers"] == "b:9092"
    with pytest.raises(KafkaConnectorError, match=r"enable\.auto\.commit='true' cannot be served"):
        reader_config("b:9092", {"enable.auto.commit": True}, "source 'x'")


@given(st.integers(1, 10**7), st.floats(1.0, 10**6))
def test_a_range_fetch_limit_holds_the_range_and_librdkafka_takes_it(records: int, bytes_per_record: float) -> None:
    """The limit a reader asks for is never below what the range holds (none at all beyond
    librdkafka's own 50 MiB), and is a setting librdkafka accepts (its rules between the
    four sizes), for any range and record size."""
    from confluent_kafka import Consumer

    limit = range_fetch_limit(records, bytes_per_record, {})
    assert limit["fetch.max.bytes"] >= records * bytes_per_record if limit else records * bytes_per_record > 45 * 2**20
    Consumer({"group.id": "g", "bootstrap.servers": "127.0.0.1:9", **limit}).close()


def test_definition_errors_name_the_thing_at_fault() -> None:
    with pytest.raises(JobDefinitionError, match="clashes"):
        json_values("kafka_offset long", metadata=["offset"])
    with pytest.raises(JobDefinitionError, match="one topic per source"):
        kafka_source("b:9092", ["a", "b"], uid="events")  # type: ignore[arg-type]
    with pytest.raises(JobDefinitionError, match=r"'transactional\.id' is keyscale's to set"):
        KafkaSink("b:9092", "out", options={"transactional.id": "mine"})
    assert kafka_source("b:9092", "clicks").schema == RAW_SCHEMA


def test_serial_commits_come_from_the_job_or_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KEYSCALE_KAFKA_SERIAL_COMMITS", raising=False)
    assert KafkaSink("b:9092", "out").serial_commits is False
    monkeypatch.setenv("KEYSCALE_KAFKA_SERIAL_COMMITS", "1")
    assert KafkaSink("b:9092", "out").serial_commits is True
    assert KafkaSink("b:9092", "out", serial_commits=False).serial_commits is False  # the job's own choice
    monkeypatch.setenv("KEYSCALE_KAFKA_SERIAL_COMMITS", "yes")
    with pytest.raises(JobDefinitionError, match="KEYSCALE_KAFKA_SERIAL_COMMITS='yes'"):
        KafkaSink("b:9092", "out")


def test_a_task_commits_inside_its_turn() -> None:
    """With serial commits, a task's commit (the step a broker may mishandle when two
    transactions on a partition end at once) runs while it holds the host's turn."""
    from contextlib import contextmanager

    from keyscale.kafka.sink import _transaction

    held = [False]
    calls: list[tuple[str, bool]] = []

    @contextmanager
    def turn() -> Any:
        held[0] = True
        try:
            yield
        finally:
            held[0] = False

    class Producer:
        def __getattr__(self, name: str) -> Any:
            return lambda *a, **k: calls.append((name, held[0]))

    batch = pa.RecordBatch.from_pydict({"k": ["a", "b"], "n": [1, 2]})
    rows = _transaction(Producer(), "out", "out.keyscale-commits", "k", None, iter([batch]), "L", 3, 0, 1000, turn, kill_driver=0)
    assert rows == 2
    assert [c for c in calls if c[0] != "produce"] == [("begin_transaction", False), ("flush", False), ("commit_transaction", True)]


class _Message:
    def __init__(self, offset: int, ts_type: int, ms: int) -> None:
        self._offset, self._ts = offset, (ts_type, ms)

    def error(self) -> None:
        return None

    def offset(self) -> int:
        return self._offset

    def partition(self) -> int:
        return 0

    def key(self) -> bytes:
        return b"k"

    def value(self) -> bytes:
        return json.dumps({"v": self._offset}).encode()

    def timestamp(self) -> tuple[int, int]:
        return self._ts


@pytest.mark.parametrize(("ts_type", "clock"), [("TIMESTAMP_LOG_APPEND_TIME", "kafka LogAppendTime"),
                                                ("TIMESTAMP_CREATE_TIME", "kafka CreateTime")])
def test_read_timed_says_which_kafka_timestamp_it_is_and_leaves_out_a_missing_one(monkeypatch: pytest.MonkeyPatch, ts_type: str,
                                                                                   clock: str) -> None:
    """A broker that honours ``message.timestamp.type=LogAppendTime`` (Tansu, the tests'
    broker, does not) marks its records so: the latency then runs on the broker's clock. A
    record without a timestamp (-1) is not measured."""
    import confluent_kafka

    from keyscale.kafka.source import KafkaLog

    kind = getattr(confluent_kafka, ts_type)
    msgs = [_Message(0, kind, 1_000), _Message(1, confluent_kafka.TIMESTAMP_NOT_AVAILABLE, -1), _Message(2, kind, 3_000)]

    class Consumer:
        def __init__(self, config: Any) -> None:
            self.left = list(msgs)

        def assign(self, parts: Any) -> None:
            pass

        def consume(self, num_messages: int, timeout: float) -> list[_Message]:
            out, self.left = self.left, []
            return out

        def close(self) -> None:
            pass

    monkeypatch.setattr(confluent_kafka, "Consumer", Consumer)
    table, times = KafkaLog("127.0.0.1:9", "t", decoder=json_values("v long")).read_timed(0, 0, 3)
    assert table.column("v").to_pylist() == [0, 1, 2]
    assert times is not None and times.clock == clock
    assert times.seconds[0] == 1.0 and times.seconds[2] == 3.0 and math.isnan(times.seconds[1])
