"""Event-time windows on workload W-ts (issue 6): keyscale against Spark's own windows, same run.

    .venv/bin/python bench/windows.py --repeats 3          # the benchmark
    .venv/bin/python bench/windows.py --quick              # smoke run on a small workload
    .venv/bin/python bench/windows.py --verify-only        # results equal? (small workload)
    .venv/bin/python bench/windows.py --profile tumbling   # one subtask's Python work, no Spark

keyscale runs from a copy of ``src/keyscale`` taken at start (``--src-commit`` for a
commit's), so edits made by others during a run do not leak into it.

W-ts is workload W (5 Parquet files x 400,000 rows, ``key`` uniform in [0, 100,000), the
same keys as W: file ``i`` draws them from ``seed + i``) plus an event-time column ``ts``:
file ``i`` covers event times ``[T0 + i*5 min, T0 + (i+1)*5 min)``, rising along the file,
each record moved back by a uniform 0-5 s (bounded disorder below the 10 s watermark
delay, so no record is late). One file per micro-batch, so the watermark passes ~5
one-minute windows per batch. Generated deterministically with numpy (no Spark) into
``bench/data/W-ts`` (gitignored), written once.

Per repeat, interleaved so that machine noise hits all alike:

1. Spark ``withWatermark("ts", "10 seconds").groupBy(window("ts", "1 minute"), "key").count()``,
   append mode (each window emitted once, when the watermark passes it: what keyscale does),
   RocksDB state store;
2. keyscale ``TumblingWindows("1 minute")`` count at parallelism 2 (``bench/jobs/w_window.py``);
3. Spark ``groupBy(session_window("ts", "30 seconds"), "key").count()``, same watermark, append;
4. keyscale ``SessionWindows("30 seconds")`` count at parallelism 2 (``bench/jobs/w_window.py``, ``--set window=session``).

All: ``maxFilesPerTrigger=1``, noop sink, local[2], 2 shuffle partitions / parallelism 2,
one Spark session. Each batch is measured by Spark's own ``triggerExecution``; steady
state = median of batches 1..N-1 of a run, then the median over repeats.
"""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _workload import DEFAULT_DATA_ROOT, W_FILES, W_KEYS, W_ROWS_PER_FILE, workload_files  # noqa: E402
from spark_baselines import (  # noqa: E402
    ROCKSDB_PROVIDER,
    _noop_sink,
    _stage_input,
    _tempdir,
    batch_seconds,
    run_available_now,
)

TS_SCHEMA = "key long, v long, ts timestamp"
#: Event time of the first record: 2024-01-01T00:00:00Z (minute-aligned).
T0_MS = 1_704_067_200_000
_MARKER = "_COMPLETE"


# --------------------------------------------------------------------------- pinned source


def pin_source(commit: str | None = None) -> dict[str, Any]:
    """Run keyscale from a private copy of ``src/keyscale`` (driver and Python workers).

    Others edit ``src/`` while benchmarks run; a Python worker started mid-run would
    import whatever is there then. The copy (of the working tree as it is now, or of
    ``commit``) goes first on ``sys.path`` and ``PYTHONPATH``, which the JVM passes to its
    Python workers. Call before anything imports keyscale.
    """
    if "keyscale" in sys.modules:
        raise RuntimeError("pin_source() must run before keyscale is imported")
    repo = HERE.parent

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True).stdout.strip()

    snap = Path(tempfile.mkdtemp(prefix="ks-bench-src-"))
    atexit.register(shutil.rmtree, snap, True)
    if commit:
        archive = subprocess.run(["git", "archive", commit, "src/keyscale"], cwd=repo, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(snap)], input=archive, check=True)
    else:
        shutil.copytree(repo / "src" / "keyscale", snap / "src" / "keyscale", ignore=shutil.ignore_patterns("__pycache__"))
    path = str(snap / "src")
    sys.path.insert(0, path)
    os.environ["PYTHONPATH"] = path + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
    return {
        "head": git("rev-parse", "HEAD"),
        "source": commit or "working tree",
        "uncommitted_in_src": git("status", "--porcelain", "--", "src").splitlines() if not commit else [],
        "path": path,
    }


