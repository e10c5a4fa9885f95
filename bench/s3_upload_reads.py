"""What a large upload does to reads of the same S3 server (issue 37): ranged GETs of an
object, as a point lookup makes them, while other processes upload large objects, by the
number of parts each upload has in flight (``--storage-option upload_concurrency``).

    .venv/bin/python bench/s3_upload_reads.py --uploads 1 --concurrency 12,4,2,1,0
    .venv/bin/python bench/s3_upload_reads.py --uploads 2 --concurrency 12,2,1

A private SeaweedFS server (``keyscale.storage.seaweed``) holds a 110 MB object; this
process reads ``--read-kb`` at a random offset of it every 20 ms for ``--seconds`` per
setting, while ``--uploads`` processes each upload ``--upload-mb`` again and again with
obstore's multipart upload at each ``--concurrency`` (parts of ``--part-mb`` in flight at
once; 0: one PUT, no parts) in turn. Printed: per setting, the reads' p50 / p90 / p99 /
max and the uploads' median time. Each setting writes ~10 objects of ``--upload-mb``: the
server's volumes fill after ~15 settings of 2 uploads (HTTP 500), so keep runs short.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import statistics
import tempfile
import time
from typing import Any


def _uploader(stop: Any, times: Any, mb: int, concurrency: int, part_mb: int) -> None:
    import obstore

    from keyscale.storage import ObjectStore, open_store

    store = open_store("s3://bench/up", "bench bucket")
    assert isinstance(store, ObjectStore)
    data, i = os.urandom(mb << 20), 0
    while not stop.is_set():
        t = time.perf_counter()
        obstore.put(store.client, f"up/big-{os.getpid()}-{i % 3}", data, use_multipart=concurrency > 0,
                    max_concurrency=max(concurrency, 1), chunk_size=part_mb << 20)
        times.put(time.perf_counter() - t)
        i += 1


def _reads(store: Any, seconds: float, size: int) -> list[float]:
    pick, out = random.Random(0), []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t = time.perf_counter()
        store.get_range("read/object", pick.randrange(0, 100 << 20), size)
        out.append((time.perf_counter() - t) * 1000)
        time.sleep(0.02)
    return sorted(out)


def _pct(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--uploads", type=int, default=1, help="processes uploading at once")
    ap.add_argument("--concurrency", default="12,2", help="parts in flight per upload, comma-separated, in turn (0: one PUT)")
    ap.add_argument("--upload-mb", type=int, default=190, help="size of each upload (a 5M-key snapshot of string keys: ~190 MB)")
    ap.add_argument("--part-mb", type=int, default=5)
    ap.add_argument("--read-kb", type=int, default=304, help="bytes of each read (a lookup's record batch of a snapshot: ~304 KB)")
    ap.add_argument("--seconds", type=float, default=20.0)
    a = ap.parse_args()

    from keyscale.storage import open_store
    from keyscale.storage.seaweed import serving_bucket

    # Gone at the end: each setting writes GBs. The uploaders (spawned) inherit the server's settings.
    with tempfile.TemporaryDirectory(prefix="ks-upload-reads-") as scratch, serving_bucket(scratch, "bench"):
        store = open_store("s3://bench", "bench bucket")
        store.put("read/object", os.urandom(110 << 20))
        ctx = mp.get_context("spawn")
        print("| uploads at once | parts in flight each | read p50 | p90 | p99 | max | upload (median) |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for concurrency in (int(x) for x in a.concurrency.split(",")):
            stop, times = ctx.Event(), ctx.Queue()
            procs = [ctx.Process(target=_uploader, args=(stop, times, a.upload_mb, concurrency, a.part_mb))
                     for _ in range(a.uploads)]
            for p in procs:
                p.start()
            time.sleep(2)  # the uploads under way
            ms = _reads(store, a.seconds, a.read_kb << 10)
            stop.set()
            for p in procs:
                p.join()
            took = []
            while not times.empty():
                took.append(times.get())
            p50, p90, p99 = (_pct(ms, q) for q in (0.5, 0.9, 0.99))
            up = f"{statistics.median(took):.2f} s ({len(took)})" if took else "none finished"
            print(f"| {a.uploads} | {concurrency or 'one PUT'} | {p50:.1f} ms | {p90:.1f} | {p99:.1f} | {ms[-1]:.1f} | {up} |", flush=True)


if __name__ == "__main__":
    main()
