"""Kafka in and out with a real Kafka-protocol broker (Tansu, started by the tests): the
FLIP-8 scenario on a 4-partition topic, crashes around the sink's transactions, savepoint
restore at another parallelism, and the source's checks."""

from __future__ import annotations

import datetime as dt
import json
import signal
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from conftest import EXAMPLES, cli, cli_here, new_topic, produce_events, run_job
from keyscale.checkpoint.jobdir import JobDir
from keyscale.kafka.sink import read_committed
from keyscale.kafka.source import KafkaLog, json_values
from keyscale.sources.partitioned import LogError

pytestmark = [pytest.mark.spark, pytest.mark.slow]

JOB = EXAMPLES / "kafka_running_count.py"


def _updates(bootstrap: str, topic: str) -> list[dict[str, Any]]:
    return _decoded(read_committed(bootstrap, topic))


def _decoded(records: list[tuple[int, int, bytes | None, bytes | None]]) -> list[dict[str, Any]]:
    return [json.loads(v) for _, _, _, v in records if v is not None]


def _output_view(records: list[tuple[int, int, bytes | None, bytes | None]], bootstrap: str, topic: str) -> str:
    """Per output partition, what a read_committed consumer saw (``records``: records,
    last offset) against the partition's end: tells a transaction left open (the stable
    offset held short of the end) from output never written."""
    seen: dict[int, list[int]] = defaultdict(list)
    for part, offset, _, _ in records:
        seen[part].append(offset)
    ends = KafkaLog(bootstrap, topic).end_offsets()
    return "; ".join(f"partition {p}: {len(seen[p])} records read committed, last offset {max(seen[p], default=-1)}, end {e}"
                     for p, e in enumerate(ends))


def _check_exactly_once(updates: list[dict[str, Any]], events: list[dict[str, Any]], context: str = "") -> None:
    """A running count's output read back: every update once (counts strictly grow per
    key), and each key's last update holds its totals."""
    seen = Counter((u["key"], u["count"]) for u in updates)
    dupes = [k for k, n in seen.items() if n > 1]
    assert not dupes, f"duplicate updates: {dupes[:5]}"
    want_count, want_sum = Counter(e["key"] for e in events), defaultdict(int)
    for e in events:
        want_sum[e["key"]] += e["value"]
    last: dict[str, dict[str, Any]] = {}
    for u in updates:
        if u["key"] not in last or u["count"] > last[u["key"]]["count"]:
            last[u["key"]] = u
    got = {k: (u["count"], u["sum"]) for k, u in last.items()}
    want = {k: (n, want_sum[k]) for k, n in want_count.items()}
    wrong = {k: (got.get(k), w) for k, w in want.items() if got.get(k) != w}
    assert got == want, f"{len(wrong)} of {len(want)} keys' last update (count, sum) != their totals: {dict(list(wrong.items())[:8])}; {context}"


def _check_read_to_end(job: JobDir, bootstrap: str, topic: str, log: str) -> list[list[list[int]]]:
    """The job's committed positions are the topic's ends: it read every event (so a
    wrong output is the sink's or the reader's fault, not an early end). Returns the
    readers' committed (partition, offset) lists."""
    manifest = job.latest_manifest()
    assert manifest is not None
    readers: list[list[list[int]]] = manifest.operators["events"].operator_state["offsets"]["subtasks"]
    positions = {p: o for r in readers for p, o in r}
    assert positions == dict(enumerate(KafkaLog(bootstrap, topic).end_offsets())), log[-3000:]
    return readers


def test_kafka_log_reads_planned_ranges_past_transaction_markers(kafka_broker: Any) -> None:
    from confluent_kafka import Producer

    b = kafka_broker.bootstrap
    topic = new_topic(b, 2)
    events = produce_events(b, topic, 300, keys=20)
    tx = Producer({"bootstrap.servers": b, "transactional.id": f"test-{topic}"})
    tx.init_transactions(10)
    tx.begin_transaction()
    tx.produce(topic, value=json.dumps({"key": "tx", "value": 5, "ts": "2026-01-01T00:00:00Z"}).encode(), partition=0)
    tx.commit_transaction(10)  # the commit marker takes an offset of its own
    log = KafkaLog(b, topic, decoder=json_values("key string, value long, ts timestamp", metadata=["offset"]))
    ends = log.end_offsets()
    # The true ends, though the broker's ListOffsets answer may be short of them (Tansu).
    read = [log.read(p, 0, ends[p]) for p in range(2)]
    assert sum(t.num_rows for t in read) == len(events) + 1
    assert sorted(r["value"] for t in read for r in t.to_pylist() if r["key"] != "tx") == sorted(e["value"] for e in events)
    # A range split anywhere reads each record once.
    split = pa.concat_tables([log.read(0, 0, 17), log.read(0, 17, ends[0])])
    assert split.column("kafka_offset").to_pylist() == read[0].column("kafka_offset").to_pylist()
    assert log.identity() is not None


