"""A tumbling one-minute count per key over event time, with late data.

    keyscale run examples/tumbling_count.py --job-dir jobs/tc -p 2 \
        --set input=DIR --set output=OUT [--set late=LATE_DIR] --until-idle --drain-at-end

Input columns: key string, value long, ts timestamp (event time). The watermark trails the
largest event time by ``out_of_orderness`` (default 10 seconds). A window emits
(key, window_start, window_end, count, total) once the watermark passes its end; records up
to ``lateness`` (default 30 seconds) late update it and it emits again, so the last row of a
window is its result. Records later than that go to ``late`` if given.
"""

import keyscale as ks

NAME = "tumbling_count"


def build(ctx: ks.JobContext) -> ks.Pipeline:
    events = (
        ctx.spark.readStream.schema("key string, value long, ts timestamp")
        .option("maxFilesPerTrigger", int(ctx.arg("files_per_batch", "1")))
        .parquet(ctx.arg("input"))
    )
    late = ctx.args.get("late")
    return (
        ks.stream(events)
        .with_watermark("ts", ctx.arg("out_of_orderness", "10 seconds"))
        .key_by("key")
        .window(
            ks.windows.TumblingWindows(ctx.arg("size", "1 minute")),
            allowed_lateness=ctx.arg("lateness", "30 seconds"),
            late_output=ks.sinks.ParquetSink(late) if late else None,
        )
        .aggregate(uid="per_minute", count=ks.aggregates.count(), total=ks.aggregates.sum("value"))
        .sink(ks.sinks.ParquetSink(ctx.arg("output")))
    )
