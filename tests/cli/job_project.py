"""A small job project on disk, as users write them: a job file that imports a sibling
module and a sibling package (which imports another module), none of them installed.

Shared by tests/cli/test_job_modules.py (local mode) and tests/cluster/test_job_modules_cluster.py.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

JOB = '''
import keyscale as ks
from myjob import Scaled, pipeline_of      # a sibling module
from mypkg.columns import doubled          # a sibling package

NAME = "project_job"


def build(ctx):
    return pipeline_of(ctx, Scaled(), doubled)
'''

MYJOB = '''
import keyscale as ks
from helpers import scale                  # imported by the sibling module, not the job file


class Scaled(ks.KeyedProcessFunction):
    """Runs on the workers: its class and scale() must reach them."""

    def open(self, ctx):
        self.total = ctx.value_state("total", "long")

    def process_element(self, row, ctx):
        total = (self.total.value() or 0) + scale(row.value)
        self.total.update(total)
        yield (ctx.key, total)


def pipeline_of(ctx, fn, doubled):
    events = ctx.spark.readStream.schema("key string, value long, ts timestamp").parquet(ctx.arg("input"))
    return (
        ks.stream(events)
        .transform(doubled)
        .key_by("key")
        .process(fn, "key string, total long", uid="scaled")
        .sink(ks.sinks.ParquetSink(ctx.arg("output")))
    )
'''

HELPERS = '''
def scale(v):
    return v * 10
'''

COLUMNS = '''
from mypkg.units import TWO


def doubled(df):
    return df.withColumn("value", df.value * TWO)
'''


def write_project(folder: Path) -> Path:
    """The project under ``folder``; returns its job file."""
    (folder / "mypkg").mkdir(parents=True)
    (folder / "job.py").write_text(JOB)
    (folder / "myjob.py").write_text(MYJOB)
    (folder / "helpers.py").write_text(HELPERS)
    (folder / "mypkg" / "__init__.py").write_text("")
    (folder / "mypkg" / "columns.py").write_text(COLUMNS)
    (folder / "mypkg" / "units.py").write_text("TWO = 2\n")
    return folder / "job.py"


def expected_totals(events: pd.DataFrame) -> dict[str, int]:
    """Each key's final total: the sum of its values, doubled, times ten."""
    return {str(k): int(v) * 20 for k, v in events.groupby("key")["value"].sum().items()}


def final_totals(out: pd.DataFrame) -> dict[str, int]:
    return {str(k): int(v) for k, v in out.groupby("key")["total"].max().items()}
