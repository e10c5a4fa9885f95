"""The Kafka sink's exactly-once rules under re-planning, retries, zombie runs and lineages
(issue 32, cases 1, 2, 5 and 10), against a real Kafka-protocol broker (Tansu)."""

from __future__ import annotations

import json
import logging
import signal
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from test_kafka_jobs import _check_exactly_once, _check_read_to_end, _decoded, _output_view

from conftest import EXAMPLES, cli, cli_here, new_topic, produce_events
from keyscale.checkpoint.fence import Fence, epoch_key
from keyscale.checkpoint.jobdir import JobDir
from keyscale.checkpoint.lineage import Lineage
from keyscale.errors import FencedError, OutputError, decode_error
from keyscale.kafka.sink import COMMIT_LOG_SUFFIX, KafkaSink, _write_task, read_committed
from keyscale.sinks.base import SinkContext
from keyscale.storage import open_store

JOB = EXAMPLES / "kafka_running_count.py"


class _Task:
    """What ``_write_task`` asks of Spark's TaskContext."""

    def __init__(self, partition: int, attempt: int) -> None:
        self.partition, self.attempt = partition, attempt

    def partitionId(self) -> int:
        return self.partition

    def attemptNumber(self) -> int:
        return self.attempt


def _as_task(monkeypatch: pytest.MonkeyPatch, partition: int, attempt: int) -> None:
    from pyspark import TaskContext

    monkeypatch.setattr(TaskContext, "get", classmethod(lambda cls: _Task(partition, attempt)))


def _rows(n: int, first: int = 0) -> Iterator[pa.RecordBatch]:
    yield pa.RecordBatch.from_pydict({"key": [f"k{i}" for i in range(first, first + n)], "n": list(range(first, first + n))})


def _commit_records(bootstrap: str, topic: str) -> list[dict[str, Any]]:
    return [json.loads(v) for _, _, _, v in read_committed(bootstrap, topic + COMMIT_LOG_SUFFIX) if v is not None]


def _ctx(lineage: Lineage, committed: int, fence: Fence | None = None) -> SinkContext:
    return SinkContext(lineage, "job", "/tmp/job", "run", committed, "", fence)


def _task_args(sink: KafkaSink, lineage: str, batch: int, start: int, fence: Fence | None = None) -> dict[str, Any]:
    return dict(bootstrap=sink.bootstrap, topic=sink.topic, options={}, key="key", value=None, txn_prefix=sink._txn_prefix(lineage),
                lineage=lineage, batch_id=batch, done=frozenset(), commit_log_start=start, timeout_ms=sink.timeout_ms, serial=False,
                fault="", driver_pid=0, tasks=None, fence=fence)


# -- case 1: a replay at another -p ---------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(("first", "restart"), [(4, 2), (2, 4)])
def test_a_replay_at_another_parallelism_writes_every_update_once(first: int, restart: int, spark: Any, kafka_broker: Any, tmp_path: Path) -> None:
    """Task 0 of batch 2 commits, the driver dies before the other tasks (one core: they run
    in turn), the restart asks for another -p: batch 2 keeps its plan (its committed output
    is per task), the new -p applies from batch 3, and every update is in the topic once."""
    b = kafka_broker.bootstrap
    src, out = new_topic(b, 4, "in"), new_topic(b, 2, "out")
    events = produce_events(b, src, 800, keys=40, seed=5)
    base = ["run", str(JOB), "--job-dir", str(tmp_path / "job"), "--until-idle", "--retain", "100",
            "--set", f"bootstrap={b}", "--set", f"input={src}", "--set", f"output={out}", "--set", "max_records=60"]
    crashed = cli(*base, "--master", "local[1]", "-p", str(first), "--fault", "kafka-postcommit:2")
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    assert JobDir(tmp_path / "job").manifest_batches()[-1] == 1
    resumed = cli_here(*base, "-p", str(restart), check=True)  # a new driver, on the tests' session
    _check_read_to_end(JobDir(tmp_path / "job"), b, src, resumed.stderr)
    records = read_committed(b, out)
    updates = _decoded(records)
    # Batch 2's own updates, each once: a lost one is not seen by the totals check when a
    # later batch updates its key again.
    got = Counter((u["key"], u["count"], u["sum"]) for u in updates)
    want = _updates_of_batch(JobDir(tmp_path / "job"), b, src, 2)
    assert want and {u: got[u] for u in want} == dict.fromkeys(want, 1), f"batch 2's updates not once: {[(u, got[u]) for u in sorted(want) if got[u] != 1][:8]}"
    _check_exactly_once(updates, events, _output_view(records, b, out))
    assert f"-p {restart} applies from the next batch" in resumed.stderr, resumed.stderr[-3000:]