def check_pinned(spark: Any, pinned: dict[str, Any]) -> list[str]:
    """Where the driver and the Python workers import keyscale from (must be the copy)."""
    import keyscale

    where = spark.sparkContext.parallelize(range(2), 2).map(lambda _: __import__("keyscale").__file__).collect()
    found = sorted({keyscale.__file__, *where})
    if any(not f.startswith(pinned["path"]) for f in found):
        raise RuntimeError(f"keyscale is not imported from the pinned copy {pinned['path']}: {found}")
    return found


# --------------------------------------------------------------------------- workload W-ts


def ensure_ts_workload(
    root: Path,
    name: str = "W-ts",
    files: int = W_FILES,
    rows_per_file: int = W_ROWS_PER_FILE,
    keys: int = W_KEYS,
    seed: int = 0,
    span_ms: int = 300_000,
    disorder_ms: int = 5_000,
) -> Path:
    """Create ``root/name`` (W's rows plus ``ts``) unless it exists complete; return its path.

    Row ``j`` of file ``i`` has ``key`` as in W, ``v = 1`` and
    ``ts = T0 + i*span + floor(j*span/rows) - U[0, disorder)`` (ms, UTC). The ``_COMPLETE``
    marker holds the parameters and a few shape statistics.
    """
    root = Path(root)
    target = root / name
    params = {
        "files": files, "rows_per_file": rows_per_file, "keys": keys, "seed": seed, "span_ms": span_ms,
        "disorder_ms": disorder_ms, "t0_ms": T0_MS, "schema": TS_SCHEMA,
    }
    marker = target / _MARKER
    if marker.exists():
        have = json.loads(marker.read_text())
        if have.get("params") != params:
            raise ValueError(f"workload {target} exists with parameters {have.get('params')}, requested {params}")
        if len(workload_files(target)) == files:
            return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root))
    try:
        schema = pa.schema([("key", pa.int64()), ("v", pa.int64()), ("ts", pa.timestamp("us", tz="UTC"))])
        ones = pa.array(np.ones(rows_per_file, dtype=np.int64))
        all_keys, all_ts = [], []
        for i in range(files):
            key = np.random.default_rng(seed + i).integers(0, keys, size=rows_per_file, dtype=np.int64)  # = W
            jitter = np.random.default_rng(10_000 + seed + i).integers(0, disorder_ms, size=rows_per_file, dtype=np.int64)
            ts = T0_MS + i * span_ms + (np.arange(rows_per_file, dtype=np.int64) * span_ms) // rows_per_file - jitter
            table = pa.Table.from_arrays([pa.array(key), ones, pa.array(ts * 1000, type=pa.int64()).cast(schema.field("ts").type)], schema=schema)
            pq.write_table(table, tmp / f"part-{i:05d}.parquet")
            all_keys.append(key)
            all_ts.append(ts)
        now = time.time()
        for i in range(files):  # Spark reads oldest first: make that the name order
            t = now - (files - i)
            os.utime(tmp / f"part-{i:05d}.parquet", (t, t))
        stats = _shape(np.concatenate(all_keys), np.concatenate(all_ts), span_ms, rows_per_file)
        (tmp / _MARKER).write_text(json.dumps({"params": params, "shape": stats}, indent=1, sort_keys=True))
        tmp.chmod(0o755)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _shape(key: np.ndarray, ts: np.ndarray, span_ms: int, rows_per_file: int) -> dict[str, Any]:
    """How many (key, minute) windows and 30 s sessions the data holds (all of it)."""
    minute = (ts - T0_MS) // 60_000
    windows = len(np.unique(key * 10_000 + minute))
    order = np.lexsort((ts, key))
    k, t = key[order], ts[order]
    new = np.concatenate([[True], (k[1:] != k[:-1]) | (t[1:] - t[:-1] > 30_000)])
    sessions = int(new.sum())
    sizes = np.diff(np.append(np.flatnonzero(new), len(k)))
    return {
        "records": len(key), "distinct_keys": len(np.unique(key)), "minute_windows": windows,
        "records_per_minute_window": len(key) / windows, "sessions_30s": sessions,
        "records_per_session": len(key) / sessions, "single_record_sessions": float(np.mean(sizes == 1)),
        "largest_session": int(sizes.max()), "records_per_key_per_file": rows_per_file / len(np.unique(key)),
    }


