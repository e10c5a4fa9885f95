"""Running count and sum per key over Parquet files that keep arriving.

    keyscale run examples/running_count.py --job-dir jobs/rc -p 2 \
        --set input=DIR --set output=OUT --until-idle

Input columns: key string, value long, ts timestamp. For each key updated in a batch the
output gets a row (key, count, sum); the row with the largest count holds the key's totals.
"""

import keyscale as ks

NAME = "running_count"


def build(ctx: ks.JobContext) -> ks.Pipeline:
    events = (
        ctx.spark.readStream.schema("key string, value long, ts timestamp")
        .option("maxFilesPerTrigger", int(ctx.arg("files_per_batch", "1")))
        .parquet(ctx.arg("input"))
    )
    return (
        ks.stream(events)
        .key_by("key")
        .aggregate(uid="totals", count=ks.aggregates.count(), sum=ks.aggregates.sum("value"))
        .sink(ks.sinks.ParquetSink(ctx.arg("output")))
    )


if __name__ == "__main__":  # spark-submit examples/running_count.py --job-dir DIR -p 2 --set input=... --set output=...
    raise SystemExit(ks.main(build))
