"""Two keyed stages with ordinary PySpark in between.

Stage 1 keeps a running total per user; plain Spark maps each updated total to a tier;
stage 2 counts, per tier, how many times users entered it (per-record API).

    keyscale run examples/two_stage.py --job-dir jobs/tiers -p 2 \
        --set input=DIR --set output=OUT --until-idle
"""

from typing import Any

from pyspark.sql import functions as F

import keyscale as ks

NAME = "two_stage"


class TierEntries(ks.KeyedProcessFunction):
    """Per tier: how many users have entered it so far, and which."""

    def open(self, ctx: ks.state.RuntimeContext) -> None:
        self.members = ctx.map_state("members", "string", "long")

    def process(self, key: Any, rows: Any, ctx: ks.state.Context) -> Any:
        new = [r.key for r in rows if not self.members.contains(r.key)]
        for user in new:
            self.members.put(user, ctx.batch_id)
        if new:
            yield (key, len(self.members.keys()), len(new))


def build(ctx: ks.JobContext) -> ks.Pipeline:
    events = (
        ctx.spark.readStream.schema("key string, value long, ts timestamp")
        .option("maxFilesPerTrigger", 1)
        .parquet(ctx.arg("input"))
    )
    return (
        ks.stream(events)
        .key_by("key")
        .aggregate(uid="user_totals", total=ks.aggregates.sum("value"))
        .transform(lambda df: df.withColumn("tier", F.least(F.floor(F.col("total") / 500), F.lit(9)).cast("int")))
        .key_by("tier")
        .process(TierEntries(), "tier int, members long, entered long", uid="tier_entries")
        .sink(ks.sinks.ParquetSink(ctx.arg("output")))
    )
