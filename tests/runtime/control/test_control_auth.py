"""Only the job's owner may call its control API (issue 10, case 11).

A server on 127.0.0.1 with no token and any Content-Type let any local user, or a web page
posting ``text/plain`` to a scanned port, drain, rescale or savepoint the job. These tests
drive the real :class:`ControlServer` over HTTP with a stand-in runner (no Spark), so each
refusal can be checked to have changed nothing.
"""

from __future__ import annotations

import json
import os
import stat
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from keyscale.checkpoint.jobdir import JobDir
from keyscale.errors import KeyscaleError
from keyscale.runtime.control.auth import (
    CSRF_HEADER,
    check_request,
    check_session_scope,
    has_secret,
    new_secret,
    read_secret,
    secret_path,
)
from keyscale.runtime.control.server import ControlServer, call
from keyscale.state.keygroups import check_parallelism
from keyscale.storage import LocalStore


class FakeRunner:
    """What the control server needs of a JobRunner; records every action it is asked for."""

    def __init__(self, jobdir: JobDir):
        self.jobdir = jobdir
        self.actions: list[str] = []
        self.state = "running"

    def request_rescale(self, parallelism: int, operator: str | None = None) -> None:
        check_parallelism(parallelism, 8)  # as JobRunner: the request reaches the job directory
        self.jobdir.request_rescale(parallelism, operator)

    def live_status(self) -> dict[str, Any]:
        self.actions.append("status")
        return {"running": True, "pid": os.getpid()}

    def take_savepoint(self, dest: str | None = None, then_stop: bool = False) -> Path:
        self.actions.append(f"savepoint {dest}")
        return Path(dest or "/sp")

    def drain(self, dest: str | None = None) -> Path:
        self.actions.append(f"drain {dest}")
        return Path(dest or "/sp")

    def stop(self) -> None:
        self.actions.append("stop")

    def request_restart(self, parallelism: int | None, job_file: str | None = None) -> str:
        self.actions.append(f"restart {parallelism} {job_file}")
        return "/sp"


@pytest.fixture
def server(tmp_path: Path) -> Any:
    jd = JobDir(tmp_path / "job")
    jd.claim("count", 8, 8)
    runner = FakeRunner(jd)
    srv = ControlServer(runner)  # type: ignore[arg-type]
    yield srv, runner, jd
    srv.close()


