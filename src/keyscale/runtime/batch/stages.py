"""The Spark plan of one batch: its stages, as ``mapInArrow`` calls over exact shuffles.

Per keyed stage: key group and arrival sequence columns, a shuffle to one partition per
subtask (partition ``i`` is subtask ``i``; for a small batch of a log, none: the first keyed
stage's tasks read it themselves, :func:`reading_stage`), and ``mapInArrow`` running the subtask
(:class:`~keyscale.runtime.task.spec.StageTask`); per non-keyed stage a round robin over its
subtasks (:class:`~keyscale.runtime.task.nonkeyed.NonKeyedTask`); rules streams (broadcasts) are
applied on the driver. Runs on the driver; the functions it hands Spark run on the
executors (:mod:`keyscale.runtime.task`). Nothing here runs a Spark action, writes the job
directory or changes ``JobState`` (but its marker-row cache, ``job.markers``): the sink
write runs the plan (commit protocol step 4, ``commit.py``).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import reduce
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, cast

import pyarrow as pa

from keyscale._spark_map import map_in_arrow
from keyscale._spark_types import from_arrow_schema, to_arrow_schema
from keyscale._steps import (
    Branch,
    KeyedStep,
    LogInputStep,
    NonKeyedStep,
    TransformStep,
    source_schema,
)
from keyscale.checkpoint.intent import SourcePlan
from keyscale.checkpoint.manifest import StateFile, chains
from keyscale.checkpoint.retention import snapshot_range
from keyscale.cluster.executors import executor_cores
from keyscale.errors import JobDefinitionError
from keyscale.operators.nonkeyed import broadcast_from_json, broadcast_to_json, lists_for
from keyscale.operators.poison import DEAD_LETTER_SCHEMA, FAIL
from keyscale.operators.vectorized import RunningAggregate, partial_column
from keyscale.runtime.batch.jobstate import JobState, session_cache
from keyscale.runtime.batch.source_plan import LogRead, read_in_stage
from keyscale.runtime.task import arrival
from keyscale.runtime.task.nonkeyed import NonKeyedTask, make_nonkeyed_function
from keyscale.runtime.task.spark import make_stage_function
from keyscale.runtime.task.spec import (
    COMBINED_AHEAD,
    COMBINED_EVENT_MS,
    COMBINED_RECORDS,
    DEAD,
    KG,
    LATE,
    MAIN,
    MARKER,
    ROUTE,
    SEQ,
    StageTask,
    side_output_schema,
)
from keyscale.state.backends import check_rocksdb_keys
from keyscale.state.keygroups import key_group_range, subtask_of_sql
from keyscale.state.spark_hash import VECTORIZED_TYPES, key_group_sql, route_sql

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession
    from pyspark.sql.types import DataType, StructType

    from keyscale.sinks.base import Sink


@dataclass
class BatchPlan:
    """A batch's Spark plan, not run yet: each sink and its rows (each branch's sink, then
    the side outputs: late records, dead letters), and the stage outputs cached because
    more than one write reads them (released after the writes)."""

    writes: list[tuple[Sink, DataFrame]]
    cached: list[DataFrame]


def plan_stages(
    job: JobState, df: DataFrame | None, batch_id: int, batch_time_ms: int, par: dict[str, int], watermark_ms: int, rules: dict[str, dict[str, Any]],
    side_df: DataFrame | None = None, input_dead_letters: DataFrame | None = None, in_stage: LogRead | None = None,
) -> BatchPlan:
    """The pipeline's steps over the batch's input ``df``, at the intent's parallelism ``par``
    (``side_df``: the records read from the log beside a Spark source; ``input_dead_letters``:
    the batch's malformed input records for the dead-letter sink, runtime/batch/malformed.py;
    ``in_stage``: instead of ``df``, the log read its first keyed stage's tasks do, as
    :func:`reading_stage` allowed).

    Each stage is planned once, however many branches read it; where several writes read
    one stage's output (branches, side outputs), it is cached, so its tasks run (and its
    state moves) once per batch.

    A file source's batch carries its arrival-order columns (``arrival.ORDER``): through
    keyscale's own filter and select to the keyed stages that read it, dropped before
    anything else (a user's transform, a non-keyed stage, a sink)."""
    from pyspark.sql import functions as F

    pipeline = job.pipeline
    assert pipeline is not None
    readers = _readers(pipeline.branches)
    frames: dict[tuple[int, ...], DataFrame] = {}
    # The arrival-order columns each path's output carries (the input's, while they ride along).
    orders: dict[tuple[int, ...], tuple[str, ...]] = {(): arrival.order_columns(df) if df is not None else ()}
    side: list[tuple[Sink, DataFrame]] = []
    dead_letters: list[DataFrame] = [] if input_dead_letters is None else [input_dead_letters]
    cached: list[DataFrame] = []

    def shared(path: tuple[int, ...], out: DataFrame) -> DataFrame:
        if readers[path] > 1:
            out = out.persist()
            cached.append(out)
        frames[path] = out
        return out

    writes: list[tuple[Sink, DataFrame]] = []
    for branch in pipeline.branches:
        path: tuple[int, ...] = ()
        # With ``in_stage`` there is no ``df``: the first step, a keyed stage, reads the log itself.
        out = frames[path] if path in frames else shared(path, df) if df is not None else cast("DataFrame", None)
        for step in branch.steps:
            order = orders[path]
            path = (*path, id(step))
            if path in frames:
                out = frames[path]
                continue
            orders[path] = ()
            if isinstance(step, LogInputStep):
                assert side_df is not None
                out = shared(path, step.merge(arrival.without(out, order), side_df))
                continue
            if isinstance(step, TransformStep):
                if order and step.keeping is not None:
                    orders[path] = order
                    out = shared(path, step.keeping(out, order))
                else:
                    out = shared(path, step.fn(arrival.without(out, order)))
                continue
            if isinstance(step, NonKeyedStep):
                out = shared(path, nonkeyed(job, arrival.without(out, order), step, batch_id, batch_time_ms, par[step.uid], rules))
                continue
            out = keyed(job, out, step, batch_id, batch_time_ms, par[step.uid], watermark_ms, rules, order, in_stage if path == (id(step),) else None)
            dead = pipeline.error_policy(step).on_error == "dead_letter"
            if step.late_sink is not None or dead:
                # The stage runs once (cached); its rows split into the main, late and dead-letter streams.
                staged = out.persist()
                cached.append(staged)
                out = staged.where(F.col(MAIN).isNotNull()).select(f"{MAIN}.*")
                if step.late_sink is not None:
                    side.append((step.late_sink, staged.where(F.col(LATE).isNotNull()).select(f"{LATE}.*")))
                if dead:
                    dead_letters.append(staged.where(F.col(DEAD).isNotNull()).select(f"{DEAD}.*"))
                frames[path] = out  # a filter of the cached stage: reading it twice runs nothing twice
                continue
            out = shared(path, out)
        writes.append((branch.sink, arrival.without(out, orders[path])))
    if pipeline.dead_letter is not None and dead_letters:
        side.append((pipeline.dead_letter, reduce(lambda a, b: a.unionByName(b), dead_letters)))
    return BatchPlan(writes + side, cached)


# A batch is read by its first keyed stage's own tasks, each reading all of it, when its
# offsets times the stage's parallelism are at most this (20,000 offsets at P=2) and the
# executors' cores run all the stage's tasks at once: the reader tasks and the shuffle cost
# a small batch more than reading it P times does, and the extra reads stay bounded. With
# more tasks than cores the tasks queue, each reading everything: measured slower
# (docs/benchmarks.md, "Reading in the keyed stage").
STAGE_READS = 40_000


def reading_stage(job: JobState, read: LogRead, par: Mapping[str, int]) -> KeyedStep | None:
    """The keyed stage whose tasks read the batch's log records themselves (no reader tasks,
    no shuffle), if any: the stage every branch starts with, when the batch's offsets times
    its parallelism (``par``, the intent's) are at most ``STAGE_READS``, the executors have
    a core for each of its tasks, it merges no partial aggregates (``combine=True``
    aggregates in Spark first), no malformed input is split off on the driver, and the
    tasks compute its keys' Spark hash."""
    pipeline = job.pipeline
    if pipeline is None or job.malformed is not None:
        return None
    firsts = {id(b.steps[0]) if b.steps else None for b in pipeline.branches}
    step = pipeline.branches[0].steps[0] if len(firsts) == 1 and pipeline.branches[0].steps else None
    if not isinstance(step, KeyedStep) or step.combine or read.offsets * par[step.uid] > STAGE_READS:
        return None
    # Keys whose hash the tasks compute in numpy, as Spark does (a key of another type: Spark's shuffle).
    schema = source_schema(read.src)
    if not all(k in schema.names and schema[k].dataType.simpleString() in VECTORIZED_TYPES for k in step.key_names):
        return None
    return step if par[step.uid] <= executor_cores(job.spark) else None


def _readers(branches: Sequence[Branch]) -> Counter[tuple[int, ...]]:
    """How many writes or next stages read the output of each path of stages (a path: the
    ids of the stages from the source on; ``()`` is the input)."""
    readers: set[tuple[tuple[int, ...], int | str]] = set()
    for i, b in enumerate(branches):
        ids = tuple(id(s) for s in b.steps)
        for n in range(len(ids)):
            readers.add((ids[:n], ids[n]))
        readers.add((ids, f"sink {i}"))
    return Counter(path for path, _ in readers)


def apply_broadcasts(job: JobState, plans: Mapping[str, SourcePlan]) -> dict[str, dict[str, Any]]:
    """Each rules stream's state for this batch: the committed state with the batch's
    rules records applied on the driver, in partition then offset order."""
    assert job.pipeline is not None
    out = {}
    for uid, b in job.pipeline.broadcasts.items():
        prev = job.committed.manifest.operators.get(uid) if job.committed.manifest else None
        state = broadcast_from_json(prev.operator_state.get("broadcast") if prev else None)
        for ranges in plans.get(uid, []):
            for part, start, end in sorted(ranges):
                if end > start:
                    for row in b.source.log.read(part, start, end).to_pylist():
                        b.apply(state, SimpleNamespace(**row))
        try:
            json.dumps(broadcast_to_json(state))
        except (TypeError, ValueError) as e:
            raise JobDefinitionError(f"broadcast state '{uid}': values must be JSON values ({e})") from None
        out[uid] = state
    return out


def nonkeyed(job: JobState, df: DataFrame, step: NonKeyedStep, batch_id: int, batch_time_ms: int, p: int, rules: dict[str, dict[str, Any]]) -> DataFrame:
    """A non-keyed stage at parallelism ``p``: its lists from the committed manifest."""

    prev = job.committed.manifest.operators.get(step.uid) if job.committed.manifest else None
    lists = lists_for(prev.operator_state if prev else {}, step.lists, p, step.uid)
    spec = NonKeyedTask(
        uid=step.uid, function=step.function, output_schema=step.output_schema, parallelism=p,
        batch_id=batch_id, batch_time_ms=batch_time_ms, lists=tuple(lists),
        broadcast_state=rules.get(step.broadcast.uid) if step.broadcast else None, report_to=job.reports.sender,
        input_schema=step.input_schema,
    )
    # Round robin: a subtask's share, one Spark task per subtask (partition i is subtask i).
    return map_in_arrow(df.repartition(p), make_nonkeyed_function(spec), from_arrow_schema(step.output_schema))


def keyed(
    job: JobState, df: DataFrame | None, step: KeyedStep, batch_id: int, batch_time_ms: int, p: int, watermark_ms: int, rules: dict[str, dict[str, Any]],
    order: Sequence[str] = (), in_stage: LogRead | None = None,
) -> DataFrame:
    """A keyed stage at parallelism ``p``: its state files from the committed manifest, which
    key groups each subtask snapshots (compacts) this batch, and the exact shuffle to its subtasks. ``order``:
    the arrival-order columns ``df`` carries (``arrival.ORDER``, or none). ``in_stage``: no
    ``df`` and no shuffle, the stage's tasks read the batch's log records themselves."""

    m = job.max_parallelism
    prev = job.committed.manifest.operators.get(step.uid) if job.committed.manifest else None
    files: tuple[StateFile, ...] = prev.files if prev else ()
    ranges = [key_group_range(s, m, p) for s in range(p)]
    snapshot = tuple(snapshot_range(r, batch_id, chains(files, r), job.opts.max_chain, job.opts.max_file_age) for r in ranges)
    fault = None
    # The test fault points a keyed task reaches (keyscale/_faults.py), shipped by name.
    if job.fault("in-compaction", batch_id) and any(snapshot):
        fault = "in-compaction"
    # A task kills the driver mid-batch, or while a state file uploads (the output streaming on);
    # asynchronous checkpoints: 2 s after their tasks end, the Python worker uploading a state
    # file dies, or the files appear, or their uploads fail (runtime/task/upload.py, Upload._test_fault).
    for point in ("mid-batch", "mid-upload", "worker-dies-mid-upload", "slow-upload", "fail-upload"):
        if job.fault(point, batch_id):
            fault = point
    policy = job.pipeline.error_policy(step) if job.pipeline else FAIL
    backend = step.state_backend or job.opts.state_backend
    if backend == "rocksdb":
        check_rocksdb_keys(step.uid, step.state_key_columns)
    spec = StageTask(
        store=job.jobdir.store, run_id=job.run_id, uid=step.uid, function=step.function,
        key_names=step.key_names, key_types=step.key_types, input_schema=task_input(step, policy.on_error == "dead_letter"),
        output_schema=step.output_schema, states=step.states, null_keys=step.null_keys,
        max_parallelism=m, parallelism=p, batch_id=batch_id, batch_time_ms=batch_time_ms,
        committed=job.committed.manifest.batch if job.committed.manifest else -1, files=files, snapshot=snapshot,
        fault=fault, driver_pid=os.getpid(), watermark_ms=watermark_ms, event_time=step.event_time,
        extra_keys=step.extra_state_keys, late_output=step.late_sink is not None,
        broadcast_state=rules.get(step.broadcast.uid) if step.broadcast else None, event_time_limit_ms=job.event_time_limit(batch_time_ms),
        on_error=policy, report_to=job.reports.sender, state_backend=backend,
        detach_upload=job.opts.async_checkpoints, pending=job.committed.pending.batch if job.committed.pending else -1, upload_timeout=job.upload_timeout,
    )
    if in_stage is not None:
        staged = read_in_stage(job, in_stage, spec)
    else:
        assert df is not None
        # The schema is read once (each read is a call to the JVM).
        spark_schema = df.schema
        # Each stage its own marker rows: two stages never share a piece of plan (nor its columns' ids).
        rows, to = routed(df, spark_schema, spec.input_schema.names, step.key_names, m, p, job.markers.setdefault(step.uid, {}), order)
        if step.combine:
            staged, spec = combined(rows.withColumn(ROUTE, to).repartition(p, ROUTE), spark_schema, step, spec)
        else:
            staged = rows.repartition(p, to)
    dead = spec.on_error.on_error == "dead_letter"
    schema = (
        side_output_schema(step.output_schema, step.input_schema if spec.late_output else None, DEAD_LETTER_SCHEMA if dead else None)
        if spec.late_output or dead else step.output_schema
    )
    return map_in_arrow(staged, make_stage_function(spec), from_arrow_schema(schema))


def routed(
    df: DataFrame, schema: StructType, columns: Sequence[str], key_names: Sequence[str], m: int, p: int, cache: dict[Any, Any] | None = None,
    order: Sequence[str] = (),
) -> tuple[DataFrame, Column]:
    """The rows a keyed stage at parallelism ``p`` (``m`` key groups) ships: ``columns`` of
    ``df`` (whose ``schema`` the caller read) with each row's arrival sequence and key group
    (and the arrival-order columns ``order`` of a file source: the task sorts by them first,
    ``arrival.in_arrival_order``), one marker row per subtask, and the expression that routes a
    row to its subtask's partition (``repartition(p, expr)``). ``cache``: the marker rows
    built in earlier batches."""
    from pyspark.sql import functions as F

    # The plan is rebuilt every batch, and every Column made in Python is several calls to
    # the JVM (~1 ms each): the select is one list of SQL expressions (N + 5 calls for N,
    # where Columns took ~43 for a two-column stage).
    rows = df.selectExpr(*map(_quoted, columns), f"monotonically_increasing_id() as {SEQ}", f"{key_group_sql(key_names, m)} as {KG}",
                         *map(_quoted, order))
    # Spark places a row on partition pmod(hash(x), p): route subtask i to partition i.
    to = F.expr(route_sql(subtask_of_sql(KG, m, p), p))
    return rows.unionByName(_markers(df.sparkSession, schema, columns, m, p, {} if cache is None else cache, order)), to


def _markers(
    spark: SparkSession, schema: StructType, columns: Sequence[str], m: int, p: int, cache: dict[Any, Any], order: Sequence[str] = (),
) -> DataFrame:
    """One marker row per subtask (sequence -1, dropped by the task): every subtask runs, and
    reports, even when Spark proves the batch empty (a transform with an aggregate or a
    window over an empty batch plans to no partitions at all). They depend on the columns
    and the parallelism only, so they are built (and analysed by Spark: ~30 ms on a
    two-input stage) once per query session and reused by every batch. All of them in one
    partition: a range spread over the default parallelism would be that many map tasks a
    batch (all but ``p`` of them empty), each a task to launch on the batch's fixed path."""
    from pyspark.sql import functions as F

    cache = session_cache(cache, spark)
    key = (tuple(columns), tuple(schema[c].dataType for c in columns), m, p, tuple(order))
    markers: DataFrame | None = cache.get(key)
    if markers is None:
        starts = ", ".join(str(key_group_range(s, m, p).start) for s in range(p))
        markers = cache[key] = spark.range(0, p, 1, 1).select(
            *[_null_of(c, schema[c].dataType) for c in columns],
            F.expr(f"cast(-1 as bigint) as {SEQ}"), F.expr(f"cast(element_at(array({starts}), cast(id as int) + 1) as int) as {KG}"),
            *(F.expr(f"cast(-1 as bigint) as {c}") for c in order))
    return markers


def combined(staged: DataFrame, input_schema: StructType, step: KeyedStep, spec: StageTask) -> tuple[DataFrame, StageTask]:
    """``aggregate(combine=True)``: the stage's shuffled records aggregated per key by Spark
    in each subtask's partition (grouped by the routing column too, so Spark needs no other
    exchange: the partition stays the subtask's), and the stage's task merging those
    partials. Each row carries the records it stands for and their event-time maximum
    within the batch's bound (and how many were beyond it), so the task reports what it
    would have; the marker rows stay rows of their own (sequence -1). ``input_schema``: the
    batch's, already read by ``keyed`` (each read of a plan's schema is a call to the JVM)."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import FractionalType, IntegralType, TimestampType

    fn = step.function
    assert isinstance(fn, RunningAggregate)
    parts = [F.count(F.lit(1)).alias(COMBINED_RECORDS)]
    partials = [COMBINED_RECORDS]
    for name, agg in fn.aggs.items():
        col = F.col(agg.column) if agg.column is not None else F.lit(1)
        if agg.kind == "mean":
            partials += [partial_column(name, "sum"), partial_column(name, "count")]
            parts += [F.sum(col).alias(partials[-2]), F.count(col).alias(partials[-1])]
            continue
        partials.append(partial_column(name))
        if agg.kind == "min" and isinstance(input_schema[str(agg.column)].dataType, FractionalType):
            # A NaN is a value that a minimum keeps (numpy's, the task's); Spark's sorts it above all.
            parts.append(F.when(F.max(F.isnan(col)), F.lit(float("nan"))).otherwise(F.min(col)).alias(partials[-1]))
        else:
            parts.append({"count": F.count, "sum": F.sum, "min": F.min, "max": F.max}[agg.kind](col).alias(partials[-1]))
    if step.event_time is not None:
        t = input_schema[step.event_time].dataType
        if isinstance(t, TimestampType):
            us = F.unix_micros(F.col(step.event_time))
            ms = ((us - F.pmod(us, F.lit(1000))) / 1000).cast("long")  # floored, as the task's event_time_ms
        elif isinstance(t, IntegralType):
            ms = F.col(step.event_time).cast("long")
        else:
            raise JobDefinitionError(f"operator '{step.uid}': combine=True needs the event-time column '{step.event_time}' to be "
                                     f"a timestamp or an integer (milliseconds), not {t.simpleString()}")
        limit = spec.event_time_limit_ms
        beyond = ms > F.lit(limit) if limit is not None else F.lit(False)
        partials += [COMBINED_EVENT_MS, COMBINED_AHEAD]
        parts += [F.max(F.when(~beyond, ms)).alias(COMBINED_EVENT_MS), F.sum(beyond.cast("long")).alias(COMBINED_AHEAD)]
    marker = (F.col(SEQ) < 0).alias(MARKER)
    grouped = staged.groupBy(ROUTE, marker, KG, *step.key_names).agg(*parts, F.min(SEQ).alias(SEQ))
    # timezone: a partial min/max of a timestamp is a timestamp (keyscale's sessions run in UTC)
    task_schema = to_arrow_schema(grouped.select(*step.key_names, *partials).schema, utc=True)
    out = grouped.select(*task_schema.names, SEQ, KG)
    return out, replace(spec, function=RunningAggregate(fn.aggs, fn.key_names, fn.input_types, merging=True),
                        input_schema=task_schema, combined=True)


def _quoted(column: str) -> str:
    """A column name as a SQL identifier."""
    return "`" + column.replace("`", "``") + "`"


def _null_of(column: str, t: DataType) -> Column:
    """A null of type ``t`` named ``column``: one SQL expression where the type has a SQL
    name (one call to the JVM instead of three), else built from Columns."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import AtomicType

    if isinstance(t, AtomicType):
        return F.expr(f"cast(null as {t.simpleString()}) as {_quoted(column)}")
    return F.lit(None).cast(t).alias(column)


def task_input(step: KeyedStep, dead_letters: bool) -> pa.Schema:
    """The columns a keyed stage's tasks get: for a function that declares the columns it
    reads (``input_columns``; the built-in aggregates do), those, its keys and the event
    time, so the others never cross the shuffle and Arrow; all of them when poison records
    go to dead letters or late records to a late output (both carry whole records)."""
    reads = getattr(step.function, "input_columns", None)
    if reads is None or dead_letters or step.late_sink is not None:
        return step.input_schema
    keep = {*step.key_names, *reads, *([step.event_time] if step.event_time else [])}
    return pa.schema([f for f in step.input_schema if f.name in keep])
