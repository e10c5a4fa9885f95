"""Workload W-ts in keyscale: an event-time window count per key, tumbling or sessions.

``--set input=DIR`` (Parquet ``key long, v long, ts timestamp``); ``--set window=tumbling``
(``--set size=1 minute``, operator ``per_minute``) or ``--set window=session`` (``--set
gap=30 seconds``, operator ``sessions``); ``--set out_of_orderness=10 seconds``;
``--set sink=noop|parquet`` (``--set output=DIR``). Each window (session) emits one row
(key, window_start, window_end, count) once the watermark passes its end.
"""

import keyscale as ks

NAME = "w_window"


def build(ctx: ks.JobContext) -> ks.Pipeline:
    df = ctx.spark.readStream.schema("key long, v long, ts timestamp").option("maxFilesPerTrigger", 1).parquet(ctx.arg("input"))
    keyed = ks.stream(df).with_watermark("ts", ctx.arg("out_of_orderness", "10 seconds")).key_by("key")
    if ctx.arg("window", "tumbling") == "session":
        counts = keyed.window(ks.windows.SessionWindows(ctx.arg("gap", "30 seconds"))).aggregate(uid="sessions", count=ks.aggregates.count())
    else:
        counts = keyed.window(ks.windows.TumblingWindows(ctx.arg("size", "1 minute"))).aggregate(uid="per_minute", count=ks.aggregates.count())
    sink = ks.sinks.NoopSink() if ctx.arg("sink", "noop") == "noop" else ks.sinks.ParquetSink(ctx.arg("output"))
    return counts.sink(sink)
