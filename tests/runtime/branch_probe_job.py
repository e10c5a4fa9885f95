"""A test job: one keyed stage whose rows go to two sinks; the stage notes in a file how
many records each of its subtasks processed, so a test can tell whether it ran once."""

from __future__ import annotations

import os
from typing import Any

import pandas as pd

import keyscale as ks


class CountingProbe(ks.VectorizedKeyedFunction):
    def __init__(self, notes: str):
        self.notes = notes

    def open(self, ctx: ks.state.RuntimeContext) -> None:
        ctx.value_state("n", "long")

    def process_batch(self, batch: ks.state.KeyedBatch) -> tuple[dict[str, Any], pd.DataFrame]:
        with open(os.path.join(self.notes, f"{os.getpid()}-{id(batch)}"), "a") as f:
            f.write(f"{batch.batch_id} {len(batch.records)}\n")
        n = batch.state["n"].fillna(0).to_numpy() + batch.count()
        return {"n": n}, pd.DataFrame({"key": batch.keys["key"], "n": n})


def build(ctx: ks.JobContext) -> ks.Pipeline:
    events = ctx.spark.readStream.schema("key string, value long, ts timestamp").option("maxFilesPerTrigger", 1).parquet(ctx.arg("input"))
    counted = ks.stream(events).key_by("key").process(CountingProbe(ctx.arg("notes")), "key string, n long", uid="probe")
    return ks.pipeline(counted.sink(ks.sinks.ParquetSink(ctx.arg("a"))), counted.sink(ks.sinks.ParquetSink(ctx.arg("b"))))
