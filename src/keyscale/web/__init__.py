"""The dashboard a running job serves on its control API (``/ui/``), and who may open it.

The page (``static/``: HTML, JS, CSS and uPlot 1.6.32 from npm, vendored, no CDN) reads
``GET /status`` and ``GET /history`` and posts rescale, savepoint and stop requests like the
CLI. A browser cannot send the control secret, so ``keyscale dashboard DIR`` asks the job
(with the secret) for a one-time login link: opening it within two minutes sets an
HttpOnly, SameSite=Strict session cookie for this run (see
:mod:`keyscale.runtime.control.auth` for the rules a request must pass).

Below the control plane: the pages, their files and the login links, served by a job's
control API (:mod:`keyscale.runtime.control.server`, in the job's driver) and by
``keyscale ui`` (:mod:`keyscale.cli.folder`); imports nothing of keyscale.
"""

from __future__ import annotations

import secrets
import threading
import time
from importlib import resources

__all__ = ["LOGIN_TTL_SECONDS", "Logins", "static_file"]

LOGIN_TTL_SECONDS = 120.0

_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8",
          ".png": "image/png", ".svg": "image/svg+xml", ".LICENSE": "text/plain; charset=utf-8"}


def static_file(name: str) -> tuple[bytes, str] | None:
    """A file of the dashboard (its bytes and content type), or None if there is no such file.

    >>> static_file("index.html")[1]
    'text/html; charset=utf-8'
    >>> static_file("../__init__.py") is None
    True
    """
    if not name or "/" in name or "\\" in name or name.startswith("."):
        return None
    f = resources.files(__package__).joinpath("static", name)
    if not f.is_file():
        return None
    return f.read_bytes(), next((t for ext, t in _TYPES.items() if name.endswith(ext)), "application/octet-stream")


class Logins:
    """One-time login tokens and the dashboard sessions they open (this run only).

    >>> logins = Logins()
    >>> token = logins.issue()
    >>> session = logins.redeem(token)
    >>> session in logins.sessions, logins.redeem(token)
    (True, None)
    """

    def __init__(self, ttl: float = LOGIN_TTL_SECONDS):
        self.ttl = ttl
        self._tokens: dict[str, float] = {}
        self.sessions: set[str] = set()
        self._lock = threading.Lock()

    def issue(self) -> str:
        """A token for one login, valid for ``ttl`` seconds."""
        token = secrets.token_urlsafe(24)
        with self._lock:
            self._tokens[token] = time.monotonic() + self.ttl
        return token

    def redeem(self, token: str) -> str | None:
        """A new session id for a valid, unused token (which is then spent); else None."""
        with self._lock:
            expires = self._tokens.pop(token, None)
            if expires is None or time.monotonic() > expires:
                return None
            session = secrets.token_urlsafe(32)
            self.sessions.add(session)
            return session