def _updates_of_batch(job: JobDir, bootstrap: str, topic: str, batch: int) -> set[tuple[str, int, int]]:
    """The running count's updates of ``batch``: each key it read, with its count and sum
    over the input up to the batch's end (the readers' positions in its manifest)."""
    from keyscale.kafka.source import KafkaLog, json_values

    def positions(n: int) -> dict[int, int]:
        readers = job.read_manifest(n).operators["events"].operator_state["offsets"]["subtasks"]
        return {int(p): int(o) for r in readers for p, o in r}

    before, after = positions(batch - 1), positions(batch)
    log = KafkaLog(bootstrap, topic, decoder=json_values("key string, value long, ts timestamp"))
    count: Counter[str] = Counter()
    total: Counter[str] = Counter()
    keys: set[str] = set()
    for p, end in after.items():
        for e in log.read(p, 0, end).to_pylist():
            count[e["key"]] += 1
            total[e["key"]] += e["value"]
        keys.update(e["key"] for e in log.read(p, before.get(p, 0), end).to_pylist())
    return {(k, count[k], total[k]) for k in keys}


def test_a_replay_split_into_other_tasks_than_its_committed_ones_is_an_error(spark: Any, kafka_broker: Any) -> None:
    """Batch 5's task 0 committed as one of 4 tasks; a replay of batch 5 in 2 tasks (a
    changed plan) stops with an error naming the topic and batch, and writes nothing."""
    from confluent_kafka import Producer

    b = kafka_broker.bootstrap
    out = new_topic(b, 1, "out")
    sink = KafkaSink(b, out, key="key", serial_commits=True)
    me = Lineage("a" * 32)
    sink.open(_ctx(me, 4))
    p = Producer({"bootstrap.servers": b})
    p.produce(sink.commit_log, key=b"x", value=json.dumps({"lineage": me.id, "batch": 5, "task": 0, "rows": 3, "tasks": 4, "epoch": 1}).encode(), partition=0)
    p.flush(10)
    sink.open(_ctx(me, 4))
    df = spark.createDataFrame([(f"k{i}", i) for i in range(10)], "key string, n long").repartition(2, "key")
    with pytest.raises(OutputError, match=rf"topic '{out}'.*batch 5.*4 tasks.*2"):
        sink.write(df, 5)
    assert read_committed(b, out) == []


# -- case 5: the retry check ------------------------------------------------------------------


