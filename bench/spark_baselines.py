"""Spark Structured Streaming baselines on workload W (see ``bench/_workload.py``).

Every baseline runs one streaming query over a workload folder with
``maxFilesPerTrigger=1`` (one Parquet file = one micro-batch) and
``trigger(availableNow=True)``, a fresh checkpoint in a temporary directory and the
RocksDB state store provider, and returns::

    {"batch_seconds": [...],   # per batch, progress durationMs.triggerExecution / 1000
     "wall_seconds": float,    # query start() .. termination
     "rows": int,              # input rows processed
     ...}                      # extra diagnostics (state rows, shuffle partitions, ...)

The sink is a ``foreachBatch`` that runs ``df.write.format("noop")``: the per-batch
result is fully computed but the sink itself costs (almost) nothing.

Spark sessions: use :func:`make_spark`. It sets ``PYSPARK_PYTHON`` to this interpreter
(the workers need pyarrow), ``local[2]``, no UI, ``spark.sql.shuffle.partitions`` and the
RocksDB provider. :func:`stop_spark` stops a session and, optionally, its JVM, so the
next :func:`make_spark` starts from a cold driver (used by :func:`offline_repartition`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from _workload import W_SCHEMA, workload_files

__all__ = [
    "ROCKSDB_PROVIDER",
    "apply_in_pandas_with_state",
    "make_spark",
    "native_agg",
    "offline_repartition",
    "stop_spark",
    "transform_with_state_in_pandas",
]

ROCKSDB_PROVIDER = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"

Result = dict[str, Any]
SparkFactory = Callable[[int], "SparkSession"]  # shuffle partitions -> session

if TYPE_CHECKING:  # importing pyspark is deferred to make_spark
    from pyspark.sql import DataFrame, SparkSession


# --------------------------------------------------------------------------- sessions


def make_spark(shuffle_partitions: int = 2, app_name: str = "keyscale-bench") -> SparkSession:
    """Create (or get) a local[2] SparkSession configured for the benchmarks."""
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    spark = (
        SparkSession.builder.master("local[2]")
        .appName(app_name)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", str(shuffle_partitions))
        .config("spark.sql.streaming.stateStore.providerClass", ROCKSDB_PROVIDER)
        .config("spark.sql.adaptive.enabled", "false")  # AQE is off for streaming anyway
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    # getOrCreate may return an existing session; make the setting effective anyway.
    spark.conf.set("spark.sql.shuffle.partitions", str(shuffle_partitions))
    spark.conf.set("spark.sql.streaming.stateStore.providerClass", ROCKSDB_PROVIDER)
    return spark


def stop_spark(spark: SparkSession, stop_jvm: bool = False) -> None:
    """Stop ``spark``; with ``stop_jvm`` also shut down the py4j gateway and its JVM.

    After ``stop_jvm=True`` the next :func:`make_spark` launches a new JVM, which is what
    a restarted driver process pays.
    """
    from pyspark import SparkContext

    for q in spark.streams.active:
        q.stop()
    spark.stop()
    if not stop_jvm:
        return
    gw = SparkContext._gateway
    if gw is None:
        return
    proc = getattr(gw, "proc", None)
    with contextlib.suppress(Exception):  # sockets may already be closed
        gw.shutdown()
    if proc is not None:
        try:
            if proc.stdin is not None:
                proc.stdin.close()  # the JVM exits when its stdin pipe closes
            proc.wait(timeout=60)
        except Exception:
            proc.kill()
            proc.wait(timeout=30)
    SparkContext._gateway = None
    SparkContext._jvm = None


# --------------------------------------------------------------------------- helpers


@contextmanager
def _tempdir(prefix: str) -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _stage_input(data_dir: Path, dest: Path, max_files: int | None = None) -> list[Path]:
    """Hard-link (or copy) the first ``max_files`` workload files of ``data_dir`` into ``dest``.

    Hard links keep the modification times, so Spark's oldest-first order stays the
    batch order. Staging lets a run process a prefix of the workload, or add a file later,
    without touching the shared workload folder.
    """
    files = workload_files(Path(data_dir))
    if not files:
        raise FileNotFoundError(f"no part-*.parquet files in {data_dir}")
    if max_files is not None:
        files = files[:max_files]
    dest.mkdir(parents=True, exist_ok=True)
    out = []
    for f in files:
        target = dest / f.name
        try:
            os.link(f, target)
        except OSError:
            shutil.copy2(f, target)
        out.append(target)
    return out


def _source(spark: SparkSession, input_dir: Path) -> DataFrame:
    return (
        spark.readStream.format("parquet")
        .schema(W_SCHEMA)
        .option("maxFilesPerTrigger", 1)
        .load(str(input_dir))
    )


def _noop_sink(batch_df: DataFrame, batch_id: int) -> None:
    batch_df.write.format("noop").mode("overwrite").save()


def run_available_now(
    result_df: DataFrame, checkpoint: Path, output_mode: str = "update", sink: Callable[[DataFrame, int], None] = _noop_sink,
) -> tuple[list[Any], float]:
    """Run ``result_df`` into ``foreachBatch(sink)`` until all input is processed: the
    progress of every batch, in order, and the wall seconds from start to termination.
    Every Spark-native baseline of ``bench/`` times itself with this."""
    query = (
        result_df.writeStream.outputMode(output_mode)
        .foreachBatch(sink)
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
    )
    t0 = time.perf_counter()
    q = query.start()
    try:
        q.awaitTermination()
        wall = time.perf_counter() - t0
        if q.exception() is not None:
            raise RuntimeError(f"streaming query failed: {q.exception()}")
        progress = sorted(q.recentProgress, key=lambda p: p.batchId)
    finally:
        q.stop()
    return progress, wall


def batch_seconds(progress: list[Any]) -> list[float]:
    """Spark's own time (``triggerExecution``) of each batch that had input, in seconds."""
    return [p.durationMs.get("triggerExecution", 0) / 1000.0 for p in progress if p.numInputRows > 0]