def test_kafka_timestamps_are_the_records_append_times(kafka_broker: Any) -> None:
    """The latency's append times (keyscale.latency): each record's Kafka timestamp, which is
    the producer's CreateTime on a topic left at its default, said as such."""
    from confluent_kafka import Producer

    b = kafka_broker.bootstrap
    topic = new_topic(b, 1)
    p = Producer({"bootstrap.servers": b, "log_level": 3})
    stamps = [1_767_225_600_000 + 250 * i for i in range(5)]  # 2026-01-01, a quarter second apart
    for i, ms in enumerate(stamps):
        p.produce(topic, value=json.dumps({"key": "k", "value": i, "ts": "2026-01-01T00:00:00Z"}).encode(), partition=0, timestamp=ms)
    p.flush(30)
    log = KafkaLog(b, topic, decoder=json_values("key string, value long, ts timestamp"))
    table, times = log.read_timed(0, 0, log.end_offsets()[0])
    assert table.column("value").to_pylist() == list(range(5))
    assert times is not None and times.clock == "kafka CreateTime"
    assert [round(t * 1000) for t in times.seconds] == stamps


def test_undecodable_value_names_its_offset_or_is_skipped(kafka_broker: Any) -> None:
    from confluent_kafka import Producer

    b = kafka_broker.bootstrap
    topic = new_topic(b, 1)
    p = Producer({"bootstrap.servers": b})
    for v in (b'{"n": 1}', b"{oops", b'{"n": 3}'):
        p.produce(topic, value=v, partition=0)
    p.flush(10)
    strict = KafkaLog(b, topic, decoder=json_values("n long"))
    with pytest.raises(Exception, match=rf"topic '{topic}', partition 0, offset 1: the value is not a JSON object.*'{{oops'"):
        strict.read(0, 0, 3)
    lenient = KafkaLog(b, topic, decoder=json_values("n long", on_error="skip"))
    assert lenient.read(0, 0, 3).column("n").to_pylist() == [1, 3]
    assert lenient.take_skipped() == 1


def test_flip8_live_rescale_on_kafka_partitions_exactly_once(kafka_broker: Any, tmp_path: Path) -> None:
    """2 readers, live to 1, then to 4, while records keep coming: no partition dropped, no
    reader idle, every update in the output topic once."""
    b = kafka_broker.bootstrap
    src, out = new_topic(b, 4, "in"), new_topic(b, 3, "out")
    events = produce_events(b, src, 1200, keys=50, seed=1)
    plan = {1: 1, 3: 4}

    def on_batch(rec: Any) -> None:
        if rec.batch in plan:
            events.extend(produce_events(b, src, 400, keys=50, first=len(events), seed=1))
            JobDir(tmp_path / "job").request_rescale(plan[rec.batch])

    summary = run_job(JOB, tmp_path / "job", 2, {"bootstrap": b, "input": src, "output": out, "max_records": "100"}, on_batch)
    assert [(r[2], r[3]) for r in summary.rescales if r[1] == "events"] == [(2, 1), (1, 4)]
    readers = _check_read_to_end(JobDir(tmp_path / "job"), b, src, "")
    _check_exactly_once(_updates(b, out), events)
    assert sorted(len(r) for r in readers) == [1, 1, 1, 1]  # after the rescale to 4: one partition each
    # Every record's latency was measured, from its Kafka timestamp (CreateTime: Tansu's topics
    # have no LogAppendTime) to its batch's transactions' commit, through both rescales.
    measured = [r.latency for r in summary.batches if r.records]
    assert all(lat is not None and lat.clock == "kafka CreateTime" for lat in measured)
    assert sum(lat.records for lat in measured if lat is not None) == len(events) == sum(r.records for r in summary.batches)
    assert summary.latency.total == len(events)