def shape_of(data: Path) -> dict[str, Any]:
    return dict(json.loads((Path(data) / _MARKER).read_text())["shape"])


# --------------------------------------------------------------------------- Spark side


def _ts_source(spark: Any, input_dir: Path) -> Any:
    return spark.readStream.format("parquet").schema(TS_SCHEMA).option("maxFilesPerTrigger", 1).load(str(input_dir))


def _run_spark(df: Any, checkpoint: Path, output_mode: str, sink: Any = _noop_sink) -> dict[str, Any]:
    """Run until all input is processed; per batch with input: triggerExecution and state metrics."""
    progress, wall = run_available_now(df, checkpoint, output_mode, sink)
    batches = [p for p in progress if p.numInputRows > 0]
    ops = [p.stateOperators[0] if p.stateOperators else None for p in batches]
    return {
        "batch_seconds": batch_seconds(batches),
        "add_batch_seconds": [p.durationMs.get("addBatch", 0) / 1000.0 for p in batches],
        "batch_rows": [p.numInputRows for p in batches],
        "state_rows": [int(o.numRowsTotal) if o else None for o in ops],
        "state_rows_removed": [int(o.numRowsRemoved) if o else None for o in ops],
        "dropped_by_watermark": [int(o.numRowsDroppedByWatermark) if o else None for o in ops],
        "no_data_batches": len(progress) - len(batches),
        "wall_seconds": wall,
        "rows": int(sum(p.numInputRows for p in batches)),
    }


def spark_windows(spark: Any, data: Path, kind: str, size: str = "1 minute", gap: str = "30 seconds",
                  delay: str = "10 seconds", output_mode: str = "append", sink: Any = _noop_sink) -> dict[str, Any]:
    """Spark's native tumbling window (``kind="tumbling"``) or session window count per key."""
    from pyspark.sql import functions as F

    with _tempdir("ks-win-spark-") as tmp:
        _stage_input(Path(data), tmp / "in")
        src = _ts_source(spark, tmp / "in").withWatermark("ts", delay)
        w = F.window("ts", size) if kind == "tumbling" else F.session_window("ts", gap)
        df = src.groupBy(w, "key").count()
        return _run_spark(df, tmp / "ckpt", output_mode, sink)


# --------------------------------------------------------------------------- keyscale side


