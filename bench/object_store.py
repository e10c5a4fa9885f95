"""Workload W with state and sink on local disk against the same on an S3 server, same run.

    .venv/bin/python bench/object_store.py --repeats 3 [--keys string] [--async-checkpoints]
    .venv/bin/python bench/object_store.py --async-checkpoints --keys string --state-keys 2000000 --files 8 --compaction-chain 2

Starts a private SeaweedFS (keyscale.storage.seaweed) on 127.0.0.1. Per repeat, interleaved
so that machine noise hits both alike: the W running count (``bench/jobs/w_count.py``,
vectorized, Parquet sink, parallelism 2, local[2]) with job directory and output on local
disk, then with both on S3. Steady batch = median of the batches after the first (W: 1-4) of Spark's own
``triggerExecution``; medians over repeats. Also the storage requests of each steady batch
(driver and tasks: job directory only; the sink's are reported apart: its part objects and
its marker), the end-to-end wall time, and the CPU time the S3 server used meanwhile.

``--keys string`` runs the same with string keys (``k<n>``), the case users have.
``--async-checkpoints`` adds, in each repeat, both again with asynchronous checkpoints
(a batch's state files upload while the next batch runs). ``--state-keys N --files F``
runs W's shape (400,000 rows a file) over N distinct keys and F files instead (large
state: large deltas, and with ``--compaction-chain 2`` a snapshot every other batch).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _workload import DEFAULT_DATA_ROOT, ensure_workload  # noqa: E402

from keyscale.runtime.driver.runner import JobRunner, RunOptions  # noqa: E402
from keyscale.sinks.parquet import read_marker  # noqa: E402
from keyscale.storage import open_store  # noqa: E402
from keyscale.storage.seaweed import create_bucket, serving_bucket  # noqa: E402


def string_keyed(data: Path) -> Path:
    """W with its int64 keys written as strings ``k<n>`` (made once, next to W)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    out = data.parent / (data.name + "-string")
    if (out / "_COMPLETE").exists():
        return out
    out.mkdir(exist_ok=True)
    for f in sorted(data.glob("*.parquet")):
        t = pq.read_table(f)
        keys = pc.binary_join_element_wise(pa.scalar("k"), pc.cast(t.column("key"), pa.string()), "")
        pq.write_table(t.set_column(0, "key", keys), out / f.name)
        os.utime(out / f.name, (f.stat().st_mtime, f.stat().st_mtime))
    (out / "_COMPLETE").write_text("ok")
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (/proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(data: Path, job_dir: str, output: str, key_type: str, async_checkpoints: bool = False, max_chain: int = 8) -> dict[str, Any]:
    opts = RunOptions(
        job_file=str(HERE / "jobs" / "w_count.py"), job_dir=job_dir, parallelism=2, until_idle=True,
        args={"input": str(data), "mode": "vectorized", "sink": "parquet", "output": output, "key_type": key_type},
        async_checkpoints=async_checkpoints, max_chain=max_chain,
    )
    t = time.perf_counter()
    runner = JobRunner(opts)
    s = runner.run()
    wall = time.perf_counter() - t
    steady = s.batches[1:]
    requests: Counter[str] = Counter()
    for b in steady:
        requests.update(b.requests)
    out = open_store(output, "output")
    sink_objects = []
    for b in steady:
        m = read_marker(out, f"batch={b.batch:012d}")
        sink_objects.append(1 + (len(m.files) if m is not None and m.files is not None else 0))
    return {
        "steady": statistics.median(s.trigger_seconds[1:]), "wall": wall, "rows": s.records,
        "writes_per_batch": max(b.requests.get("put", 0) + b.requests.get("create", 0) for b in steady),
        "requests_per_batch": {k: v / len(steady) for k, v in sorted(requests.items())},
        "sink_objects_per_batch": statistics.median(sink_objects),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--keys", choices=["long", "string"], default="long")
    ap.add_argument("--async-checkpoints", action="store_true", help="also run both with asynchronous checkpoints")
    ap.add_argument("--state-keys", type=int, default=None, help="distinct keys (default: W's 100,000)")
    ap.add_argument("--files", type=int, default=None, help="input files, one a batch (default: W's 5)")
    ap.add_argument("--compaction-chain", type=int, default=8)
    a = ap.parse_args(argv)
    wheres = ["local", "s3", *(["local async", "s3 async"] if a.async_checkpoints else [])]
    if a.state_keys or a.files:
        keys, files = a.state_keys or 100_000, a.files or 5
        data = ensure_workload(DEFAULT_DATA_ROOT, f"W-{keys}keys-{files}files", files=files, keys=keys)
    else:
        data = ensure_workload(DEFAULT_DATA_ROOT, "W")
    if a.keys == "string":
        data = string_keyed(data)
    tmp = Path(tempfile.mkdtemp(prefix="ks-objstore-"))
    results: dict[str, list[dict[str, Any]]] = {w: [] for w in wheres}
    try:
        with serving_bucket(tmp / "weed", "bench-0") as server:
            for r in range(a.repeats):
                bucket = f"bench-{r}"
                if r:  # a bucket a repeat: each starts empty
                    create_bucket(server, bucket)
                for i, where in enumerate(wheres):
                    root = str(tmp / f"r{r}" / str(i)) if where.startswith("local") else f"s3://{bucket}/{i}"
                    cpu_before = cpu_seconds(server.pid)
                    res = run(data, f"{root}/job", f"{root}/out", a.keys, where.endswith("async"), a.compaction_chain)
                    res["server_cpu"] = cpu_seconds(server.pid) - cpu_before  # the S3 server's CPU, on the job's 2 cores
                    results[where].append(res)
                    print(f"repeat {r} {where}: steady {res['steady']:.2f} s, wall {res['wall']:.1f} s, S3 server CPU {res['server_cpu']:.1f} s, "
                          f"writes/batch {res['writes_per_batch']}, requests/batch {res['requests_per_batch']}, "
                          f"sink objects/batch {res['sink_objects_per_batch']}", flush=True)
                shutil.rmtree(tmp / f"r{r}", ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    steady = {w: statistics.median(x["steady"] for x in results[w]) for w in wheres}
    wall = {w: statistics.median(x["wall"] for x in results[w]) for w in wheres}
    cpu = {w: statistics.median(x["server_cpu"] for x in results[w]) for w in wheres}
    print("\n| where | steady batch | end to end | S3 server CPU | writes per batch (job dir) | requests per batch (job dir) | sink objects per batch |")
    print("|---|---|---|---|---|---|---|")
    for w in wheres:
        x = results[w][-1]
        print(f"| {w} | {steady[w]:.2f} s | {wall[w]:.1f} s | {cpu[w]:.1f} s | {x['writes_per_batch']} | {x['requests_per_batch']} | "
              f"{x['sink_objects_per_batch']} |")
    print(f"\nS3 / local: steady {steady['s3'] / steady['local']:.2f}x, end to end {wall['s3'] / wall['local']:.2f}x (target steady <= 1.3x)")
    if a.async_checkpoints:
        print(f"S3 async / local: steady {steady['s3 async'] / steady['local']:.2f}x, end to end {wall['s3 async'] / wall['local']:.2f}x "
              f"(target steady <= 1.1x); S3 async / S3: steady {steady['s3 async'] / steady['s3']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
