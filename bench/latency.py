"""Latency side by side: Kafka -> keyed count and sum -> Kafka (issue 35, item 5).

    PYTHONPATH=src .venv/bin/python bench/latency.py --repeats 1 --out bench/out/latency.json
    PYTHONPATH=src .venv/bin/python bench/latency.py --quick          # a smoke check (~6 min)

Three engines on the same input, measured the same way, each in its own process with a
private Tansu broker (keyscale.kafka.broker, in memory) and fresh topics (4 partitions in,
4 out), local[2], parallelism / shuffle partitions 2. Each rate (and the rescale phase)
runs on a new broker, engine process and topics (``phase_groups``: Tansu slows down with
a partition's history), unless ``--one-broker``:

- ``keyscale``: ``examples/kafka_running_count.py`` (Kafka source -> keyed count and sum ->
  ``KafkaSink``, one transaction per task and batch, exactly once), batches back to back
  (trigger interval 1 ms; ``--trigger`` to change it). After the phase at ``--rescale-rate``,
  one more at that rate for each ``--rescales FROM:TO`` (default 2:3): the job starts at
  FROM, is asked for TO (``keyscale rescale``) in the phase's middle and for FROM again at
  its end. On 2 cores, 2:3 runs more subtasks than cores after it; 1:2 adds a core. FROM:FROM
  is the control: the same phase with no rescale, its minute measured around the time one
  would be asked for (how much of that minute is the broker's history).
- ``spark``: Spark's own stateful streaming aggregation, ``groupBy(key).agg(count, sum)`` in
  update mode, the default trigger (processingTime 0: batches back to back), its default
  state store (HDFS-backed; ``--spark-rocksdb`` for RocksDB). Spark's Kafka connector is
  Maven-only and not here, so the source is a Python streaming data source
  (``pyspark.sql.datasource.DataSourceStreamReader``): offsets per partition, the end of each
  partition found by keyscale's own end probe (``kafka.client.true_ends``) and a partition's
  range read and JSON-decoded by keyscale's own reader (``KafkaLog.read`` with
  ``json_values``), one Spark task per Kafka partition, so both engines read Kafka with the
  same code. The sink is ``foreachBatch``: the batch's updated rows, as JSON
  ``{key, count, sum}``, go to the output topic in one Kafka transaction per batch (a
  transactional confluent-kafka producer in the driver; not fenced by batch id, so a batch
  replayed after a crash would be written again: cheaper than keyscale's exactly-once).
- ``stateless``: keyscale's floor, ``bench/jobs/kafka_passthrough.py``: the same source and
  sink with no state, each record mapped to an output record ``{key, seq}``.

Input: a producer process sends JSON ``{key, value, ts, seq}`` with string keys ``user-<n>``
(``--keys``, default 10,000) at a steady rate. Each run primes the engine first (5 records/s
until its first output arrives: the JVM and Python workers started), then goes through
phases: an almost empty one (5 records/s, ``--empty-seconds``) and an empty one (no input),
for the fixed cost of a batch; then each rate of ``--rates`` for ``--warmup`` + ``--seconds``
s. Between phases the harness waits until every record produced is in the output (or
``--drain`` s passed).

Latency, the way users feel it: a record's latency is from its produce call to the
arrival, at a ``read_committed`` consumer of the output topic, of the first update of its
key whose count includes it (the stateless floor: of its own output record); p50, p99,
max over the records produced in the measured ``--seconds`` of the phase (not the
warm-up). Records not in the output when the phase drained count with the time they
waited until then (``unmatched``). Whether lag grows: the median latency of the measured
window's last quarter against its first (grows: more than 0.5 s and 10% above), the
records the engine read per second in the window (``read/s``: below the rate, it falls
behind), and the drain, from the phase's last record produced to the output including it.
Batches: each engine's own time per batch (keyscale: ``BatchRecord.seconds``; Spark:
``durationMs.triggerExecution``) in the window, median.

The machine is shared: the load average (``uptime``) is recorded beside every phase.
Output: a markdown table on stdout, JSON with everything (``--out``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from array import array
from pathlib import Path
from typing import Any, NamedTuple

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
KEYED_JOB = ROOT / "examples" / "kafka_running_count.py"
STATELESS_JOB = HERE / "jobs" / "kafka_passthrough.py"
ENGINES = ("keyscale", "spark", "stateless")
# Not in the default run: keyscale with asynchronous checkpoints (RunOptions.async_checkpoints), and
# with a latency target (RunOptions.latency_target, --latency-target: its batches sized for it).
OPTIONAL = ("keyscale_async", "keyscale_target")
PARTITIONS = 4
PRIME_RATE = 5.0
RESCALE = "{rate:,}/s + rescale {p}->{to}"
CONTROL = "{rate:,}/s at {p}, no rescale (control)"
SPARK_SOURCE_SCHEMA = "key string, value long, seq long"


class Phase(NamedTuple):
    """A measured phase: input ``rate`` records/s for ``seconds``; ``rescale``: the engine
    starts it at the first parallelism and is asked for the second in its middle (for the
    same one: asked for nothing, a control)."""

    name: str
    rate: float
    seconds: float
    rescale: tuple[int, int] | None = None


def parse_rescales(text: str, parallelism: int) -> list[tuple[int, int]]:
    """``--rescales``: ``FROM:TO`` pairs, comma-separated (``""``: the table's parallelism to
    one more); ``P:P`` is a control phase, with no rescale.

    >>> parse_rescales("", 2), parse_rescales("2:3,1:2,1:1", 2)
    ([(2, 3)], [(2, 3), (1, 2), (1, 1)])
    """
    out = []
    for spec in (text or f"{parallelism}:{parallelism + 1}").split(","):
        m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", spec)
        if m is None or int(m[1]) < 1 or int(m[2]) < 1:
            raise ValueError(f"--rescales {text!r}: {spec!r} is not FROM:TO, two parallelisms of at least 1")
        out.append((int(m[1]), int(m[2])))
    return out


def _key_id(i: int, keys: int) -> int:
    return (i * 7919) % keys  # a permutation of the residues mod keys (7919 is prime)


# --------------------------------------------------------------------------- producer (own process)


def _producer_main(cfg: dict[str, Any], primed: Any, go: Any, phase_done: Any, produced: Any, out_path: str) -> None:
    """Prime at PRIME_RATE until ``primed`` is set (the engine's first output arrived), then for each phase: wait for ``go``, send
    ``rate`` records/s for ``seconds``, set ``phase_done``. Writes the produce time (wall
    clock) of every record, by sequence number, and the phases' bounds to ``out_path``."""
    import numpy as np
    from confluent_kafka import Producer

    keys, topic = cfg["keys"], cfg["input"]
    names = [f"user-{k:05d}".encode() for k in range(keys)]
    total = int(cfg["prime_timeout"] * PRIME_RATE) + sum(int(r * s) + 1000 for r, s in cfg["phases"]) + 1000
    times = np.zeros(total, dtype=np.float64)
    p = Producer({"bootstrap.servers": cfg["bootstrap"], "linger.ms": 5, "partitioner": "murmur2_random", "log_level": 3})
    i = 0

    def send(n: int) -> None:
        nonlocal i
        while i < n:
            k = names[_key_id(i, keys)]
            v = b'{"key":"%s","value":%d,"ts":"2026-01-01T00:00:00Z","seq":%d}' % (k, i % 100, i)
            times[i] = time.time()
            while True:
                try:
                    p.produce(topic, key=k, value=v)
                    break
                except BufferError:
                    p.poll(0.005)
            i += 1
        produced.value = i

    bounds: list[dict[str, float]] = []
    t0 = time.perf_counter()
    while not primed.is_set() and not go.is_set():
        if time.perf_counter() - t0 > cfg["prime_timeout"]:
            break
        send(i + 1)
        p.poll(0)
        time.sleep(1 / PRIME_RATE)
    for rate, seconds in cfg["phases"]:
        go.wait()
        go.clear()
        first, start, t0 = i, time.time(), time.perf_counter()
        while (el := time.perf_counter() - t0) < seconds:
            send(first + int(el * rate))
            p.poll(0)
            time.sleep(0.002)
        p.flush(60)
        bounds.append({"rate": rate, "start": start, "end": time.time(), "first": first, "last": i})
        phase_done.set()
    p.flush(60)
    np.save(out_path + ".npy", times[:i])
    Path(out_path + ".json").write_text(json.dumps({"records": i, "phases": bounds}))


# --------------------------------------------------------------------------- consumer (thread)


class Outputs:
    """Reads the output topic with read_committed; keeps (key, count, arrival) per update,
    or (seq, arrival) per record for the stateless floor."""

    COUNT = re.compile(rb'"count":\s*(\d+)')
    SEQ = re.compile(rb'"seq":\s*(\d+)')

    def __init__(self, bootstrap: str, topic: str, keys: int, stateless: bool) -> None:
        import numpy as np

        self.stateless = stateless
        self.keys = keys
        self.ids, self.counts, self.arrivals = array("q"), array("q"), array("d")
        self.max_count = np.zeros(keys, dtype=np.int64)
        self.received = 0
        self.first = threading.Event()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._t = threading.Thread(target=self._run, args=(bootstrap, topic), daemon=True)
        self._t.start()

    def _run(self, bootstrap: str, topic: str) -> None:
        from confluent_kafka import Consumer, KafkaError, TopicPartition

        try:
            c = Consumer({"bootstrap.servers": bootstrap, "group.id": "latency-bench", "isolation.level": "read_committed",
                          "enable.auto.commit": False, "fetch.wait.max.ms": 10, "log_level": 3})
            c.assign([TopicPartition(topic, p, 0) for p in range(PARTITIONS)])
            pattern = self.SEQ if self.stateless else self.COUNT
            while not self._stop.is_set():
                msgs = c.consume(num_messages=10_000, timeout=0.05)
                now = time.time()
                for m in msgs:
                    if m.error() is not None:
                        if m.error().code() != KafkaError._PARTITION_EOF:
                            raise RuntimeError(m.error().str())
                        continue
                    found = pattern.search(m.value())
                    if found is None:
                        continue
                    n = int(found.group(1))
                    if self.stateless:
                        self.ids.append(n)
                    else:
                        k = int(m.key()[5:])
                        self.ids.append(k)
                        self.counts.append(n)
                        if n > self.max_count[k]:
                            self.max_count[k] = n
                    self.arrivals.append(now)
                    self.received += 1
                if msgs and self.received:
                    self.first.set()
            c.close()
        except BaseException as e:  # reported by covered()
            self._error = e

    def covered(self, n: int) -> bool:
        """Whether the output includes every one of the first ``n`` records."""
        import numpy as np

        if self._error is not None:
            raise RuntimeError(f"output consumer failed: {self._error}")
        if self.stateless:
            return self.received >= n
        r = np.arange(self.keys)
        need = np.zeros(self.keys, dtype=np.int64)
        need[(r * 7919) % self.keys] = n // self.keys + (r < n % self.keys)
        return bool(np.all(self.max_count >= need))

    def stop(self) -> None:
        self._stop.set()
        self._t.join(10)

    def arrival_per_record(self, n: int) -> Any:
        """Per record 0..n-1: when the first output including it arrived (inf: never)."""
        import numpy as np

        arr = np.frombuffer(self.arrivals, dtype=np.float64).copy() if len(self.arrivals) else np.zeros(0)
        out = np.full(n, np.inf)
        if not len(arr):
            return out
        ids = np.frombuffer(self.ids, dtype=np.int64).copy()
        if self.stateless:
            ok = ids < n
            np.minimum.at(out, ids[ok], arr[ok])
            return out
        counts = np.frombuffer(self.counts, dtype=np.int64).copy()
        base = float(arr.min())
        rel = arr - base
        big = float(rel.max()) + 10.0
        order = np.lexsort((counts, ids))  # by key, then count
        k, c, a = ids[order], counts[order], rel[order]
        # suffix minimum of arrival within each key (over counts >= this one)
        shifted = (a + k * big)[::-1]
        suffix = np.minimum.accumulate(shifted)[::-1] - k * big
        composite = k * (1 << 32) + c
        seq = np.arange(n, dtype=np.int64)
        rk = (seq * 7919) % self.keys
        rn = seq // self.keys + 1
        pos = np.searchsorted(composite, rk * (1 << 32) + rn, side="left")
        inside = pos < len(composite)
        hit = np.zeros(n, dtype=bool)
        hit[inside] = k[pos[inside]] == rk[inside]
        out[hit] = suffix[pos[hit]] + base
        return out


# --------------------------------------------------------------------------- engines (own process)


def _engine_main(cfg: dict[str, Any]) -> int:
    """Run one engine until the stop file appears; write its batches to cfg["result"]."""
    stop_file = Path(cfg["stop"])
    batches: list[dict[str, Any]] = []
    if cfg["engine"] != "spark":
        import logging

        from keyscale.runtime.driver.runner import JobRunner, RunOptions

        spark_job: dict[int, float] = {}

        class BatchLines(logging.Handler):  # the driver's "batch N committed in X s (Spark job Y s)"
            def emit(self, record: logging.LogRecord) -> None:
                if str(record.msg).startswith("batch %d %s in %.2f s (Spark job"):
                    args: Any = record.args
                    spark_job[int(args[0])] = float(args[3])

        logging.getLogger("keyscale").addHandler(BatchLines())
        logging.getLogger("keyscale").setLevel(logging.INFO)

        def collect() -> None:
            # The batches from the job's history (what GET /history shows), not an on_batch
            # callback: the job plans on the log's end read at the commit unless code of the
            # caller's ran between two batches (which may have appended to the log).
            seen = batches[-1]["batch"] if batches else -1
            for h in runner.history()["batches"]:
                if h["batch"] > seen:
                    end, lat = h["time_ms"] / 1000, h.get("latency") or {}  # keyscale's own measure, append time to commit
                    batches.append({"batch": h["batch"], "start": end - h["seconds"], "end": end, "seconds": h["seconds"],
                                    "records": h["records"], "parallelism": max(h["parallelism"].values()) if h["parallelism"] else 0,
                                    "own_p50_s": lat.get("p50_seconds"), "own_p99_s": lat.get("p99_seconds"),
                                    "steps": h.get("steps") or {}})

        job = STATELESS_JOB if cfg["engine"] == "stateless" else KEYED_JOB
        opts = RunOptions(job_file=str(job), job_dir=cfg["dir"], parallelism=cfg["parallelism"], trigger_interval=cfg["trigger"],
                          args={"bootstrap": cfg["bootstrap"], "input": cfg["input"], "output": cfg["output"]},
                          async_checkpoints=cfg["engine"] == "keyscale_async",
                          latency_target=cfg["latency_target"] if cfg["engine"] == "keyscale_target" else None)
        runner = JobRunner(opts)

        def watch() -> None:
            while not stop_file.exists():
                time.sleep(0.2)
                collect()
            runner.stop()

        threading.Thread(target=watch, daemon=True).start()
        summary = runner.run()
        collect()
        limits = {h["batch"]: h.get("read_limit") for h in runner.history()["batches"]}
        for b in batches:
            b["spark_job_s"] = spark_job.get(b["batch"], float("nan"))
            b["read_limit"] = limits.get(b["batch"])  # with a latency target: the batch's read limit
        result = {"batches": batches, "rescales": [list(r) for r in summary.rescales]}
    else:
        result = _spark_engine(cfg, stop_file)
    Path(cfg["result"]).write_text(json.dumps(result))
    return 0


def _spark_engine(cfg: dict[str, Any], stop_file: Path) -> dict[str, Any]:
    import datetime as dt
    import uuid

    os.environ["PYSPARK_PYTHON"] = sys.executable
    from confluent_kafka import Producer
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F
    from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition

    class KafkaRange(InputPartition):
        def __init__(self, partition: int, start: int, end: int) -> None:
            self.partition, self.start, self.end = partition, start, end

    class KafkaStreamReader(DataSourceStreamReader):
        def __init__(self, options: dict[str, str]) -> None:
            self.bootstrap, self.topic = options["bootstrap"], options["topic"]
            self._log: Any = None

        def __getstate__(self) -> dict[str, Any]:
            return {"bootstrap": self.bootstrap, "topic": self.topic, "_log": None}

        def _kafka(self) -> Any:
            if self._log is None:
                from keyscale.kafka.source import KafkaLog, json_values

                self._log = KafkaLog(self.bootstrap, self.topic, json_values(SPARK_SOURCE_SCHEMA), None, "earliest", None)
            return self._log

        def initialOffset(self) -> dict:
            return {str(p): o for p, o in enumerate(self._kafka().first_offsets())}

        def latestOffset(self, start: dict | None = None, limit: Any = None) -> dict:
            return {str(p): o for p, o in enumerate(self._kafka().end_offsets())}

        def partitions(self, start: dict, end: dict) -> list[KafkaRange]:
            return [KafkaRange(int(p), int(start.get(p, 0)), int(e)) for p, e in end.items() if int(e) > int(start.get(p, 0))]

        def read(self, partition: KafkaRange) -> Any:
            table = self._kafka().read(partition.partition, partition.start, partition.end)
            yield from table.select(["key", "value", "seq"]).to_batches()

    class KafkaJsonSource(DataSource):
        @classmethod
        def name(cls) -> str:
            return "bench_kafka_json"

        def schema(self) -> str:
            return SPARK_SOURCE_SCHEMA

        def streamReader(self, schema: Any) -> KafkaStreamReader:
            return KafkaStreamReader(self.options)

    builder = (SparkSession.builder.master("local[2]").appName("latency-spark")
               .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
               .config("spark.sql.shuffle.partitions", str(cfg["parallelism"]))
               .config("spark.sql.streaming.numRecentProgressUpdates", "100000"))
    if cfg.get("rocksdb"):
        builder = builder.config("spark.sql.streaming.stateStore.providerClass",
                                 "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider")
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    spark.dataSource.register(KafkaJsonSource)
    events = spark.readStream.format("bench_kafka_json").option("bootstrap", cfg["bootstrap"]).option("topic", cfg["input"]).load()
    totals = events.groupBy("key").agg(F.count(F.lit(1)).alias("count"), F.sum("value").alias("sum"))
    producer = Producer({"bootstrap.servers": cfg["bootstrap"], "transactional.id": f"latency-spark-{uuid.uuid4().hex[:8]}",
                         "linger.ms": 5, "log_level": 3})
    producer.init_transactions(30)
    out = cfg["output"]

    def sink(batch: Any, batch_id: int) -> None:
        rows = batch.select(F.col("key"), F.to_json(F.struct("key", "count", "sum")).alias("v")).toArrow()
        producer.begin_transaction()
        for k, v in zip(rows.column(0).to_pylist(), rows.column(1).to_pylist(), strict=True):
            while True:
                try:
                    producer.produce(out, key=k.encode(), value=v.encode())
                    break
                except BufferError:
                    producer.poll(0.005)
        producer.commit_transaction(60)

    q = (totals.writeStream.outputMode("update").foreachBatch(sink)
         .option("checkpointLocation", cfg["dir"]).start())  # the default trigger: processingTime 0
    while not stop_file.exists():
        if q.exception() is not None:
            raise RuntimeError(str(q.exception()))
        time.sleep(0.2)
    progress = q.recentProgress
    q.stop()
    batches = []
    for pr in progress:
        if pr.numInputRows <= 0:
            continue  # Spark runs no batch without new input (its progress events then are status only)
        start = dt.datetime.fromisoformat(pr.timestamp.replace("Z", "+00:00")).timestamp()
        seconds = pr.durationMs.get("triggerExecution", 0) / 1000
        batches.append({"start": start, "end": start + seconds, "seconds": seconds, "records": pr.numInputRows,
                        "parallelism": cfg["parallelism"],
                        "phases_ms": {k: v for k, v in pr.durationMs.items() if k != "triggerExecution"}})
    return {"batches": batches, "rescales": []}


# --------------------------------------------------------------------------- one engine's run


def _topic(bootstrap: str, name: str) -> str:
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})  # kept alive until the answer
    admin.create_topics([NewTopic(name, PARTITIONS)])[name].result(timeout=30)
    return name


