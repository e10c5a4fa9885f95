"""Workload W's task in keyscale: per-key running count (sum of v), emitted for every key
updated in a batch. ``--set mode=vectorized|combined|per-record`` (combined: vectorized with
``combine=True``); ``--set sink=noop|parquet``; ``--set key_type=long|string``."""

from typing import Any

import keyscale as ks

NAME = "w_count"


class RunningCount(ks.KeyedProcessFunction):
    def open(self, ctx: ks.state.RuntimeContext) -> None:
        self.count = ctx.value_state("count", "long")

    def process(self, key: Any, rows: Any, ctx: ks.state.Context) -> Any:
        n = (self.count.value() or 0) + sum(r.v for r in rows)
        self.count.update(n)
        return [(key, n)]


def build(ctx: ks.JobContext) -> ks.Pipeline:
    df = ctx.spark.readStream.schema(f"key {ctx.arg('key_type', 'long')}, v long").option("maxFilesPerTrigger", 1).parquet(ctx.arg("input"))
    keyed = ks.stream(df).key_by("key")
    mode = ctx.arg("mode", "vectorized")
    if mode in ("vectorized", "combined"):
        counts = keyed.aggregate(uid="count", combine=mode == "combined", count=ks.aggregates.sum("v"))
    else:
        counts = keyed.process(RunningCount(), f"key {ctx.arg('key_type', 'long')}, count long", uid="count")
    sink = ks.sinks.NoopSink() if ctx.arg("sink", "noop") == "noop" else ks.sinks.ParquetSink(ctx.arg("output"))
    return counts.sink(sink)
