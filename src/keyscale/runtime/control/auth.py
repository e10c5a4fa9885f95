"""Who may call a running job's control API: a per-run secret, the Host header, JSON bodies.

The control API can drain a job, rescale it and write a savepoint of all its state to any
path, so it must answer only its owner. Listening on 127.0.0.1 is not enough: every local
user can reach that address, and so can a web page in the owner's browser (a ``text/plain``
POST needs no CORS preflight; DNS rebinding makes a page's own host name resolve to
127.0.0.1). Three rules close those doors:

- **A secret** in ``JOB_DIR/control/secret``, mode 0600 from the moment it exists (created
  with ``os.open(..., 0o600)`` under a temporary name, then renamed), is required on every
  request as ``Authorization: Bearer <secret>``. Only the user who runs the job can read it;
  a browser cannot know it and cannot send the header without a preflight the server never
  grants.
- **The Host header** must name the server itself (``127.0.0.1:<port>`` or
  ``localhost:<port>``), which a rebound host name never does.
- **POST bodies are JSON** (``Content-Type: application/json``), which a page can only send
  after a preflight.

A browser on the dashboard holds a session from a one-time login link instead of the secret
(:mod:`keyscale.web`). A session acts on *this* job only: it may rescale, take a savepoint
into the job directory's default place and stop, as the dashboard's buttons do, but never
name a path or a file (``dest``, ``job_file``: :func:`check_session_scope`). A path in a
request makes the job write anywhere its owner can (a savepoint over another file) or run
any file as its owner (a restart with another job file); only the secret's holder, who can
do that already, may ask for it. A leaked or stolen login link stays worth no more than the
dashboard.

The secret is **regenerated on every run** (not kept for the job directory's life): clients
read it at each call, so rotation costs them nothing, and a secret that leaked (a copy of the
job directory, a backup, a log of a debugging session) stops working when the job restarts.
It is removed when the run ends cleanly, if it is still the run's own (a run that a newer one
took over leaves the newer run's secret alone: :meth:`keyscale.runtime.control.server.ControlServer.close`);
a killed run leaves it (still 0600), and the next run replaces it before it serves.

**Beyond one machine** (``--control-host 0.0.0.0``, for a Kubernetes probe or Prometheus in
another pod) the Host header names whatever address the caller used (a pod IP, a Service
name), so it cannot be checked against a list; it is not needed either where a credential
decides: a request with the secret or the metrics token is served whatever its Host (a page
that rebinds a name still cannot know them). What a browser carries by itself, a dashboard
session cookie or a login link, still needs Host ``127.0.0.1``/``localhost`` (reach the
dashboard through a tunnel or ``kubectl port-forward`` to the same port number).

Two endpoints may answer without the secret: ``GET /health`` always (state only: what a
liveness probe, which cannot read a file of the job directory, needs), and ``GET /metrics``
with the operator's stable token or, if they chose so, with nothing
(:mod:`keyscale.runtime.control.settings`). ``/metrics`` still answers the secret too.

The checks are pure functions of the request so they can be tested without a server.
"""

from __future__ import annotations

import hmac
import secrets
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from keyscale.errors import KeyscaleError
from keyscale.storage import Store

SECRET = "control/secret"


def secret_path(store: Store) -> str:
    """Where a job directory's control secret lives (``JOB_DIR/control/secret``)."""
    return store.url(SECRET)


def new_secret(store: Store) -> str:
    """Write a fresh secret to ``JOB_DIR/control/secret``; return it. On local disk the file
    is readable by its owner only (created 0600 under a unique temporary name, never another
    user's file or a symlink, and renamed into place); on an object store, the bucket's
    permissions decide who can read it, as they decide who can read the job's state."""
    token = secrets.token_urlsafe(32)
    store.put(SECRET, token.encode(), private=True)
    return token


def read_secret(store: Store) -> str:
    """The running job's secret, as a client reads it; a :class:`KeyscaleError` naming the file if it cannot."""
    path = secret_path(store)
    try:
        token = (store.get_text(SECRET) or "").strip() if store.exists(SECRET) else None
    except PermissionError:
        raise KeyscaleError(
            f"cannot read the control secret {path} (permission denied): only the user who runs the job "
            f"({_owner(Path(path))}) can control it"
        ) from None
    if token is None:
        raise KeyscaleError(f"the job has no control secret {path}: it is not running, or was started by a keyscale "
                            "without an authenticated control API")
    if not token:
        raise KeyscaleError(f"the control secret {path} is empty")
    return token


def _owner(path: Path) -> str:
    try:
        uid = path.stat().st_uid
    except OSError:
        return "its owner"
    try:
        import pwd

        return f"user {pwd.getpwuid(uid).pw_name}"
    except (ImportError, KeyError):
        return f"uid {uid}"


SESSION_COOKIE = "keyscale_session"
CSRF_HEADER = "X-Keyscale-Request"


def session_of(cookie_header: str) -> str:
    """The dashboard session id in a ``Cookie`` header ('' if none).

    >>> session_of("a=1; keyscale_session=abc; b=2")
    'abc'
    """
    for part in cookie_header.split(";"):
        name, _, value = part.strip().partition("=")
        if name == SESSION_COOKIE:
            return value
    return ""