# kafka-precommit: a task kills the driver after its transaction is flushed, before it
# commits; mid-batch: while the batch is being computed (its output partly written);
# mid-upload with asynchronous checkpoints: while batch 2's state uploads during batch 3,
# whose output is in the topic too: both batches are replayed.
@pytest.mark.parametrize(("fault", "asynchronous"), [("mid-batch:2", False), ("kafka-precommit:2", False), ("mid-upload:2", True)])
def test_killed_driver_resumes_with_kafka_output_exactly_once(fault: str, asynchronous: bool, spark: Any, kafka_broker: Any, tmp_path: Path) -> None:
    b = kafka_broker.bootstrap
    src, out = new_topic(b, 4, "in"), new_topic(b, 2, "out")
    events = produce_events(b, src, 1000, keys=40, seed=2)
    base = ["run", str(JOB), "--job-dir", str(tmp_path / "job"), "-p", "2", "--until-idle",
            "--set", f"bootstrap={b}", "--set", f"input={src}", "--set", f"output={out}", "--set", "max_records=60",
            *(["--async-checkpoints"] if asynchronous else [])]
    crashed = cli(*base, "--fault", fault)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    assert JobDir(tmp_path / "job").manifest_batches()[-1] == 1  # batch 2 never committed
    resumed = cli_here(*base, check=True)  # a new driver: the killed one's JVM and workers are gone with it
    if fault == "kafka-precommit:2":
        assert "already committed" in resumed.stderr
    _check_read_to_end(JobDir(tmp_path / "job"), b, src, resumed.stderr)
    records = read_committed(b, out)  # read once: the view describes the output checked
    _check_exactly_once(_decoded(records), events, _output_view(records, b, out))


def test_savepoint_restore_at_another_parallelism(kafka_broker: Any, tmp_path: Path) -> None:
    from confluent_kafka import Consumer, TopicPartition

    from keyscale.checkpoint.savepoint import write_savepoint

    b = kafka_broker.bootstrap
    src, out = new_topic(b, 4, "in"), new_topic(b, 2, "out")
    events = produce_events(b, src, 600, keys=30, seed=3)
    args = {"bootstrap": b, "input": src, "output": out, "max_records": "100"}
    run_job(JOB, tmp_path / "a", 2, args)
    a = JobDir(tmp_path / "a")
    sp = write_savepoint(a, a.read_manifest(a.manifest_batches()[-1]), tmp_path / "sp")
    events += produce_events(b, src, 500, keys=30, first=len(events), seed=3)
    run_job(JOB, tmp_path / "b", 3, {**args, "group": "monitor"}, from_savepoint=sp)
    _check_exactly_once(_updates(b, out), events)
    # The positions also went to the consumer group, for lag monitors.
    c = Consumer({"bootstrap.servers": b, "group.id": "monitor"})
    committed = {t.partition: t.offset for t in c.committed([TopicPartition(src, p) for p in range(4)], timeout=10)}
    c.close()
    assert committed == dict(enumerate(KafkaLog(b, src).end_offsets()))


def test_input_written_in_transactions_is_read_batch_after_batch_and_across_a_restart(kafka_broker: Any, tmp_path: Path) -> None:
    """Input an exactly-once producer wrote (another keyscale job's output, say): each
    transaction's commit marker takes an offset of its own, so a batch's range can end
    just after one. The checks before the next batch (in the run, and after a restart) must
    not take the record missing at the marker's offset for one the log lost."""
    b = kafka_broker.bootstrap
    src, out = new_topic(b, 2, "in"), new_topic(b, 1, "out")
    events = produce_events(b, src, 200, keys=10, transactional_id=f"upstream-{src}")
    args = {"bootstrap": b, "input": src, "output": out, "max_records": "40"}
    run_job(JOB, tmp_path / "job", 2, args)
    events += produce_events(b, src, 100, keys=10, first=len(events), transactional_id=f"upstream-{src}")
    run_job(JOB, tmp_path / "job", 2, args)
    _check_exactly_once(_updates(b, out), events)
    _check_read_to_end(JobDir(tmp_path / "job"), b, src, "")


def test_a_recreated_topic_stops_the_job(kafka_broker: Any, tmp_path: Path) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    b = kafka_broker.bootstrap
    src, out = new_topic(b, 2, "in"), new_topic(b, 1, "out")
    produce_events(b, src, 100, keys=5)
    args = {"bootstrap": b, "input": src, "output": out}
    run_job(JOB, tmp_path / "job", 1, args)
    admin = AdminClient({"bootstrap.servers": b})
    admin.delete_topics([src])[src].result(timeout=30)
    admin.create_topics([NewTopic(src, 2)])[src].result(timeout=30)
    produce_events(b, src, 10, keys=5)
    with pytest.raises(LogError, match="was recreated"):
        run_job(JOB, tmp_path / "job", 1, args)