def _request(url: str, method: str = "POST", body: bytes | None = b"{}", headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, data=body if method == "POST" else None, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _owner_headers(jd: JobDir) -> dict[str, str]:
    return {"Content-Type": "application/json", "Authorization": f"Bearer {read_secret(jd.store)}"}


def test_requests_without_the_secret_are_refused_and_change_nothing(server: Any) -> None:
    srv, runner, jd = server
    rescale = json.dumps({"parallelism": 5}).encode()
    # A local user who found the port: no token, JSON body.
    for path, body in [("/rescale", rescale), ("/savepoint", b'{"dest": "/tmp/stolen"}'), ("/stop", b'{"drain": true}'), ("/cancel", b"{}")]:
        code, answer = _request(srv.url + path, body=body, headers={"Content-Type": "application/json"})
        assert code == 401 and "control secret" in answer["error"], (path, code, answer)
    code, _ = _request(srv.url + "/status", method="GET")
    assert code == 401
    # A wrong token, and a token sent without the Bearer scheme.
    code, _ = _request(srv.url + "/rescale", body=rescale, headers={"Content-Type": "application/json", "Authorization": "Bearer nope"})
    assert code == 401
    code, _ = _request(srv.url + "/rescale", body=rescale, headers={"Content-Type": "application/json", "Authorization": read_secret(jd.store)})
    assert code == 401
    assert runner.actions == [] and jd.read_rescale_requests() == {}


def test_a_web_page_cannot_post_text_plain_or_rebind_dns(server: Any) -> None:
    srv, runner, jd = server
    rescale = json.dumps({"parallelism": 5}).encode()
    # The "simple" cross-origin POST a browser sends without a preflight: text/plain, no token.
    code, _ = _request(srv.url + "/rescale", body=rescale, headers={"Content-Type": "text/plain"})
    assert code == 401
    # Even with the secret, a body that is not declared JSON is refused.
    code, answer = _request(srv.url + "/rescale", body=rescale, headers={**_owner_headers(jd), "Content-Type": "text/plain"})
    assert code == 415 and "application/json" in answer["error"]
    # DNS rebinding: the page's own host name now resolves to 127.0.0.1; its Host header says so.
    code, answer = _request(srv.url + "/rescale", body=rescale, headers={**_owner_headers(jd), "Host": f"evil.example:{srv.httpd.server_address[1]}"})
    assert code == 403 and "evil.example" in answer["error"]
    code, _ = _request(srv.url + "/status", method="GET", headers={**_owner_headers(jd), "Host": "127.0.0.1:1"})
    assert code == 403
    assert runner.actions == [] and jd.read_rescale_requests() == {}


def test_the_owner_with_the_secret_is_served(server: Any) -> None:
    srv, runner, jd = server
    port = srv.httpd.server_address[1]
    code, answer = _request(srv.url + "/rescale", body=b'{"parallelism": 5}', headers={**_owner_headers(jd), "Content-Type": "application/json; charset=utf-8"})
    assert code == 202 and answer["parallelism"] == 5 and jd.read_rescale_requests() == {"*": 5}
    code, answer = _request(f"http://localhost:{port}/status", method="GET", headers=_owner_headers(jd))
    assert code == 200 and answer["running"]
    # control.call (the CLI, the supervisor, the benchmarks) reads the secret itself.
    assert call(jd, "POST", "/savepoint", {"dest": "/tmp/sp"})["savepoint"] == "/tmp/sp"
    assert runner.actions == ["status", "savepoint /tmp/sp"]


def test_the_secret_is_owner_only_fresh_per_run_and_gone_after(tmp_path: Path) -> None:
    jd = JobDir(tmp_path / "job")
    jd.claim("count", 8, 8)
    old = os.umask(0)  # even a permissive umask must not widen the file
    try:
        first = ControlServer(FakeRunner(jd))  # type: ignore[arg-type]
    finally:
        os.umask(old)
    path = Path(secret_path(jd.store))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    token = read_secret(jd.store)
    assert len(token) >= 40
    assert [p.name for p in (jd.path / "control").iterdir() if p.name.startswith(".secret")] == []  # no temporary file left
    first.close()
    assert not path.exists()
    second = ControlServer(FakeRunner(jd))  # type: ignore[arg-type]
    try:
        assert read_secret(jd.store) != token
        code, _ = _request(second.url + "/status", method="GET", headers={"Authorization": f"Bearer {token}"})
        assert code == 401  # the last run's secret no longer works
    finally:
        second.close()


def test_new_secret_never_follows_a_planted_symlink(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("keep")
    control = tmp_path / "control"
    control.mkdir()
    (control / "secret").symlink_to(target)
    new_secret(LocalStore(tmp_path))
    assert target.read_text() == "keep" and not (control / "secret").is_symlink()


def test_check_request_rules() -> None:
    ok = {"Host": "127.0.0.1:8000", "Authorization": "Bearer s3cret", "Content-Type": "application/json"}
    assert check_request("POST", ok, 8000, "s3cret") is None
    assert check_request("GET", {**ok, "Content-Type": ""}, 8000, "s3cret") is None
    assert check_request("GET", {**ok, "Host": "LOCALHOST:8000"}, 8000, "s3cret") is None
    assert check_request("POST", {**ok, "Host": ""}, 8000, "s3cret") == (403, "Host header '(none)' is not this server (127.0.0.1:8000 or localhost:8000)")
    assert check_request("POST", {**ok, "Host": "127.0.0.1"}, 8000, "s3cret") is not None
    for auth in ["Bearer s3cre", "Bearer s3cretX", "", "s3cret", "Bearer"]:
        refusal = check_request("POST", {**ok, "Authorization": auth}, 8000, "s3cret")
        assert refusal is not None and refusal[0] == 401, auth
    assert check_request("POST", {**ok, "Authorization": "Basic s3cret"}, 8000, "s3cret") is not None
    assert check_request("POST", {**ok, "Content-Type": "application/x-www-form-urlencoded"}, 8000, "s3cret") == (
        415, "POST bodies must be JSON (Content-Type: application/json), not 'application/x-www-form-urlencoded'")


def test_read_secret_names_the_file_when_missing(tmp_path: Path) -> None:
    with pytest.raises(KeyscaleError, match=str(tmp_path / "control" / "secret")):
        read_secret(LocalStore(tmp_path))


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to act as another user")
def test_another_local_user_cannot_control_the_job(server: Any, tmp_path: Path) -> None:
    """Another local user who can reach the job directory (but not the 0600 secret) is told which file it cannot read."""
    import pwd

    _srv, runner, jd = server
    nobody = pwd.getpwnam("nobody")
    for p in [tmp_path, *tmp_path.parents]:  # a job directory others may look into, as with a 022 umask
        if p != Path("/"):
            p.chmod(p.stat().st_mode | 0o055)
    (jd.path / "control").chmod(0o755)
    ((jd.path / "control") / "http.json").chmod(0o644)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child becomes the other user and calls the API as the CLI would
        try:
            os.close(read_end)
            os.setgid(nobody.pw_gid)
            os.setuid(nobody.pw_uid)
            try:
                call(jd, "POST", "/rescale", {"parallelism": 5})
                msg = "served"
            except KeyscaleError as e:
                msg = f"KeyscaleError: {e}"
            except BaseException as e:  # reported to the parent
                msg = f"{type(e).__name__}: {e}"
            os.write(write_end, msg.encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as f:
        msg = f.read()
    os.waitpid(pid, 0)
    assert msg.startswith("KeyscaleError: cannot read the control secret " + str(secret_path(jd.store))), msg
    assert "permission denied" in msg
    assert runner.actions == [] and jd.read_rescale_requests() == {}


def _dashboard_session(srv: Any, jd: JobDir) -> dict[str, str]:
    """The headers of a browser logged in with a one-time link (``keyscale dashboard DIR``)."""
    import http.client

    link = call(jd, "POST", "/ui/token")["url"]
    conn = http.client.HTTPConnection("127.0.0.1", srv.httpd.server_address[1], timeout=30)
    try:  # the 303 itself: its Set-Cookie is the session
        conn.request("GET", link.split(str(srv.httpd.server_address[1]), 1)[1])
        resp = conn.getresponse()
        assert resp.status == 303, resp.status
        cookie = (resp.getheader("Set-Cookie") or "").split(";", 1)[0]
    finally:
        conn.close()
    assert cookie.startswith("keyscale_session=")
    return {"Cookie": cookie, CSRF_HEADER: "1", "Content-Type": "application/json"}


def test_a_dashboard_session_cannot_name_a_path_or_a_file(server: Any, tmp_path: Path) -> None:
    """Issue 32, case 11: a one-time dashboard link must not grant what only the secret may:
    a savepoint written anywhere (``dest``) or a restart running any file (``job_file``)."""
    srv, runner, jd = server
    browser = _dashboard_session(srv, jd)
    target = tmp_path / "elsewhere"
    for path, body in [("/savepoint", {"dest": str(target)}), ("/stop", {"savepoint": True, "dest": str(target)}),
                       ("/stop", {"drain": True, "dest": str(target)}), ("/restart", {"job_file": str(tmp_path / "evil.py")})]:
        code, answer = _request(srv.url + path, body=json.dumps(body).encode(), headers=browser)
        assert code == 403, (path, body, code, answer)
        assert "control secret" in answer["error"] and ("'dest'" in answer["error"] or "'job_file'" in answer["error"]), answer
    assert runner.actions == [] and not target.exists()
    # What the dashboard's own buttons send is served: a savepoint into the default place, a stop after one, a rescale.
    assert _request(srv.url + "/savepoint", body=b"{}", headers=browser)[0] == 200
    assert _request(srv.url + "/stop", body=b'{"savepoint": true}', headers=browser)[0] == 200
    assert _request(srv.url + "/rescale", body=b'{"parallelism": 3}', headers=browser)[0] == 202
    assert runner.actions == ["savepoint None", "savepoint None", "stop"]
    # The secret's holder may still name both.
    assert call(jd, "POST", "/savepoint", {"dest": str(target)})["savepoint"] == str(target)
    assert call(jd, "POST", "/restart", {"job_file": "/jobs/new.py"})["restarting"]
    assert runner.actions[-2:] == [f"savepoint {target}", "restart None /jobs/new.py"]


def test_session_scope_rules() -> None:
    assert check_session_scope("/savepoint", {}) is None
    assert check_session_scope("/savepoint", {"dest": None}) is None  # names nothing
    assert check_session_scope("/stop", {"savepoint": True}) is None
    assert check_session_scope("/restart", {"parallelism": 4}) is None
    assert check_session_scope("/savepoint", {"dest": "/tmp/x"}) == (
        403, "a dashboard session cannot name 'dest' in POST /savepoint: a request that names a path or a file needs the control "
        "secret (keyscale CLI, or 'Authorization: Bearer <JOB_DIR/control/secret>')")
    refusal = check_session_scope("/restart", {"job_file": "x.py", "dest": "y"})
    assert refusal is not None and refusal[0] == 403 and "'dest' or 'job_file'" in refusal[1]
    # check_request with the body read: a session is refused a path, the secret's holder is not.
    session = {"Host": "127.0.0.1:9", "Cookie": "keyscale_session=s1", CSRF_HEADER: "1", "Content-Type": "application/json"}
    owner = {"Host": "127.0.0.1:9", "Authorization": "Bearer s3cret", "Content-Type": "application/json"}
    assert check_request("POST", session, 9, "s3cret", {"s1"}, "/savepoint", {}) is None
    assert check_request("POST", session, 9, "s3cret", {"s1"}, "/savepoint", {"dest": "/x"})[0] == 403  # type: ignore[index]
    assert check_request("POST", session, 9, "s3cret", {"s1"}, "/restart", {"job_file": "/x.py"})[0] == 403  # type: ignore[index]
    assert check_request("POST", owner, 9, "s3cret", {"s1"}, "/restart", {"job_file": "/x.py", "dest": "/x"}) is None
    assert check_request("POST", {**session, "Cookie": "keyscale_session=s2"}, 9, "s3cret", {"s1"}, "/savepoint", {"dest": "/x"})[0] == 401  # type: ignore[index]
    # Who counts as the secret's holder: the Bearer scheme and the exact secret only.
    assert has_secret({"Authorization": "Bearer s3cret"}, "s3cret") and has_secret({"Authorization": "bearer s3cret "}, "s3cret")
    assert not has_secret({"Authorization": "Bearer s3cre"}, "s3cret") and not has_secret({"Cookie": "keyscale_session=s3cret"}, "s3cret")
    assert not has_secret({}, "s3cret")


def test_close_deletes_only_this_runs_control_files_and_the_heartbeat_restores_them(tmp_path: Path) -> None:
    """Issue 32, case 4: the control secret and address are shared by the job's runs; a run
    deletes them at its end only while they are its own, and the live run writes them again
    (from its heartbeat) if a run it fenced deleted them late."""
    jd = JobDir(tmp_path / "job")
    jd.claim("count", 8, 8)
    srv = ControlServer(FakeRunner(jd))  # type: ignore[arg-type]
    ours = (read_secret(jd.store), jd.read_json("control/http.json"))
    jd.store.delete_many(["control/secret", "control/http.json"])  # a fenced run's late delete
    srv.reassert()
    assert (read_secret(jd.store), jd.read_json("control/http.json")) == ours
    srv.reassert()  # nothing to do: no warning, same files
    # A newer run on another host wrote its own (same URL: another machine's 127.0.0.1).
    theirs = {"url": srv.url, "epoch": 7, "server": "another"}
    jd.store.put("control/secret", b"the-newer-runs-secret", private=True)
    jd.write_json("control/http.json", theirs)
    srv.close()
    assert read_secret(jd.store) == "the-newer-runs-secret" and jd.read_json("control/http.json") == theirs
    srv.reassert()  # a last heartbeat after the close: writes nothing
    assert read_secret(jd.store) == "the-newer-runs-secret" and jd.read_json("control/http.json") == theirs


def test_a_fenced_runs_heartbeat_writes_neither_status_nor_control_files(tmp_path: Path) -> None:
    """The heartbeat checks the epoch before each beat's writes: once a newer run claimed the
    job directory, this run's heartbeat stops, writing nothing more."""
    from keyscale.checkpoint.fence import epoch_key
    from keyscale.runtime.driver.heartbeat import Heartbeat

    jd = JobDir(tmp_path / "job")
    jd.claim("count", 8, 8)
    jd.claim_epoch()
    written: list[str] = []
    beat = Heartbeat(jd, lambda: {"pid": os.getpid()}, every=3600)
    beat.also = lambda: written.append("control files")
    beat._beat()
    assert jd.read_status()["epoch"] == jd.epoch and written == ["control files"]
    jd.store.create(epoch_key(jd.epoch + 1), b"{}")  # a newer run
    jd.store.put("status.json", b'{"running": true, "epoch": 2}')
    assert not beat._beat()  # fenced: the heartbeat stops
    beat.close()
    assert jd.read_status() == {"running": True, "epoch": 2} and written == ["control files"]
