"""Shared fixtures: a local Spark session, event files, output readers, job runners."""

from __future__ import annotations

import datetime as dt
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
RUNNING_COUNT = EXAMPLES / "running_count.py"
ALERTS = EXAMPLES / "threshold_alerts.py"

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)


@pytest.fixture(autouse=True)
def _keyscale_logs_reach_caplog() -> Any:
    """The CLI's main() routes keyscale's log to stderr only; undo that between tests."""
    yield
    log = logging.getLogger("keyscale")
    log.handlers[:] = []
    log.propagate = True


@pytest.fixture(scope="session")
def spark() -> Any:
    from keyscale.runtime.session import spark_session

    session = spark_session("local[2]")
    yield session
    session.stop()


def write_events(folder: Path, files: int, rows: int, keys: int, seed: int = 0, first: int = 0, null_keys: int = 0) -> None:
    """Parquet files part-<first>..: columns key string, value long, ts timestamp."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed + first)
    for i in range(first, first + files):
        k = rng.integers(0, keys, rows)
        key_list: list[str | None] = [f"k{x}" for x in k]
        for j in range(null_keys):
            key_list[j * 7 % rows] = None
        base = dt.datetime(2026, 1, 1, tzinfo=dt.UTC) + dt.timedelta(seconds=i * rows)
        table = pa.table(
            {
                "key": pa.array(key_list, pa.string()),
                "value": pa.array(rng.integers(1, 100, rows), pa.int64()),
                "ts": pa.array([base + dt.timedelta(seconds=j) for j in range(rows)], pa.timestamp("us", tz="UTC")),
            }
        )
        tmp = folder / f".part-{i:05d}.parquet.tmp"
        pq.write_table(table, tmp)
        final = folder / f"part-{i:05d}.parquet"
        tmp.rename(final)
        # Spark's file source takes files in modification-time order: make it the name order.
        stamp = 1_700_000_000 + i
        os.utime(final, (stamp, stamp))


def read_output(folder: Path) -> pd.DataFrame:
    """Every row a job wrote, with its batch, in a canonical order."""
    if not folder.exists() or not any(folder.glob("batch=*")):
        return pd.DataFrame()
    df = pads.dataset(str(folder), partitioning="hive").to_table().to_pandas()
    cols = list(df.columns)
    return df.sort_values(cols).reset_index(drop=True)


def run_job(
    job_file: Path,
    job_dir: Path,
    parallelism: int | None,
    args: dict[str, str],
    on_batch: Callable[[Any], None] | None = None,
    **kw: Any,
) -> Any:
    from keyscale.runtime.driver import JobRunner, RunOptions

    opts = RunOptions(job_file=str(job_file), job_dir=str(job_dir), parallelism=parallelism, until_idle=True, args=args, **kw)
    return JobRunner(opts, on_batch).run()


def reference_output(tmp_path_factory: pytest.TempPathFactory, events: Path, parallelism: int = 1, **kw: Any) -> pd.DataFrame:
    """The output of an uninterrupted run of the running count: what other runs must equal."""
    tmp = tmp_path_factory.mktemp("ref")
    run_job(RUNNING_COUNT, tmp / "job", parallelism, {"input": str(events), "output": str(tmp / "out")}, **kw)
    return read_output(tmp / "out")


def cli(*argv: str, timeout: float = 300, check: bool = False) -> subprocess.CompletedProcess[str]:
    """Run the keyscale CLI in a fresh process (its own Spark driver)."""
    proc = subprocess.run(
        [sys.executable, "-m", "keyscale.cli.main", *argv],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT,
        env={**os.environ, "KEYSCALE_SPARK_LOG_LEVEL": "ERROR"},
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"keyscale {' '.join(argv)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc
