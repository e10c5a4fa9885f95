"""The job of ``bench/chaos.py``: keyed state and event-time windows over a partitioned log.

Two keyed stages, so a fault can hurt either kind of state:

* ``seq`` (a vectorized keyed function, value state ``n``): numbers each key's records
  1, 2, 3, ... in arrival order and passes them on with that number. Exactly-once keyed
  state means a key's largest number equals its number of records in the log.
* ``windows``: a tumbling event-time window per key (``size``, default 10 seconds) with
  count, sum of ``value`` and the largest ``n`` seen. Its last row per window must match the
  log's records in that window.

The lateness bound is generous (``lateness``, default 1 hour): a run of minutes never drops
a record as late unless the watermark is wrong, so a short window is a lost record.
Arguments: ``log``, ``output``, ``late`` (optional), ``limit`` (records per partition and batch).
Kafka in and out (issue 32): ``source=kafka`` reads the topic ``topic`` on ``bootstrap``
(JSON values ``key``, ``value``, ``ts``) instead of ``log``; ``sink=kafka`` writes the windows
to the topic ``output`` on ``bootstrap`` (``KafkaSink``, key = the record's key), each row
stamped with its batch number (``batch``, as the Parquet sink's folders give it), so a check
can tell a replay's row written twice from a window emitted again.
"""

import numpy as np
from pyspark.sql import functions as F

import keyscale as ks

NAME = "chaos_count"


class Numbered(ks.VectorizedKeyedFunction):
    """Each record gets its key's running record number ``n``."""

    def open(self, ctx):
        ctx.value_state("n", "long")

    def process_batch(self, batch):
        prev = batch.state["n"].fillna(0).astype("int64").to_numpy()
        counts = batch.count()
        group = np.repeat(np.arange(len(counts)), counts)
        rank = np.empty(len(batch.order), dtype=np.int64)
        rank[batch.order] = np.arange(len(batch.order)) - batch.starts[:-1][group] + 1
        out = batch.records[["key", "value", "ts"]].assign(n=prev[batch.codes] + rank)
        return {"n": prev + counts}, out


class BatchStampedKafkaSink(ks.kafka.KafkaSink):
    """The Kafka sink, each row with its batch number (a projection: the output's split into
    tasks, which the sink's idempotence is keyed on, is unchanged)."""

    def write(self, df, batch_id):
        return super().write(df.withColumn("batch", F.lit(batch_id)), batch_id)


def build(ctx):
    limit = int(ctx.arg("limit", "2000"))
    if ctx.args.get("source", "log") == "kafka":
        source = ks.kafka.kafka_source(ctx.arg("bootstrap"), ctx.arg("topic"), uid="reader", max_records_per_batch=limit,
                                         decoder=ks.kafka.json_values("key string, value long, ts timestamp"))
    else:
        source = ks.sources.log_source(ctx.arg("log"), uid="reader", max_records_per_batch=limit)
    if ctx.args.get("sink", "parquet") == "kafka":
        sink = BatchStampedKafkaSink(ctx.arg("bootstrap"), ctx.arg("output"), key="key")
    else:
        sink = ks.sinks.ParquetSink(ctx.arg("output"))
    late = ctx.args.get("late")
    return (
        ks.stream(source)
        .with_watermark("ts", ctx.arg("out_of_orderness", "5 seconds"))
        .key_by("key")
        .process(Numbered(), "key string, value long, ts timestamp, n long", uid="seq")
        .key_by("key")
        .window(ks.windows.TumblingWindows(ctx.arg("size", "10 seconds")), allowed_lateness=ctx.arg("lateness", "1 hour"),
                late_output=ks.sinks.ParquetSink(late) if late else None)
        .aggregate(uid="windows", count=ks.aggregates.count(), total=ks.aggregates.sum("value"), last=ks.aggregates.max("n"))
        .sink(sink)
    )
