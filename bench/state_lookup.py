"""Point lookup latency (issue 37, item 1): ``StateLookup.get`` of random keys of a job
directory holding N string keys (a snapshot per subtask, then D deltas of 1% of the keys
each), on local disk or an object store.

Three passes of ``--lookups`` random keys (9 in 10 live, 1 in 10 never written), with the
committed manifest in memory as the running job has it (``JobHandle.state``,
``GET /state``): with the slice cache off (every lookup reads its key group's footers and
record batches from the store), with the default cache cold, then warm; and one pass that
lists the job directory and reads the newest manifest per lookup, as ``keyscale state get``
does. Prints p50/p99/max in milliseconds, the
store's requests and the process's CPU time per lookup (on a busy machine the percentiles
include waiting for a core; the CPU time does not).

    .venv/bin/python bench/state_lookup.py --keys 1000000
    .venv/bin/python bench/state_lookup.py --keys 1000000 --seaweedfs          # on a SeaweedFS S3 server of its own
    .venv/bin/python bench/state_lookup.py --keys 10000000 --where s3://bench/lookup   # AWS_* in the environment
    .venv/bin/python bench/state_lookup.py --snapshot-cost 2500000 --runs 5
    .venv/bin/python bench/state_lookup.py --keys 10000000 --where /tmp/lk/job            # build once, then
    PYTHONPATH=../main/src .venv/bin/python bench/state_lookup.py --keys 10000000 --where /tmp/lk/job --reuse   # another code path
    .venv/bin/python bench/state_lookup.py --keys 10000000 --seaweedfs --ab ../main/src --rounds 2   # A B A B on one server

``--snapshot-cost N``: what the order that gives snapshots fences costs the write. One
subtask's snapshot of N string keys (a value and a list state, in a ``KeyedStateTable``)
as a job writes it (``arrow_parts`` then ``spill_state_file`` to scratch), in key-group
order only (A, as before fences) and in file order with fences (B), A B A B ``--runs``
times in one process: medians and B/A.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from keyscale.checkpoint.encode import write_state_file
from keyscale.checkpoint.jobdir import JobDir
from keyscale.checkpoint.manifest import Manifest, OperatorCheckpoint
from keyscale.state.keygroups import key_group_ranges
from keyscale.state.order import order_rows
from keyscale.state.table import KG_COLUMN
from keyscale.state.types import StateDescriptor
from keyscale.state_processor import StateLookup
from keyscale.state_processor.keygroups import key_groups
from keyscale.state_processor.lookup import DEFAULT_CACHE_BYTES

STATES = (StateDescriptor("count", "value", pa.int64()), StateDescriptor("recent", "list", pa.int64()))


def _table(keys: list[str], m: int, rng: np.random.Generator, snapshot: bool) -> pa.Table:
    """Rows as a job writes them: a snapshot in file order (key group, then sub key, so it
    gets fences), a delta by key group only."""
    n = len(keys)
    recent = pa.ListArray.from_arrays(pa.array(np.arange(0, 2 * n + 1, 2, dtype=np.int32)), pa.array(rng.integers(0, 99, 2 * n)))
    t = pa.table({"user": pa.array(keys, pa.string()), "count": pa.array(rng.integers(1, 1000, n)), "recent": recent})
    kgs = key_groups(t, ["user"], ["string"], m)
    order = order_rows(kgs, t.column("user")) if snapshot else np.argsort(kgs, kind="stable")
    return t.add_column(1, KG_COLUMN, pa.array(kgs, pa.int32())).take(pa.array(order))


def build(where: str, n: int, m: int, p: int, deltas: int) -> JobDir:
    jd = JobDir(where)
    jd.claim("lookup-bench", m, m)
    rng = np.random.default_rng(0)
    files = []
    for batch in range(deltas + 1):
        if batch == 0:
            keys = [f"user-{i:09d}" for i in range(n)]
        else:
            keys = [f"user-{i:09d}" for i in np.sort(rng.choice(n, max(1, n // 100), replace=False))]
        table = _table(keys, m, rng, snapshot=batch == 0)
        kgs = table.column(KG_COLUMN).to_numpy()
        for s, r in enumerate(key_group_ranges(m, p)):
            lo, hi = np.searchsorted(kgs, r.start), np.searchsorted(kgs, r.end, side="right")
            kind = "snapshot" if batch == 0 else "delta"
            rel = f"state/op/{batch:012d}-s{s:05d}-{kind}.arrow"
            files.append(write_state_file(jd.store, rel, table.slice(int(lo), int(hi - lo)), kind, batch, r))  # type: ignore[arg-type]
        op = OperatorCheckpoint("op", m, p, (("user", "string"),), tuple(d.to_json() for d in STATES), tuple(files))
        jd.commit(Manifest("lookup-bench", batch, 0, {"op": op}))
        del table
    return jd


READ_BYTES = [0]  # bytes fetched from an object store (ranged and whole reads)


def _count_bytes(store: Any) -> None:
    get, get_range = store.get, store.get_range

    def counted_get(key: str) -> bytes:
        data = get(key)
        READ_BYTES[0] += len(data)
        return data  # type: ignore[no-any-return]

    def counted_range(key: str, start: int, length: int) -> bytes:
        data = get_range(key, start, length)
        READ_BYTES[0] += len(data)
        return data  # type: ignore[no-any-return]

    store.get, store.get_range = counted_get, counted_range


def _pass(lookup: StateLookup, keys: list[str]) -> dict[str, Any]:
    store = lookup.jobdir.store
    before = sum(store.requests.values())
    read_before = READ_BYTES[0]
    ms = []
    found = 0
    cpu = time.process_time()
    for k in keys:
        t0 = time.perf_counter()
        found += lookup.get("op", k)["found"]
        ms.append((time.perf_counter() - t0) * 1000)
    a = np.array(ms)
    return {"p50_ms": round(float(np.percentile(a, 50)), 2), "p99_ms": round(float(np.percentile(a, 99)), 2),
            "max_ms": round(float(a.max()), 2), "found": found,
            "cpu_ms_per_lookup": round((time.process_time() - cpu) * 1000 / len(keys), 2),
            "requests_per_lookup": round((sum(store.requests.values()) - before) / len(keys), 2),
            "kb_per_lookup": round((READ_BYTES[0] - read_before) / len(keys) / 1000, 1)}


def snapshot_cost(n: int, runs: int) -> None:
    from keyscale.checkpoint.encode import spill_state_file
    from keyscale.state.keygroups import KeyGroupRange
    from keyscale.state.table import KeyedStateTable
    from keyscale.storage.scratch import remove_scratch

    rng = np.random.default_rng(0)
    t = _table([f"user-{i:09d}" for i in rng.permutation(n)], 128, rng, snapshot=False)
    table = KeyedStateTable(["user"], [pa.string()], list(STATES))
    table.apply(t)
    del t
    rows = table.rows_in_range(0, 127)
    times: dict[str, list[float]] = {"A": [], "B": []}
    for _ in range(runs):
        for side, ordered in (("A", False), ("B", True)):
            t0 = time.perf_counter()
            _, path = spill_state_file("x", table.arrow_parts(rows, file_order=ordered), table.schema(), "snapshot", 0,
                                       KeyGroupRange(0, 127), ordered=ordered)
            times[side].append(time.perf_counter() - t0)
            remove_scratch(path.parent)
    med = {s: float(np.median(v)) for s, v in times.items()}
    print(json.dumps({"keys": n, "runs": runs, "A_kg_order_s": [round(x, 3) for x in times["A"]],
                      "B_file_order_fences_s": [round(x, 3) for x in times["B"]], "median_A_s": round(med["A"], 3),
                      "median_B_s": round(med["B"], 3), "ratio_B_over_A": round(med["B"] / med["A"], 3),
                      "load_average": os.getloadavg()}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, default=1_000_000)
    ap.add_argument("--lookups", type=int, default=1000)
    ap.add_argument("--max-parallelism", type=int, default=128)
    ap.add_argument("-p", "--parallelism", type=int, default=4)
    ap.add_argument("--deltas", type=int, default=3)
    ap.add_argument("--chunk-rows", type=int, help="rows per record batch of the snapshots built (default: the writer's, CHUNK_ROWS)")
    ap.add_argument("--where", help="job directory to create (default: a temporary folder)")
    ap.add_argument("--reuse", action="store_true", help="look up in the job directory --where that an earlier run built (same --keys): "
                    "A B runs of two code paths on the same files")
    ap.add_argument("--passes", default="no_cache,cache_cold,cache_warm,listing_cache_warm", help="which passes to run (comma-separated)")
    ap.add_argument("--ab", metavar="SRC", help="build once, then run the passes in child processes with PYTHONPATH=SRC (A: "
                    "another checkout's src) and this checkout's src (B), A B --rounds times, on the same files")
    ap.add_argument("--rounds", type=int, default=2, help="A B rounds of --ab")
    ap.add_argument("--seaweedfs", action="store_true", help="on a private SeaweedFS S3 server started for the run (keyscale.storage.seaweed)")
    ap.add_argument("--snapshot-cost", type=int, metavar="N", help="measure the write-side cost of fences on a snapshot of N keys instead")
    ap.add_argument("--runs", type=int, default=5, help="A B rounds of --snapshot-cost")
    a = ap.parse_args()
    if a.snapshot_cost:
        snapshot_cost(a.snapshot_cost, a.runs)
        return
    if a.seaweedfs:
        from keyscale.storage.seaweed import serving_bucket

        with serving_bucket(tempfile.mkdtemp(prefix="lookup-bench-s3-"), "bench"):
            run(a, "s3://bench/job")
        return
    run(a, a.where or tempfile.mkdtemp(prefix="lookup-bench-") + "/job")


def run(a: argparse.Namespace, where: str) -> None:
    if a.ab and not a.reuse:
        build(where, a.keys, a.max_parallelism, a.parallelism, a.deltas)
        here = str(Path(__file__).resolve().parent.parent / "src")
        args = [sys.executable, __file__, "--keys", str(a.keys), "--lookups", str(a.lookups), "--where", where, "--reuse", "--passes", a.passes]
        for r in range(a.rounds):
            for side, src in (("A", a.ab), ("B", here)):
                out = subprocess.run(args, env={**os.environ, "PYTHONPATH": src}, capture_output=True, text=True, check=True)
                print(json.dumps({"round": r, "side": side, "src": src, **json.loads(out.stdout.strip().splitlines()[-1])}), flush=True)
        return
    t0 = time.perf_counter()
    if a.chunk_rows:
        import keyscale.checkpoint.files as files

        files.CHUNK_ROWS = a.chunk_rows  # an experiment on the snapshots' record batch size
    jd = JobDir(where) if a.reuse else build(where, a.keys, a.max_parallelism, a.parallelism, a.deltas)
    built = time.perf_counter() - t0
    rng = np.random.default_rng(1)
    picks = [f"user-{i:09d}" if rng.random() < 0.9 else f"absent-{i}" for i in rng.integers(0, a.keys, a.lookups)]
    state_bytes = sum(f.bytes for f in jd.latest_manifest().operators["op"].files)  # type: ignore[union-attr]
    out: dict[str, Any] = {"chunk_rows": a.chunk_rows, "keys": a.keys, "max_parallelism": a.max_parallelism, "parallelism": a.parallelism, "deltas": a.deltas,
                           "where": "local" if jd.is_local else jd.uri.split(":")[0], "state_mb": round(state_bytes / 1e6, 1),
                           "build_s": round(built, 1)}
    latest = jd.latest_manifest()
    passes = a.passes.split(",")
    if not jd.is_local:
        _count_bytes(jd.store)
    # As the running job serves them (JobHandle.state, GET /state): the committed manifest in memory.
    if "no_cache" in passes:
        out["no_cache"] = _pass(StateLookup(jd, cache_bytes=0, latest=lambda: latest), picks)
    cached = StateLookup(jd, cache_bytes=DEFAULT_CACHE_BYTES, latest=lambda: latest)
    if "cache_cold" in passes or "cache_warm" in passes:
        out["cache_cold"] = _pass(cached, picks)
        out["cache_warm"] = _pass(cached, picks)
    # As `keyscale state get` does: the job directory listed and the newest manifest read per lookup.
    if "listing_cache_warm" in passes:
        out["listing_cache_warm"] = _pass(StateLookup(jd, cache_bytes=DEFAULT_CACHE_BYTES), picks[: len(picks) // 4] * 2)
    out["load_average"] = os.getloadavg()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
