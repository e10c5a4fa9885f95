"""Diff of two savepoints (issue 37, item 4): ``diff_savepoints`` (``keyscale state diff``)
of one operator holding N long keys with two value states, between a savepoint A and a
savepoint B that is A with 1% of its keys deleted, 1% new keys and 5% of the values changed.

Per run, timed, in one process: the diff with B at A's max parallelism (128), the diff
with B at another one (256: A's keys are re-bucketed and spilled), and beside them the floor
of any diff that reads the savepoints (Parquet decoding of both, nothing compared) and a
pandas outer merge of both (read, merge on the key, compare). The savepoints are written
once (bootstrapped from Arrow tables, timed apart). Prints medians over ``--runs``.

    .venv/bin/python bench/state_diff.py --keys 10000000 --runs 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from keyscale.checkpoint.savepoint import read_savepoint
from keyscale.state_processor import diff_savepoints, write_savepoint_from_dataframes

UID = "totals"
STATES = {"count": "long", "sum": "long"}


def make_savepoints(root: Path, n: int) -> tuple[str, str, str, dict[str, int]]:
    rng = np.random.default_rng(37)
    keys = np.arange(n, dtype=np.int64)
    count = rng.integers(1, 1000, n)
    total = rng.integers(0, 10**9, n)
    a = pa.table({"key": keys, "count": count, "sum": total})
    keep = rng.random(n) >= 0.01
    changed = (rng.random(n) < 0.05) & keep
    count_b = np.where(changed, count + 1, count)
    new = np.arange(n, n + n // 100, dtype=np.int64)
    b = pa.table({"key": np.concatenate([keys[keep], new]), "count": np.concatenate([count_b[keep], np.ones(len(new), np.int64)]),
                  "sum": np.concatenate([total[keep], np.zeros(len(new), np.int64)])})
    sa = write_savepoint_from_dataframes(root / "a", "bench", {UID: (a, ["key"], STATES)}, 128)
    sb = write_savepoint_from_dataframes(root / "b", "bench", {UID: (b, ["key"], STATES)}, 128)
    sb256 = write_savepoint_from_dataframes(root / "b256", "bench", {UID: (b, ["key"], STATES)}, 256)
    return sa, sb, sb256, {"only_a": int((~keep).sum()), "only_b": len(new), "changed": int(changed.sum())}


def _read_all(sp: str) -> pa.Table:
    info = read_savepoint(sp, verify=False)
    return pa.concat_tables([pq.read_table(Path(sp) / f.path) for f in info.operators[UID].files])


def floor(sa: str, sb: str) -> None:
    _read_all(sa)
    _read_all(sb)


def pandas_merge(sa: str, sb: str) -> tuple[int, int, int]:
    a = _read_all(sa).to_pandas()
    b = _read_all(sb).to_pandas()
    m = a.merge(b, on="key", how="outer", suffixes=("_a", "_b"), indicator=True)
    both = m[m["_merge"] == "both"]
    changed = ((both["count_a"] != both["count_b"]) | (both["sum_a"] != both["sum_b"])).sum()
    return int((m["_merge"] == "left_only").sum()), int((m["_merge"] == "right_only").sum()), int(changed)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--keys", type=int, default=1_000_000)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--dir", help="where to write the savepoints (default: a temporary folder)")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="keyscale-bench-diff-", dir=a.dir) as tmp:
        t0 = time.perf_counter()
        sa, sb, sb256, want = make_savepoints(Path(tmp), a.keys)
        build = time.perf_counter() - t0
        times: dict[str, list[float]] = {"diff, same max parallelism": [], "diff, max parallelism 128 vs 256": [],
                                         "floor: read both savepoints": [], "pandas: read + outer merge": []}
        for _ in range(a.runs):
            t = time.perf_counter()
            d = diff_savepoints(sa, sb, UID)
            times["diff, same max parallelism"].append(time.perf_counter() - t)
            assert {"only_a": d.only_a, "only_b": d.only_b, "changed": d.changed} == want, (d.to_json(), want)
            t = time.perf_counter()
            d = diff_savepoints(sa, sb256, UID)
            times["diff, max parallelism 128 vs 256"].append(time.perf_counter() - t)
            assert {"only_a": d.only_a, "only_b": d.only_b, "changed": d.changed} == want
            t = time.perf_counter()
            floor(sa, sb)
            times["floor: read both savepoints"].append(time.perf_counter() - t)
            t = time.perf_counter()
            assert pandas_merge(sa, sb) == (want["only_a"], want["only_b"], want["changed"])
            times["pandas: read + outer merge"].append(time.perf_counter() - t)
        base = statistics.median(times["floor: read both savepoints"])
        result: dict[str, Any] = {"keys": a.keys, "runs": a.runs, "build_seconds": round(build, 1), "differences": want,
                                  "median_seconds": {k: round(statistics.median(v), 2) for k, v in times.items()},
                                  "ratio_to_floor": {k: round(statistics.median(v) / base, 1) for k, v in times.items()}}
        print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
