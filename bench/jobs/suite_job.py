"""The keyscale side of bench/suite.py (issue 12): one job file, ``--set job=NAME``.

Input columns: key string, value long, ts timestamp (as the examples). Jobs:
``running_count`` (count, sum), ``multi_agg`` (count, sum, min, max, mean on (key, bucket)),
``tumbling`` (1-minute count and sum), ``session`` (30 s gap), ``process`` (per-record
KeyedProcessFunction: running count and sum), ``two_stage`` (running sum, then a count per tier).
All write to a ParquetSink at ``--set output=DIR``. ``--set combine=yes``: the running
aggregates (running_count, multi_agg, two_stage's first stage) with ``combine=True``.
"""

from typing import Any

from pyspark.sql import functions as F

import keyscale as ks

NAME = "suite_job"


class CountSum(ks.KeyedProcessFunction):
    def open(self, ctx: ks.state.RuntimeContext) -> None:
        self.n = ctx.value_state("n", "long")
        self.s = ctx.value_state("s", "long")

    def process(self, key: Any, rows: Any, ctx: ks.state.Context) -> Any:
        n, s = self.n.value() or 0, self.s.value() or 0
        for r in rows:
            n += 1
            s += r.value
        self.n.update(n)
        self.s.update(s)
        return [(key, n, s)]


def build(ctx: ks.JobContext) -> ks.Pipeline:
    job = ctx.arg("job")
    src = ctx.spark.readStream.schema("key string, value long, ts timestamp").option("maxFilesPerTrigger", 1).parquet(ctx.arg("input"))
    sink = ks.sinks.ParquetSink(ctx.arg("output"))
    s = ks.stream(src)
    combine = ctx.arg("combine", "no") == "yes"
    if job == "running_count":
        return s.key_by("key").aggregate(uid="totals", combine=combine, count=ks.aggregates.count(), sum=ks.aggregates.sum("value")).sink(sink)
    if job == "multi_agg":
        s2 = ks.stream(src.withColumn("bucket", (F.col("value") % 4).cast("int")))
        return (s2.key_by("key", "bucket")
                .aggregate(uid="stats", combine=combine, n=ks.aggregates.count(), total=ks.aggregates.sum("value"), lo=ks.aggregates.min("value"), hi=ks.aggregates.max("value"), avg=ks.aggregates.mean("value"))
                .sink(sink))
    if job in ("tumbling", "session"):
        w = ks.windows.TumblingWindows("1 minute") if job == "tumbling" else ks.windows.SessionWindows("30 seconds")
        return (s.with_watermark("ts", "10 seconds").key_by("key").window(w)
                .aggregate(uid="win", count=ks.aggregates.count(), total=ks.aggregates.sum("value")).sink(sink))
    if job == "process":
        return s.key_by("key").process(CountSum(), "key string, count long, sum long", uid="cs").sink(sink)
    if job == "two_stage":
        return (s.key_by("key").aggregate(uid="totals", combine=combine, total=ks.aggregates.sum("value"))
                .transform(lambda df: df.withColumn("tier", F.least(F.floor(F.col("total") / 500), F.lit(9)).cast("int")))
                .key_by("tier").aggregate(uid="tiers", updates=ks.aggregates.count())
                .sink(sink))
    raise ks.KeyscaleError(f"suite_job: unknown job {job!r}")
