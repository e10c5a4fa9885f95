"""The pipeline runner of :mod:`keyscale.testing`: a whole job file on in-memory batches,
with local Spark (for pipelines with PySpark steps), returning each batch's output.

Each batch is written as one Parquet file into a temporary input folder, given to the job
as ``--set <input>=FOLDER``; each named output gets a temporary folder as
``--set <name>=FOLDER``; the job runs until its input is read (job files that read one
file per batch, as the examples do with ``maxFilesPerTrigger``, run one batch per input
batch), and the Parquet sinks' output comes back per batch::

    from keyscale.testing import run_job_file

    out = run_job_file("examples/running_count.py", [[{"key": "a", "value": 1, "ts": t0}], ...],
                       schema="key string, value long, ts timestamp", parallelism=2)
    out["output"][0]   # the rows batch 0 wrote, sorted
"""

from __future__ import annotations

import io
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from keyscale.sources.log import create_log
from keyscale.state.types import arrow_schema
from keyscale.storage import LocalStore
from keyscale.testing.keyed import Records, sorted_rows, to_arrow


@dataclass
class JobRun:
    """What :func:`run_job_file` returns: each output's rows per batch (``run["output"][b]``)
    and the live rescales that took place, as (batch, operator, from, to)."""

    outputs: dict[str, list[list[dict[str, Any]]]]
    rescales: list[tuple[int, str, int, int]] = field(default_factory=list)

    def __getitem__(self, output: str) -> list[list[dict[str, Any]]]:
        return self.outputs[output]


def run_job_file(
    job_file: str | Path, batches: Sequence[Records] = (), *, schema: str = "", input: str = "input", outputs: Sequence[str] = ("output",),
    logs: dict[str, tuple[str, Records]] | None = None, args: dict[str, str] | None = None, parallelism: int = 2,
    rescales: dict[int, int] | None = None, **options: Any,
) -> JobRun:
    """Run ``job_file`` on ``batches`` (each: dicts, pandas or Arrow of the Spark DDL
    ``schema``) with local Spark; returns, per output name, each batch's rows (sorted,
    without the ``batch`` column). ``logs``: for a job on partitioned logs, the argument
    naming each log and its (schema, records), written to a one-partition folder log before
    the run (how many records a batch reads is the job's own setting). ``options`` are
    RunOptions fields (``drain_at_end=True`` to fire the windows still open at the end...).
    ``rescales``: after batch ``b`` commits, ask the running job for parallelism
    ``rescales[b]``, as ``keyscale rescale`` does (a live rescale at the next batch)."""
    import pyarrow.parquet as pq

    from keyscale.checkpoint.jobdir import JobDir
    from keyscale.runtime.control.server import control_api
    from keyscale.runtime.driver.runner import BatchRecord, JobRunner, RunOptions
    from keyscale.sinks.parquet import read_output

    root = Path(tempfile.mkdtemp(prefix="keyscale-run-"))
    try:
        inputs = LocalStore(root / "in")
        for i, records in enumerate(batches):
            arrow = arrow_schema(schema)
            buf = io.BytesIO()
            pq.write_table(to_arrow(records, arrow), buf)
            inputs.put(f"part-{i:05d}.parquet", buf.getvalue())
            # A second apart: Spark orders new files by modification time, and files
            # written within one tick would be read in any order.
            inputs.set_modified(f"part-{i:05d}.parquet", time.time() - len(batches) + i)
        for name, (log_schema, records) in (logs or {}).items():
            log = create_log(root / "logs" / name, log_schema, 1)
            log.append(0, to_arrow(records, arrow_schema(log_schema)))
        folders = {name: root / "out" / name for name in outputs}
        every = {**({input: str(root / "in")} if batches else {}), **{n: str(root / "logs" / n) for n in logs or {}},
                 **{n: str(f) for n, f in folders.items()}, **(args or {})}
        opts = RunOptions(job_file=str(job_file), job_dir=str(root / "job"), parallelism=parallelism, until_idle=True, args=every, **options)
        job_dir = JobDir(str(root / "job"))

        def on_batch(rec: BatchRecord) -> None:
            if rec.batch in (rescales or {}):
                job_dir.request_rescale((rescales or {})[rec.batch])

        summary = JobRunner(opts, on_batch, serve=control_api(opts)).run()
        n = max([len(batches), *(b.batch + 1 for b in summary.batches)])
        result: dict[str, list[list[dict[str, Any]]]] = {}
        for name, folder in folders.items():
            per_batch: list[list[dict[str, Any]]] = [[] for _ in range(n)]
            if folder.exists():
                for row in read_output(str(folder)).to_pylist():
                    b = row.pop("batch")
                    per_batch[b].append(row)
            result[name] = [sorted_rows(rows) for rows in per_batch]
        return JobRun(result, list(summary.rescales))
    finally:
        shutil.rmtree(root, ignore_errors=True)
