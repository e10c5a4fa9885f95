"""Benchmark workload W (see /work/shared/ANCHORS.md) and a small results format.

Workload W: ``files`` Parquet files of ``rows_per_file`` rows each, columns
``key: int64`` uniform in ``[0, keys)`` and ``v: int64 = 1``. The task on it is a
per-key running count (sum of ``v``), one file per micro-batch.

* ``W``    -- 5 x 400,000 rows, 100,000 keys.
* ``W-1M`` -- the same with 1,000,000 keys (``ensure_workload(root, "W-1M", keys=1_000_000)``).

The data is generated with numpy + pyarrow (no Spark), deterministically from ``seed``
(file ``i`` uses ``seed + i``), and written once: a directory is only reused when its
``_COMPLETE`` marker matches the requested parameters. Writing goes to a temporary sibling
directory which is renamed into place, so a crashed run never leaves a half-written workload.

Results are plain JSON objects (``write_result`` / ``load_results``).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

__all__ = [
    "DEFAULT_DATA_ROOT",
    "W1M_KEYS",
    "W_FILES",
    "W_KEYS",
    "W_ROWS_PER_FILE",
    "W_SCHEMA",
    "ensure_workload",
    "load_results",
    "median",
    "workload_files",
    "write_result",
]

#: Spark DDL schema of the workload files.
W_SCHEMA = "key long, v long"

W_FILES = 5
W_ROWS_PER_FILE = 400_000
W_KEYS = 100_000
W1M_KEYS = 1_000_000

#: Default location for generated data (gitignored).
DEFAULT_DATA_ROOT = Path(__file__).resolve().parent / "data"

_MARKER = "_COMPLETE"


def _file_name(i: int) -> str:
    return f"part-{i:05d}.parquet"


def workload_files(data_dir: Path) -> list[Path]:
    """The Parquet files of a workload directory, in batch order."""
    return sorted(Path(data_dir).glob("part-*.parquet"))


def ensure_workload(
    root: Path,
    name: str = "W",
    files: int = W_FILES,
    rows_per_file: int = W_ROWS_PER_FILE,
    keys: int = W_KEYS,
    seed: int = 0,
) -> Path:
    """Create workload ``root/name`` unless it already exists complete; return its path.

    The directory holds ``part-00000.parquet`` .. ``part-{files-1:05d}.parquet`` and a
    ``_COMPLETE`` JSON marker with the generation parameters. An existing directory whose
    marker does not match the parameters is an error (pick another ``name``); an existing
    directory without a marker (an interrupted write by another tool) is replaced.
    """
    root = Path(root)
    target = root / name
    params = {
        "files": files,
        "rows_per_file": rows_per_file,
        "keys": keys,
        "seed": seed,
        "schema": W_SCHEMA,
    }
    marker = target / _MARKER
    if marker.exists():
        have = json.loads(marker.read_text())
        if have != params:
            raise ValueError(
                f"workload {target} exists with parameters {have}, requested {params}"
            )
        if len(workload_files(target)) == files:
            return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root))
    try:
        schema = pa.schema([("key", pa.int64()), ("v", pa.int64())])
        ones = pa.array(np.ones(rows_per_file, dtype=np.int64))
        for i in range(files):
            rng = np.random.default_rng(seed + i)
            key = rng.integers(0, keys, size=rows_per_file, dtype=np.int64)
            table = pa.Table.from_arrays([pa.array(key), ones], schema=schema)
            pq.write_table(table, tmp / _file_name(i))
        # Spark's file source orders by modification time; make the times strictly
        # increasing in batch order so that "oldest first" equals name order.
        now = time.time()
        for i in range(files):
            t = now - (files - i)
            os.utime(tmp / _file_name(i), (t, t))
        (tmp / _MARKER).write_text(json.dumps(params, sort_keys=True))
        tmp.chmod(0o755)
        if target.exists():
            # Incomplete leftover (no/mismatched file count): replace it.
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def median(xs: Iterable[float]) -> float:
    """Median of a non-empty iterable of numbers (``statistics.median``)."""
    values = list(xs)
    if not values:
        raise ValueError("median of empty sequence")
    return float(statistics.median(values))


def write_result(path: Path, result: Mapping[str, Any]) -> Path:
    """Write ``result`` as pretty JSON to ``path`` (atomically, parent dirs created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=2, sort_keys=False, default=str) + "\n")
    os.replace(tmp, path)
    return path


def load_results(path: Path) -> Any:
    """Load a JSON result written by :func:`write_result`."""
    return json.loads(Path(path).read_text())
