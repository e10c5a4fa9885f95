"""What a worker pays to reload a keyed range from the checkpoint: a snapshot of N string
keys and D delta files of ~200,000 changed keys each, into an empty state table.

This is the reload a keyed task does when Spark hands it a Python worker that did not
serve its key groups last batch (docs/benchmarks.md, "running_count against its floor").
``apply_all`` (what the task runs) against applying the files one by one; medians of 7.

    .venv/bin/python bench/state_reload.py --keys 500000 1000000 --deltas 1 2 4
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import pyarrow as pa

from keyscale.state.table import KG_COLUMN, KeyedStateTable
from keyscale.state.types import StateDescriptor


def states(kind: str) -> list[StateDescriptor]:
    """running_count's two counters, or (``string``) a state Python holds as objects."""
    if kind == "string":
        return [StateDescriptor("count", "value", pa.int64()), StateDescriptor("last", "value", pa.string())]
    return [StateDescriptor("count", "value", pa.int64()), StateDescriptor("sum", "value", pa.int64())]


def state_file(keys: np.ndarray, rows: np.ndarray, rng: np.random.Generator, kind: str) -> pa.Table:
    second = pa.array([f"v{v}" for v in rng.integers(0, 99, len(rows))]) if kind == "string" else pa.array(rng.integers(1, 99, len(rows)))
    return pa.table({"k": pa.array(keys[rows]), KG_COLUMN: pa.array((rows % 128).astype(np.int32)),
                     "count": pa.array(rng.integers(1, 9, len(rows))), "last" if kind == "string" else "sum": second})


def measure(n: int, deltas: int, repeats: int, kind: str) -> dict[str, float]:
    rng = np.random.default_rng(0)
    keys = np.array([f"user-{i:08d}" for i in range(n)], dtype=object)
    files = [state_file(keys, np.arange(n), rng, kind)]
    files += [state_file(keys, np.unique(rng.integers(0, n, 200_000)), rng, kind) for _ in range(deltas)]
    descriptors = states(kind)
    times: dict[str, list[float]] = {"apply_all": [], "one by one": []}
    for _ in range(repeats):
        t = KeyedStateTable(["k"], [pa.string()], descriptors)
        start = time.perf_counter()
        t.apply_all(files)
        times["apply_all"].append(time.perf_counter() - start)
        t = KeyedStateTable(["k"], [pa.string()], descriptors)
        start = time.perf_counter()
        for f in files:
            t.apply(f)
        times["one by one"].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, nargs="+", default=[500_000, 1_000_000])
    ap.add_argument("--deltas", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--states", choices=["numeric", "string"], nargs="+", default=["numeric", "string"])
    args = ap.parse_args()
    print("| states | snapshot keys | delta files | apply_all (s) | one by one (s) |\n|---|---|---|---|---|")
    for kind in args.states:
        for n in args.keys:
            for d in args.deltas:
                r = measure(n, d, args.repeats, kind)
                print(f"| {kind} | {n:,} | {d} | {r['apply_all']:.3f} | {r['one by one']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