def _load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def _grows(q1: float, q4: float) -> bool:
    """Lag grows: the median latency of the window's last quarter is above its first's by
    more than 0.5 s and 10%."""
    return q4 - q1 > max(0.5, 0.1 * q1)


def _pct(xs: Any, q: float) -> float:
    import numpy as np

    return float(np.percentile(xs, q)) if len(xs) else float("nan")


def phase_groups(engine: str, a: argparse.Namespace) -> list[list[Phase]]:
    """The engine's phases, in groups that each run on a broker, topics and engine process
    of their own: one group a measured phase (the fixed-cost phases with the first rate;
    each rescale phase, at its rate, alone), or all in one with ``--one-broker`` (where a
    rescale starts from the table's parallelism).

    Why a broker a rate: Tansu's in-memory storage answers a fetch or an end probe more
    slowly the longer the partition's history. Measured with ``bench/tansu_history.py``: a
    read of 4 x 500 records at 5,000 records/s took 28 ms after 10 s of history, 263 ms
    after 60 s and 1.3 s after 120 s, while a topic 3 s old on the same broker read in
    17-38 ms. Late phases on one broker measured the broker's history more than the
    engines (docs/benchmarks.md, "The broker's history")."""
    groups: list[list[Phase]] = [[]]
    if a.empty_seconds > 0:
        groups[0] += [Phase("almost empty", PRIME_RATE, a.warmup / 2 + a.empty_seconds), Phase("empty", 0.0, a.empty_seconds)]
    for i, r in enumerate(a.rates):
        if i > 0 and not a.one_broker:
            groups.append([])
        groups[-1].append(Phase(f"{r:,}/s", float(r), a.warmup + a.seconds))
        if r == a.rescale_rate and engine in ("keyscale", "keyscale_async") and a.rescale_seconds > 0:
            # at that rate: a live rescale in the middle of the phase, and back to the first
            # parallelism at its end (with --one-broker, applied in the next phase's warm-up)
            for p, to in a.rescales:
                if a.one_broker and p != a.parallelism:
                    raise ValueError(f"--rescales {p}:{to} with --one-broker: a rescale there starts from --parallelism {a.parallelism}")
                if not a.one_broker:
                    groups.append([])
                groups[-1].append(Phase((RESCALE if to != p else CONTROL).format(rate=r, p=p, to=to), float(r), a.warmup + a.rescale_seconds, (p, to)))
    return [g for g in groups if g]


