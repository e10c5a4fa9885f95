"""``keyscale state serve`` (issue 37): the control API's ``GET /state`` from a process of its own.

Its answers equal the whole read of the checkpoint they name (the model of
tests/state_processor/test_lookup.py) and move to a newer checkpoint within ``max_age``;
a checkpoint whose files retention deleted under a cached manifest is replaced, not an
error; ``/state`` needs the token (read again at each request) and, on loopback, a Host
naming the server; the command prints where it listens and ends on SIGTERM. The same
server beside a running job, live rescaled, on local disk and S3:
tests/state_processor/test_lookup.py::test_a_running_job_answers_lookups_through_a_live_rescale.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from tests.runtime.control.test_control_settings import outside_address
from tests.state_processor.test_lookup import _check, _job, _model

from keyscale.checkpoint.jobdir import JobDir
from keyscale.checkpoint.manifest import Manifest, restore_chain
from keyscale.errors import KeyscaleError
from keyscale.runtime.control.lookups import LookupServer
from keyscale.runtime.control.settings import BearerToken


def _get(url: str, token: str | None = None, host: str | None = None) -> tuple[int, dict[str, Any]]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    if host:
        headers["Host"] = host
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text("first-token\n")
    return path


def test_answers_equal_the_whole_read_and_need_the_token(tmp_path: Path, token_file: Path) -> None:
    jd = _job(tmp_path / "job")
    model = _model(jd, 3)
    server = LookupServer(str(tmp_path / "job"), token=BearerToken(file=str(token_file), origin="test", kind="state lookup"))
    try:
        users = [f"u{i}" for i in range(0, 300, 7)] + ["nobody"]
        query = "&".join(f"key={u}" for u in users)
        code, body = _get(f"{server.url}/state/op?{query}", "first-token")
        assert code == 200
        for user, answer in zip(users, body["answers"], strict=True):
            _check(answer, model.get(user), 3)
        assert _get(f"{server.url}/state/op?key={users[0]}", "first-token") == (200, body["answers"][0])  # one key: the answer alone
        # A service keeps its connection: several requests on one, a refused one among them.
        conn = http.client.HTTPConnection(urlsplit(server.url).netloc, timeout=30)
        for token, code in (("first-token", 200), ("wrong", 401), ("first-token", 200)):
            conn.request("GET", "/state/op?key=u1", headers={"Authorization": f"Bearer {token}"})
            reply = conn.getresponse()
            assert (reply.status, json.loads(reply.read()).get("batch")) == (code, 3 if code == 200 else None)
        conn.close()

        assert _get(f"{server.url}/state/op?key=u1")[0] == 401
        assert _get(f"{server.url}/state/op?key=u1", "wrong")[0] == 401
        port = server.url.rsplit(":", 1)[1]
        assert _get(f"{server.url}/state/op?key=u1", "first-token", host=f"evil.example:{port}")[0] == 403
        code, err = _get(f"{server.url}/state/nope?key=u1", "first-token")
        assert code == 404 and "operator 'nope' does not exist" in err["error"]
        assert _get(f"{server.url}/state/op", "first-token")[0] == 400
        assert _get(f"{server.url}/health") == (200, {"job": "job", "batch": 3})  # no credential needed

        token_file.write_text("second-token\n")  # a mounted secret rotated: read again at each request
        assert _get(f"{server.url}/state/op?key=u1", "first-token")[0] == 401
        assert _get(f"{server.url}/state/op?key=u1", "second-token")[0] == 200
    finally:
        server.close()


def test_answers_move_to_a_newer_checkpoint_and_past_files_retention_deleted(tmp_path: Path) -> None:
    jd = _job(tmp_path / "job")
    server = LookupServer(str(tmp_path / "job"), unauthenticated=True, max_age=3600)
    try:
        assert _get(f"{server.url}/state/op?key=u1")[1]["batch"] == 3
        # A newer checkpoint (the same state as batch 3), and retention deletes batch 3's own
        # files: the cached manifest names files that are gone, so the lookup lists again.
        m3 = jd.read_manifest(3)
        model = _model(jd, 3)
        # A key not read yet whose restore chain has one of the files deleted below, not read
        # for u1 either (a small delta u1's lookup read is held whole: no read would fail).
        read = set(restore_chain(m3.operators["op"].files, model["u1"]["key_group"]))
        user = next(u for u, row in model.items() if u != "u1"
                    and any(f.batch == 3 and f not in read for f in restore_chain(m3.operators["op"].files, row["key_group"])))
        jd.commit(Manifest("job", 4, 4000, m3.operators))
        moved = []
        for f in m3.operators["op"].files:  # batch 3's files under other names: the same state at batch 5
            if f.batch == 3:
                new_path = f.path.replace("000000000003-", "000000000005-")
                jd.store.put(new_path, jd.store.get(f.path))
                jd.store.delete(f.path)
                f = dataclasses.replace(f, path=new_path)
            moved.append(f)
        op = dataclasses.replace(m3.operators["op"], files=tuple(moved))
        jd.commit(Manifest("job", 5, 5000, {**m3.operators, "op": op}))
        code, body = _get(f"{server.url}/state/op?key={user}")
        assert code == 200, body
        _check(body, model[user], 5)
    finally:
        server.close()
    fresh = LookupServer(str(tmp_path / "job"), unauthenticated=True, max_age=0)
    try:
        assert _get(f"{fresh.url}/state/op?key=u1")[1]["batch"] == 5
    finally:
        fresh.close()


def test_health_is_503_until_a_checkpoint_commits(tmp_path: Path) -> None:
    jd = JobDir(tmp_path / "job")
    jd.claim("job", 16, 16)
    server = LookupServer(str(tmp_path / "job"), unauthenticated=True, max_age=0)
    try:
        code, body = _get(f"{server.url}/health")
        assert code == 503 and "has no committed checkpoint yet" in body["error"]
        assert _get(f"{server.url}/state/op?key=u1")[0] == 404
    finally:
        server.close()


@pytest.mark.skipif(outside_address() is None, reason="this machine has no address but loopback")
def test_on_every_address_a_pod_ip_caller_needs_the_token_alone(tmp_path: Path) -> None:
    """``--host 0.0.0.0``: a Service reaches the server at the pod's IP (its Host header says
    so); /state still needs the token, /health nothing."""
    jd = _job(tmp_path / "job", users=20)
    model = _model(jd, 3)
    server = LookupServer(str(tmp_path / "job"), host="0.0.0.0", token=BearerToken(value="pod-token"))
    try:
        assert server.url.startswith("http://127.0.0.1:")  # clients on this host
        outside = f"http://{outside_address()}:{server.url.rsplit(':', 1)[1]}"
        assert _get(f"{outside}/health") == (200, {"job": "job", "batch": 3})
        assert _get(f"{outside}/state/op?key=u2")[0] == 401
        code, answer = _get(f"{outside}/state/op?key=u2", "pod-token")
        assert code == 200
        _check(answer, model.get("u2"), 3)
    finally:
        server.close()


@pytest.mark.parametrize(("kwargs", "said"), [
    ({}, "needs a token (--token-file) or --unauthenticated"),
    ({"unauthenticated": True, "token": BearerToken(value="t")}, "needs a token (--token-file) or --unauthenticated"),
    ({"unauthenticated": True, "max_age": -1}, "--max-age -1: give 0 or more seconds"),
])
def test_settings_it_cannot_serve_are_errors(tmp_path: Path, kwargs: dict[str, Any], said: str) -> None:
    _job(tmp_path / "job", users=10)
    with pytest.raises(KeyscaleError, match=re.escape(said)):
        LookupServer(str(tmp_path / "job"), **kwargs)


def test_the_command_says_where_it_listens_and_ends_on_sigterm(tmp_path: Path, token_file: Path) -> None:
    jd = _job(tmp_path / "job", users=50)
    model = _model(jd, 3)
    cmd = [sys.executable, "-m", "keyscale.cli.main", "state", "serve", str(tmp_path / "job"), "--token-file", str(token_file)]
    with subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True) as proc:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        assert "checkpoint 3 now" in line and f"with the token of {token_file}" in line, line
        url = re.search(r"at (http://\S+) ", line)
        assert url is not None, line
        code, answer = _get(f"{url.group(1)}/state/op?key=u3", "first-token")
        assert code == 200
        _check(answer, model.get("u3"), 3)
        proc.send_signal(signal.SIGTERM)
        rest = proc.stderr.read()
    assert proc.returncode == 0 and "stopped" in rest


@pytest.mark.parametrize(("args", "said"), [
    (["--unauthenticated", "{tmp}/nowhere"], "{tmp}/nowhere is not a keyscale job directory (no job.json)"),
    (["--token-file", "{tmp}/missing", "{tmp}/job"], "the state lookup token file {tmp}/missing (--token-file) does not exist"),
    (["{tmp}/job"], "one of the arguments --token-file --unauthenticated is required"),
])
def test_the_commands_mistakes_are_one_line_errors(tmp_path: Path, args: list[str], said: str) -> None:
    _job(tmp_path / "job", users=10)
    run = subprocess.run([sys.executable, "-m", "keyscale.cli.main", "state", "serve", *(a.format(tmp=tmp_path) for a in args)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and said.format(tmp=tmp_path) in run.stderr, run.stderr
