"""``keyscale state serve``: the control API's ``GET /state`` in a process of its own.

A running job answers ``GET /state/<uid>?key=K`` on its control API, in its driver process,
where each request waits for the interpreter that the job's own loop holds: on a machine
whose cores the job's tasks keep busy, that wait is most of a lookup's tail (measured in
docs/benchmarks.md, "State lookups from a process of their own"). This server gives the
same answers (:func:`.server.state_reply`, :class:`keyscale.state_processor.StateLookup`)
from a process that shares nothing with the job but its job directory, which it only
reads, as ``keyscale state get`` does. So it costs the job's driver nothing, answers while
the job is stopped or restarting, and runs on any machine that can read the job directory
(an object store).

- ``GET /state/<uid>?key=K[&key=K2...]``: as on the control API. Which checkpoint answers
  is listed at most once per ``max_age`` seconds (default 1), so an answer's ``batch`` is
  of a checkpoint at most that much older than the newest committed one.
- ``GET /health``: ``200 {"job": ..., "batch": N}`` once the job directory has a committed
  checkpoint, else 503; without credentials.

Every ``/state`` request carries ``Authorization: Bearer <token>``, the content of the
``token_file`` (read again at each request, so a mounted secret can rotate), unless the
operator chose ``unauthenticated``; on loopback the Host header must name the server, as
for the control API (:mod:`.auth`). The job's own control secret is not used: it is made
and deleted by each run, and this server outlives runs.

>>> import json, tempfile, urllib.request, pyarrow as pa
>>> from pathlib import Path
>>> from keyscale.checkpoint.jobdir import JobDir
>>> from keyscale.checkpoint.encode import write_state_file
>>> from keyscale.checkpoint.manifest import Manifest, OperatorCheckpoint
>>> from keyscale.state.keygroups import KeyGroupRange
>>> from keyscale.state.spark_hash import key_group_of
>>> from keyscale.state.types import StateDescriptor
>>> jd = JobDir(Path(tempfile.mkdtemp()) / "job"); _ = jd.claim("clicks", 8, 8)
>>> rows = pa.table({"user": ["ann"], "__kg": pa.array([key_group_of(["ann"], ["string"], 8)], pa.int32()), "total": [7]})
>>> f = write_state_file(jd.store, "state/t/000000000003-s00000-snapshot.arrow", rows, "snapshot", 3, KeyGroupRange(0, 7))
>>> total = StateDescriptor("total", "value", pa.int64())
>>> _ = jd.commit(Manifest("clicks", 3, 0, {"t": OperatorCheckpoint("t", 8, 1, (("user", "string"),), (total.to_json(),), (f,))}))
>>> server = LookupServer(jd.uri, unauthenticated=True)
>>> json.load(urllib.request.urlopen(f"{server.url}/health"))
{'job': 'clicks', 'batch': 3}
>>> answer = json.load(urllib.request.urlopen(f"{server.url}/state/t?key=ann"))
>>> answer["batch"], answer["found"], answer["state"]
(3, True, {'total': 7})
>>> server.close()
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler
from typing import Any

from keyscale.errors import KeyscaleError
from keyscale.runtime.control.auth import check_health, has_secret
from keyscale.runtime.control.server import bound, listen, state_reply
from keyscale.runtime.control.settings import BearerToken
from keyscale.state_processor.lookup import StateLookup

log = logging.getLogger("keyscale")

__all__ = ["LookupServer"]


class LookupServer:
    """Serves point lookups of one job directory's committed state until :meth:`close`."""

    def __init__(self, job_dir: str, host: str = "127.0.0.1", port: int = 0, token: BearerToken | None = None,
                 unauthenticated: bool = False, max_age: float = 1.0):
        if (token is None) == (not unauthenticated):
            raise KeyscaleError("keyscale state serve needs a token (--token-file) or --unauthenticated, one of them")
        if max_age < 0:
            raise KeyscaleError(f"--max-age {max_age}: give 0 or more seconds")
        self.lookup = StateLookup(job_dir, max_age=max_age)
        if not self.lookup.jobdir.exists():
            raise KeyscaleError(f"{self.lookup.jobdir.uri} is not a keyscale job directory (no job.json)")

        class Handler(_Handler):
            pass

        Handler.lookup, Handler.token = self.lookup, token
        self.httpd = listen(host, port, Handler, "keyscale state serve", "--host/--port")
        at = bound(self.httpd)
        Handler.port, Handler.any_host, self.url = at.port, at.any_host, at.url
        threading.Thread(target=self.httpd.serve_forever, name="keyscale-state-serve", daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _Handler(BaseHTTPRequestHandler):
    # Keep-alive: a service asking many lookups reuses its connection (no connect and no new
    # server thread per request); an idle one is closed after ``timeout`` seconds. The headers
    # and the body are two writes: without TCP_NODELAY the second waits for the client's
    # delayed ACK (~40 ms) on a kept connection.
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    timeout = 60
    lookup: StateLookup
    token: BearerToken | None
    port: int
    any_host: bool

    def log_message(self, format: str, *args: Any) -> None:
        return  # a lookup server answering 50 requests a second logs its refusals, not each answer

    def _reply(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        if code == 401:
            self.send_header("WWW-Authenticate", 'Bearer realm="keyscale"')
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _refusal(self) -> tuple[int, str] | None:
        """As the control API's rules (:mod:`.auth`): the Host on loopback, then the token."""
        headers = {h: self.headers.get(h) or "" for h in ("Host", "Authorization")}
        refused = check_health(headers, self.port, self.any_host)
        if refused is None and self.path != "/health" and self.token is not None and not has_secret(headers, self.token.current()):
            refused = 401, "missing or wrong token: send 'Authorization: Bearer <the content of the server's --token-file>'"
        return refused

    def do_GET(self) -> None:
        if (self.headers.get("Content-Length") or "0") != "0":
            self.close_connection = True  # a GET with a body: unread, it would be taken for the next request
        refusal = self._refusal()
        if refusal is not None:
            log.warning("state lookups: refused GET %s (%d: %s)", self.path, *refusal)
            self._reply(refusal[0], {"error": refusal[1]})
        elif self.path == "/health":
            try:
                m = self.lookup.manifest()
            except KeyscaleError as e:
                self._reply(503, {"error": str(e)})
                return
            self._reply(200, {"job": m.job, "batch": m.batch})
        elif self.path.startswith("/state/"):
            self._reply(*state_reply(self.path, self.lookup.get_many))
        else:
            self._reply(404, {"error": f"no such endpoint: GET {self.path} (this server answers GET /state/<uid>?key=... and /health)"})