def _run_available(result_df: DataFrame, checkpoint: Path, output_mode: str = "update") -> Result:
    """Run ``result_df`` with the noop foreachBatch sink until all input is processed."""
    return _summarise(*run_available_now(result_df, checkpoint, output_mode))


def _summarise(progress: list[Any], wall: float) -> Result:
    batches = [p for p in progress if p.numInputRows > 0]
    out: Result = {
        "batch_seconds": batch_seconds(batches),
        "add_batch_seconds": [p.durationMs.get("addBatch", 0) / 1000.0 for p in batches],
        "batch_ids": [p.batchId for p in batches],
        "batch_rows": [p.numInputRows for p in batches],
        "wall_seconds": wall,
        "rows": int(sum(p.numInputRows for p in batches)),
    }
    if batches and batches[-1].stateOperators:
        op = batches[-1].stateOperators[0]
        out["state_rows"] = int(op.numRowsTotal)
        out["state_partitions"] = int(op.numShufflePartitions)
    return out


# --------------------------------------------------------------------------- baselines


def _native_agg_df(spark: SparkSession, input_dir: Path) -> DataFrame:
    from pyspark.sql import functions as F

    return _source(spark, input_dir).groupBy("key").agg(F.sum("v").alias("count"))


def native_agg(spark: SparkSession, data_dir: Path, max_batches: int | None = None) -> Result:
    """Native ``groupBy(key).agg(sum(v))``, RocksDB state, update mode.

    ``spark`` must have been created with :func:`make_spark` (RocksDB provider, shuffle
    partitions). ``max_batches`` limits the number of workload files processed.
    """
    with _tempdir("ks-native-") as tmp:
        _stage_input(Path(data_dir), tmp / "in", max_batches)
        return _run_available(_native_agg_df(spark, tmp / "in"), tmp / "ckpt")


def _make_count_with_group_state() -> Callable[..., Iterator[Any]]:
    """Build the applyInPandasWithState function as a closure.

    Defined inside a function so cloudpickle ships it by value: the Python workers cannot
    import this module (``bench/`` is not on their path).
    """
    import pandas as pd

    def count_with_group_state(key: tuple, pdfs: Iterator[pd.DataFrame], state: Any):
        total = int(state.get[0]) if state.exists else 0
        for pdf in pdfs:
            total += int(pdf["v"].sum())
        state.update((total,))
        yield pd.DataFrame({"key": [key[0]], "count": [total]})

    return count_with_group_state


def apply_in_pandas_with_state(
    spark: SparkSession, data_dir: Path, max_batches: int | None = None
) -> Result:
    """Running count per key with ``groupBy(key).applyInPandasWithState`` (state = count).

    One Python call per key per batch; the state is a single ``long`` per key, pickled
    through Arrow by Spark. Update mode, no timeout.
    """
    with _tempdir("ks-aipws-") as tmp:
        _stage_input(Path(data_dir), tmp / "in", max_batches)
        df = _source(spark, tmp / "in").groupBy("key").applyInPandasWithState(
            _make_count_with_group_state(),
            outputStructType="key long, count long",
            stateStructType="count long",
            outputMode="update",
            timeoutConf="NoTimeout",
        )
        return _run_available(df, tmp / "ckpt")


