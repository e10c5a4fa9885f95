"""A keyed running count that costs ``cost_ms`` per record: the job of ``bench/elastic.py``.

The cost is a ``time.sleep`` per batch (``records x cost_ms``), i.e. I/O-like work (waiting
on a remote service, not CPU), so more subtasks on more executors help even on a machine
with fewer physical cores than executors. ``tests/scaling/test_elastic_cluster.py`` runs it too.

Arguments (``--set NAME=VALUE``): ``log`` (the partitioned log to read), ``output`` (a
Parquet folder), ``cost_ms`` (default 1), ``limit`` (records one batch reads per log
partition, default 2000).
"""

import time

import keyscale as ks

NAME = "slow_count"


class SlowCount(ks.VectorizedKeyedFunction):
    """A running count that costs ``cost_ms`` per record (I/O-like work: waits, not CPU)."""

    def __init__(self, cost_ms):
        self.cost = cost_ms / 1000

    def open(self, ctx):
        ctx.value_state("count", "long")

    def process_batch(self, batch):
        time.sleep(len(batch.records) * self.cost)
        new = batch.state["count"].fillna(0).astype("int64").to_numpy() + batch.count()
        out = batch.keys.assign(count=new)
        return {"count": new}, out


def build(ctx):
    source = ks.sources.log_source(ctx.arg("log"), uid="reader", max_records_per_batch=int(ctx.arg("limit", "2000")))
    return (
        ks.stream(source).key_by("key")
        .process(SlowCount(float(ctx.arg("cost_ms", "1"))), "key string, count long", uid="totals")
        .sink(ks.sinks.ParquetSink(ctx.arg("output")))
    )
