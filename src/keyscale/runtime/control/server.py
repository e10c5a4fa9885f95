"""The running job's control API: a small HTTP server, on 127.0.0.1 unless told otherwise.

``GET /status``; ``GET /state/<uid>?key=K`` (what key ``K`` of keyed operator ``uid`` holds at
the last committed checkpoint, :class:`keyscale.state_processor.StateLookup`); ``GET /metrics`` (Prometheus' text format, :mod:`keyscale.runtime.control.metrics`);
``GET /health`` (200 while the job runs its batches, else 503); ``GET /history`` (recent
batches, rescales and decisions, savepoints: the dashboard's timelines); ``GET /ui/`` (the
dashboard, :mod:`keyscale.web`; ``POST /ui/token`` gives a one-time login link); ``POST /rescale`` ``{"parallelism": N, "operator": uid?}`` (applied at the
next batch); ``POST /savepoint`` ``{"dest": path?}`` (taken between two batches, answers
with its path); ``POST /stop`` ``{"savepoint": bool, "dest": path?}``; ``POST /restart``
``{"parallelism": N?, "job_file": path?}`` (savepoint, then the same process starts the job
again in the same Spark application); ``POST /cancel``.
Answers are JSON; errors are ``{"error": "..."}`` with status 400 (bad request) or 409
(refused, the job keeps running). The address is written to ``JOB_DIR/control/http.json``
while the job runs; it listens on 127.0.0.1 unless told otherwise (``control_host``,
``control_port``: :mod:`keyscale.runtime.control.settings`).

Every request but ``GET /health`` must carry ``Authorization: Bearer <JOB_DIR/control/secret>``
(else 401) and, on loopback, a Host header naming the server (else 403); ``GET /metrics`` may
instead carry the operator's metrics token, or nothing if they made it unauthenticated. POST
bodies must be JSON (else 415). The dashboard's
session (a one-time login link) stands in for the secret, but may not name a path or a file
(``dest``, ``job_file``: 403). A refused request changes nothing. See
:mod:`keyscale.runtime.control.auth` for why.

Runs in the job's driver process, on threads of its own; sees the job only through
:class:`~keyscale.runtime.control.running.RunningJob` and writes nothing but its own
control files (secret, address) in the job directory. :func:`call` is the client side
(``keyscale`` commands, the deploy supervisor, ``keyscale ui``).
"""

from __future__ import annotations

import ipaddress
import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any, NamedTuple
from urllib.parse import parse_qs, unquote, urlsplit

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from keyscale.errors import InputDataError, KeyscaleError
from keyscale.runtime.control.auth import (
    CSRF_HEADER,
    SECRET,
    SESSION_COOKIE,
    auth_header,
    check_health,
    check_host,
    check_metrics,
    check_request,
    new_secret,
    read_secret,
)
from keyscale.runtime.control.metrics import health, registry_for
from keyscale.runtime.control.running import RunningJob
from keyscale.runtime.control.settings import ControlSettings, control_settings
from keyscale.web import LOGIN_TTL_SECONDS, Logins, static_file

if TYPE_CHECKING:
    from collections.abc import Callable

    from keyscale.checkpoint.jobdir import JobDir
    from keyscale.runtime.batch.jobstate import RunOptions

log = logging.getLogger("keyscale")

ADDRESS = "control/http.json"  # where a client finds the running job's control API


def control_api(opts: RunOptions) -> Callable[[RunningJob], ControlServer]:
    """What serves a job's control API once it is set up (``JobRunner(serve=...)``), with
    the settings of ``opts``: read now (a token file too), so a setting the control API
    cannot serve fails the start, before Spark."""
    settings = control_settings(opts)
    return lambda job: ControlServer(job, settings)


