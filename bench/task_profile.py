"""The Python share of a keyed batch: one subtask's `run_subtask`, without Spark.

    .venv/bin/python bench/task_profile.py [--records 200000] [--keys 50000] [--batches 6]

W's shape per subtask at P=2 (200,000 records over ~50,000 keys): arrival sort, key
grouping, warm state lookup, running sum, upsert and the delta file. Prints the median
seconds of the warm batches (the first one builds the state).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa

from keyscale.checkpoint.manifest import StateFile, live_files
from keyscale.operators.vectorized import Agg, RunningAggregate
from keyscale.runtime.task.keyed import StageTask, run_subtask
from keyscale.storage import LocalStore


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=200_000)
    ap.add_argument("--keys", type=int, default=50_000)
    ap.add_argument("--batches", type=int, default=6)
    a = ap.parse_args(argv)
    fn = RunningAggregate({"count": Agg("sum", "v")}, ["key"], {"key": pa.int64(), "v": pa.int64()})
    job_dir = tempfile.mkdtemp(prefix="ks-profile-")
    rng = np.random.default_rng(0)
    files: tuple[StateFile, ...] = ()
    times = []
    for b in range(a.batches):
        keys = rng.integers(0, a.keys, a.records) * 2  # key groups 0..63: subtask 0 of 2 at M=128
        batch = pa.RecordBatch.from_arrays(
            [pa.array(keys), pa.array(np.ones(a.records, dtype=np.int64)), pa.array(rng.permutation(a.records) + b * 10**7),
             pa.array((keys % 64).astype(np.int32))],
            names=["key", "v", "__seq", "__kg"],
        )
        spec = StageTask(
            store=LocalStore(job_dir), run_id="profile", uid="count", function=fn, key_names=("key",), key_types=(pa.int64(),),
            input_schema=pa.schema([("key", pa.int64()), ("v", pa.int64())]),
            output_schema=pa.schema([("key", pa.int64()), ("count", pa.int64())]),
            states=tuple(fn.state_descriptors()), null_keys="error", max_parallelism=128, parallelism=2, batch_id=b,
            batch_time_ms=0, committed=b - 1, files=files, compact=(False, False),
        )
        t = time.perf_counter()
        _, report = run_subtask(spec, iter([batch]), 0)
        times.append(time.perf_counter() - t)
        files = tuple(live_files([*files, report.file], 128))
    print(f"run_subtask, {a.records:,} records over {a.keys:,} keys: first batch {times[0]:.3f} s, "
          f"warm batches median {statistics.median(times[1:]):.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
