"""10M keys of state in one job on this machine.

    .venv/bin/python bench/big_state.py [--keys 10000000] [--files 5] [--backend memory|rocksdb]
    .venv/bin/python bench/big_state.py --in-process [--key-type long|string] [--keys N] [--files 5]
    .venv/bin/python bench/big_state.py --bootstrap --keys 100000000 [--files 4] [--backend rocksdb]

Input: ``--files`` Parquet files, each with ``keys/files`` new distinct keys (so the state
grows to ``--keys`` keys) plus the same number of updates to random earlier keys. The
vectorized running count at P=2; reported per batch: time, state keys, and the resident
memory of the Spark driver, its JVM and the Python workers; at the end the checkpoint size
and a restart (new process) at P=4 until its first batch (restoring all keys from files).

``--in-process``: no Spark. This process plays one Python worker that runs every subtask
of every batch through the keyed task's own code (``run_subtask``: grouping, the
vectorized count, the state table, delta files on local disk); ``--key-type string``
makes the keys ``k<n>``. ``--backend rocksdb``: the keyed stage keeps its state in RocksDB
on local disk (issue 15) instead of the workers' memory. Reported: the process's RSS after each batch, and at the end the
state table's bytes per key by part (key columns, Python objects behind them, key groups,
values, validity, lookup index) and the RSS over the process's RSS before the first batch.

``--bootstrap``: the state of ``--keys`` keys (count 1 each) is written by Spark as a
savepoint (``write_savepoint_from_dataframes`` over ``spark.range``), not built batch by
batch, which at 100M keys would take hours here. The job starts from it at P=2 and reads
``--files`` files of 4M records (2M new keys, 2M updates of existing ones); after the
second file it is rescaled live to P=4. Reported per batch as above; then a savepoint of
the last checkpoint and a new process at P=4 restored from it, with one more file, until
its first batch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from keyscale.checkpoint.jobdir import JobDir  # noqa: E402
from keyscale.runtime.driver.runner import BatchRecord, JobRunner, RunOptions  # noqa: E402


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


def workers_rss_list() -> list[float]:
    """Resident memory (MB) of this run's Python daemon and workers."""
    return rss_list("pyspark.daemon") + rss_list("pyspark/daemon")


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


def _self_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _release_free_memory() -> None:
    """Hand memory freed by the allocators back to the system (glibc's heap, Arrow's pool),
    so that what RSS shows after it is memory in use."""
    import contextlib
    import ctypes
    import gc

    gc.collect()
    pa.default_memory_pool().release_unused()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def table_breakdown(table: Any) -> dict[str, int]:
    """Bytes of a KeyedStateTable by part; also for the table before issue 15 (numpy and
    object key columns, a pandas index), so that one command measures both."""
    from keyscale.state.factorize import make_index

    if hasattr(table, "memory"):
        parts: dict[str, int] = dict(table.memory())
        keys = list(getattr(table, "_keys", []))
    else:
        keys = list(table.keys)
        table.positions(make_index([k[:1] for k in keys]))  # its lookup index is built at the first lookup after a change
        lookup = table._lookup
        shared = lookup is not None and any(np.shares_memory(np.asarray(lookup), a) for a in [*keys, table._hashes])
        index = (lookup.memory_usage() - (lookup.nbytes if shared else 0) if lookup is not None else 0) + table._hashes.nbytes
        parts = {"keys": sum(k.nbytes for k in keys), "kg": table.kg.nbytes, "values": sum(v.nbytes for v in table.values.values()),
                 "valid": sum(v.nbytes for v in table.valid.values()), "index": int(index)}
    parts["python objects of keys"] = sum(sys.getsizeof(v) for k in keys if isinstance(k, np.ndarray) and k.dtype == object for v in k)
    return parts


