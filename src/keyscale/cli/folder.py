"""``keyscale ui FOLDER``: one page for every job under a folder, with a link to each
running job's dashboard (the process of ``keyscale ui``, not a job's).

Above the control plane: it reads job directories' status (:mod:`keyscale.runtime.control.jobstatus`),
checks requests with the control API's rules and calls each job's control API; its page
is one of :mod:`keyscale.web`'s files.

The server runs as the user who starts it and listens on 127.0.0.1. It is opened like a
job's dashboard, by a one-time link it prints (session cookie, Host check: see
:mod:`keyscale.runtime.control.auth`); from there, "open" asks the chosen job for a
one-time dashboard link with that job's own secret, which this user can read only if the
job is theirs, and sends the browser to it.
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from keyscale.errors import KeyscaleError
from keyscale.runtime.control.auth import SESSION_COOKIE, check_host, check_request
from keyscale.runtime.control.jobstatus import find_jobs, status_dict
from keyscale.web import Logins, static_file

__all__ = ["FolderServer", "folder_rows"]

log = logging.getLogger("keyscale")


def folder_rows(folder: str) -> list[dict[str, Any]]:
    """One row per job directory under ``folder``: name, state, parallelism, last checkpoint,
    last error; a directory that cannot be read is a row that says why."""
    rows: list[dict[str, Any]] = []
    for d in find_jobs(folder):
        try:
            st = status_dict(d)
        except KeyscaleError as e:
            rows.append({"dir": d, "job": "?", "state": "unreadable", "error": str(e)})
            continue
        rows.append({
            "dir": d, "job": st["job"], "state": st["state"], "last_checkpoint": st["last_checkpoint"],
            "parallelism": {u: o["parallelism"] for u, o in st["operators"].items()},
            "error": (st.get("last_error") or {}).get("message") if st["state"] == "failed" else None,
        })
    return rows


class FolderServer:
    """Serves the folder page until :meth:`close`; :attr:`login_url` opens it once."""

    def __init__(self, folder: str, port: int = 0):
        self.folder = folder
        self.logins = Logins()
        server = self

        class Handler(_FolderHandler):
            pass

        Handler.server_ref = server
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = int(self.httpd.server_address[1])
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="keyscale-folder-ui", daemon=True)
        self._thread.start()

    @property
    def login_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/ui/login?token={self.logins.issue()}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _FolderHandler(BaseHTTPRequestHandler):
    server_ref: FolderServer

    def log_message(self, format: str, *args: Any) -> None:
        return

    def _send(self, code: int, data: bytes, ctype: str, extra: dict[str, str] | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _json(self, code: int, body: Any) -> None:
        self._send(code, json.dumps(body).encode(), "application/json")

    def do_GET(self) -> None:
        srv = self.server_ref
        headers = {h: self.headers.get(h) or "" for h in ("Host", "Cookie")}
        url = urlsplit(self.path)
        if url.path == "/ui/login":
            refused = check_host(headers, srv.port)
            session = srv.logins.redeem(parse_qs(url.query).get("token", [""])[0]) if refused is None else None
            if session is None:
                self._json(*(refused or (401, {"error": "this login link is unknown, used or expired: run keyscale ui again"})))
                return
            self._send(303, b"", "text/plain", {"Set-Cookie": f"{SESSION_COOKIE}={session}; HttpOnly; SameSite=Strict; Path=/", "Location": "/"})
            return
        # No secret here: only the session cookie a one-time link set opens the page.
        refused = check_request("GET", headers, srv.port, secret="\0no secret: sessions only", sessions=srv.logins.sessions)
        if refused is not None:
            self._json(refused[0], {"error": refused[1]})
            return
        if url.path == "/":
            found = static_file("folder.html")
            assert found is not None
            self._send(200, found[0], found[1], {"Content-Security-Policy": "default-src 'self'"})
        elif url.path == "/jobs":
            self._json(200, {"folder": srv.folder, "jobs": folder_rows(srv.folder)})
        elif url.path == "/open":
            self._open(parse_qs(url.query).get("dir", [""])[0])
        elif url.path.startswith("/static/") and (found := static_file(url.path[len("/static/"):])) is not None:
            self._send(200, found[0], found[1])
        else:
            self._json(404, {"error": f"no such page: {url.path}"})

    def _open(self, job_dir: str) -> None:
        from keyscale.checkpoint.jobdir import JobDir
        from keyscale.runtime.control.server import call

        if job_dir not in find_jobs(self.server_ref.folder):
            self._json(404, {"error": f"{job_dir} is not a job under {self.server_ref.folder}"})
            return
        try:
            link = call(JobDir(job_dir), "POST", "/ui/token", timeout=10)["url"]
        except KeyscaleError as e:
            self._json(409, {"error": f"cannot open the dashboard of {job_dir}: {e}"})
            return
        self._send(303, b"", "text/plain", {"Location": link})
