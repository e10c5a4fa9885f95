"""Exactly-once output to a Kafka topic: one transaction per output task and batch.

Protocol (per batch ``b``; ``L`` = the job's lineage id, ``E`` = the run's epoch):

1. ``open(ctx)`` (driver, before the first batch): the commit log topic
   ``<topic>.keyscale-commits`` (one partition, compacted: ``kafka/commit_log.py``) is
   created if missing, or its retention checked (a warning if the broker may delete
   records). It is read; for each transactional id this lineage used, a producer with that
   id is initialised, which aborts a transaction a crashed run left open (Kafka's zombie
   fencing), so the topic's last stable offset moves on; then the commit records of ``L``
   for batches after ``ctx.committed`` are read back: those (batch, task) outputs are
   already in the topic, and the batch's number of output tasks with them. Output of other
   lineages is named in a warning (lineages, below).
2. ``write(df, b)``: the driver checks the fence (``ctx.fence``: a newer run took over ->
   FencedError, nothing written) and that a batch with committed tasks is split into as
   many tasks as when they committed (else an OutputError). Every Spark task of the output
   writes its rows in one transaction of the transactional id
   ``keyscale-<L>-<topic>-<task>``. ``init_transactions`` fences any other producer of that
   id (a zombie task of an earlier attempt or run); then the task checks the fence, and
   reads the commit log from the offset the batch started at, past siblings' open
   transactions, to the end it saw after ``init_transactions``: if any attempt or epoch of
   ``L`` committed this (batch, task), it writes nothing. This runs on every attempt (a
   stage retry numbers its tasks' attempts from 0 again). In the transaction: the rows,
   then the commit record ``(L, b, task, rows, tasks, E)`` to the commit log; flush
   (pre-commit: everything is on the brokers); the fence is checked once more (fenced: the
   transaction is aborted), then ``commit_transaction``. Tasks whose commit record ``open``
   found run the batch's plan (state is rebuilt) and write nothing.
3. keyscale commits its checkpoint (the manifest) after ``write`` returns.

A crash before a task's commit: its transaction is aborted by the fencing of the next
attempt, invisible to ``read_committed`` consumers, and the replayed batch writes the task's
rows again. A crash after a task's commit (before the manifest): its commit record is found
at restart and the replay does not write the rows again. So ``read_committed`` consumers
see each output row once, on brokers that implement Kafka's transactions (KIP-98).

Per-task idempotence relies on the output's split into tasks being a fixed function of
the batch's intent: a keyed stage's output is one task per subtask (key-group range), so
task ``i`` of a replay computes the rows task ``i`` of the first attempt computed, by
keyscale's deterministic replay. A replay at another parallelism would split the key
groups otherwise; so ``plan_bound(b)`` tells keyscale that some of ``b``'s output is
committed per task, and keyscale replays ``b`` at its intent's parallelism (a new ``-p``
applies from the next batch: ``runtime/batch/commit.py``, ``replay_intent``). Where Spark knows
the number of output tasks before running (an exchange ends the plan), each commit record
carries it, and a replay split otherwise fails with an OutputError rather than losing or
duplicating output; where it does not (a union: the dead-letter output), that check is off.

Lineages (the rules of every sink, ``checkpoint/lineage.py``): a restore from an older
savepoint, an interrupted drain or a job directory that starts over begins a lineage that
writes batches again an ancestor lineage wrote after their fork; another lineage's output
may be in the topic too (a second job, this job before a start without its checkpoint).
Kafka output cannot be moved aside, so ``open`` warns, naming the lineages and batches,
until the new lineage has committed output of its own to the topic; a consumer sees both.

The commit is done in the task, before keyscale's checkpoint, not after it as in Flink's
two-phase sink: a Kafka transaction can only be committed by the producer instance that
opened it, and librdkafka (unlike the Java client Flink uses through reflection) cannot
resume another process's transaction; a Spark task's producer does not outlive its task.
The commit log makes the early commit safe, as the Parquet sink's markers do. What a
consumer sees: a batch's output becomes visible task by task, before the job's checkpoint
of that batch. A run paused between the fence check and ``commit_transaction`` commits
once more; the new run's tasks, with the same transactional ids, fence its producers.

Tansu 0.6 (the broker keyscale's tests run) serves records of aborted transactions to
``read_committed`` consumers; on it a crash (or a fenced run's abort) inside a transaction
after its records were sent leaves them visible. It also mishandles transactions on one
partition that end at the same moment: now and then one is left uncompleted and
``read_committed`` consumers stop behind it for good (docs/design.md, "Concurrent commits on
Tansu"). With ``serial_commits`` (or ``KEYSCALE_KAFKA_SERIAL_COMMITS=1``) the tasks of one
host take turns to end their transactions (``storage.scratch.host_turn``), which covers all
of local mode; keyscale's tests set it. Tansu keeps topic settings (``cleanup.policy``) but
does not compact. See docs/design.md for what the tests check on Tansu.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from keyscale._faults import armed, fault_point
from keyscale._keywords import checked_keywords
from keyscale._spark_map import map_in_arrow
from keyscale.errors import FencedError, JobDefinitionError, OutputError, encode_error
from keyscale.kafka import commit_log
from keyscale.kafka.client import (
    EAGER_CONNECTIONS,
    KafkaConnectorError,
    connection_options,
    partition_count,
)
from keyscale.kafka.commit_log import COMMIT_LOG_SUFFIX
from keyscale.storage.scratch import host_turn

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame

    from keyscale.checkpoint.fence import Fence
    from keyscale.sinks.base import SinkContext

log = logging.getLogger(__name__)

__all__ = ["COMMIT_LOG_SUFFIX", "SERIAL_COMMITS_ENV", "KafkaSink", "encode_values", "output_tasks", "read_committed"]

_RESULT_SCHEMA = "task int, rows long, written boolean"
SERIAL_COMMITS_ENV = "KEYSCALE_KAFKA_SERIAL_COMMITS"


def _producer_settings(bootstrap: str, options: Mapping[str, Any], txn_id: str | None, timeout_ms: int) -> dict[str, Any]:
    # murmur2: Java clients' key partitioning
    base: dict[str, Any] = {"linger.ms": 20, "partitioner": "murmur2_random", "log_level": 3, **EAGER_CONNECTIONS}
    out = {**base, **options, "bootstrap.servers": bootstrap}
    if txn_id is not None:
        out.update({"transactional.id": txn_id, "transaction.timeout.ms": timeout_ms})
    return out


def _transactional_producer(bootstrap: str, options: Mapping[str, Any], txn_id: str, timeout_ms: int) -> Any:
    """A producer for transactional id ``txn_id``, connected, before ``init_transactions``.

    Connected first (a metadata request): librdkafka starts ``init_transactions`` at once,
    and when no broker connection is up yet it looks for the transaction coordinator again
    only on a 500 ms timer. Against a local broker that took 0.5 s in 12-16 of 60 inits, and
    in none of 180 after the metadata request (``bench/kafka_task_cost.py``); a sink task
    makes a producer every batch."""
    from confluent_kafka import Producer

    producer = Producer(_producer_settings(bootstrap, options, txn_id, timeout_ms))
    try:
        producer.list_topics(timeout=timeout_ms / 1000)  # every topic: naming one may create it (auto-creation)
    except BaseException:
        producer.close()
        raise
    return producer


def encode_values(table: pa.Table, key: str | None, value: str | None) -> tuple[list[bytes | None], list[bytes | None]]:
    """Each row's Kafka key and value: ``key`` column's text (or bytes), None without one;
    the ``value`` column's text or bytes, or (``value`` None) the row as a JSON object
    of every column (timestamps as ISO-8601 text).

    >>> import pyarrow as pa
    >>> encode_values(pa.table({"k": ["a"], "n": [1]}), "k", None)
    ([b'a'], [b'{"k":"a","n":1}'])
    """
    import pyarrow as pa

    def as_bytes(col: pa.ChunkedArray[Any]) -> list[bytes | None]:
        if pa.types.is_binary(col.type) or pa.types.is_large_binary(col.type):
            return list(col.to_pylist())
        return [None if v is None else str(v).encode() for v in col.to_pylist()]

    n = table.num_rows
    keys: list[bytes | None] = as_bytes(table.column(key)) if key is not None else [None] * n
    if value is not None:
        return keys, as_bytes(table.column(value))
    rows = table.to_pylist()
    return keys, [json.dumps(r, separators=(",", ":"), default=_json_default).encode() for r in rows]


def _json_default(v: Any) -> Any:
    if hasattr(v, "isoformat"):
        return v.isoformat()
    if isinstance(v, bytes):
        return v.decode("utf-8", errors="replace")
    return str(v)


def output_tasks(df: DataFrame) -> int | None:
    """How many Spark tasks will write ``df``, from its physical plan (planned, not run):
    known where the plan ends in an exchange to a fixed number of partitions (a keyed or
    non-keyed stage's output: one task per subtask); None where Spark learns it only by
    running (a union of such outputs: the dead-letter sink's)."""
    try:
        n = int(df._jdf.queryExecution().sparkPlan().outputPartitioning().numPartitions())
    except Exception as e:  # not a classic Spark DataFrame: the check is off, not the write
        log.debug("could not tell the output tasks of a batch: %s", e)
        return None
    return n if n > 0 else None


def _write_task(
    bootstrap: str, topic: str, options: dict[str, Any], key: str | None, value: str | None, txn_prefix: str, lineage: str,
    batch_id: int, done: frozenset[int], commit_log_start: int, timeout_ms: int, serial: bool, fault: str, driver_pid: int,
    tasks: int | None, fence: Fence | None, batches: Iterator[pa.RecordBatch],
) -> Iterator[pa.RecordBatch]:
    """One Spark task: its rows in one transaction with its commit record (see the module doc)."""
    import pyarrow as pa
    from confluent_kafka import KafkaException
    from pyspark import TaskContext

    ctx = TaskContext.get()
    task = ctx.partitionId() if ctx is not None else 0
    log_topic = topic + COMMIT_LOG_SUFFIX

    fields: list[pa.Field[Any]] = [pa.field("task", pa.int32()), pa.field("rows", pa.int64()), pa.field("written", pa.bool_())]

    def result(rows: int, written: bool) -> Iterator[pa.RecordBatch]:
        yield pa.RecordBatch.from_pydict({"task": [task], "rows": [rows], "written": [written]}, schema=pa.schema(fields))

    def drain() -> int:
        return sum(b.num_rows for b in batches)  # runs the plan (state is rebuilt), writes nothing

    if task in done:
        drain()
        yield from result(0, False)
        return
    doing = f"writing batch {batch_id}, task {task} to Kafka topic {topic!r}"
    turn = functools.partial(host_turn, f"kafka-commit-{topic}") if serial else contextlib.nullcontext
    producer = None
    try:
        producer = _transactional_producer(bootstrap, options, f"{txn_prefix}-{task}", timeout_ms)
        with turn():  # may end (abort) an earlier attempt's transaction
            producer.init_transactions(timeout_ms / 1000)  # fences an earlier attempt of this task
        if fence is not None:
            fence.check(doing)
        # Every attempt: a stage retry starts its tasks' attempt numbers at 0 again.
        if commit_log.committed_before(bootstrap, options, log_topic, commit_log_start, lineage, batch_id, task, timeout_ms / 1000 + 10):
            drain()
            rows, written = 0, False
        else:
            rows, written = _transaction(producer, topic, log_topic, key, value, batches, lineage, batch_id, task, timeout_ms, turn,
                                         kill_driver=driver_pid if armed(fault, "kafka-precommit", batch_id) and task == 0 else 0,
                                         tasks=tasks, fence=fence), True
            if armed(fault, "kafka-postcommit", batch_id) and task == 0:  # test-only fault: after a commit, before the others'
                fault_point("kafka-postcommit", driver_pid)
    except FencedError as e:
        raise RuntimeError(encode_error(e)) from None
    except KafkaException as e:
        raise RuntimeError(encode_error(OutputError(f"Kafka sink (topic {topic!r}), batch {batch_id}, task {task}: {e.args[0].str() if e.args else e}"))) from None
    except KafkaConnectorError as e:
        raise RuntimeError(encode_error(OutputError(f"Kafka sink (topic {topic!r}), batch {batch_id}, task {task}: {e}"))) from None
    finally:
        if producer is not None:
            producer.close()  # one left to the garbage collector keeps reconnecting to a broker that is gone
    yield from result(rows, written)


def _transaction(producer: Any, topic: str, log_topic: str, key: str | None, value: str | None, batches: Iterator[pa.RecordBatch],
                 lineage: str, batch_id: int, task: int, timeout_ms: int, turn: Callable[[], AbstractContextManager[Any]],
                 kill_driver: int, tasks: int | None = None, fence: Fence | None = None) -> int:
    """The task's rows and its commit record in one transaction; returns the rows. A fenced
    run (``fence``) aborts the transaction instead of committing it."""
    import pyarrow as pa

    producer.begin_transaction()
    rows = 0
    for b in batches:
        if b.num_rows == 0:
            continue
        keys, values = encode_values(pa.Table.from_batches([b]), key, value)
        for k, v in zip(keys, values, strict=True):
            while True:
                try:
                    producer.produce(topic, value=v, key=k)
                    break
                except BufferError:
                    producer.poll(0.05)  # the local queue is full: let deliveries drain
        rows += b.num_rows
    record_key, record_value = commit_log.record(lineage, batch_id, task, rows, tasks, fence.epoch if fence is not None else 0)
    producer.produce(log_topic, key=record_key, value=record_value, partition=0)
    producer.flush(timeout_ms / 1000)  # pre-commit: every record of the transaction is on the brokers
    if kill_driver:  # test-only fault: between pre-commit and commit
        fault_point("kafka-precommit", kill_driver)
    with turn():
        if fence is not None:
            try:
                fence.check(f"committing batch {batch_id}, task {task} to Kafka topic {topic!r}")
            except FencedError:
                producer.abort_transaction(timeout_ms / 1000)  # not left open: it would hold the new run's readers back
                raise
        producer.commit_transaction(timeout_ms / 1000)
    return rows


def _serial_commits_from_env() -> bool:
    value = os.environ.get(SERIAL_COMMITS_ENV, "")
    if value not in ("", "0", "1"):
        raise JobDefinitionError(f"{SERIAL_COMMITS_ENV}={value!r}: use 1 (tasks of a host take turns to commit) or 0")
    return value == "1"


class KafkaSink:
    """Write each batch to a Kafka topic exactly once (see the module doc for the protocol).

    ``key``: the column whose text (or bytes) is each record's key (Kafka partitions by it
    with the Java clients' murmur2), None for no key. ``value``: a column holding each
    record's text or bytes, or None for the row as a JSON object of all its columns.
    ``options``: confluent-kafka producer settings (security, ``linger.ms``...); the
    transactional settings are keyscale's. The topic must exist; its commit log
    ``<topic>.keyscale-commits`` is created (one partition, compacted) if missing. ``serial_commits``:
    the tasks on one host take turns to commit their transactions, for brokers that
    mishandle concurrent commits on a partition (Tansu 0.6, see the module doc); None reads
    ``KEYSCALE_KAFKA_SERIAL_COMMITS`` (``1`` for on) where the job is defined.

    Consumers must read with ``isolation.level=read_committed`` to see each row once.

    >>> KafkaSink("127.0.0.1:9092", "counts", key="key").describe()
    "Kafka topic 'counts' on 127.0.0.1:9092 (transactions)"
    """

    exactly_once = True

    @checked_keywords
    def __init__(self, bootstrap: str, topic: str, key: str | None = None, value: str | None = None,
                 options: Mapping[str, Any] | None = None, transaction_timeout_s: float = 60.0,
                 serial_commits: bool | None = None) -> None:
        if not bootstrap or not topic:
            raise JobDefinitionError("KafkaSink needs a bootstrap address and a topic")
        reserved = sorted(k for k in (options or {}) if k in ("transactional.id", "transaction.timeout.ms", "enable.idempotence", "bootstrap.servers"))
        if reserved:
            raise JobDefinitionError(f"KafkaSink (topic {topic!r}): option {reserved[0]!r} is keyscale's to set (transactions per task)")
        self.bootstrap = bootstrap
        self.topic = topic
        self.key = key
        self.value = value
        self.options = dict(options or {})
        self.timeout_ms = int(transaction_timeout_s * 1000)
        self.serial_commits = _serial_commits_from_env() if serial_commits is None else serial_commits
        self._ctx: SinkContext | None = None
        self._done: dict[int, set[int]] = {}  # per batch after the committed one: its tasks already committed
        self._tasks: dict[int, int] = {}  # per such batch: how many output tasks it had when they committed

    def describe(self) -> str:
        return f"Kafka topic {self.topic!r} on {self.bootstrap} (transactions)"

    @property
    def commit_log(self) -> str:
        return self.topic + COMMIT_LOG_SUFFIX

    def _txn_prefix(self, lineage: str) -> str:
        return f"keyscale-{lineage[:16]}-{self.topic}"

    def _consumer(self, isolation: str) -> Any:
        return commit_log.reader(self.bootstrap, self.options, isolation)

    def open(self, ctx: SinkContext) -> None:
        """Check the topic, create (or check) the commit log, fence this lineage's open
        transactions, learn which outputs of batches after ``ctx.committed`` are already
        committed, and warn of other lineages' output (the module doc)."""
        from confluent_kafka.admin import AdminClient  # type: ignore[attr-defined]

        self._ctx = ctx
        admin = AdminClient({"bootstrap.servers": self.bootstrap, "log_level": 3, **connection_options(self.options)})
        try:
            partition_count(admin, self.topic, self.bootstrap)
        except KafkaConnectorError as e:
            raise OutputError(f"{e}; create the output topic (its partitions and replication are yours to choose) before the job writes it") from None
        commit_log.ensure(admin, self.topic, self.commit_log)
        lineage = ctx.lineage.id
        # Every task index this lineage wrote with (commit records, committed or not):
        # fencing them aborts what a crashed run left open, so the stable offset moves on.
        c = self._consumer("read_uncommitted")
        try:
            seen = [r for r in commit_log.read(c, self.commit_log, 0) if r.get("lineage") == lineage]
        finally:
            c.close()
        tasks = {int(r["task"]) for r in seen}
        for task in sorted(tasks):
            try:
                p = _transactional_producer(self.bootstrap, self.options, f"{self._txn_prefix(lineage)}-{task}", self.timeout_ms)
                try:
                    p.init_transactions(self.timeout_ms / 1000)
                finally:
                    p.close()
            except Exception as e:
                raise OutputError(f"Kafka sink (topic {self.topic!r}): could not fence transactional id of task {task}: {e}") from None
        # To the high watermark, past another lineage's open transaction: a commit record
        # behind it would be missed, and its task written again.
        records = list(commit_log.read_committed_to_end(self.bootstrap, self.options, self.commit_log, 0, self.timeout_ms / 1000 + 10))
        committed = [r for r in records if r.get("lineage") == lineage]
        self._done, self._tasks = {}, {}
        for r in committed:
            if int(r["batch"]) > ctx.committed:
                self._done.setdefault(int(r["batch"]), set()).add(int(r["task"]))
                if r.get("tasks") is not None:
                    self._tasks[int(r["batch"])] = int(r["tasks"])
        if self._done:
            log.info("Kafka sink %r: output of batches %s is already committed (a crash came before keyscale's checkpoint); "
                     "their replay will not write it again", self.topic, sorted(self._done))
        others = commit_log.other_output(records, ctx.lineage, ctx.committed) if not committed else []
        if others:
            log.warning("Kafka sink %r: the topic holds output this run does not own, which stays visible to consumers (Kafka "
                        "output cannot be moved aside): %s. Said until this run's lineage (%s) commits output to the topic",
                        self.topic, "; ".join(others), lineage[:16])

    def plan_bound(self, batch_id: int) -> bool:
        """Whether some of ``batch_id``'s output is committed, per task of its plan (the
        :class:`~keyscale.sinks.base.Sink` protocol): its replay must keep that plan."""
        return bool(self._done.get(batch_id))

    def _commit_log_end(self) -> int:
        c = self._consumer("read_committed")
        try:
            # Never past the true end (a broker may report less: Tansu), so a task's check
            # from here sees every commit record of this batch.
            return commit_log.end_offset(c, self.commit_log)
        finally:
            c.close()

    def write(self, df: DataFrame, batch_id: int) -> int:
        """Write batch ``batch_id``'s rows, each task in its own transaction; returns the rows written."""
        ctx = self._ctx
        lineage = ctx.lineage.id if ctx else "none"
        fence = ctx.fence if ctx else None
        if fence is not None:
            fence.check(f"writing batch {batch_id} to Kafka topic {self.topic!r}")
        columns = df.columns
        for what, col in (("key", self.key), ("value", self.value)):
            if col is not None and col not in columns:
                raise OutputError(f"Kafka sink (topic {self.topic!r}): {what} column {col!r} is not in the output's columns {columns}")
        tasks = output_tasks(df)
        done, recorded = self._done.get(batch_id, set()), self._tasks.get(batch_id)
        if done and tasks is not None and recorded is not None and tasks != recorded:
            raise OutputError(
                f"Kafka sink (topic {self.topic!r}): batch {batch_id} was split into {recorded} tasks when its tasks {sorted(done)} "
                f"committed, and its replay into {tasks}: the output of some tasks would be lost or written twice. "
                "keyscale replays such a batch at its first plan; this one's plan changed (a bug: please report it)")
        task = functools.partial(
            _write_task, self.bootstrap, self.topic, self.options, self.key, self.value, self._txn_prefix(lineage), lineage,
            batch_id, frozenset(done), self._commit_log_end(), self.timeout_ms, self.serial_commits,
            ctx.fault if ctx else "", os.getpid(), tasks, fence,
        )
        results = map_in_arrow(df, task, _RESULT_SCHEMA).collect()
        return sum(int(r["rows"]) for r in results)


def read_committed(bootstrap: str, topic: str, timeout: float = 30.0) -> list[tuple[int, int, bytes | None, bytes | None]]:
    """Every record of ``topic`` a ``read_committed`` consumer sees, as (partition, offset,
    key, value): for tests and small checks of a sink's output."""
    from confluent_kafka import KafkaError, TopicPartition

    c = commit_log.reader(bootstrap, {}, "read_committed")
    try:
        n = partition_count(c, topic, bootstrap)
        c.assign([TopicPartition(topic, p, 0) for p in range(n)])
        out: list[tuple[int, int, bytes | None, bytes | None]] = []
        ended: set[int] = set()
        deadline = time.monotonic() + timeout
        while len(ended) < n:
            if time.monotonic() > deadline:
                raise KafkaConnectorError(f"Kafka topic {topic!r}: partitions {sorted(set(range(n)) - ended)} not read to their end in {timeout:.0f} s")
            for m in c.consume(num_messages=10_000, timeout=0.5):
                err = m.error()
                if err is None:
                    out.append((m.partition() or 0, m.offset() or 0, m.key(), m.value()))
                elif err.code() == KafkaError._PARTITION_EOF:
                    ended.add(m.partition() or 0)
        return sorted(out)
    finally:
        c.close()