def in_process(keys: int, files: int, key_type: str, parallelism: int, data: Path, backend: str = "memory") -> dict[str, Any]:
    """Every subtask of every batch through ``run_subtask`` in this process (see module doc)."""
    import pyarrow.compute as pc

    import keyscale.runtime.task.keyed as task
    from keyscale.checkpoint.manifest import StateFile, live_files
    from keyscale.operators.vectorized import RunningAggregate
    from keyscale.operators.vectorized import sum as ksum
    from keyscale.runtime.task.keyed import KG, SEQ, StageTask, run_subtask
    from keyscale.state.keygroups import key_group_range
    from keyscale.storage import LocalStore

    m = 128
    ktype = pa.int64() if key_type == "long" else pa.string()
    schema = pa.schema([("key", ktype), ("v", pa.int64())])
    fn = RunningAggregate({"count": ksum("v")}, ["key"], {"key": ktype, "v": pa.int64()})
    out_schema = pa.schema([schema.field("key"), *fn.output_fields()])
    job = HERE / "out" / "big_state_in_process"
    shutil.rmtree(job, ignore_errors=True)
    live: list[StateFile] = []
    seq = 0
    rows = []
    _release_free_memory()
    base = _self_rss_mb()
    print(f"in-process, {key_type} keys, P={parallelism}: RSS before the first batch {base:.0f} MB", flush=True)
    for b in range(files):
        t0, c0 = time.perf_counter(), time.process_time()
        part = pq.read_table(data / f"part-{b:05d}.parquet")
        k = part.column("key").to_numpy()
        kg = ((k.view(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(57)).astype(np.int32)  # any fixed spread over 128 groups
        col: Any = pa.array(k) if key_type == "long" else pc.binary_join_element_wise("k", pc.cast(pa.array(k), pa.string()), "")
        full = pa.table({"key": col, "v": part.column("v"), SEQ: np.arange(seq, seq + len(k)), KG: kg})
        seq += len(k)
        spec = StageTask(store=LocalStore(job), run_id="bench", uid="count", function=fn, key_names=("key",), key_types=(ktype,),
                         input_schema=schema, output_schema=out_schema, states=tuple(fn.state_descriptors()), null_keys="error",
                         max_parallelism=m, parallelism=parallelism, batch_id=b, batch_time_ms=1_700_000_000_000 + b,
                         committed=b - 1, files=tuple(live), compact=(False,) * parallelism, state_backend=backend)
        new = []
        for i in range(parallelism):
            rng = key_group_range(i, m, parallelism)
            mine = full.filter(pa.array((kg >= rng.start) & (kg <= rng.end)))
            _, report = run_subtask(spec, iter(mine.to_batches(max_chunksize=500_000)), i)
            if report["file"]:
                new.append(StateFile.from_json(report["file"]))
            del mine
        live = live_files([*live, *new], m)
        del part, k, kg, col, full
        seconds = time.perf_counter() - t0
        held = sum(len(h.table) for h in task._HELD.values())
        # CPU seconds too: on a machine shared with other jobs, wall time is mostly waiting.
        row: dict[str, Any] = {"batch": b, "seconds": round(seconds, 2), "cpu_seconds": round(time.process_time() - c0, 2), "held_keys": held, "rss_mb": round(_self_rss_mb()), "rss_over_start_mb": round(_self_rss_mb() - base)}
        rows.append(row)
        print(f"  {row}", flush=True)
    if backend != "memory":  # no table to break down: the state is on disk
        from keyscale.runtime.task.rocks import RocksSession

        # What a subtask whose database holds nothing pays for its range: the files read into RocksDB.
        spec = dataclasses.replace(spec, batch_id=files, committed=files - 1, files=tuple(live), run_id="bench-reload")
        reload_s = []
        for i in range(parallelism):
            t0 = time.perf_counter()
            session = RocksSession(spec, key_group_range(i, m, parallelism), i)
            session.obtain(spec.input_schema.append(pa.field(SEQ, pa.int64())).append(pa.field(KG, pa.int32())).empty_table())
            session.finish(spec.batch_id)
            session.close()
            reload_s.append(round(time.perf_counter() - t0, 2))
        print(f"an empty database loads each range in {reload_s} s ({len(live)} files)", flush=True)
        summary = {"keys": keys, "key_type": key_type, "backend": backend, "seconds_per_batch": [r["seconds"] for r in rows],
                   "cpu_seconds_per_batch": [r["cpu_seconds"] for r in rows],
                   "rss_over_start_mb": rows[-1]["rss_over_start_mb"], "full_reload_seconds_per_range": reload_s}
        print(json.dumps(summary, indent=1), flush=True)
        shutil.rmtree(job, ignore_errors=True)
        return {"batches": rows, **summary}
    (held_state,) = task._HELD.values()
    parts = table_breakdown(held_state.table)
    n = len(held_state.table)
    rss_end = _self_rss_mb() - base
    _release_free_memory()
    rss_released = _self_rss_mb() - base
    # What a worker that holds nothing pays for a range: its files read and applied.
    spec = dataclasses.replace(spec, batch_id=files, committed=files - 1, files=tuple(live))
    reload_s = []
    for i in range(parallelism):
        task._HELD.clear()
        t0 = time.perf_counter()
        task.obtain_state(spec, key_group_range(i, m, parallelism))
        reload_s.append(round(time.perf_counter() - t0, 2))
    print(f"a fresh worker loads each range in {reload_s} s ({len(live)} files)", flush=True)
    summary = {
        "keys": n, "key_type": key_type,
        "bytes_per_key": {name: round(v / n, 1) for name, v in parts.items()},
        "table_bytes_per_key": round(sum(parts.values()) / n, 1),
        "rss_over_start_bytes_per_key": round(rss_end * 2**20 / n, 1),
        "rss_over_start_after_release_bytes_per_key": round(rss_released * 2**20 / n, 1),
        "seconds_per_batch": [r["seconds"] for r in rows],
        "cpu_seconds_per_batch": [r["cpu_seconds"] for r in rows],
        "full_reload_seconds_per_range": reload_s,
    }
    print(json.dumps(summary, indent=1), flush=True)
    shutil.rmtree(job, ignore_errors=True)
    return {"batches": rows, **summary}


def make_update_input(folder: Path, existing: int, files: int, per_file: int) -> None:
    """``files`` files of ``per_file`` records: half new keys (from ``existing`` on), half
    updates of random keys below ``existing``."""
    marker = folder / "_COMPLETE"
    want = {"existing": existing, "files": files, "per_file": per_file}
    if marker.exists() and json.loads(marker.read_text()) == want:
        return
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    rng = np.random.default_rng(2)
    half = per_file // 2
    for i in range(files):
        new = np.arange(existing + i * half, existing + (i + 1) * half, dtype=np.int64)
        k = rng.permutation(np.concatenate([new, rng.integers(0, existing, half).astype(np.int64)]))
        path = folder / f"part-{i:05d}.parquet"
        pq.write_table(pa.table({"key": k, "v": np.ones(len(k), dtype=np.int64)}), path)
        os.utime(path, (1_700_000_000 + i, 1_700_000_000 + i))
    marker.write_text(json.dumps(want))


def bootstrapped(keys: int, files: int, backend: str, per_file: int = 4_000_000) -> dict[str, Any]:
    """``--bootstrap`` (module doc): start from a savepoint of ``keys`` keys, rescale live, restore."""
    from pyspark.sql import functions as F

    from keyscale.checkpoint.savepoint import write_savepoint
    from keyscale.runtime.driver.session import spark_session
    from keyscale.state_processor.bootstrap import write_savepoint_from_dataframes

    root = HERE / "out" / "big_bootstrap"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    data = HERE / "data" / f"big-updates-{keys}-{files}x{per_file}"
    make_update_input(data, keys, files + 1, per_file)  # the last one for the restored job
    inp = root / "in"
    inp.mkdir()
    parts = sorted(data.glob("part-*.parquet"))
    for f in parts[:files]:
        os.link(f, inp / f.name)
    conf = {"spark.sql.execution.arrow.maxRecordsPerBatch": "500000"}
    spark = spark_session("local[2]", conf=conf)
    t = time.perf_counter()
    state = spark.range(keys).select(F.col("id").alias("key"), F.lit(1).cast("long").alias("count"))
    sp = write_savepoint_from_dataframes(str(root / "sp"), "w_count", {"count": (state, ["key"], {"count": "long"})}, 128)
    bootstrap_s = time.perf_counter() - t
    print(f"savepoint of {keys:,} keys written by Spark in {bootstrap_s:.1f} s", flush=True)

    job = JobDir(root / "job")
    rows: list[dict[str, Any]] = []

    # The Python workers' peak RSS within each batch (sampled every 0.5 s): a batch's
    # working set, a restore or a snapshot may take more than what is left after it.
    peak = [0.0]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.5):
            peak[0] = max(peak[0], sum(workers_rss_list()))

    threading.Thread(target=sample, daemon=True).start()

    def on_batch(rec: BatchRecord) -> None:
        workers = workers_rss_list()
        row = {"batch": rec.batch, "seconds": round(rec.seconds, 2), "records": rec.records, "parallelism": rec.parallelism.get("count"),
               "python_workers_mb": round(sum(workers)), "python_workers_peak_mb": round(max(peak[0], sum(workers))), "per_python_process_mb": [round(w) for w in sorted(workers)],
               "jvm_mb": round(rss_mb("org.apache.spark.deploy.SparkSubmit"))}
        peak[0] = 0.0
        rows.append(row)
        print(f"  {row}", flush=True)
        if rec.batch == 1:
            job.request_rescale(4)

    opts = RunOptions(job_file=str(HERE / "jobs" / "w_count.py"), job_dir=str(job.path), parallelism=2, until_idle=True,
                      args={"input": str(inp), "mode": "vectorized", "sink": "noop"}, spark_conf=conf, state_backend=backend,
                      from_savepoint=sp)
    t = time.perf_counter()
    summary = JobRunner(opts, on_batch).run()
    wall = time.perf_counter() - t
    done.set()
    manifest = job.latest_manifest()
    assert manifest is not None
    t = time.perf_counter()
    sp2 = write_savepoint(job, manifest, str(root / "sp2"))
    savepoint_s = time.perf_counter() - t
    print(f"savepoint of the last checkpoint: {savepoint_s:.1f} s", flush=True)

    os.link(parts[files], inp / parts[files].name)
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "keyscale.cli.main", "run", str(HERE / "jobs" / "w_count.py"), "--job-dir", str(root / "job2"),
                             "-p", "4", "--until-idle", "--from-savepoint", sp2, "--set", f"input={inp}", "--set", "mode=vectorized",
                             "--set", "sink=noop", "--state-backend", backend],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, cwd=ROOT)
    first = None
    assert proc.stderr is not None
    said = []
    for line in proc.stderr:
        said.append(line)
        if first is None and " committed in " in line:
            first = time.perf_counter() - t0
            proc.terminate()  # the first batch is what is measured
    if proc.wait() not in (0, -15) or first is None:
        raise RuntimeError("the restore failed:\n" + "".join(said[-30:]))
    print(f"restore at P=4 from the savepoint: first batch {first} s after launch (JVM start included)", flush=True)
    out = {"keys": keys, "backend": backend, "bootstrap_seconds": bootstrap_s, "batches": rows, "wall_seconds": wall,
           "trigger_seconds": summary.trigger_seconds, "rescales": [list(r) for r in summary.rescales],
           "savepoint_seconds": savepoint_s, "restore_first_batch_s": first}
    shutil.rmtree(root, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, default=10_000_000)
    ap.add_argument("--files", type=int, default=5)
    ap.add_argument("--out", default=str(HERE / "out" / "big_state.json"))
    ap.add_argument("--in-process", action="store_true", help="no Spark: the keyed task's code in this process (see module doc)")
    ap.add_argument("--key-type", choices=["long", "string"], default="long", help="with --in-process")
    ap.add_argument("--parallelism", type=int, default=2, help="with --in-process")
    ap.add_argument("--backend", choices=["memory", "rocksdb"], default="memory", help="the keyed stage's state backend")
    ap.add_argument("--bootstrap", action="store_true", help="state of --keys keys from a savepoint Spark writes (see module doc)")
    ap.add_argument("--records-per-file", type=int, default=4_000_000, help="with --bootstrap")
    a = ap.parse_args(argv)
    logging.getLogger("keyscale").setLevel(logging.WARNING)
    if a.bootstrap:
        result = bootstrapped(a.keys, a.files, a.backend, a.records_per_file)
        Path(a.out).write_text(json.dumps({"command": "bench/big_state.py " + " ".join(argv or sys.argv[1:]), **result}, indent=1))
        return 0
    data = HERE / "data" / f"big-{a.keys}"
    print(f"generating input: {a.keys:,} keys over {a.files} files ...", flush=True)
    make_input(data, a.keys, a.files)
    if a.in_process:
        result = in_process(a.keys, a.files, a.key_type, a.parallelism, data, a.backend)
        Path(a.out).write_text(json.dumps({"command": "bench/big_state.py " + " ".join(argv or sys.argv[1:]), **result}, indent=1))
        return 0
    job = HERE / "out" / "big_state_job"
    shutil.rmtree(job, ignore_errors=True)
    rows = []

    def on_batch(rec: BatchRecord) -> None:
        m = JobDir(job).latest_manifest()
        assert m is not None
        state_mb = sum(f.bytes for f in m.operators["count"].files) / 1e6
        workers = workers_rss_list()
        # Key groups the subtasks loaded from files (not warm in the worker that ran them).
        subtasks = (JobDir(job).read_status() or {}).get("operators", {}).get("count", {}).get("subtasks", [])
        loaded = sum(t.get("loaded_key_groups", 0) for t in subtasks)
        row = {"batch": rec.batch, "seconds": round(rec.seconds, 2), "records": rec.records,
               "python_workers_mb": round(sum(workers), 0), "per_python_process_mb": [round(w) for w in sorted(workers)],
               "jvm_mb": round(rss_mb("org.apache.spark.deploy.SparkSubmit"), 0),
               "driver_mb": round(rss_mb("big_state.py"), 0), "checkpoint_mb": round(state_mb, 1),
               "loaded_key_groups": loaded}
        rows.append(row)
        print(f"  {row}", flush=True)

    opts = RunOptions(job_file=str(HERE / "jobs" / "w_count.py"), job_dir=str(job), parallelism=2, until_idle=True,
                      args={"input": str(data), "mode": "vectorized", "sink": "noop"},
                      spark_conf={"spark.sql.execution.arrow.maxRecordsPerBatch": "500000"}, state_backend=a.backend)
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
                                 "-p", "4", "--until-idle", "--set", f"input={data}", "--set", "mode=vectorized", "--set", "sink=noop",
                                 "--state-backend", a.backend],
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
