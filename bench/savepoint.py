"""Savepoint and restore at 1M and 10M keys, against exporting the same state from Spark.

    .venv/bin/python bench/savepoint.py [--sizes 1M,10M]

Per size: the running count (vectorized) builds its state at P=2 (1M: W-1M's 5 files,
~865k keys; 10M: bench/big_state.py's input, 10M keys). Then, timed:
- keyscale savepoint of the stopped job (canonical Parquet + metadata);
- keyscale restore of it at P=4: a new `keyscale run --from-savepoint -p 4` process, from
  launch to its first committed batch (one more input file), JVM start included;
- Spark: the same count as a native streaming aggregation with RocksDB state, then its
  state exported with the state data source (`spark.read.format("statestore")`) to
  Parquet. Spark has no way to load state back (the data source only reads), so there is
  no restore to compare; its offline repartition + restart is in bench/rescale.py.
PyFlink (apache-flink) is not installed by this project; its figures in ANCHORS.md come
from another run and are quoted, not measured here.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from _workload import DEFAULT_DATA_ROOT, ensure_workload  # noqa: E402
from big_state import make_input  # noqa: E402
from spark_baselines import ROCKSDB_PROVIDER, _native_agg_df, _run_available  # noqa: E402

from keyscale.checkpoint.jobdir import JobDir  # noqa: E402
from keyscale.checkpoint.savepoint import write_savepoint  # noqa: E402
from keyscale.runtime.driver.runner import JobRunner, RunOptions  # noqa: E402
from keyscale.runtime.driver.session import spark_session  # noqa: E402


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def one_size(label: str, data: Path, tmp: Path) -> dict[str, Any]:
    inp = tmp / "in"
    inp.mkdir()
    files = sorted(data.glob("part-*.parquet"))
    for f in files:
        os.link(f, inp / f.name)
    args = {"input": str(inp), "mode": "vectorized", "sink": "noop"}
    job = JobDir(tmp / "job")
    JobRunner(RunOptions(job_file=str(HERE / "jobs" / "w_count.py"), job_dir=str(job.path), parallelism=2, until_idle=True, args=args,
                         spark_conf={"spark.sql.execution.arrow.maxRecordsPerBatch": "500000"})).run()
    m = job.latest_manifest()
    assert m is not None
    t = time.perf_counter()
    sp = write_savepoint(job, m, tmp / "sp")
    sp_s = time.perf_counter() - t

    shutil.copyfile(files[0], inp / f"part-{len(files):05d}.parquet")  # one more batch after the restore
    t = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "keyscale.cli.main", "run", str(HERE / "jobs" / "w_count.py"), "--job-dir", str(tmp / "job2"),
                             "-p", "4", "--until-idle", "--from-savepoint", str(sp), *(x for k, v in args.items() for x in ("--set", f"{k}={v}"))],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, cwd=ROOT)
    restored = first = None
    assert proc.stderr is not None
    for line in proc.stderr:
        if "restored savepoint" in line and restored is None:
            restored = time.perf_counter() - t
        if f"batch {len(files)} committed" in line and first is None:
            first = time.perf_counter() - t
    if proc.wait() != 0 or first is None:
        raise RuntimeError("restore run failed")
    (inp / f"part-{len(files):05d}.parquet").unlink()

    spark = spark_session("local[2]", "keyscale-bench", {"spark.sql.streaming.stateStore.providerClass": ROCKSDB_PROVIDER})
    spark.conf.set("spark.sql.streaming.stateStore.providerClass", ROCKSDB_PROVIDER)
    ckpt = tmp / "spark-ckpt"
    _run_available(_native_agg_df(spark, inp), ckpt)
    t = time.perf_counter()
    spark.read.format("statestore").load(str(ckpt)).write.parquet(str(tmp / "spark-export"))
    export_s = time.perf_counter() - t
    keys = spark.read.parquet(str(tmp / "spark-export")).count()
    return {"size": label, "keys": keys, "keyscale_savepoint_s": sp_s, "savepoint_mb": du(sp) / 1e6,
            "keyscale_restore_launch_to_restored_s": restored, "keyscale_restore_launch_to_first_batch_s": first,
            "spark_statestore_export_s": export_s, "spark_export_mb": du(tmp / "spark-export") / 1e6}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1M,10M")
    ap.add_argument("--out", default=str(HERE / "out" / "savepoint.json"))
    a = ap.parse_args(argv)
    logging.getLogger("keyscale").setLevel(logging.WARNING)
    results = []
    for label in a.sizes.split(","):
        if label == "1M":
            data = ensure_workload(DEFAULT_DATA_ROOT, "W-1M", keys=1_000_000)
        else:
            data = HERE / "data" / "big-10000000"
            make_input(data, 10_000_000, 5)
        tmp = Path(tempfile.mkdtemp(prefix="ks-sp-"))
        try:
            r = one_size(label, data, tmp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        results.append(r)
        print(json.dumps(r), flush=True)
    Path(a.out).write_text(json.dumps({"command": "bench/savepoint.py " + " ".join(argv or sys.argv[1:]), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
