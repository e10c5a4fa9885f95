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
"""

import numpy as np

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


def build(ctx):
    source = ks.log_source(ctx.arg("log"), uid="reader", max_records_per_batch=int(ctx.arg("limit", "2000")))
    late = ctx.args.get("late")
    return (
        ks.stream(source)
        .with_watermark("ts", ctx.arg("out_of_orderness", "5 seconds"))
        .key_by("key")
        .process(Numbered(), "key string, value long, ts timestamp, n long", uid="seq")
        .key_by("key")
        .window(ks.TumblingWindows(ctx.arg("size", "10 seconds")), allowed_lateness=ctx.arg("lateness", "1 hour"),
                late_output=ks.ParquetSink(late) if late else None)
        .aggregate(uid="windows", count=ks.count(), total=ks.sum("value"), last=ks.max("n"))
        .sink(ks.ParquetSink(ctx.arg("output")))
    )