class ControlServer:
    """Serves one :class:`~keyscale.runtime.control.running.RunningJob` until :meth:`close`."""

    def __init__(self, runner: RunningJob, settings: ControlSettings | None = None):
        self.runner = runner
        settings = settings or ControlSettings()
        # reassert (the heartbeat's thread) and close: no file written again once close deleted it.
        self._files = threading.Lock()
        self._closed = False

        class Handler(_Handler):
            pass

        Handler.runner, Handler.registry, Handler.logins, Handler.settings = runner, registry_for(runner), Logins(), settings
        self.httpd = listen(settings.host, settings.port, Handler)  # before the secret: a failed start leaves none behind
        at = bound(self.httpd)
        Handler.port, Handler.any_host = at.port, at.any_host
        secret = new_secret(runner.jobdir.store)  # before the address: a client that finds one finds the other
        self.secret = Handler.secret = secret
        self.url = at.url
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="keyscale-control", daemon=True)
        self._thread.start()
        # The run's epoch and a server id beside the URL: another host's server may have the same URL.
        self.address = {"url": self.url, "epoch": runner.jobdir.epoch, "server": uuid.uuid4().hex}
        runner.jobdir.write_json(ADDRESS, self.address, durable=False)
        if Handler.any_host:
            log.info("control API at %s, listening on %s port %d: /health without authentication, %s, "
                     "every other endpoint with the control secret", self.url, at.address, at.port, settings.describe_metrics())
        else:
            log.info("control API at %s (%s)", self.url, settings.describe_metrics())

    def _mine(self) -> list[str]:
        """Which of the control files are still this server's (a newer run writes its own)."""
        jd = self.runner.jobdir
        mine = [SECRET] if (jd.store.get_text(SECRET) or "").strip() == self.secret else []
        return mine + ([ADDRESS] if jd.read_json(ADDRESS).get("server") == self.address["server"] else [])

    def reassert(self) -> None:
        """Write the control files again if they are not this server's: called by the heartbeat
        (object stores) after it found this run current, so a file that a fenced run deleted
        late (see :meth:`close`) is back within a heartbeat."""
        with self._files:
            if not self._closed:
                self._reassert()

    def _reassert(self) -> None:
        mine = self._mine()
        if SECRET not in mine:
            log.warning("the control secret %s was not this run's: written again", self.runner.jobdir.store.url(SECRET))
            self.runner.jobdir.store.put(SECRET, self.secret.encode(), private=True)
        if ADDRESS not in mine:
            self.runner.jobdir.write_json(ADDRESS, self.address, durable=False)

    def close(self) -> None:
        """Stop serving; delete the control secret and address if they are still this run's.

        They are shared by every run of the job: a run that a newer one took over (fenced)
        deletes nothing, else the live job could no longer be stopped or savepointed. The
        fence check, the comparison and the delete are separate requests, so a run paused
        between them (only possible on an object store, where no lock keeps a second run
        out) can still delete the newer run's files once; the newer run's heartbeat writes
        them again (:meth:`reassert`) within a heartbeat, and this run, fenced, writes
        nothing after."""
        try:
            with self._files:
                self._closed = True
                jd = self.runner.jobdir
                newer = jd.fence.newer()
                if newer is not None:
                    log.info("a newer run (pid %s on %s) took over the job directory: its control API files stay",
                             newer.get("pid", "?"), newer.get("host", "?"))
                else:
                    jd.store.delete_many(self._mine())
        finally:
            self.httpd.shutdown()
            self.httpd.server_close()


def state_reply(path: str, lookup: Callable[[str, list[str]], list[dict[str, Any]]]) -> tuple[int, dict[str, Any]]:
    """The answer to ``GET /state/<uid>?key=K[&key=K2...]`` (``path``), from ``lookup(uid,
    keys)``: what the keys hold at the last committed checkpoint
    (:class:`keyscale.state_processor.StateLookup`), one answer for one key, ``{"answers":
    [...]}`` for several. An unknown operator or no checkpoint yet is 404, a key that is not
    of the operator's key type 400; a key without state is an answer. The control API and
    ``keyscale state serve`` (:mod:`.lookups`) both answer with it."""
    parts = urlsplit(path)
    uid = unquote(parts.path[len("/state/"):])
    keys = parse_qs(parts.query, keep_blank_values=True).get("key", [])
    if not uid or not keys:
        return 400, {"error": "ask GET /state/<uid>?key=KEY (repeat key= for several keys; a key of several columns as a JSON array)"}
    try:
        answers = lookup(uid, keys)
    except InputDataError as e:
        return 400, {"error": str(e)}
    except KeyscaleError as e:
        return 404, {"error": str(e)}
    return 200, answers[0] if len(answers) == 1 else {"answers": answers}


