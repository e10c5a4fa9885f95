"""Per-user sessions by inactivity gap, one summary row per session.

    keyscale run examples/sessionization.py --job-dir jobs/sess -p 2 \
        --set input=DIR --set output=OUT --until-idle --drain-at-end

Input columns: key string (the user), value long, ts timestamp (event time). A session is
a run of a user's events with gaps shorter than ``gap`` (default 30 seconds); it closes
when the watermark passes its last event plus the gap, and emits
(key, window_start, window_end, events, total, smallest, largest): ``window_end`` is
the last event plus the gap.
"""

import keyscale as ks

NAME = "sessionization"


def build(ctx: ks.JobContext) -> ks.Pipeline:
    events = (
        ctx.spark.readStream.schema("key string, value long, ts timestamp")
        .option("maxFilesPerTrigger", int(ctx.arg("files_per_batch", "1")))
        .parquet(ctx.arg("input"))
    )
    return (
        ks.stream(events)
        .with_watermark("ts", ctx.arg("out_of_orderness", "10 seconds"), idleness=ctx.args.get("idleness"))
        .key_by("key")
        .window(ks.windows.SessionWindows(ctx.arg("gap", "30 seconds")))
        .aggregate(uid="sessions", events=ks.aggregates.count(), total=ks.aggregates.sum("value"), smallest=ks.aggregates.min("value"), largest=ks.aggregates.max("value"))
        .sink(ks.sinks.ParquetSink(ctx.arg("output")))
    )