def run_engine(engine: str, a: argparse.Namespace, tmp: Path, tag: str, phases: list[Phase]) -> dict[str, Any]:
    """One engine through ``phases`` on a broker of its own, at the parallelism its rescale
    phase starts from (else ``--parallelism``); the phases' figures."""
    import numpy as np

    from keyscale.checkpoint.jobdir import JobDir
    from keyscale.kafka.broker import start_tansu

    broker = start_tansu()
    run_dir = tmp / f"{engine}-{tag}"
    run_dir.mkdir(parents=True)
    ctx = mp.get_context("spawn")
    primed, go, phase_done, produced = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Value("q", 0)
    engine_proc = prod = None
    outputs: Outputs | None = None
    try:
        inp, out = _topic(broker.bootstrap, "events"), _topic(broker.bootstrap, "updates")
        outputs = Outputs(broker.bootstrap, out, a.keys, stateless=engine == "stateless")
        cfg = {"engine": engine, "bootstrap": broker.bootstrap, "input": inp, "output": out, "dir": str(run_dir / "job"),
               "parallelism": next((ph.rescale[0] for ph in phases if ph.rescale), a.parallelism), "trigger": a.trigger, "stop": str(run_dir / "stop"), "result": str(run_dir / "result.json"),
               "rocksdb": a.spark_rocksdb, "latency_target": a.latency_target}
        log = open(run_dir / "engine.log", "wb")  # noqa: SIM115 (closed with the process)
        # The caller's PYTHONPATH first: with PYTHONPATH=BASE/src, the engine runs BASE's keyscale
        # (this checkout's only where it names none), so A B runs compare what they say they do.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH", ""), str(ROOT / "src")) if p)}
        env.setdefault("KEYSCALE_KAFKA_SERIAL_COMMITS", "1")  # Tansu needs it (bench/kafka.py)
        engine_proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--engine-run", json.dumps(cfg)],
                                       stdout=log, stderr=subprocess.STDOUT, env=env)
        pcfg = {"keys": a.keys, "input": inp, "bootstrap": broker.bootstrap, "prime_timeout": a.start_timeout,
                "phases": [(ph.rate, ph.seconds) for ph in phases]}
        prod = ctx.Process(target=_producer_main, args=(pcfg, primed, go, phase_done, produced, str(run_dir / "produced")))
        prod.start()
        started = time.time()
        while not outputs.first.wait(0.5):
            if engine_proc.poll() is not None or time.time() - started > a.start_timeout:
                raise RuntimeError(f"{engine} produced no output (exit {engine_proc.poll()}); see {run_dir / 'engine.log'}")
        primed.set()
        print(f"  {engine}: first output {time.time() - started:.1f} s after start; load {_load()}", flush=True)
        # every record produced while priming in the output, then the phases
        time.sleep(0.5)
        while not outputs.covered(produced.value) and time.time() - started < a.start_timeout:
            time.sleep(0.1)
        loads: list[str] = []
        drains: list[float] = []
        rescale_at: dict[str, float] = {}  # phase -> when the rescale was asked for
        for name, _, _, rescale in phases:
            phase_done.clear()
            go.set()
            t_phase = time.time()
            while not phase_done.wait(0.2):
                if engine_proc.poll() is not None:
                    raise RuntimeError(f"{engine} ended during phase {name}; see {run_dir / 'engine.log'}")
                if rescale and name not in rescale_at and time.time() - t_phase > a.warmup + a.rescale_seconds / 2:
                    rescale_at[name] = time.time()
                    if rescale[1] != rescale[0]:
                        JobDir(cfg["dir"]).request_rescale(rescale[1])
            if rescale and rescale[1] != rescale[0]:
                JobDir(cfg["dir"]).request_rescale(rescale[0])  # back, for the next rates
            loads.append(_load())
            t_end = time.time()
            while not outputs.covered(produced.value) and time.time() - t_end < a.drain:
                time.sleep(0.1)
            drains.append(time.time() - t_end)
            print(f"    {engine} {name}: done, drained in {drains[-1]:.1f} s, load {loads[-1]}", flush=True)
        prod.join(120)  # it writes the produce times after its last phase
    finally:
        if engine_proc is not None:
            (run_dir / "stop").touch()
            try:
                engine_proc.wait(120)
            except subprocess.TimeoutExpired:
                engine_proc.kill()
                engine_proc.wait()
        if prod is not None and prod.is_alive():
            prod.kill()  # failed mid-run
        if outputs is not None:
            outputs.stop()
        broker.stop()
    result = json.loads(Path(cfg["result"]).read_text()) if Path(cfg["result"]).exists() else {"batches": [], "rescales": []}
    times = np.load(run_dir / "produced.npy")
    meta = json.loads((run_dir / "produced.json").read_text())
    arrival = outputs.arrival_per_record(len(times))
    rows = []
    for (name, rate, _, rescale), bounds, load, drain in zip(phases, meta["phases"], loads, drains, strict=True):
        m0 = bounds["start"] + {"almost empty": a.warmup / 2, "empty": 2.0}.get(name, a.warmup)
        seqs = np.arange(bounds["first"], bounds["last"])
        measured = seqs[times[seqs] >= m0]
        lat = arrival[measured] - times[measured]
        unmatched = int(np.isinf(lat).sum())
        deadline = bounds["end"] + drain
        lat = np.where(np.isinf(lat), deadline - times[measured], lat)
        # the batches begun in the window (not one the next phase's first record started)
        batches = [b for b in result["batches"] if m0 <= b["start"] < bounds["end"] - 0.2]
        row: dict[str, Any] = {"engine": engine, "phase": name, "rate": rate, "records": len(measured), "unmatched": unmatched,
                               "p50_s": _pct(lat, 50), "p99_s": _pct(lat, 99), "max_s": float(lat.max()) if len(lat) else float("nan"),
                               "drain_s": drain, "load": load, "batches": len(batches),
                               "median_batch_s": statistics.median(b["seconds"] for b in batches) if batches else float("nan"),
                               "median_batch_records": statistics.median(b["records"] for b in batches) if batches else float("nan"),
                               "empty_batches": sum(1 for b in batches if b["records"] == 0)}
        with_input = [b["seconds"] for b in batches if b["records"] > 0]
        without = [b["seconds"] for b in batches if b["records"] == 0]
        row["median_batch_with_input_s"] = statistics.median(with_input) if with_input else float("nan")
        row["median_empty_batch_s"] = statistics.median(without) if without else float("nan")
        if engine != "spark" and batches:
            after = {id(b): n for b, n in zip(result["batches"], result["batches"][1:], strict=False)}
            gaps = [after[id(b)]["start"] - b["end"] for b in batches if id(b) in after]
            jobs = [b["spark_job_s"] for b in batches if b.get("spark_job_s", float("nan")) == b.get("spark_job_s")]
            row["median_spark_job_s"] = statistics.median(jobs) if jobs else float("nan")
            row["median_between_batches_s"] = statistics.median(gaps) if gaps else float("nan")
            own = [b["own_p99_s"] for b in batches if b.get("own_p99_s") is not None]
            row["own_median_batch_p99_s"] = statistics.median(own) if own else float("nan")  # keyscale's per-batch p99, at the commit
            limits = [b["read_limit"] for b in batches if b.get("read_limit") is not None]
            row["median_read_limit"] = statistics.median(limits) if limits else float("nan")
            row["batches_at_limit"] = sum(1 for b in batches if b.get("read_limit") is not None and b["records"] >= b["read_limit"])
        if len(lat) >= 8:
            order = np.argsort(times[measured])
            quarters = np.array_split(lat[order], 4)
            q1, q4 = float(np.median(quarters[0])), float(np.median(quarters[-1]))
            row.update(first_quarter_p50_s=q1, last_quarter_p50_s=q4, lag_grows=_grows(q1, q4) or unmatched > 0)
        if batches:
            span = max(b["end"] for b in batches) - min(b["start"] for b in batches)
            row["read_per_s"] = sum(b["records"] for b in batches) / span if span > 0 else float("nan")
        if rescale and name in rescale_at:
            asked = rescale_at[name]
            t = times[measured]
            around = lat[(t >= asked - 30) & (t <= asked + 30)]
            after = lat[(t >= asked) & (t <= asked + 10)]
            row.update(rescale_at=asked, p99_minute_around_rescale_s=_pct(around, 99), p99_10s_after_rescale_s=_pct(after, 99),
                       rescales=result["rescales"],
                       batches_around_rescale=[b for b in result["batches"] if asked - 5 <= b["start"] <= asked + 15])
        if engine == "spark" and batches:
            phases_ms: dict[str, list[float]] = {}
            for b in batches:
                for k, v in b.get("phases_ms", {}).items():
                    phases_ms.setdefault(k, []).append(v)
            row["spark_median_ms"] = {k: statistics.median(v) for k, v in phases_ms.items()}
        rows.append(row)
    return {"engine": engine, "phases": rows, "dir": str(run_dir)}