def listen(host: str, port: int, handler: type[BaseHTTPRequestHandler], what: str = "the control API",
            settings: str = "--control-host/--control-port, KEYSCALE_CONTROL_HOST/KEYSCALE_CONTROL_PORT") -> ThreadingHTTPServer:
    """A server on ``host`` (an IPv4 or IPv6 address, or a name) and ``port``; a KeyscaleError
    naming them (``what`` listens there, ``settings`` choose them) if it cannot listen there
    (a port in use, an address this host does not have)."""

    class Server(ThreadingHTTPServer):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

    try:
        return Server((host, port), handler)
    except (OSError, OverflowError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise KeyscaleError(f"{what} cannot listen on {host} port {port}: {reason} (host and port: {settings})") from None


class Bound(NamedTuple):
    """Where a server of :func:`listen` listens: its ``address`` and ``port``, the ``url``
    clients on this machine use, and whether it listens beyond loopback (``any_host``: the
    callers' Host headers then name addresses it cannot know: ``auth.py``)."""

    address: str
    port: int
    url: str
    any_host: bool


def bound(httpd: ThreadingHTTPServer) -> Bound:
    """Where ``httpd`` listens (the control API, ``keyscale state serve``)."""
    address, port = str(httpd.server_address[0]), int(httpd.server_address[1])
    ip = ipaddress.ip_address(address)
    if ip.is_unspecified:  # a wildcard address is reached as loopback
        host = "[::1]" if ip.version == 6 else "127.0.0.1"
    else:
        host = f"[{address}]" if ip.version == 6 else address
    return Bound(address, port, f"http://{host}:{port}", not ip.is_loopback)


class _Handler(BaseHTTPRequestHandler):
    runner: RunningJob
    secret: str
    port: int
    registry: CollectorRegistry
    logins: Logins
    settings: ControlSettings
    any_host: bool  # listening beyond loopback (auth.py: which Host headers are accepted)

    def log_message(self, format: str, *args: Any) -> None:
        return  # requests are logged by what they do, not by the HTTP layer

    def _reply(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _auth_headers(self) -> dict[str, str]:
        return {h: self.headers.get(h) or "" for h in ("Host", "Authorization", "Content-Type", "Cookie", CSRF_HEADER)}

    def _refused(self, method: str) -> bool:
        """Answer a request that is not the owner's (nothing done); True if it was refused."""
        headers = self._auth_headers()
        if method == "GET" and self.path.startswith("/ui/login?"):  # the one-time link carries its own proof
            refusal = check_host(headers, self.port)
        elif method == "GET" and self.path == "/health":
            refusal = check_health(headers, self.port, self.any_host)
        elif method == "GET" and self.path == "/metrics":
            token = self.settings.metrics_token
            refusal = check_metrics(headers, self.port, self.secret, token.current() if token is not None else None,
                                    self.settings.metrics_unauthenticated, self.any_host)
        else:
            refusal = check_request(method, headers, self.port, self.secret, self.logins.sessions, any_host=self.any_host)
        if refusal is None:
            return False
        code, reason = refusal
        try:  # read (and ignore) a small body, so the client sees the answer rather than a reset connection
            length = int(self.headers.get("Content-Length") or 0)
            if 0 < length <= 1 << 16:
                self.rfile.read(length)
        except (ValueError, OSError):
            pass
        log.warning("control API: refused %s %s (%d: %s)", method, self.path, code, reason)
        data = json.dumps({"error": reason}).encode()
        self.send_response(code)
        if code == 401:
            self.send_header("WWW-Authenticate", 'Bearer realm="keyscale"')
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)
        self.close_connection = True
        return True

    def do_GET(self) -> None:
        if self._refused("GET"):
            return
        if self.path == "/status":
            self._reply(200, self.runner.live_status())
        elif self.path == "/history":
            self._reply(200, self.runner.history())
        elif self.path.startswith("/state/"):
            self._state()
        elif self.path.startswith("/ui/login?"):
            token = parse_qs(urlsplit(self.path).query).get("token", [""])[0]
            session = self.logins.redeem(token)
            if session is None:
                self._reply(401, {"error": "this login link is unknown, used or expired: run keyscale dashboard DIR for a new one"})
                return
            log.info("dashboard: a browser logged in with a one-time link")
            self.send_response(303)
            self.send_header("Set-Cookie", f"{SESSION_COOKIE}={session}; HttpOnly; SameSite=Strict; Path=/")
            self.send_header("Location", "/ui/")
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif self.path in ("/ui", "/ui/") or self.path.startswith("/ui/static/"):
            found = static_file("index.html" if self.path in ("/ui", "/ui/") else self.path[len("/ui/static/"):])
            if found is None:
                self._reply(404, {"error": f"no such file: {self.path}"})
                return
            data, ctype = found
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Content-Security-Policy", "default-src 'self'; style-src 'self' 'unsafe-inline'")
            self.end_headers()
            self.wfile.write(data)
        elif self.path == "/health":
            r = self.runner
            code, body = health(r.state, r.query_active(), r.last_committed(), int(time.time() * 1000), r.stop_requested())
            self._reply(code, body)
        elif self.path == "/metrics":
            data = generate_latest(self.registry)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        else:
            self._reply(404, {"error": f"no such endpoint: GET {self.path}"})

    def _state(self) -> None:
        self._reply(*state_reply(self.path, self.runner.lookup_state))

    def do_POST(self) -> None:
        if self._refused("POST"):
            return
        try:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}")
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
        except ValueError as e:
            self._reply(400, {"error": f"bad request body: {e}"})
            return
        refusal = check_request("POST", self._auth_headers(), self.port, self.secret, self.logins.sessions, self.path, body,
                                any_host=self.any_host)
        if refusal is not None:  # a dashboard session naming a path or a file
            code, reason = refusal
            log.warning("control API: refused POST %s (%d: %s)", self.path, code, reason)
            self._reply(code, {"error": reason})
            return
        r = self.runner
        try:
            if self.path == "/rescale":
                p, op = int(body["parallelism"]), body.get("operator")
                r.request_rescale(p, op)
                self._reply(202, {"accepted": True, "parallelism": p, "operator": op})
            elif self.path == "/restart":
                want = body.get("parallelism")
                path = r.request_restart(int(want) if want is not None else None, body.get("job_file"))
                self._reply(200, {"restarting": True, "savepoint": path})
            elif self.path == "/ui/token":
                self._reply(200, {"url": f"http://127.0.0.1:{self.port}/ui/login?token={self.logins.issue()}",
                                  "expires_in_seconds": LOGIN_TTL_SECONDS})
            elif self.path == "/savepoint":
                self._reply(200, {"savepoint": str(r.take_savepoint(body.get("dest")))})
            elif self.path in ("/stop", "/cancel"):
                out: dict[str, Any] = {"stopping": True}
                if self.path == "/stop" and body.get("drain"):
                    log.info("stopping with a drain: event time advances to the end, then a final savepoint")
                    out["savepoint"] = str(r.drain(body.get("dest")))
                elif self.path == "/stop" and body.get("savepoint"):
                    out["savepoint"] = str(r.take_savepoint(body.get("dest"), then_stop=True))
                log.info("stopping at a batch boundary (%s)", "after a savepoint" if "savepoint" in out else "no savepoint")
                r.stop()
                self._reply(200, out)
            else:
                self._reply(404, {"error": f"no such endpoint: POST {self.path}"})
        except (KeyError, TypeError, ValueError) as e:
            self._reply(400, {"error": f"bad request: {e}"})
        except KeyscaleError as e:
            log.error("%s refused: %s (the job keeps running)", self.path.strip("/"), e)
            self._reply(409, {"error": str(e)})


def call(jobdir: JobDir, method: str, path: str, body: dict[str, Any] | None = None, timeout: float = 600) -> dict[str, Any]:
    """Call a running job's control API; a refusal or an unreachable job is a KeyscaleError.

    Reads the job's secret itself: a caller who cannot read ``JOB_DIR/control/secret`` gets a
    KeyscaleError naming that file.
    """
    url = jobdir.read_json(ADDRESS).get("url")
    if not url:
        raise KeyscaleError(f"no job is running in {jobdir.uri} (no control API address)")
    headers = {"Content-Type": "application/json", **auth_header(read_secret(jobdir.store))}
    data = json.dumps(body or {}).encode() if method == "POST" else None
    req = urllib.request.Request(url + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return dict(json.loads(resp.read()))
    except urllib.error.HTTPError as e:
        try:
            msg = json.loads(e.read()).get("error", str(e))
        except ValueError:
            msg = str(e)
        raise KeyscaleError(msg) from None
    except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
        raise KeyscaleError(f"the job in {jobdir.uri} does not answer its control API ({e})") from None
