"""Which Python S3 client the storage layer should use: pyarrow.fs, s3fs or obstore.

    .venv/bin/python bench/s3_clients.py [--small 200] [--big-mb 8] [--big-repeats 10] [--list-objects 1000]

Starts a private SeaweedFS (keyscale.storage.seaweed) in a temporary folder and, for
each client, measures: PUT of a 1 KB JSON object (median latency over --small puts to
new keys), GET of it (median over --small), PUT and GET of an --big-mb object (median
over --big-repeats), LIST of a prefix holding --list-objects objects (median over 10),
and tries for real whether the client can do a conditional create (If-None-Match: *,
refused on an existing key) and a compare-and-swap (If-Match: ETag). s3fs is not a
keyscale dependency: ``pip install s3fs`` to include it (skipped otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from keyscale.storage.seaweed import serving_bucket

BUCKET = "bench"


def median_ms(fn: Callable[[int], object], n: int) -> float:
    """Median wall time of fn(i) for i in range(n), in ms."""
    xs = []
    for i in range(n):
        t = time.perf_counter()
        fn(i)
        xs.append(time.perf_counter() - t)
    return statistics.median(xs) * 1000


class Client:
    """One library behind the operations the storage layer needs."""

    name = ""

    def put(self, key: str, data: bytes) -> None: ...
    def get(self, key: str) -> bytes: ...
    def list(self, prefix: str) -> list[str]: ...
    def create(self, key: str, data: bytes) -> str:
        """'ok', 'refused' (the key exists) or why the client cannot."""
        return "no API"

    def cas(self, key: str, data: bytes, etag: str) -> str:
        return "no API"

    def etag(self, key: str) -> str: ...


class Obstore(Client):
    name = "obstore"

    def __init__(self, server: Any) -> None:
        from obstore.store import S3Store

        self.s = S3Store(
            BUCKET,
            endpoint=server.endpoint_url,
            access_key_id=server.access_key,
            secret_access_key=server.secret_key,
            region=server.region,
            client_options={"allow_http": True},
        )

    def put(self, key: str, data: bytes) -> None:
        self.s.put(key, data)

    def get(self, key: str) -> bytes:
        return bytes(self.s.get(key).bytes())

    def list(self, prefix: str) -> list[str]:
        return [o["path"] for batch in self.s.list(prefix) for o in batch]

    def create(self, key: str, data: bytes) -> str:
        from obstore.exceptions import AlreadyExistsError

        try:
            self.s.put(key, data, mode="create")
            return "ok"
        except AlreadyExistsError:
            return "refused"

    def cas(self, key: str, data: bytes, etag: str) -> str:
        from obstore.exceptions import PreconditionError

        try:
            self.s.put(key, data, mode={"e_tag": etag})
            return "ok"
        except PreconditionError:
            return "refused"

    def etag(self, key: str) -> str:
        return str(self.s.head(key)["e_tag"])


class PyarrowFs(Client):
    name = "pyarrow.fs"

    def __init__(self, server: Any) -> None:
        import pyarrow.fs as pafs

        self.pafs = pafs
        self.fs = pafs.S3FileSystem(
            access_key=server.access_key,
            secret_key=server.secret_key,
            endpoint_override=server.endpoint_url,
            scheme="http",
            region=server.region,
        )

    def put(self, key: str, data: bytes) -> None:
        with self.fs.open_output_stream(f"{BUCKET}/{key}") as f:
            f.write(data)

    def get(self, key: str) -> bytes:
        # Each read's fastest pyarrow way: a stream is one GET, but reads a large object
        # in small ranges (8 MB: ~200 ms unbuffered); a random-access file costs a HEAD
        # first but reads it whole.
        if "/big/" in key:
            with self.fs.open_input_file(f"{BUCKET}/{key}") as f:
                return bytes(f.readall())
        with self.fs.open_input_stream(f"{BUCKET}/{key}") as f:
            return bytes(f.read())

    def list(self, prefix: str) -> list[str]:
        infos = self.fs.get_file_info(self.pafs.FileSelector(f"{BUCKET}/{prefix}", recursive=True))
        return [i.path for i in infos if i.type == self.pafs.FileType.File]

    def create(self, key: str, data: bytes) -> str:
        return "no API"  # open_output_stream always overwrites

    def cas(self, key: str, data: bytes, etag: str) -> str:
        return "no API"

    def etag(self, key: str) -> str:
        return ""


class S3fs(Client):
    name = "s3fs"

    def __init__(self, server: Any) -> None:
        import s3fs

        self.fs = s3fs.S3FileSystem(
            key=server.access_key,
            secret=server.secret_key,
            endpoint_url=server.endpoint_url,
            client_kwargs={"region_name": server.region},
            use_listings_cache=False,
        )

    def put(self, key: str, data: bytes) -> None:
        self.fs.pipe_file(f"{BUCKET}/{key}", data)

    def get(self, key: str) -> bytes:
        return bytes(self.fs.cat_file(f"{BUCKET}/{key}"))

    def list(self, prefix: str) -> list[str]:
        return list(self.fs.find(f"{BUCKET}/{prefix}"))

    def create(self, key: str, data: bytes) -> str:
        try:
            self.fs.pipe_file(f"{BUCKET}/{key}", data, mode="create")
            return "ok"
        except (FileExistsError, OSError) as err:
            return _refused(err)

    def cas(self, key: str, data: bytes, etag: str) -> str:
        # No documented API: put_object's IfMatch passed through pipe_file's **kwargs.
        try:
            self.fs.pipe_file(f"{BUCKET}/{key}", data, IfMatch=etag)
            return "ok"
        except (FileExistsError, OSError) as err:
            return _refused(err)

    def etag(self, key: str) -> str:
        return str(self.fs.info(f"{BUCKET}/{key}", refresh=True)["ETag"])


def _refused(err: Exception) -> str:
    """s3fs turns a 412 into OSError(EINVAL, 'At least one of the pre-conditions ...')."""
    text = repr(err).lower().replace("-", "")
    return "refused" if isinstance(err, FileExistsError) or "precondition" in text else repr(err)[:80]


def conditional(c: Client) -> tuple[str, str]:
    """(create, cas): each 'yes' only if the new key is written AND the stale/second write refused."""
    base = f"{c.name}/cond/"
    first = c.create(base + "k", b"1")
    second = c.create(base + "k", b"2") if first == "ok" else first
    kept = first != "ok" or c.get(base + "k") == b"1"
    if first.startswith("no API"):
        create = "no (no API)"
    else:
        create = "yes" if (first, second, kept) == ("ok", "refused", True) else f"no ({first}, {second})"
    c.put(base + "m", b"v1")
    etag = c.etag(base + "m")
    if not etag:
        return create, "no (no API)"
    ok = c.cas(base + "m", b"v2", etag)
    stale = c.cas(base + "m", b"v3", etag) if ok == "ok" else ok
    cas = "yes" if (ok, stale) == ("ok", "refused") and c.get(base + "m") == b"v2" else f"no ({ok}, {stale})"
    return create, cas


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", type=int, default=200)
    ap.add_argument("--big-mb", type=int, default=8)
    ap.add_argument("--big-repeats", type=int, default=10)
    ap.add_argument("--list-objects", type=int, default=1000)
    ap.add_argument("--list-repeats", type=int, default=10)
    a = ap.parse_args(argv)

    small = json.dumps({"batch": 1, "pad": "x" * 990}).encode()[:1024]
    big = os.urandom(a.big_mb * 2**20)
    with tempfile.TemporaryDirectory(prefix="keyscale-s3bench-") as tmp, serving_bucket(tmp, BUCKET) as server:
        clients: list[Client] = [PyarrowFs(server)]
        try:
            clients.append(S3fs(server))
        except ImportError:
            print("s3fs not installed: skipped (pip install s3fs)", file=sys.stderr)
        clients.append(Obstore(server))
        # One listing set for all: written once (obstore), listed by each client.
        setup = Obstore(server)
        for i in range(a.list_objects):
            setup.put(f"listing/{i:05d}.json", small)
        rows = []
        for c in clients:
            p = f"{c.name}/"
            c.put(p + "warm", small)  # connection set up outside the timings
            c.get(p + "warm")
            put_small = median_ms(lambda i, c=c, p=p: c.put(f"{p}small/{i:05d}.json", small), a.small)
            get_small = median_ms(lambda i, c=c, p=p: c.get(f"{p}small/{i:05d}.json"), a.small)
            put_big = median_ms(lambda i, c=c, p=p: c.put(f"{p}big/{i}", big), a.big_repeats)
            get_big = median_ms(lambda i, c=c, p=p: c.get(f"{p}big/{i}"), a.big_repeats)
            assert c.get(f"{p}big/0") == big
            listed = c.list("listing/")
            assert len(listed) == a.list_objects, (c.name, len(listed))
            lst = median_ms(lambda _i, c=c: c.list("listing/"), a.list_repeats)
            create, cas = conditional(c)
            rows.append((c.name, put_small, get_small, put_big, get_big, lst, create, cas))

    mb = a.big_mb
    head = ("client", "PUT 1 KB ms", "GET 1 KB ms", f"PUT {mb} MB ms", f"GET {mb} MB ms", f"LIST {a.list_objects} ms", "create (If-None-Match)", "CAS (If-Match)")
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for name, ps, gs, pb, gb, ls, create, cas in rows:
        print(f"| {name} | {ps:.2f} | {gs:.2f} | {pb:.0f} | {gb:.0f} | {ls:.0f} | {create} | {cas} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
