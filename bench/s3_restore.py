"""What moving state costs on an object store: write a subtask's snapshot, read it whole,
and read the slice of key groups that moves to another subtask, on a SeaweedFS S3 server.

    .venv/bin/python bench/s3_restore.py --keys 2000000 --repeats 5

A snapshot of ``--keys`` running-count keys (string keys ``key-<n>``, a count and a sum)
over 128 key groups, written with keyscale's own state-file writer through the storage
seam. Reads: the whole file, a quarter of its key groups (what a subtask hands over when
parallelism doubles twice), and one key group. Medians over repeats; MB/s of the bytes the
slice needs. Figures feed docs/scaling-plan.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from keyscale.checkpoint.encode import write_state_file
from keyscale.checkpoint.files import read_state_slice
from keyscale.state.keygroups import KeyGroupRange
from keyscale.state.table import KG_COLUMN
from keyscale.storage import open_store
from keyscale.storage.seaweed import serving_bucket


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, default=2_000_000)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    kgs = np.sort(rng.integers(0, 128, a.keys)).astype(np.int32)
    table = pa.table({
        "key": pa.array([f"key-{i}" for i in range(a.keys)]), KG_COLUMN: pa.array(kgs),
        "count": pa.array(rng.integers(0, 1 << 20, a.keys)), "sum": pa.array(rng.integers(0, 1 << 40, a.keys)),
    })
    with tempfile.TemporaryDirectory(prefix="ks-s3restore-") as tmp, serving_bucket(Path(tmp) / "weed", "restore"):
        store = open_store("s3://restore/job", "job directory")
        times: dict[str, list[float]] = {"write": [], "whole": [], "quarter": [], "one key group": []}
        requests: dict[str, int] = {}
        f = None
        for r in range(a.repeats):
            t = time.perf_counter()
            f = write_state_file(store, f"state/op/{r:012d}-s00000-snapshot-x.arrow", table, "snapshot", r, KeyGroupRange(0, 127))
            times["write"].append(time.perf_counter() - t)
            for name, part in (("whole", KeyGroupRange(0, 127)), ("quarter", KeyGroupRange(32, 63)), ("one key group", KeyGroupRange(77, 77))):
                store.requests.clear()
                t = time.perf_counter()
                got = read_state_slice(store, f, part)
                times[name].append(time.perf_counter() - t)
                requests[name] = sum(store.requests.values())
                assert got.num_rows == int(((kgs >= part.start) & (kgs <= part.end)).sum())
        assert f is not None
        mb = f.bytes / 1e6
        print(f"snapshot: {a.keys:,} keys, {mb:.1f} MB ({f.bytes / a.keys:.1f} bytes per key), record batches of 65,536 rows\n")
        print("| operation | median | requests | MB/s of the bytes needed |")
        print("|---|---|---|---|")
        share = {"write": 1.0, "whole": 1.0, "quarter": 0.25, "one key group": 1 / 128}
        for name, xs in times.items():
            med = statistics.median(xs)
            print(f"| {name} | {med * 1000:.0f} ms | {requests.get(name, 1)} | {mb * share[name] / med:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