def test_a_missing_output_topic_is_an_error_before_the_first_batch(kafka_broker: Any, tmp_path: Path) -> None:
    b = kafka_broker.bootstrap
    src = new_topic(b, 1, "in")
    produce_events(b, src, 10, keys=2)
    run = cli_here("run", str(JOB), "--job-dir", str(tmp_path / "job"), "-p", "1", "--until-idle",
              "--set", f"bootstrap={b}", "--set", f"input={src}", "--set", "output=no-such-topic")
    assert run.returncode != 0
    assert "'no-such-topic'" in run.stderr and "create the output topic" in run.stderr, run.stderr[-2000:]
    with pytest.raises(LogError):
        KafkaLog(b, "no-such-topic").end_offsets()


def test_kafka_sessions_into_delta_example(kafka_broker: Any, tmp_path: Path) -> None:
    """examples/kafka_sessions_delta.py: every session of the produced clicks once in the
    Delta table, as a plain recount finds them."""
    from deltalake import DeltaTable

    b = kafka_broker.bootstrap
    src = new_topic(b, 2, "clicks")
    events = produce_events(b, src, 300, keys=10, seed=4)
    table = tmp_path / "sessions"
    run_job(EXAMPLES / "kafka_sessions_delta.py", tmp_path / "job", 2,
            {"bootstrap": b, "input": src, "output": str(table), "max_records": "50", "gap": "30 seconds"}, drain_at_end=True)
    got = sorted((r["key"], r["window_start"].timestamp(), r["window_end"].timestamp(), r["events"], r["total"])
                 for r in DeltaTable(str(table)).to_pyarrow_table().to_pylist())
    by_key: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for e in events:
        by_key[e["key"]].append((dt.datetime.fromisoformat(e["ts"]).timestamp(), e["value"]))
    want = []
    for key, items in by_key.items():
        items.sort()
        session = [items[0]]
        for t, v in items[1:]:
            if t - session[-1][0] > 30:
                want.append((key, session[0][0], session[-1][0] + 30, len(session), sum(x for _, x in session)))
                session = []
            session.append((t, v))
        want.append((key, session[0][0], session[-1][0] + 30, len(session), sum(x for _, x in session)))
    assert got == sorted(want)


CONNECT_JOB = '''
import keyscale as ks

NAME = "kafka_enrich"

class Enrich(ks.KeyedCoProcessFunction):
    """Events get their key's name; events before the name wait for it in state."""
    def open(self, ctx):
        self.name = ctx.value_state("name", "string")
        self.waiting = ctx.list_state("waiting", "long")
    def process_element1(self, row, ctx):
        self.name.update(row["name"])
        for v in self.waiting.get():
            yield (ctx.key, row["name"], v)
        self.waiting.update([])
    def process_element2(self, row, ctx):
        if self.name.value() is None:
            self.waiting.add(row["value"])
        else:
            yield (ctx.key, self.name.value(), row["value"])

def build(ctx):
    names = ks.stream(ks.sources.log_source(ctx.arg("names"), uid="names", max_records_per_batch=7))
    events = ks.stream(ks.kafka.kafka_source(ctx.arg("bootstrap"), ctx.arg("topic"), uid="events", max_records_per_batch=30,
                                               decoder=ks.kafka.json_values("key string, value long, ts timestamp")))
    out = names.connect(events).key_by("key", "key").process(Enrich(), "key string, name string, value long", uid="enrich")
    return out.sink(ks.sinks.ParquetSink(ctx.arg("output")))
'''


def test_a_log_and_a_kafka_topic_connected_enrich_every_event_once_across_a_live_rescale(kafka_broker: Any, tmp_path: Path) -> None:
    from conftest import read_output
    from keyscale.sources.log import create_log

    b = kafka_broker.bootstrap
    topic = new_topic(b, 3)
    events = produce_events(b, topic, 240, keys=25)
    names = create_log(tmp_path / "names", "key string, name string", partitions=2)
    for p in (0, 1):  # every key named once, spread over two partitions and several batches
        names.append(p, pa.table({"key": [f"k{i:04d}" for i in range(p, 25, 2)], "name": [f"name-{i}" for i in range(p, 25, 2)]}))
    job = tmp_path / "enrich.py"
    job.write_text(CONNECT_JOB)
    jd = JobDir(tmp_path / "job")

    def rescale(rec: Any) -> None:
        if rec.batch == 1:
            jd.request_rescale(3)

    summary = run_job(job, tmp_path / "job", 2, {"names": str(tmp_path / "names"), "bootstrap": b, "topic": topic, "output": str(tmp_path / "out")}, rescale)
    assert len(summary.batches) >= 3 and any(r[1] == "enrich" and r[3] == 3 for r in summary.rescales)
    out = read_output(tmp_path / "out")
    got = Counter(zip(out["key"], out["name"], out["value"], strict=True))
    assert got == Counter((e["key"], f"name-{int(e['key'][1:])}", e["value"]) for e in events)