# --------------------------------------------------------------------------- report


def _fmt(x: Any, unit: str = " s") -> str:
    if x is None or (isinstance(x, float) and x != x):
        return "-"
    return f"{x:.2f}{unit}" if isinstance(x, float) else str(x)


def _n(x: Any) -> str:
    return "-" if x is None or x != x else f"{x:,.0f}"


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Medians over repeats, per (engine, phase)."""
    by: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in runs:
        for row in r["phases"]:
            by.setdefault((row["engine"], row["phase"]), []).append(row)
    out = []
    for (engine, phase), rows in by.items():
        med: dict[str, Any] = {"engine": engine, "phase": phase, "repeats": len(rows), "rate": rows[0]["rate"],
                               "loads": [r["load"] for r in rows],
                               "lag_grows": [_grows(r["first_quarter_p50_s"], r["last_quarter_p50_s"]) or r["unmatched"] > 0
                                             if "first_quarter_p50_s" in r else None for r in rows]}
        for k, v in rows[0].items():
            if isinstance(v, float | int) and not isinstance(v, bool) and k != "rate":
                vals = [r[k] for r in rows if isinstance(r.get(k), float | int) and r[k] == r[k]]
                med[k] = statistics.median(vals) if vals else float("nan")
        phases_ms = [r["spark_median_ms"] for r in rows if r.get("spark_median_ms")]
        if phases_ms:
            med["spark_median_ms"] = {k: statistics.median(p.get(k, 0) for p in phases_ms) for k in phases_ms[0]}
        out.append(med)
    return out


def table(summary: list[dict[str, Any]]) -> str:
    get = {(s["engine"], s["phase"]): s for s in summary}
    lines = ["| input | engine | p50 | p99 | max | lag grows (last quarter's p50 vs first's) | drain | median batch (records) | read/s | p99 / keyscale's p99 | load (1/5/15 min) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    phases = list(dict.fromkeys(s["phase"] for s in summary if s["phase"] not in ("almost empty", "empty")))
    for phase in phases:
        ks = get.get(("keyscale", phase))
        for engine in ENGINES + OPTIONAL:
            s = get.get((engine, phase))
            if s is None:
                continue
            ratio = f"{s['p99_s'] / ks['p99_s']:.2f}x" if ks and engine != "keyscale" and ks["p99_s"] > 0 else ""
            grows = ", ".join("yes" if g else "no" for g in s["lag_grows"] if g is not None)
            grows += f" ({_fmt(s.get('last_quarter_p50_s'))} vs {_fmt(s.get('first_quarter_p50_s'))})" if "first_quarter_p50_s" in s else ""
            lines.append(f"| {phase} | {engine} | {_fmt(s['p50_s'])} | {_fmt(s['p99_s'])} | {_fmt(s['max_s'])} | {grows} | "
                         f"{_fmt(s['drain_s'])} | {_fmt(s['median_batch_s'])} ({_n(s['median_batch_records'])}) | {_n(s.get('read_per_s'))} | {ratio} | "
                         f"{'; '.join(s['loads'])} |")
        for engine in ("keyscale", "keyscale_async"):
            s = get.get((engine, phase))
            if s and "p99_minute_around_rescale_s" in s:
                lines.append(f"| {phase} | {engine}, the minute around the rescale | | {_fmt(s['p99_minute_around_rescale_s'])} | | | | | | | |")
                lines.append(f"| {phase} | {engine}, the 10 s after the rescale request | | {_fmt(s.get('p99_10s_after_rescale_s'))} | | | | | | | |")
    lines += ["", "| almost empty batch (5 records/s) | median batch | records per batch | empty batch (no input) | load |", "|---|---|---|---|---|"]
    for engine in ENGINES + OPTIONAL:
        s, e = get.get((engine, "almost empty")), get.get((engine, "empty"))
        if s is None:
            continue
        lines.append(f"| {engine} | {_fmt(s['median_batch_with_input_s'])} | {_n(s['median_batch_records'])} | "
                     f"{_fmt(e['median_empty_batch_s']) if e else '-'}{' (Spark runs no batch without input)' if engine == 'spark' else ''} | "
                     f"{'; '.join(s['loads'])} |")
    lines += ["", "| input | engine | median batch | keyscale: its Spark job (the tasks) | keyscale: between batches | "
              "Spark: addBatch / latestOffset / walCommit / commitOffsets / queryPlanning (ms) |", "|---|---|---|---|---|---|"]
    for s in summary:
        if s["engine"] == "spark":
            ms = s.get("spark_median_ms") or {}
            parts = " / ".join(_n(ms.get(k)) for k in ("addBatch", "latestOffset", "walCommit", "commitOffsets", "queryPlanning"))
            lines.append(f"| {s['phase']} | spark | {_fmt(s.get('median_batch_s'))} | | | {parts} |")
        else:
            lines.append(f"| {s['phase']} | {s['engine']} | {_fmt(s.get('median_batch_s'))} | {_fmt(s.get('median_spark_job_s'))} | "
                         f"{_fmt(s.get('median_between_batches_s'))} | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine-run", help=argparse.SUPPRESS)
    ap.add_argument("--engines", default=",".join(ENGINES), help="comma-separated, of " + ", ".join(ENGINES + OPTIONAL))
    ap.add_argument("--rates", default="1000,5000,20000,50000", help="records/s, comma-separated")
    ap.add_argument("--seconds", type=float, default=40.0, help="measured seconds per rate (after --warmup)")
    ap.add_argument("--warmup", type=float, default=10.0, help="seconds at each rate before measuring")
    ap.add_argument("--empty-seconds", type=float, default=20.0, help="almost empty and empty phases (0: skip)")
    ap.add_argument("--rescale-rate", type=int, default=5000)
    ap.add_argument("--rescale-seconds", type=float, default=60.0, help="measured seconds of keyscale's phase with a live rescale (0: skip)")
    ap.add_argument("--rescales", default="", help="FROM:TO parallelisms of the rescale phases, comma-separated, each a phase "
                    "(default: --parallelism to one more; on 2 cores 2:3 runs more subtasks than cores, 1:2 adds a core; P:P a control "
                    "phase with no rescale)")
    ap.add_argument("--drain", type=float, default=60.0, help="at most this long after a phase for its records to reach the output")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--one-broker", action="store_true",
                    help="every phase of an engine on one broker (before 2026-12-01); default: a broker and fresh topics a rate")
    ap.add_argument("--keys", type=int, default=10_000)
    ap.add_argument("--parallelism", type=int, default=2)
    ap.add_argument("--trigger", default="1 millisecond", help="keyscale's trigger interval")
    ap.add_argument("--latency-target", default="1s", help="the keyscale_target engine's latency target (RunOptions.latency_target)")
    ap.add_argument("--spark-rocksdb", action="store_true", help="Spark with the RocksDB state store (default: its default, HDFS-backed)")
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--quick", action="store_true", help="smoke check: rates 1000,5000, 10 s each, short warm-up and rescale phase")
    ap.add_argument("--out", help="write everything as JSON here")
    a = ap.parse_args(argv)
    if a.engine_run:
        return _engine_main(json.loads(a.engine_run))
    if a.quick:
        a.rates, a.seconds, a.warmup, a.empty_seconds, a.rescale_seconds, a.drain = "1000,5000", 10.0, 4.0, 6.0, 12.0, 20.0
    a.rates = [int(r) for r in str(a.rates).split(",") if r]
    try:
        a.rescales = parse_rescales(a.rescales, a.parallelism)
    except ValueError as e:
        ap.error(str(e))
    engines = [e for e in a.engines.split(",") if e]
    for e in engines:
        if e not in ENGINES + OPTIONAL:
            ap.error(f"unknown engine {e!r}")
    tmp = Path(tempfile.mkdtemp(prefix="ks-latency-"))
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    print(f"bench/latency.py: {started}, load {_load()}, rates {a.rates}, {a.seconds:.0f} s measured after {a.warmup:.0f} s, "
          f"engines {engines}, scratch {tmp}", flush=True)
    runs = []
    for r in range(a.repeats):
        order = engines[r % len(engines):] + engines[: r % len(engines)]  # each repeat starts with another engine
        for engine in order:
            for g, phases in enumerate(phase_groups(engine, a)):
                print(f"repeat {r}, {engine}, {', '.join(ph.name for ph in phases)}:", flush=True)
                try:
                    runs.append(run_engine(engine, a, tmp, f"r{r}g{g}", phases))
                except Exception as e:
                    print(f"  {engine} failed: {e}", flush=True)
                    runs.append({"engine": engine, "phases": [], "error": str(e)})
                for row in runs[-1]["phases"]:
                    print(f"    {json.dumps({k: v for k, v in row.items() if k != 'batches_around_rescale'})}", flush=True)
    summary = summarise(runs)
    print(f"\nKafka -> keyed count and sum -> Kafka, {a.keys:,} string keys, P={a.parallelism}, medians of {a.repeats} "
          f"(started {started}, ended {time.strftime('%H:%M:%S UTC', time.gmtime())}):\n")
    print(table(summary))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"args": {k: v for k, v in vars(a).items()}, "started": started, "runs": runs,
                                           "summary": summary}, indent=1, default=str))
        print(f"\nwritten {a.out}")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
