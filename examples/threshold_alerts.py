"""Per-record API: alert when a key's rolling sum over its last N values crosses a threshold.

    keyscale run examples/threshold_alerts.py --job-dir jobs/alerts -p 2 \
        --set input=DIR --set output=OUT [--set threshold=400 --set window=5] --until-idle

Input columns: key string, value long, ts timestamp. Output (key, ts, rolling_sum,
alert_number): one row each time the rolling sum of the key's last ``window`` values goes
from below ``threshold`` to at or above it. State per key: the last values (list state),
whether the key is above the threshold (value state), and how many alerts it raised.
"""

from typing import Any

import keyscale as ks

NAME = "threshold_alerts"


class RollingSumAlert(ks.KeyedProcessFunction):
    def __init__(self, threshold: int, window: int):
        self.threshold = threshold
        self.window = window

    def open(self, ctx: ks.state.RuntimeContext) -> None:
        self.recent = ctx.list_state("recent", "long")
        self.above = ctx.value_state("above", "boolean")
        self.alerts = ctx.value_state("alerts", "long")

    def process_element(self, row: Any, ctx: ks.state.Context) -> Any:
        recent = [*self.recent.get(), row.value][-self.window :]
        self.recent.update(recent)
        rolling = sum(recent)
        was_above = bool(self.above.value())
        now_above = rolling >= self.threshold
        if now_above != was_above:
            self.above.update(now_above)
        if now_above and not was_above:
            n = (self.alerts.value() or 0) + 1
            self.alerts.update(n)
            yield (ctx.key, row.ts, rolling, n)


def build(ctx: ks.JobContext) -> ks.Pipeline:
    events = (
        ctx.spark.readStream.schema("key string, value long, ts timestamp")
        .option("maxFilesPerTrigger", int(ctx.arg("files_per_batch", "1")))
        .parquet(ctx.arg("input"))
    )
    fn = RollingSumAlert(int(ctx.arg("threshold", "400")), int(ctx.arg("window", "5")))
    return (
        ks.stream(events)
        .key_by("key")
        .process(fn, "key string, ts timestamp, rolling_sum long, alert_number long", uid="alerts")
        .sink(ks.sinks.ParquetSink(ctx.arg("output")))
    )
