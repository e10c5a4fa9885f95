"""Why state files are Arrow IPC: write + read of one subtask's state in candidate formats.

    .venv/bin/python bench/storage.py [--rows 500000] [--repeats 5]

State shape as workload W's: key long, key group int, count long (one row per key).
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
    a = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    keys = rng.permutation(a.rows * 2)[: a.rows].astype(np.int64)
    kg = (keys % 64).astype(np.int32)
    order = np.argsort(kg, kind="stable")
    keys, kg = keys[order], kg[order]
    count = rng.integers(0, 1000, a.rows).astype(np.int64)
    table = pa.table({"key": keys, "__kg": kg, "count": count})
    d = Path(tempfile.mkdtemp())
    bounds = np.searchsorted(kg, [10, 11])

    def arrow_write(path: Path, compression: str | None) -> None:
        opts = pa.ipc.IpcWriteOptions(compression=compression)
        with pa.OSFile(str(path), "wb") as f, pa.ipc.new_file(f, table.schema, options=opts) as w:
            w.write_table(table)

    def arrow_read(path: Path) -> None:
        with pa.memory_map(str(path)) as src:
            t = pa.ipc.open_file(src).read_all()
            [t.column(c).to_numpy() for c in t.column_names]

    def arrow_slice(path: Path) -> None:
        with pa.memory_map(str(path)) as src:
            t = pa.ipc.open_file(src).read_all().slice(int(bounds[0]), int(bounds[1] - bounds[0]))
            [t.column(c).to_numpy() for c in t.column_names]

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
        "arrow ipc (zstd)": (d / "z.arrow", lambda p: arrow_write(p, "zstd"), arrow_read, arrow_slice),
        "parquet (snappy)": (d / "p.parquet", lambda p: pq.write_table(table, p), lambda p: [c.to_numpy() for c in pq.read_table(p).columns],
                             lambda p: pq.read_table(p, filters=[("__kg", "=", 10)])),
        "numpy npz": (d / "n.npz", npz_write, npz_read, npz_read),
        "sqlite (one table)": (d / "s.db", sqlite_write, sqlite_read, lambda p: sqlite_read(p, "where kg = 10")),
    }
    for name, (path, w, r, s) in cands.items():
        wt = timed(lambda w=w, path=path: w(path), a.repeats if "sqlite" not in name else 1)
        rt = timed(lambda r=r, path=path: r(path), a.repeats)
        st = timed(lambda s=s, path=path: s(path), a.repeats)
        results.append((name, wt, rt, st, path.stat().st_size))
    print(f"{a.rows:,} rows (key long, key group int, count long); medians of {a.repeats}")
    print(f"{'format':26} {'write s':>8} {'read s':>8} {'1/64 read s':>12} {'MB':>7}")
    for name, wt, rt, st, size in results:
        print(f"{name:26} {wt:8.3f} {rt:8.3f} {st:12.4f} {size / 1e6:7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
