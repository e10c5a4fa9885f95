"""Workload W-ts in keyscale: a tumbling event-time window count per key.

``--set input=DIR`` (Parquet ``key long, v long, ts timestamp``); ``--set size=1 minute``;
``--set out_of_orderness=10 seconds``; ``--set sink=noop|parquet`` (``--set output=DIR``).
Each (key, window) emits one row (key, window_start, window_end, count) once the
watermark passes the window's end.
"""

from typing import Any

import keyscale as ks

NAME = "w_window"


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
    counts = (
        ks.stream(df)
        .with_watermark("ts", ctx.arg("out_of_orderness", "10 seconds"))
        .key_by("key")
        .window(ks.TumblingWindows(ctx.arg("size", "1 minute")))
        .aggregate(uid="per_minute", count=ks.count())
    )
    sink = NoopSink() if ctx.arg("sink", "noop") == "noop" else ks.ParquetSink(ctx.arg("output"))
    return counts.sink(sink)
