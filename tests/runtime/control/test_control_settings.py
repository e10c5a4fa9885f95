"""The control API outside one laptop (issue 33, item 3): where it listens, /health without
the secret for a Kubernetes probe, /metrics with the operator's stable token (or none, if
they say so), and a clear error at start for a setting keyscale cannot serve.

The servers here are the real :class:`ControlServer` over HTTP with a stand-in runner (no
Spark); tests/api/test_prometheus_scrape.py has a real job scraped by a real Prometheus.
"""

from __future__ import annotations

import json
import os
import re
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from keyscale.checkpoint.jobdir import JobDir
from keyscale.checkpoint.manifest import Manifest
from keyscale.errors import KeyscaleError
from keyscale.runtime.batch.jobstate import RunOptions, RunSummary
from keyscale.runtime.control.auth import read_secret
from keyscale.runtime.control.server import ADDRESS, ControlServer, call
from keyscale.runtime.control.settings import BearerToken, ControlSettings, control_settings


def outside_address() -> str | None:
    """An address of this machine that is not loopback (the one its default route leaves
    from), as a pod IP is; None if it has none. A UDP connect sends nothing."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))
        except OSError:
            return None
        ip = str(s.getsockname()[0])
    return None if ip.startswith("127.") or ip == "0.0.0.0" else ip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Runner:
    """What the control server needs of a JobRunner, for a job that committed batch 4."""

    def __init__(self, jobdir: JobDir):
        self.jobdir = jobdir
        self.actions: list[str] = []
        self.state = "running"
        self.committed = Manifest(job="rc", batch=4, batch_time_ms=1, operators={}, created_ms=1)
        self.summary = RunSummary("rc", str(jobdir.uri))
        self.stopping = False

    def last_committed(self) -> Manifest:
        return self.committed

    def live_status(self) -> dict[str, Any]:
        self.actions.append("status")
        return {"job": "rc", "state": self.state, "operators": {"totals": {"parallelism": 2}}}

    def query_active(self) -> bool:
        return self.state == "running"

    def stop_requested(self) -> bool:
        return self.stopping

    def stop(self) -> None:
        self.actions.append("stop")


def _get(url: str, headers: dict[str, str] | None = None, method: str = "GET") -> tuple[int, str]:
    req = urllib.request.Request(url, method=method, headers=headers or {}, data=b"{}" if method == "POST" else None)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.fixture
def jobdir(tmp_path: Path) -> JobDir:
    jd = JobDir(tmp_path / "job")
    jd.claim("rc", 8, 8)
    return jd


@contextmanager
def _serve(jd: JobDir, settings: ControlSettings) -> Iterator[tuple[ControlServer, Runner]]:
    runner = Runner(jd)
    srv = ControlServer(runner, settings)  # type: ignore[arg-type]
    try:
        yield srv, runner
    finally:
        srv.close()


# -- settings: options, environment, errors ---------------------------------------------------


def _opts(**kw: Any) -> RunOptions:
    return RunOptions(job_file="j.py", job_dir="d", **kw)


def test_defaults_keep_the_control_api_on_loopback_with_the_secret() -> None:
    s = control_settings(_opts(), {})
    assert (s.host, s.port, s.metrics_token, s.metrics_unauthenticated) == ("127.0.0.1", 0, None, False)


def test_options_win_over_the_environment(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("from-file\n")  # a Secret's value often ends with a newline
    env = {"KEYSCALE_CONTROL_HOST": "0.0.0.0", "KEYSCALE_CONTROL_PORT": "9464", "KEYSCALE_METRICS_UNAUTHENTICATED": "true"}
    s = control_settings(_opts(), env)
    assert (s.host, s.port, s.metrics_unauthenticated) == ("0.0.0.0", 9464, True)
    s = control_settings(_opts(control_host="127.0.0.1", control_port=7000, metrics_unauthenticated=False,
                               metrics_token_file=token), env)  # a Path, as a Python caller gives it
    assert (s.host, s.port, s.metrics_unauthenticated) == ("127.0.0.1", 7000, False)
    assert s.metrics_token is not None and s.metrics_token.current() == "from-file"
    s = control_settings(_opts(), {"KEYSCALE_METRICS_TOKEN": " t0k "})
    assert s.metrics_token is not None and s.metrics_token.current() == "t0k"


@pytest.mark.parametrize(("opts", "env", "error"), [
    ({"metrics_token_file": "/nonexistent/token"}, {}, "the metrics token file /nonexistent/token (metrics_token_file (--metrics-token-file)) does not exist"),
    ({}, {"KEYSCALE_METRICS_TOKEN_FILE": "EMPTY"}, "(KEYSCALE_METRICS_TOKEN_FILE) is empty"),
    ({}, {"KEYSCALE_METRICS_TOKEN_FILE": ""}, "KEYSCALE_METRICS_TOKEN_FILE is set but names no file"),
    ({}, {"KEYSCALE_METRICS_TOKEN": "  "}, "KEYSCALE_METRICS_TOKEN is set but empty"),
    ({}, {"KEYSCALE_METRICS_TOKEN": "a b"}, "KEYSCALE_METRICS_TOKEN contains white space"),
    ({}, {"KEYSCALE_METRICS_TOKEN_FILE": "TOKEN", "KEYSCALE_METRICS_TOKEN": "x"},
     "the /metrics token is given twice (KEYSCALE_METRICS_TOKEN_FILE and KEYSCALE_METRICS_TOKEN): give one"),
    ({"metrics_unauthenticated": True}, {"KEYSCALE_METRICS_TOKEN": "x"}, "/metrics cannot both need a token (KEYSCALE_METRICS_TOKEN) and be unauthenticated"),
    ({}, {"KEYSCALE_METRICS_UNAUTHENTICATED": "maybe"}, "KEYSCALE_METRICS_UNAUTHENTICATED must be true or false (1/0, yes/no), not 'maybe'"),
    ({}, {"KEYSCALE_CONTROL_PORT": "http"}, "KEYSCALE_CONTROL_PORT must be a port number (0 for any free port), not 'http'"),
    ({"control_port": 70000}, {}, "control_port (--control-port) must be a port number from 0 to 65535"),
    ({}, {"KEYSCALE_CONTROL_HOST": ""}, "KEYSCALE_CONTROL_HOST must be an address to listen on"),
])
def test_a_setting_keyscale_cannot_serve_is_an_error_naming_it(tmp_path: Path, opts: dict[str, Any], env: dict[str, str], error: str) -> None:
    (tmp_path / "EMPTY").write_text("\n")
    (tmp_path / "TOKEN").write_text("t")
    env = {k: str(tmp_path / v) if k == "KEYSCALE_METRICS_TOKEN_FILE" and v else v for k, v in env.items()}
    with pytest.raises(KeyscaleError) as e:
        control_settings(_opts(**opts), env)
    assert error in str(e.value)


def test_a_rotated_token_file_takes_effect_and_a_broken_one_keeps_the_last(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "token"
    path.write_text("one")
    token = BearerToken(file=str(path), origin="test")
    path.write_text("two")  # a Kubernetes Secret volume is updated in place when the Secret rotates
    assert token.current() == "two"
    path.write_text("")
    assert token.current() == token.current() == "two"
    assert [r.getMessage() for r in caplog.records] == [f"the metrics token file {path} (test) is empty; the previous token stays in force"]


# -- the server: what a probe and Prometheus get ----------------------------------------------


def test_on_loopback_by_default_health_needs_no_secret_and_nothing_else_changed(jobdir: JobDir) -> None:
    with _serve(jobdir, ControlSettings()) as (srv, runner):
        assert srv.httpd.server_address[0] == "127.0.0.1"
        code, body = _get(srv.url + "/health")
        health = json.loads(body)
        assert code == 200 and health["status"] == "ok" and health["state"] == "running" and health["last_checkpoint"] == 4
        # State only: nothing that names the job, its paths or its errors.
        assert set(health) == {"status", "state", "last_checkpoint", "last_checkpoint_age_seconds"}
        assert health["last_checkpoint_age_seconds"] > 0
        assert _get(srv.url + "/metrics")[0] == 401
        assert _get(srv.url + "/status")[0] == 401
        port = srv.httpd.server_address[1]
        assert _get(srv.url + "/health", {"Host": f"evil.example:{port}"})[0] == 403  # DNS rebinding, as before
        assert runner.actions == []


def test_health_codes_for_probes(jobdir: JobDir) -> None:
    with _serve(jobdir, ControlSettings()) as (srv, runner):
        runner.stopping = True  # a stop asked for: the job ends by itself, a probe must not cut its savepoint short
        code, body = _get(srv.url + "/health")
        assert code == 200 and json.loads(body)["state"] == "stopping"
        runner.stopping = False
        runner.state = "failed"
        code, body = _get(srv.url + "/health")
        assert code == 503 and json.loads(body)["reason"] == "the job is failed"


def test_metrics_with_the_operators_token_wrong_token_no_token(jobdir: JobDir, tmp_path: Path) -> None:
    (tmp_path / "token").write_text("op-token-123\n")
    settings = control_settings(_opts(metrics_token_file=str(tmp_path / "token")), {})
    with _serve(jobdir, settings) as (srv, runner):
        code, text = _get(srv.url + "/metrics", {"Authorization": "Bearer op-token-123"})
        assert code == 200 and 'keyscale_operator_parallelism{job="rc",operator="totals"} 2.0' in text
        code, text = _get(srv.url + "/metrics", {"Authorization": "Bearer op-token-12"})
        assert code == 401 and "metrics token" in json.loads(text)["error"]
        assert _get(srv.url + "/metrics")[0] == 401
        # The per-run secret still works for /metrics (the CLI, existing scrape configs).
        assert _get(srv.url + "/metrics", {"Authorization": f"Bearer {read_secret(jobdir.store)}"})[0] == 200
        # The metrics token opens /metrics only.
        for path in ("/status", "/history"):
            assert _get(srv.url + path, {"Authorization": "Bearer op-token-123"})[0] == 401
        assert _get(srv.url + "/stop", {"Authorization": "Bearer op-token-123", "Content-Type": "application/json"}, "POST")[0] == 401
        assert runner.actions == ["status", "status"]  # the two scrapes, nothing else


def test_metrics_unauthenticated_when_the_operator_says_so(jobdir: JobDir) -> None:
    with _serve(jobdir, ControlSettings(metrics_unauthenticated=True)) as (srv, _runner):
        assert _get(srv.url + "/metrics")[0] == 200
        assert _get(srv.url + "/status")[0] == 401


@pytest.mark.skipif(outside_address() is None, reason="this machine has no address but loopback")
def test_bound_beyond_loopback_a_pod_ip_caller_is_served_by_credential(jobdir: JobDir, tmp_path: Path) -> None:
    """``--control-host 0.0.0.0``: a kubelet or Prometheus reaches the job at the pod's IP
    (their Host header says so); every sensitive endpoint still needs the secret."""
    ip = outside_address()
    port = free_port()
    (tmp_path / "token").write_text("op-token")
    settings = control_settings(_opts(control_host="0.0.0.0", control_port=port, metrics_token_file=str(tmp_path / "token")), {})
    with _serve(jobdir, settings) as (srv, runner):
        assert srv.httpd.server_address[1] == port
        assert jobdir.read_json(ADDRESS)["url"] == f"http://127.0.0.1:{port}"  # clients on this host, as before
        outside = f"http://{ip}:{port}"
        code, body = _get(outside + "/health")
        assert code == 200 and json.loads(body)["state"] == "running"
        assert _get(outside + "/metrics", {"Authorization": "Bearer op-token"})[0] == 200
        assert _get(outside + "/metrics", {"Authorization": "Bearer nope"})[0] == 401
        secret = {"Authorization": f"Bearer {read_secret(jobdir.store)}", "Content-Type": "application/json"}
        every_other = [("/status", "GET"), ("/history", "GET"), ("/ui/", "GET"), ("/ui/static/dashboard.js", "GET")] + [
            (p, "POST") for p in ("/rescale", "/savepoint", "/stop", "/restart", "/cancel", "/ui/token")]
        for path, method in every_other:
            code, body = _get(outside + path, {"Content-Type": "application/json"}, method)
            assert code == 401 and "control secret" in json.loads(body)["error"], (path, code, body)
        assert runner.actions == ["status"]  # the one scrape with the token; nothing was stopped or rescaled
        assert _get(outside + "/status", secret)[0] == 200
        assert call(jobdir, "GET", "/status")["state"] == "running"  # the CLI on the job's host
        # A dashboard login link is a browser's: it needs Host 127.0.0.1/localhost (a tunnel) even now.
        link = call(jobdir, "POST", "/ui/token")["url"]
        assert _get(link.replace("127.0.0.1", ip))[0] == 403


def test_the_bind_option_by_environment_and_a_clear_error_when_it_cannot_listen(jobdir: JobDir) -> None:
    port = free_port()
    settings = control_settings(_opts(), {"KEYSCALE_CONTROL_HOST": "::1", "KEYSCALE_CONTROL_PORT": str(port)})
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    with _serve(jobdir, settings) as (srv, _runner):
        assert srv.url == f"http://[::1]:{port}"
        assert _get(srv.url + "/health")[0] == 200
        assert call(jobdir, "GET", "/status")["state"] == "running"
        with pytest.raises(KeyscaleError, match=re.escape(f"the control API cannot listen on ::1 port {port}: Address already in use")):
            ControlServer(Runner(jobdir), settings)  # type: ignore[arg-type]
    # The next run in the same process (keyscale upgrade, rescale --restart) gets the same fixed
    # port at once, although the last one's connections are still in TIME_WAIT: probes keep working.
    with _serve(jobdir, settings) as (srv, _runner):
        assert _get(srv.url + "/health")[0] == 200
    # "::": every address, IPv6 and (dual stack, Linux's default) IPv4; clients on the host use [::1].
    with _serve(jobdir, ControlSettings(host="::")) as (srv, _runner):
        assert srv.url.startswith("http://[::1]:") and _get(srv.url + "/health")[0] == 200
        assert _get(srv.url + "/status")[0] == 401
    with pytest.raises(KeyscaleError, match=re.escape("the control API cannot listen on 203.0.113.9 port 0")):
        ControlServer(Runner(jobdir), ControlSettings(host="203.0.113.9"))  # type: ignore[arg-type]
    assert not os.path.exists(jobdir.store.url("control/secret"))  # a start that could not listen leaves no secret
