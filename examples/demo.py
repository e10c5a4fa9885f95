"""The `make run` demo: a keyed running count on local Spark, rescaled live twice.

It generates a stream of events (Parquet files, as an upstream system would drop them),
runs examples/running_count.py on them with local Spark at parallelism 2, asks for 4
subtasks after batch 2 and for 1 after batch 5 (exactly what `keyscale rescale` does to a
running job), and checks the output against an independent recount of the input.

    python examples/demo.py [--out demo-out] [--batches 8] [--rows 50000] [--keys 20000]
"""

from __future__ import annotations

import argparse
import datetime as dt
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq

from keyscale._logging import configure_logging
from keyscale.checkpoint.jobdir import JobDir
from keyscale.runtime.driver.runner import BatchRecord, JobRunner, RunOptions

HERE = Path(__file__).resolve().parent
RESCALES = {2: 4, 5: 1}  # after batch N is committed, ask for this parallelism


def generate_events(folder: Path, batches: int, rows: int, keys: int) -> None:
    """Event files with columns key string, value long, ts timestamp (skewed keys)."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(42)
    start = dt.datetime(2026, 11, 21, tzinfo=dt.UTC)
    for i in range(batches):
        k = np.minimum(rng.zipf(1.3, rows), keys) - 1
        ts = [start + dt.timedelta(milliseconds=int(x)) for x in np.sort(rng.integers(i * 60_000, (i + 1) * 60_000, rows))]
        table = pa.table({
            "key": pa.array([f"user-{x:05d}" for x in k]),
            "value": pa.array(rng.integers(1, 1000, rows), pa.int64()),
            "ts": pa.array(ts, pa.timestamp("us", tz="UTC")),
        })
        path = folder / f"events-{i:04d}.parquet"
        pq.write_table(table, path)
        stamp = time.time() - batches + i  # the file source takes files in modification order
        import os

        os.utime(path, (stamp, stamp))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="demo-out")
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--rows", type=int, default=50_000)
    ap.add_argument("--keys", type=int, default=20_000)
    a = ap.parse_args(argv)
    out = Path(a.out).absolute()
    shutil.rmtree(out, ignore_errors=True)
    configure_logging(sys.stdout, prefix="  keyscale: ")

    print(f"1/3 generating {a.batches} files x {a.rows:,} events over {a.keys:,} keys in {out / 'input'}")
    generate_events(out / "input", a.batches, a.rows, a.keys)

    print("2/3 running examples/running_count.py on local Spark (local[2]) at parallelism 2")
    job_dir = JobDir(out / "job")

    def on_batch(rec: BatchRecord) -> None:
        if rec.batch in RESCALES:
            print(f"  demo: asking the running job for parallelism {RESCALES[rec.batch]} (as `keyscale rescale {job_dir.path} -p {RESCALES[rec.batch]}`)")
            job_dir.request_rescale(RESCALES[rec.batch])

    opts = RunOptions(
        job_file=str(HERE / "running_count.py"), job_dir=str(job_dir.path), parallelism=2, until_idle=True,
        args={"input": str(out / "input"), "output": str(out / "output")},
    )
    started = time.perf_counter()
    summary = JobRunner(opts, on_batch).run()
    wall = time.perf_counter() - started

    print("3/3 checking the output against an independent recount of the input")
    events = pads.dataset(str(out / "input")).to_table().to_pandas()
    expected = events.groupby("key")["value"].agg(["size", "sum"])
    output = pads.dataset(str(out / "output"), partitioning="hive").to_table().to_pandas()
    final = output.sort_values("count").groupby("key").last()
    ok = (
        len(final) == len(expected)
        and (final["count"].reindex(expected.index) == expected["size"]).all()
        and (final["sum"].reindex(expected.index) == expected["sum"]).all()
        and not output.duplicated(["batch", "key"]).any()
    )

    print()
    print("summary")
    print(f"  job '{summary.job}': {len(summary.batches)} micro-batches, {summary.records:,} events, {wall:.1f} s wall (Spark start included)")
    print("  batch  parallelism  events    seconds")
    for b in summary.batches:
        print(f"  {b.batch:>5}  {b.parallelism['totals']:>11}  {b.records:>7,}  {b.seconds:>7.2f}")
    for batch, uid, old, new in summary.rescales:
        print(f"  live rescale of '{uid}' at batch {batch}: {old} -> {new} subtasks, no restart, no state rewritten")
    print(f"  output: {len(output):,} rows in {out / 'output'} for {len(final):,} keys")
    print(f"  exactly-once check: {'PASSED' if ok else 'FAILED'} (final count and sum per key equal a recount of the input; no key twice in a batch)")
    print(f"  inspect the job: keyscale status {job_dir.path}")
    return 0 if ok and len(summary.rescales) == len(RESCALES) else 1


if __name__ == "__main__":
    sys.exit(main())