def _make_count_processor() -> Any:
    """Build the StatefulProcessor lazily, inside a function so cloudpickle ships it by value."""
    import pandas as pd
    from pyspark.sql.streaming.stateful_processor import (
        StatefulProcessor,
        StatefulProcessorHandle,
    )

    class CountProcessor(StatefulProcessor):
        """Running count per key in a ValueState (one JVM round trip per state call)."""

        def init(self, handle: StatefulProcessorHandle) -> None:
            self.count = handle.getValueState("count", "count long")

        def handleInputRows(self, key: Any, rows: Iterator[pd.DataFrame], timerValues: Any):
            total = 0
            if self.count.exists():
                total = int(self.count.get()[0])
            for pdf in rows:
                total += int(pdf["v"].sum())
            self.count.update((total,))
            yield pd.DataFrame({"key": [key[0]], "count": [total]})

        def close(self) -> None:
            pass

    return CountProcessor()


def transform_with_state_in_pandas(
    spark: SparkSession, data_dir: Path, max_batches: int | None = None
) -> Result:
    """Running count per key with ``transformWithStateInPandas`` and a ValueState.

    Requires the RocksDB provider. Very slow (~110 s per 400k-row batch on our machines),
    so ``max_batches`` (number of workload files) is usually set, e.g. 3 to get batches
    1-2 as steady state.
    """
    with _tempdir("ks-tws-") as tmp:
        _stage_input(Path(data_dir), tmp / "in", max_batches)
        df = _source(spark, tmp / "in").groupBy("key").transformWithStateInPandas(
            statefulProcessor=_make_count_processor(),
            outputStructType="key long, count long",
            outputMode="Update",
            timeMode="None",
        )
        return _run_available(df, tmp / "ckpt")


def offline_repartition(
    spark_factory: SparkFactory,
    data_dir: Path,
    from_p: int = 2,
    to_p: int = 4,
    stop_jvm: bool = True,
) -> Result:
    """Time changing a stopped native-agg query's state parallelism the Spark 4.3 way.

    1. ``spark_factory(from_p)`` session; run :func:`native_agg`'s query over all files of
       ``data_dir`` to build RocksDB state with ``from_p`` partitions ("build_*" keys).
    2. Stop the query and the session (and its JVM unless ``stop_jvm=False``):
       ``stop_seconds``.
    3. Timed: (a) ``session_start_seconds``: ``spark_factory(from_p)``;
       (b) ``repartition_seconds``:
       ``spark._streamingCheckpointManager.repartition(ckpt, to_p)`` (experimental, Spark
       >= 4.2, query must be stopped; writes a new batch holding the repartitioned state);
       (c) ``restart_seconds``: one more input file (a copy of ``part-00000``) is added, and
       the query is restarted from the checkpoint until that first batch completes
       (``restart_batch_seconds`` is its triggerExecution; ``restart_state_partitions``
       should equal ``to_p``).
    ``total_seconds`` = a + b + c; ``total_with_stop_seconds`` adds step 2.
    The returned dict also has ``batch_seconds``/``wall_seconds``/``rows`` of the build run.
    """
    spark = None
    with _tempdir("ks-repart-") as tmp:
        in_dir, ckpt = tmp / "in", tmp / "ckpt"
        staged = _stage_input(Path(data_dir), in_dir)
        try:
            spark = spark_factory(from_p)
            build = _run_available(_native_agg_df(spark, in_dir), ckpt)
            if build.get("state_partitions") not in (None, from_p):
                raise RuntimeError(f"expected {from_p} state partitions, got {build}")

            t = time.perf_counter()
            stop_spark(spark, stop_jvm=stop_jvm)
            spark = None
            stop_s = time.perf_counter() - t

            t = time.perf_counter()
            spark = spark_factory(from_p)
            session_s = time.perf_counter() - t

            t = time.perf_counter()
            spark._streamingCheckpointManager.repartition(str(ckpt), to_p)
            repart_s = time.perf_counter() - t

            extra = in_dir / f"part-{len(staged):05d}.parquet"
            shutil.copyfile(staged[0], extra)  # new mtime: newest file
            t = time.perf_counter()
            restart = _run_available(_native_agg_df(spark, in_dir), ckpt)
            restart_s = time.perf_counter() - t
        finally:
            if spark is not None:
                stop_spark(spark, stop_jvm=False)

    if restart["rows"] <= 0:
        raise RuntimeError(f"restarted query processed no rows: {restart}")
    return {
        "batch_seconds": build["batch_seconds"],
        "wall_seconds": build["wall_seconds"],
        "rows": build["rows"],
        "build_state_rows": build.get("state_rows"),
        "build_state_partitions": build.get("state_partitions"),
        "from_p": from_p,
        "to_p": to_p,
        "stop_jvm": stop_jvm,
        "stop_seconds": stop_s,
        "session_start_seconds": session_s,
        "repartition_seconds": repart_s,
        "restart_seconds": restart_s,
        "restart_batch_seconds": restart["batch_seconds"],
        "restart_rows": restart["rows"],
        "restart_state_rows": restart.get("state_rows"),
        "restart_state_partitions": restart.get("state_partitions"),
        "total_seconds": session_s + repart_s + restart_s,
        "total_with_stop_seconds": stop_s + session_s + repart_s + restart_s,
    }