def check_host(headers: Mapping[str, str], port: int) -> tuple[int, str] | None:
    """A foreign Host header (DNS rebinding): 403, else None."""
    host = (headers.get("Host") or "").strip().lower()
    if host not in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}"):
        return 403, f"Host header {host or '(none)'!r} is not this server (127.0.0.1:{port} or localhost:{port})"
    return None


def check_health(headers: Mapping[str, str], port: int, any_host: bool = False) -> tuple[int, str] | None:
    """``GET /health`` needs no credential: it tells the job's state, nothing else. On
    loopback the Host header is checked as for every request (a rebound page learns
    nothing); with ``any_host`` (listening beyond loopback) anyone who can connect may ask."""
    return None if any_host else check_host(headers, port)


def check_metrics(headers: Mapping[str, str], port: int, secret: str, token: str | None = None,
                  unauthenticated: bool = False, any_host: bool = False) -> tuple[int, str] | None:
    """``GET /metrics``: the operator's stable ``token`` or the per-run ``secret`` as a bearer
    token, or nothing if the operator made it ``unauthenticated``; 401 otherwise.

    >>> check_metrics({"Host": "10.0.0.7:9464", "Authorization": "Bearer t0k"}, 9464, "s", token="t0k", any_host=True) is None
    True
    >>> check_metrics({"Host": "127.0.0.1:9464", "Authorization": "Bearer wrong"}, 9464, "s", token="t0k")[0]
    401
    """
    if not any_host:
        refused = check_host(headers, port)
        if refused is not None:
            return refused
    if unauthenticated or has_secret(headers, secret) or (token is not None and has_secret(headers, token)):
        return None
    need = "the metrics token" if token is not None else "the control secret (JOB_DIR/control/secret)"
    return 401, f"missing or wrong credential for /metrics: send 'Authorization: Bearer <{need}>'"


def check_request(method: str, headers: Mapping[str, str], port: int, secret: str,
                  sessions: Collection[str] = (), path: str = "", body: Mapping[str, Any] | None = None,
                  any_host: bool = False) -> tuple[int, str] | None:
    """Refuse a request that is not the owner's: ``(status, reason)``, or None to serve it.

    In order: a foreign Host (403), a missing or wrong secret (401), a POST body that is not
    JSON (415). Nothing of the request has been acted on when it is refused.

    A browser on the dashboard carries no secret but the session cookie its one-time login
    link set (``sessions``: the ids this run issued; HttpOnly, SameSite=Strict); its POSTs
    must also carry the ``X-Keyscale-Request`` header, which a page of another site cannot
    send without a CORS preflight the server never grants (403 otherwise), and, once the
    body is read (``path``, ``body``: the server checks again then), may not name a path or
    a file (403, :func:`check_session_scope`).

    ``any_host``: the server listens beyond loopback; a request with the secret is served
    whatever its Host header, a dashboard session's still needs 127.0.0.1 or localhost.
    """
    if not any_host:
        refused = check_host(headers, port)
        if refused is not None:
            return refused
    by_secret = has_secret(headers, secret)
    session = session_of(headers.get("Cookie") or "")
    by_session = bool(session) and any(hmac.compare_digest(session.encode(), s.encode()) for s in sessions)
    if not by_secret and not by_session:
        return 401, "missing or wrong control secret: send 'Authorization: Bearer <JOB_DIR/control/secret>'"
    if any_host and not by_secret:  # a browser's session: DNS rebinding is still a browser's attack
        refused = check_host(headers, port)
        if refused is not None:
            return refused
    if method == "POST" and not by_secret and not headers.get(CSRF_HEADER):
        return 403, f"a dashboard request must carry the {CSRF_HEADER} header"
    if method == "POST":
        ctype = (headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()
        if ctype != "application/json":
            return 415, f"POST bodies must be JSON (Content-Type: application/json), not {ctype or '(none)'!r}"
    if body is not None and not by_secret:
        return check_session_scope(path, body)
    return None


def has_secret(headers: Mapping[str, str], secret: str) -> bool:
    """Whether the request carries the job's secret (``Authorization: Bearer <secret>``)."""
    scheme, _, token = (headers.get("Authorization") or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), secret.encode())


# Fields of a POST body that name a path or a file: the job would write there (a savepoint's
# ``dest``, also of /stop) or run it (/restart's ``job_file``). Secret holders only.
PATH_FIELDS = ("dest", "job_file")


def check_session_scope(path: str, body: Mapping[str, Any]) -> tuple[int, str] | None:
    """Refuse a dashboard session's POST ``path`` whose ``body`` names a path or a file: 403
    and why; None to serve it. Call it for requests without the secret only (the secret's
    holder may ask for anything). A field sent as null names nothing and is allowed.

    >>> check_session_scope("/savepoint", {}) is None
    True
    >>> check_session_scope("/savepoint", {"dest": "/home/me/.bashrc"})[0]
    403
    """
    named = [f for f in PATH_FIELDS if body.get(f) is not None]
    if named:
        return 403, (f"a dashboard session cannot name {' or '.join(repr(f) for f in named)} in POST {path}: "
                     "a request that names a path or a file needs the control secret (keyscale CLI, or "
                     "'Authorization: Bearer <JOB_DIR/control/secret>')")
    return None


def auth_header(secret: str) -> dict[str, str]:
    """The header a client sends with every request."""
    return {"Authorization": f"Bearer {secret}"}
