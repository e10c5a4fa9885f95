"""10M keys of state in one job on this machine.

    .venv/bin/python bench/big_state.py [--keys 10000000] [--files 5]

Input: ``--files`` Parquet files, each with ``keys/files`` new distinct keys (so the state
grows to ``--keys`` keys) plus the same number of updates to random earlier keys. The
vectorized running count at P=2; reported per batch: time, state keys, and the resident
memory of the Spark driver, its JVM and the Python workers; at the end the checkpoint size
and a restart (new process) at P=4 until its first batch (restoring all keys from files).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from keyscale.checkpoint.jobdir import JobDir  # noqa: E402
from keyscale.runtime.driver import BatchRecord, JobRunner, RunOptions  # noqa: E402


def _descendants(root: int) -> list[int]:
    """``root`` and every process below it (this run's JVM, its Python daemon and workers:
    not the Spark jobs of anyone else on the machine)."""
    children: dict[int, list[int]] = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(pid))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def rss_list(pattern: str) -> list[float]:
    """Resident memory (MB) of each process of this run whose command line contains ``pattern``."""
    sizes = []
    for pid in _descendants(os.getpid()):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if pattern in cmd:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        sizes.append(int(line.split()[1]) / 1024)
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return sizes


def rss_mb(pattern: str) -> float:
    """Total resident memory (MB) of this run's processes whose command line contains ``pattern``."""
    return sum(rss_list(pattern))


def make_input(folder: Path, keys: int, files: int) -> None:
    marker = folder / "_COMPLETE"
    if marker.exists() and json.loads(marker.read_text()) == {"keys": keys, "files": files}:
        return
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    rng = np.random.default_rng(1)
    per = keys // files
    for i in range(files):
        new = np.arange(i * per, (i + 1) * per, dtype=np.int64)
        old = rng.integers(0, max(i * per, 1), per).astype(np.int64) if i else np.empty(0, dtype=np.int64)
        k = rng.permutation(np.concatenate([new, old]))
        path = folder / f"part-{i:05d}.parquet"
        pq.write_table(pa.table({"key": k, "v": np.ones(len(k), dtype=np.int64)}), path)
        os.utime(path, (1_700_000_000 + i, 1_700_000_000 + i))
    marker.write_text(json.dumps({"keys": keys, "files": files}))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, default=10_000_000)
    ap.add_argument("--files", type=int, default=5)
    ap.add_argument("--out", default=str(HERE / "out" / "big_state.json"))
    a = ap.parse_args(argv)
    logging.getLogger("keyscale").setLevel(logging.WARNING)
    data = HERE / "data" / f"big-{a.keys}"
    print(f"generating input: {a.keys:,} keys over {a.files} files ...", flush=True)
    make_input(data, a.keys, a.files)
    job = HERE / "out" / "big_state_job"
    shutil.rmtree(job, ignore_errors=True)
    rows = []

    def on_batch(rec: BatchRecord) -> None:
        m = JobDir(job).latest_manifest()
        assert m is not None
        state_mb = sum(f.bytes for f in m.operators["count"].files) / 1e6
        workers = rss_list("pyspark.daemon") + rss_list("pyspark/daemon")
        row = {"batch": rec.batch, "seconds": round(rec.seconds, 2), "records": rec.records,
               "python_workers_mb": round(sum(workers), 0), "per_python_process_mb": [round(w) for w in sorted(workers)],
               "jvm_mb": round(rss_mb("org.apache.spark.deploy.SparkSubmit"), 0),
               "driver_mb": round(rss_mb("big_state.py"), 0), "checkpoint_mb": round(state_mb, 1)}
        rows.append(row)
        print(f"  {row}", flush=True)

    opts = RunOptions(job_file=str(HERE / "jobs" / "w_count.py"), job_dir=str(job), parallelism=2, until_idle=True,
                      args={"input": str(data), "mode": "vectorized", "sink": "noop"},
                      spark_conf={"spark.sql.execution.arrow.maxRecordsPerBatch": "500000"})
    t = time.perf_counter()
    summary = JobRunner(opts, on_batch).run()
    wall = time.perf_counter() - t
    reports = JobDir(job).read_status()["operators"]["count"]["subtasks"]
    state_keys = sum(s["state_keys"] for s in reports)
    print(f"state keys after the last batch: {state_keys:,}; wall {wall:.1f} s", flush=True)

    extra = data / f"part-{a.files:05d}.parquet"
    shutil.copyfile(data / "part-00000.parquet", extra)
    try:
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "keyscale.cli.main", "run", str(HERE / "jobs" / "w_count.py"), "--job-dir", str(job),
                                 "-p", "4", "--until-idle", "--set", f"input={data}", "--set", "mode=vectorized", "--set", "sink=noop"],
                                stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, cwd=ROOT)
        first = None
        assert proc.stderr is not None
        for line in proc.stderr:
            if f"batch {a.files} committed" in line:
                first = time.perf_counter() - t0
        proc.wait()
    finally:
        extra.unlink()
        (data / "_COMPLETE").write_text(json.dumps({"keys": a.keys, "files": a.files}))
    print(f"restart at P=4 restoring {state_keys:,} keys: first batch {first:.1f} s after launch (JVM start included)")
    out = {"command": "bench/big_state.py " + " ".join(argv or sys.argv[1:]), "batches": rows, "state_keys": state_keys,
           "wall_seconds": wall, "restart_first_batch_s": first, "trigger_seconds": summary.trigger_seconds}
    Path(a.out).write_text(json.dumps(out, indent=1))
    shutil.rmtree(job, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
