"""Workload W-ts in keyscale: sessions per key by an event-time inactivity gap, counted.

``--set input=DIR`` (Parquet ``key long, v long, ts timestamp``); ``--set gap=30 seconds``;
``--set out_of_orderness=10 seconds``; ``--set sink=noop|parquet`` (``--set output=DIR``).
Each session emits one row (key, window_start, window_end, count) once the watermark
passes its last event plus the gap.
"""

from typing import Any

import keyscale as ks

NAME = "w_session"


class NoopSink:
    """Computes the batch and discards it (as the Spark baselines' noop sink)."""

    exactly_once = False

    def describe(self) -> str:
        return "nowhere (noop sink)"

    def write(self, df: Any, batch_id: int) -> int:
        df.write.format("noop").mode("overwrite").save()
        return -1


def build(ctx: ks.JobContext) -> ks.Pipeline:
    df = ctx.spark.readStream.schema("key long, v long, ts timestamp").option("maxFilesPerTrigger", 1).parquet(ctx.arg("input"))
    sessions = (
        ks.stream(df)
        .with_watermark("ts", ctx.arg("out_of_orderness", "10 seconds"))
        .key_by("key")
        .window(ks.SessionWindows(ctx.arg("gap", "30 seconds")))
        .aggregate(uid="sessions", count=ks.count())
    )
    sink = NoopSink() if ctx.arg("sink", "noop") == "noop" else ks.ParquetSink(ctx.arg("output"))
    return sessions.sink(sink)
