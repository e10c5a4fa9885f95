"""Why state files are Arrow IPC: write + read of one subtask's state in candidate formats.

    .venv/bin/python bench/storage.py [--rows 500000] [--repeats 5] [--string-keys]

State shape as workload W's: key long, key group int, count long (one row per key); with
``--string-keys``, the case users have: string keys, record batches of 1,024 rows.
"Read" means back to numpy columns ready for the state table; "slice read" takes one
key group's rows out of 64. Medians over repeats, one process, same data.
"""

from __future__ import annotations

import argparse
import io
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ONE_THREAD = pa.ipc.IpcReadOptions(use_threads=False)  # as keyscale reads state files


def _columns(t: pa.Table) -> list[object]:
    """The table's columns as the state table takes them: numbers as numpy, strings as Arrow."""
    return [c if pa.types.is_string(c.type) else c.to_numpy() for c in t.columns]


def timed(fn: Callable[[], object], repeats: int) -> float:
    xs = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        xs.append(time.perf_counter() - t)
    return statistics.median(xs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=500_000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--string-keys", action="store_true", help="keys 'user-<9 digits>' (the case users have) instead of longs; "
                    "record batches of 1,024 rows as state files have, and no SQLite or npz")
    a = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    keys = rng.permutation(a.rows * 2)[: a.rows].astype(np.int64)
    kg = (keys % 64).astype(np.int32)
    order = np.argsort(kg, kind="stable")
    keys, kg = keys[order], kg[order]
    count = rng.integers(0, 1000, a.rows).astype(np.int64)
    table = pa.table({"key": pa.array([f"user-{k:09d}" for k in keys.tolist()]) if a.string_keys else keys, "__kg": kg, "count": count})
    chunk = 1024 if a.string_keys else None
    d = Path(tempfile.mkdtemp())
    bounds = np.searchsorted(kg, [10, 11])

    def arrow_write(path: Path, compression: str | None) -> None:
        opts = pa.ipc.IpcWriteOptions(compression=compression, use_threads=False)  # as keyscale writes state files
        with pa.OSFile(str(path), "wb") as f, pa.ipc.new_file(f, table.schema, options=opts) as w:
            w.write_table(table, max_chunksize=chunk)

    def arrow_read(path: Path) -> None:
        with pa.memory_map(str(path)) as src:
            t = pa.ipc.open_file(src, options=ONE_THREAD).read_all()
            _columns(t)

    def arrow_slice(path: Path) -> None:
        with pa.memory_map(str(path)) as src:
            t = pa.ipc.open_file(src, options=ONE_THREAD).read_all().slice(int(bounds[0]), int(bounds[1] - bounds[0]))
            _columns(t)

    def sqlite_write(path: Path) -> None:
        path.unlink(missing_ok=True)
        con = sqlite3.connect(path)
        con.execute("create table s (kg int, key int primary key, count int)")
        con.executemany("insert into s values (?,?,?)", zip(kg.tolist(), keys.tolist(), count.tolist(), strict=True))
        con.commit()
        con.close()

    def sqlite_read(path: Path, where: str = "") -> None:
        con = sqlite3.connect(path)
        rows = con.execute(f"select kg, key, count from s {where}").fetchall()
        np.array(rows, dtype=np.int64)
        con.close()

    def npz_write(path: Path) -> None:
        buf = io.BytesIO()
        np.savez(buf, key=keys, kg=kg, count=count)
        path.write_bytes(buf.getvalue())

    def npz_read(path: Path) -> None:
        z = np.load(path)
        [z[k] for k in ("key", "kg", "count")]

    results = []
    cands = {
        "arrow ipc (uncompressed)": (d / "a.arrow", lambda p: arrow_write(p, None), arrow_read, arrow_slice),
        "arrow ipc (lz4)": (d / "l.arrow", lambda p: arrow_write(p, "lz4"), arrow_read, arrow_slice),
        "arrow ipc (zstd)": (d / "z.arrow", lambda p: arrow_write(p, "zstd"), arrow_read, arrow_slice),
        "parquet (snappy)": (d / "p.parquet", lambda p: pq.write_table(table, p), lambda p: _columns(pq.read_table(p)),
                             lambda p: pq.read_table(p, filters=[("__kg", "=", 10)])),
        "numpy npz": (d / "n.npz", npz_write, npz_read, npz_read),
        "sqlite (one table)": (d / "s.db", sqlite_write, sqlite_read, lambda p: sqlite_read(p, "where kg = 10")),
    }
    if a.string_keys:
        cands = {k: v for k, v in cands.items() if k.startswith(("arrow", "parquet"))}
    for name, (path, w, r, s) in cands.items():
        wt = timed(lambda w=w, path=path: w(path), a.repeats if "sqlite" not in name else 1)
        rt = timed(lambda r=r, path=path: r(path), a.repeats)
        st = timed(lambda s=s, path=path: s(path), a.repeats)
        results.append((name, wt, rt, st, path.stat().st_size))
    key = "key string, record batches of 1,024 rows" if a.string_keys else "key long"
    print(f"{a.rows:,} rows ({key}, key group int, count long); medians of {a.repeats}")
    print(f"{'format':26} {'write s':>8} {'read s':>8} {'1/64 read s':>12} {'MB':>7}")
    for name, wt, rt, st, size in results:
        print(f"{name:26} {wt:8.3f} {rt:8.3f} {st:12.4f} {size / 1e6:7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
