"""What a small ranged GET costs the S3 server, by the size of the object it reads from.

    PYTHONPATH=src .venv/bin/python bench/s3_ranged_reads.py
    PYTHONPATH=src .venv/bin/python bench/s3_ranged_reads.py --read-cache 256

A point lookup of keyed state reads one record batch (~30-50 KB) of a state file by byte
range. Starts a private SeaweedFS (keyscale.storage.seaweed; ``--read-cache MB``: with
1 MB chunks and a read cache of that size, ``start_seaweedfs(read_cache_mb=...)``), stores
one object of random bytes per size, and for each times ``--reads`` GETs of ``--bytes``
at random offsets through keyscale's store (obstore): the server's CPU time a GET (from
/proc, all its threads) and the wall time a GET, after 20 unmeasured ones. Prints one
JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

from procs import cpu_seconds

from keyscale.storage import open_store
from keyscale.storage.seaweed import serving_bucket


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes-mb", default="0.5,1,2,4,6,8,16,64", help="object sizes in MB, comma-separated")
    ap.add_argument("--bytes", type=int, default=30_000, help="bytes a GET reads")
    ap.add_argument("--reads", type=int, default=300, help="measured GETs per object")
    ap.add_argument("--read-cache", type=int, default=0, metavar="MB", help="the server's read cache (0: SeaweedFS's defaults)")
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="ks-ranged-") as scratch, serving_bucket(Path(scratch) / "s3", "bench", a.read_cache) as server:
        store = open_store("s3://bench/ranged", "benchmark")
        for mb in (float(x) for x in a.sizes_mb.split(",")):
            size = int(mb * (1 << 20))
            if size < a.bytes + 1:
                raise SystemExit(f"--sizes-mb: {mb} MB is smaller than --bytes {a.bytes}")
            name = f"object-{mb}"
            store.put(name, os.urandom(size))
            for _ in range(20):
                store.get_range(name, random.randrange(size - a.bytes), a.bytes)
            cpu0, t0 = cpu_seconds(server.pid), time.perf_counter()
            for _ in range(a.reads):
                store.get_range(name, random.randrange(size - a.bytes), a.bytes)
            rows.append({"object_mb": mb, "server_cpu_ms": round(1000 * (cpu_seconds(server.pid) - cpu0) / a.reads, 2),
                         "wall_ms": round(1000 * (time.perf_counter() - t0) / a.reads, 2)})
    print(json.dumps({"read_cache_mb": a.read_cache, "bytes": a.bytes, "reads": a.reads, "objects": rows}))


if __name__ == "__main__":
    main()
