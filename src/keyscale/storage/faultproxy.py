"""An HTTP proxy in front of an S3 server that fails chosen requests *after* they landed.

For tests and the chaos bench (``bench/chaos.py``): the failure an object store client
cannot tell from a request that never arrived. The proxy forwards a request to the
server, and for a request that matches a rule it drops the server's answer and replies
``503 Slow Down`` instead, so the client retries a write that already happened (a
conditional PUT then gets ``412``: "exists", although this client created it).

Requests are forwarded byte for byte (the client's signature stays valid: the proxy
keeps the Host header). One thread per connection; stopped with :meth:`FaultProxy.stop`.

>>> rule = Rule(method="PUT", key_contains="manifest-", conditional=True, times=1)
>>> rule.matches("PUT", "/bucket/job/checkpoints/manifest-000000000001.json", {"if-none-match": "*"})
True
"""

from __future__ import annotations

import http.client
import random
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit


@dataclass
class Rule:
    """Which requests to fail after they landed: ``method``, a part of the path, whether only
    conditional writes (``If-None-Match``), how many times (None: every time), and the
    chance that a matching request is failed."""

    method: str = "PUT"
    key_contains: str = ""
    conditional: bool | None = None
    times: int | None = 1
    chance: float = 1.0
    hits: int = field(default=0, init=False)

    def matches(self, method: str, path: str, headers: Mapping[str, str]) -> bool:
        if method != self.method or self.key_contains not in path:
            return False
        if self.conditional is not None and ("if-none-match" in {k.lower() for k in headers}) != self.conditional:
            return False
        return self.times is None or self.hits < self.times


class FaultProxy:
    """A proxy to ``upstream`` (``http://host:port``) on 127.0.0.1; ``url`` is its address."""

    def __init__(self, upstream: str, rules: list[Rule] | None = None, seed: int = 0) -> None:
        self.upstream = urlsplit(upstream)
        self.rules: list[Rule] = list(rules or [])
        self._rng = random.Random(seed)
        self.failed: list[str] = []  # "METHOD path" of every request failed after it landed
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _forward(self) -> None:
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("transfer-encoding", "expect")}
                body: bytes | None
                if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
                    body = self._read_chunked()
                    headers["Content-Length"] = str(len(body))
                else:
                    length = int(self.headers.get("Content-Length") or 0)
                    body = self.rfile.read(length) if length else None
                conn = http.client.HTTPConnection(proxy.upstream.hostname or "127.0.0.1", proxy.upstream.port or 80, timeout=60)
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                finally:
                    conn.close()
                if proxy._fail_now(self.command, self.path, headers):
                    self.send_response(503, "Slow Down")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(resp.status, resp.reason)
                for k, v in resp.getheaders():
                    # A HEAD's Content-Length is the object's size: kept; other answers are re-framed.
                    if k.lower() not in ("transfer-encoding", "connection") and (k.lower() != "content-length" or self.command == "HEAD"):
                        self.send_header(k, v)
                if self.command != "HEAD":
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def _read_chunked(self) -> bytes:
                parts: list[bytes] = []
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                            pass  # trailers
                        return b"".join(parts)
                    parts.append(self.rfile.read(size))
                    self.rfile.readline()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="fault-proxy", daemon=True)
        self._thread.start()

    def _fail_now(self, method: str, path: str, headers: Mapping[str, str]) -> bool:
        with self._lock:
            for rule in self.rules:
                if rule.matches(method, path, headers) and (rule.chance >= 1 or self._rng.random() < rule.chance):
                    rule.hits += 1
                    self.failed.append(f"{method} {path}")
                    return True
        return False

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