def keyscale_windows(data: Path, kind: str, parallelism: int = 2, extra: dict[str, str] | None = None) -> dict[str, Any]:
    from keyscale.runtime.driver.runner import JobRunner, RunOptions

    tmp = Path(tempfile.mkdtemp(prefix="ks-win-bench-"))
    try:
        opts = RunOptions(
            job_file=str(HERE / "jobs" / "w_window.py"), job_dir=str(tmp / "job"), parallelism=parallelism, until_idle=True,
            args={"input": str(data), "sink": "noop", "window": kind, **(extra or {})},
        )
        t = time.perf_counter()
        s = JobRunner(opts).run()
        wall = time.perf_counter() - t
        return {
            "batch_seconds": s.trigger_seconds, "driver_batch_seconds": [b.seconds for b in s.batches],
            "emitted": [b.emitted for b in s.batches], "wall_seconds": wall, "rows": s.records,
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------- verification


def verify(spark: Any, data: Path) -> dict[str, Any]:
    """Same results? Both systems write their windows; compare those both have closed.

    keyscale (``until_idle``) fires what the watermark of its last batch passes; Spark also
    runs a no-data batch at the end. The comparison covers windows ending at or before the
    smaller of the two largest ``window_end`` s (everything both have emitted by then).
    """
    from pyspark.sql import functions as F

    from keyscale.runtime.driver.runner import JobRunner, RunOptions

    out: dict[str, Any] = {}
    for kind in ("tumbling", "session"):
        with _tempdir("ks-win-verify-") as tmp:
            spark_out = tmp / "spark"

            def to_parquet(df: Any, batch_id: int, path: Path = spark_out) -> None:
                df.write.mode("append").parquet(str(path))

            spark_windows(spark, data, kind, sink=to_parquet)
            col = "window" if kind == "tumbling" else "session_window"
            s = spark.read.parquet(str(spark_out)).select(
                "key", F.col(f"{col}.start").alias("start"), F.col(f"{col}.end").alias("end"), F.col("count"))
            JobRunner(RunOptions(job_file=str(HERE / "jobs" / "w_window.py"), job_dir=str(tmp / "job"), parallelism=2, until_idle=True,
                                 args={"input": str(data), "sink": "parquet", "output": str(tmp / "ks"), "window": kind})).run()
            k = spark.read.parquet(str(tmp / "ks")).select(
                "key", F.col("window_start").alias("start"), F.col("window_end").alias("end"), F.col("count"))
            bound = min(s.agg(F.max("end")).first()[0], k.agg(F.max("end")).first()[0])
            s, k = s.where(F.col("end") <= bound), k.where(F.col("end") <= bound)
            ns, nk = s.count(), k.count()
            only_s, only_k = s.exceptAll(k).count(), k.exceptAll(s).count()
            out[kind] = {"bound": str(bound), "spark_rows": ns, "keyscale_rows": nk, "only_spark": only_s, "only_keyscale": only_k,
                         "equal": only_s == 0 and only_k == 0}
            print(f"verify {kind}: {out[kind]}", flush=True)
    return out


# --------------------------------------------------------------------------- profile


def profile(data: Path, kind: str, batches: int | None = None, profile_batch: int = 3, top: int = 25) -> dict[str, Any]:
    """One subtask's Python work per batch, without Spark: ``run_subtask`` on W-ts's records.

    Subtask 0 of 2 at 128 key groups gets the even keys (~200,000 records over ~50,000 keys
    per file) in key groups ``(key // 2) % 64``, in a random arrival order; the watermark of
    batch ``b`` trails the largest event time of batches ``< b`` by 10 s, as in the driver.
    Prints the seconds of each batch and a cProfile of batch ``profile_batch``.
    """
    import cProfile
    import io
    import pstats

    from keyscale.checkpoint.manifest import live_files
    from keyscale.operators.eventtime import NO_WATERMARK
    from keyscale.operators.vectorized import Agg
    from keyscale.operators.windows import (
        WINDOW_START,
        SessionWindows,
        TumblingWindows,
        WindowAggregate,
    )
    from keyscale.runtime.task.keyed import StageTask, run_subtask

    ts_type = pa.timestamp("us", tz="UTC")
    types = {"key": pa.int64(), "v": pa.int64(), "ts": ts_type}
    assigner = TumblingWindows("1 minute") if kind == "tumbling" else SessionWindows("30 seconds")
    fn = WindowAggregate(assigner, {"count": Agg("count")}, ["key"], types, "ts", 0)
    input_schema = pa.schema(list(types.items()))
    output_schema = pa.schema([("key", pa.int64()), *fn.output_fields()])
    job_dir = tempfile.mkdtemp(prefix="ks-win-profile-")
    rng = np.random.default_rng(0)
    files: tuple[Any, ...] = ()
    wm, max_seen = NO_WATERMARK, NO_WATERMARK
    out: dict[str, Any] = {"kind": kind, "batches": []}
    try:
        paths = workload_files(data)[: batches or None]
        for b, path in enumerate(paths):
            t = pq.read_table(path)
            t = t.filter(pa.array(t.column("key").to_numpy() % 2 == 0))
            n = t.num_rows
            keys = t.column("key").to_numpy()
            batch = pa.RecordBatch.from_arrays(
                [t.column("key").combine_chunks(), t.column("v").combine_chunks(), t.column("ts").combine_chunks(),
                 pa.array(rng.permutation(n) + b * 10**7), pa.array(((keys // 2) % 64).astype(np.int32))],
                names=["key", "v", "ts", "__seq", "__kg"],
            )
            spec = StageTask(
                job_dir=job_dir, run_id="profile", uid="w", function=fn, key_names=("key",), key_types=(pa.int64(),),
                input_schema=input_schema, output_schema=output_schema, states=tuple(fn.state_descriptors()),
                null_keys="error", max_parallelism=128, parallelism=2, batch_id=b, batch_time_ms=0, committed=b - 1,
                files=files, compact=(False, False), watermark_ms=wm, event_time="ts", extra_keys=((WINDOW_START, pa.int64()),),
            )
            prof = cProfile.Profile() if b == profile_batch else None
            t0 = time.perf_counter()
            if prof:
                prof.enable()
            res, report = run_subtask(spec, iter([batch]), 0)
            if prof:
                prof.disable()
            secs = time.perf_counter() - t0
            files = tuple(live_files([*files, report.file], 128)) if report.file else files
            max_seen = max(max_seen, int(report.max_event_ms))
            wm = max(wm, max_seen - 10_000 - 1)
            from keyscale.runtime.task.memory import _HELD

            held = next(iter(_HELD.values()))
            info = {"batch": b, "records": n, "seconds": round(secs, 3), "emitted": res.num_rows,
                    "table_rows": len(held.table), "live_rows": report.state_keys, "fired": report.windows_fired,
                    "purged": report.windows_purged, "profiled": prof is not None}
            out["batches"].append(info)
            print(f"profile {kind}: {info}", flush=True)
            if prof:
                buf = io.StringIO()
                pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(top)
                out["cprofile"] = buf.getvalue()
                print(out["cprofile"], flush=True)
    finally:
        shutil.rmtree(job_dir, ignore_errors=True)
        from keyscale.runtime.task.memory import _HELD

        _HELD.clear()
    return out


# --------------------------------------------------------------------------- main


def steady(r: dict[str, Any]) -> float:
    xs = r["batch_seconds"][1:]
    return statistics.median(xs) if xs else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="small workload (3 files x 100,000 rows, 25,000 keys), 1 repeat")
    ap.add_argument("--verify", action="store_true", help="first check that both sides compute the same windows (small workload)")
    ap.add_argument("--verify-only", action="store_true")
    ap.add_argument("--skip-sessions", action="store_true")
    ap.add_argument("--no-warmup", action="store_true", help="skip the untimed run of every system on the small workload")
    ap.add_argument("--profile", choices=["tumbling", "session"], help="profile one subtask's Python work (no Spark) and exit")
    ap.add_argument("--src-commit", default=None, help="benchmark keyscale as of this commit (default: the working tree at start)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    pinned = pin_source(a.src_commit)
    print(f"keyscale from a copy of the {pinned['source']} (HEAD {pinned['head'][:10]}, uncommitted in src: {len(pinned['uncommitted_in_src'])})", flush=True)
    logging.getLogger("keyscale").setLevel(logging.ERROR)  # not the noop sink's "not exactly-once" warning
    if a.profile:
        r = profile(ensure_ts_workload(DEFAULT_DATA_ROOT), a.profile)  # keyscale of the pinned copy
        Path(a.out or HERE / "out" / f"windows_profile_{a.profile}.json").write_text(json.dumps(r, indent=1))
        return 0
    from keyscale.runtime.driver.session import spark_session

    small = dict(name="W-ts-small", files=3, rows_per_file=100_000, keys=25_000)
    data = ensure_ts_workload(DEFAULT_DATA_ROOT, **small) if a.quick else ensure_ts_workload(DEFAULT_DATA_ROOT)  # type: ignore[arg-type]
    repeats = 1 if a.quick and a.repeats == 3 else a.repeats
    spark = spark_session("local[2]", "keyscale-bench", {"spark.sql.streaming.stateStore.providerClass": ROCKSDB_PROVIDER})
    result: dict[str, Any] = {"command": " ".join(["bench/windows.py", *(sys.argv[1:] if argv is None else argv)]),
                              "data": str(data), "shape": shape_of(data), "load_before": os.getloadavg(), "source": pinned,
                              "keyscale_imported_from": check_pinned(spark, pinned)}
    if a.verify or a.verify_only:
        result["verify"] = verify(spark, ensure_ts_workload(DEFAULT_DATA_ROOT, **small))  # type: ignore[arg-type]
        if a.verify_only:
            print(json.dumps(result["verify"], indent=1))
            return 0 if all(v["equal"] for v in result["verify"].values()) else 1

    systems: dict[str, Any] = {
        "spark tumbling": lambda: spark_windows(spark, data, "tumbling"),
        "keyscale tumbling": lambda: keyscale_windows(data, "tumbling"),
    }
    if not a.skip_sessions:
        systems["spark session"] = lambda: spark_windows(spark, data, "session")
        systems["keyscale session"] = lambda: keyscale_windows(data, "session")
    if not a.no_warmup:  # JVM JIT, Python workers and imports warm for everyone; not measured
        small_data = ensure_ts_workload(DEFAULT_DATA_ROOT, **small)  # type: ignore[arg-type]
        for kind in ("tumbling", "session"):
            spark_windows(spark, small_data, kind)
            keyscale_windows(small_data, kind)
        print("warm-up done", flush=True)
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in systems}
    for rep in range(repeats):
        for name, fn in systems.items():
            load = os.getloadavg()[0]
            r = fn()
            r["load_1min_before"] = load
            runs[name].append(r)
            print(f"repeat {rep + 1}/{repeats}: {name:18} steady {steady(r):5.2f} s  batches {[round(x, 2) for x in r['batch_seconds']]}"
                  f"  wall {r['wall_seconds']:.1f} s  load {load:.1f}", flush=True)
    result["load_after"] = os.getloadavg()

    rows_per_batch = json.loads((Path(data) / _MARKER).read_text())["params"]["rows_per_file"]
    table: dict[str, Any] = {}
    for name, rs in runs.items():
        med = statistics.median(steady(r) for r in rs)
        table[name] = {"steady_batch_s": med, "rows_per_s": rows_per_batch / med, "per_repeat_steady_s": [steady(r) for r in rs], "runs": rs}
    print(f"\n{'system':20} {'steady batch':>12} {'rows/s':>10}   per repeat")
    for name, t in table.items():
        print(f"{name:20} {t['steady_batch_s']:11.2f}s {t['rows_per_s']:10,.0f}   {[round(x, 2) for x in t['per_repeat_steady_s']]}")
    ratios = {}
    for kind in ("tumbling", "session"):
        if f"spark {kind}" in table:
            ratio = table[f"keyscale {kind}"]["rows_per_s"] / table[f"spark {kind}"]["rows_per_s"]
            per_rep = [s / k for s, k in zip(table[f"spark {kind}"]["per_repeat_steady_s"], table[f"keyscale {kind}"]["per_repeat_steady_s"], strict=True)]
            ratios[kind] = {"ratio_of_medians": ratio, "per_repeat": per_rep, "median_of_per_repeat": statistics.median(per_rep)}
            print(f"keyscale / Spark, {kind}: {ratio:.2f}x (ratio of medians); per repeat {[round(x, 2) for x in per_rep]}, "
                  f"median {statistics.median(per_rep):.2f}x")
    result.update({"rows_per_batch": rows_per_batch, "systems": table, "ratios": ratios})
    out = Path(a.out or HERE / "out" / ("windows_quick.json" if a.quick else "windows.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
