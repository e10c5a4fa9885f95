"""A test job: one keyed stage and a sink that write down their Python workers' pids, so a
test can tell whether the sink's write ran in the stage's worker (``keyscale._spark_map``,
chaining)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pandas as pd
import pyarrow as pa

import keyscale as ks


class Counting(ks.VectorizedKeyedFunction):
    def open(self, ctx: ks.state.RuntimeContext) -> None:
        ctx.value_state("n", "long")

    def process_batch(self, batch: ks.state.KeyedBatch) -> tuple[dict[str, Any], pd.DataFrame]:
        n = batch.state["n"].fillna(0).to_numpy() + batch.count()
        return {"n": n}, pd.DataFrame({"key": batch.keys["key"], "n": n, "pid": os.getpid()})


class PidNotes:
    """Writes, per task, the pids of the rows' stage workers and its own."""

    exactly_once = True

    def __init__(self, notes: str):
        self.notes = notes

    def describe(self) -> str:
        return f"pid notes in {self.notes}"

    def write(self, df: Any, batch_id: int) -> int:
        from keyscale._spark_map import map_in_arrow

        notes = self.notes

        def task(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
            stage: set[int] = set()
            rows = 0
            for b in batches:
                stage |= set(b.column("pid").to_pylist())
                rows += b.num_rows
            with open(os.path.join(notes, f"{batch_id}-{os.getpid()}"), "w") as f:
                f.write(" ".join(map(str, sorted(stage))))
            yield pa.RecordBatch.from_pydict({"rows": [rows]})

        return sum(r.rows for r in map_in_arrow(df, task, "rows long").collect())


def build(ctx: ks.JobContext) -> ks.Pipeline:
    events = ctx.spark.readStream.schema("key string, value long, ts timestamp").option("maxFilesPerTrigger", 1).parquet(ctx.arg("input"))
    counted = ks.stream(events).key_by("key").process(Counting(), "key string, n long, pid long", uid="count")
    return ks.pipeline(counted.sink(PidNotes(ctx.arg("notes"))))