def test_a_retried_task_with_attempt_number_zero_writes_nothing_again(kafka_broker: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stage retry (FetchFailed after an executor loss) starts its tasks at attempt 0
    again: a task whose earlier attempt committed must still find that commit."""
    b = kafka_broker.bootstrap
    out = new_topic(b, 1, "out")
    sink = KafkaSink(b, out, key="key", serial_commits=False)
    me = Lineage("b" * 32)
    sink.open(_ctx(me, -1))
    start = sink._commit_log_end()
    _as_task(monkeypatch, 0, 0)
    for _ in range(2):
        list(_write_task(**_task_args(sink, me.id, 0, start), batches=_rows(5)))
    assert len(read_committed(b, out)) == 5
    assert [(r["batch"], r["task"], r["rows"]) for r in _commit_records(b, out)] == [(0, 0, 5)]


def test_a_task_an_earlier_run_of_the_lineage_committed_is_not_written_again(kafka_broker: Any, monkeypatch: pytest.MonkeyPatch,
                                                                          tmp_path: Path) -> None:
    """A run (epoch 3) commits batch 0's task 0; a newer run (epoch 4) that replays batch 0
    without having seen that commit at its start writes nothing for it."""
    b = kafka_broker.bootstrap
    out = new_topic(b, 1, "out")
    store = open_store(str(tmp_path / "job"), "job directory")
    sink = KafkaSink(b, out, key="key", serial_commits=False)
    me = Lineage("9" * 32)
    sink.open(_ctx(me, -1))
    start = sink._commit_log_end()
    _as_task(monkeypatch, 0, 0)
    for epoch in (3, 4):
        if epoch == 4:
            store.put(epoch_key(4), b"{}")
        list(_write_task(**_task_args(sink, me.id, 0, start, Fence(store, epoch)), batches=_rows(4)))
    assert len(read_committed(b, out)) == 4
    assert [(r["task"], r["epoch"]) for r in _commit_records(b, out)] == [(0, 3)]


@pytest.mark.parametrize("attempt", [0, 1])
def test_the_retry_check_finds_a_commit_behind_a_siblings_open_transaction(attempt: int, kafka_broker: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Task 1's transaction is open on the commit log (its commit record sent) when task 0's
    earlier attempt commits after it: task 0's retry reads past the open transaction (it
    waits for its end) and finds its own commit record."""
    from confluent_kafka import Producer

    b = kafka_broker.bootstrap
    out = new_topic(b, 1, "out")
    sink = KafkaSink(b, out, key="key", serial_commits=False)
    me = Lineage("c" * 32)
    sink.open(_ctx(me, -1))
    start = sink._commit_log_end()

    def producer(task: int) -> Any:
        p = Producer({"bootstrap.servers": b, "transactional.id": f"{sink._txn_prefix(me.id)}-{task}", "log_level": 3})
        p.init_transactions(10)
        p.begin_transaction()
        p.produce(sink.commit_log, key=f"{me.id}:0:{task}".encode(), partition=0,
                  value=json.dumps({"lineage": me.id, "batch": 0, "task": task, "rows": 1, "tasks": 2, "epoch": 0}).encode())
        p.produce(out, key=f"t{task}".encode(), value=b"{}")
        p.flush(10)
        return p

    sibling = producer(1)  # open: the commit log's stable offset stays before its record
    earlier = producer(0)  # task 0's earlier attempt: committed after the sibling's record
    earlier.commit_transaction(10)
    _as_task(monkeypatch, 0, attempt)
    result: list[Any] = []
    retry = threading.Thread(target=lambda: result.extend(_write_task(**_task_args(sink, me.id, 0, start), batches=_rows(5))))
    retry.start()
    retry.join(3)
    assert retry.is_alive(), f"the retry did not wait for the sibling's open transaction: {result[0].to_pylist() if result else result}"
    sibling.commit_transaction(10)
    retry.join(60)
    assert not retry.is_alive()
    assert result[0].to_pylist() == [{"task": 0, "rows": 0, "written": False}]
    assert sorted(k for _, _, k, _ in read_committed(b, out)) == [b"t0", b"t1"]


# -- case 2: a zombie run's tasks -------------------------------------------------------------


def test_a_fenced_run_writes_nothing_to_kafka(spark: Any, kafka_broker: Any, tmp_path: Path) -> None:
    """A run whose epoch a newer run superseded (epochs/<n+1>.json exists) writes nothing
    and stops with FencedError (keyscale's exit code 9)."""
    b = kafka_broker.bootstrap
    out = new_topic(b, 1, "out")
    store = open_store(str(tmp_path / "job"), "job directory")
    store.put(epoch_key(4), b"{}")
    fence = Fence(store, 3)
    sink = KafkaSink(b, out, key="key", serial_commits=True)
    me = Lineage("d" * 32)
    sink.open(_ctx(me, -1, fence))
    store.put(epoch_key(4), b'{"pid": 1, "host": "elsewhere"}')
    df = spark.createDataFrame([(f"k{i}", i) for i in range(10)], "key string, n long").repartition(2, "key")
    with pytest.raises(FencedError, match="epoch 3"):
        sink.write(df, 0)
    assert read_committed(b, out) == []


def test_a_task_of_a_fenced_run_commits_nothing(kafka_broker: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The check in the task: a run fenced after its driver's check (a pause between the
    two) has its task's transaction aborted, its commit record never committed."""
    b = kafka_broker.bootstrap
    out = new_topic(b, 1, "out")
    store = open_store(str(tmp_path / "job"), "job directory")
    sink = KafkaSink(b, out, key="key", serial_commits=False)
    me = Lineage("e" * 32)
    sink.open(_ctx(me, -1, Fence(store, 3)))
    start = sink._commit_log_end()
    store.put(epoch_key(4), b'{"pid": 1, "host": "elsewhere"}')
    _as_task(monkeypatch, 0, 0)
    with pytest.raises(RuntimeError) as caught:
        list(_write_task(**_task_args(sink, me.id, 0, start, Fence(store, 3)), batches=_rows(5)))
    assert decode_error(str(caught.value)) is not None and decode_error(str(caught.value))[0] == "FencedError"  # type: ignore[index]
    assert _commit_records(b, out) == []


def test_commit_records_carry_the_runs_epoch_and_the_batchs_tasks(kafka_broker: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    b = kafka_broker.bootstrap
    out = new_topic(b, 1, "out")
    sink = KafkaSink(b, out, key="key", serial_commits=False)
    me = Lineage("f" * 32)
    fence = Fence(open_store(str(tmp_path / "job"), "job directory"), 7)
    sink.open(_ctx(me, -1, fence))
    _as_task(monkeypatch, 1, 0)
    list(_write_task(**{**_task_args(sink, me.id, 0, sink._commit_log_end(), fence), "tasks": 3}, batches=_rows(2)))
    assert [(r["task"], r["tasks"], r["epoch"]) for r in _commit_records(b, out)] == [(1, 3, 7)]


# -- case 10: retention and lineages ----------------------------------------------------------------


def _topic_config(bootstrap: str, topic: str) -> dict[str, str]:
    from confluent_kafka.admin import AdminClient, ConfigResource, ResourceType

    admin = AdminClient({"bootstrap.servers": bootstrap})
    res = admin.describe_configs([ConfigResource(ResourceType.TOPIC, topic)])
    return {k: v.value for f in res.values() for k, v in f.result(10).items()}


def test_the_commit_log_is_created_compacted(kafka_broker: Any) -> None:
    b = kafka_broker.bootstrap
    out = new_topic(b, 1, "out")
    KafkaSink(b, out).open(_ctx(Lineage("1" * 32), -1))
    assert _topic_config(b, out + COMMIT_LOG_SUFFIX).get("cleanup.policy") == "compact"


def test_a_commit_log_that_retention_would_empty_is_warned_about(kafka_broker: Any, caplog: pytest.LogCaptureFixture) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    b = kafka_broker.bootstrap
    out = new_topic(b, 1, "out")
    admin = AdminClient({"bootstrap.servers": b})
    log_topic = out + COMMIT_LOG_SUFFIX
    admin.create_topics([NewTopic(log_topic, 1, config={"cleanup.policy": "delete", "retention.ms": "604800000"})])[log_topic].result(30)
    with caplog.at_level(logging.WARNING, logger="keyscale"):
        KafkaSink(b, out).open(_ctx(Lineage("2" * 32), -1))
    text = "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    assert f"'{log_topic}'" in text and "cleanup.policy=compact" in text and "7 days" in text, text


def test_output_of_superseded_and_other_lineages_is_warned_about(kafka_broker: Any, caplog: pytest.LogCaptureFixture) -> None:
    """A restore from the savepoint of batch 2 (or an interrupted drain, or a job directory
    that starts over) writes batches 3.. again; the topic still holds the old lineage's
    batches 3-5, and another job's output: both are named at open (Kafka output cannot be
    moved aside). Shared history (batches 0-2) is not."""
    from confluent_kafka import Producer

    b = kafka_broker.bootstrap
    out = new_topic(b, 1, "out")
    old, other = "0a" * 16, "0b" * 16
    KafkaSink(b, out).open(_ctx(Lineage(old), -1))
    p = Producer({"bootstrap.servers": b})
    for lid, batch in [*((old, n) for n in range(6)), (other, 0)]:
        for task in (0, 1):
            p.produce(out + COMMIT_LOG_SUFFIX, key=f"{lid}:{batch}:{task}".encode(), partition=0,
                      value=json.dumps({"lineage": lid, "batch": batch, "task": task, "rows": 1, "tasks": 2, "epoch": 1}).encode())
    p.flush(10)
    with caplog.at_level(logging.WARNING, logger="keyscale"):
        KafkaSink(b, out).open(_ctx(Lineage("0c" * 16, {old: 2}), 2))
    text = "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    assert f"lineage {old[:16]}" in text and "batches 3-5" in text, text
    assert f"lineage {other[:16]}" in text, text
    assert "batches 0-2" not in text
