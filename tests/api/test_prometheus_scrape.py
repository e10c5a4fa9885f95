"""A real Prometheus (Debian's ``prometheus``) scrapes a running job as it would in
Kubernetes (issue 33, item 3): the job listens on 0.0.0.0 at a fixed port, Prometheus reaches
it at this machine's non-loopback address with the operator's token from a file
(``authorization.credentials_file``, as from a mounted Secret), and the test reads the
scraped series back through Prometheus' HTTP API. A second scrape job with a wrong token is
refused. Prometheus runs with its own config, data folder and port, and is stopped by its PID.
"""

from __future__ import annotations

import json
import secrets
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

import keyscale as ks
from conftest import stop_server, write_events

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
pytestmark = pytest.mark.skipif(not Path(PROMETHEUS).is_file(), reason="needs Debian's prometheus (make test installs it)")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _outside_address() -> str:
    """This machine's address on its default route (as a pod IP), else loopback."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # UDP: sends nothing
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"


@contextmanager
def prometheus(folder: Path, scrape_configs: list[dict[str, Any]]) -> Iterator[str]:
    """A Prometheus of this test's own on 127.0.0.1; yields its URL."""
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "prometheus.yml"
    # JSON is YAML: no YAML writer needed.
    # A 2-second timeout: a scrape on this busy 2-core machine can take more than Prometheus' default share.
    config.write_text(json.dumps({"global": {"scrape_interval": "2s", "scrape_timeout": "2s"}, "scrape_configs": scrape_configs}))
    port = _free_port()
    log = open(folder / "prometheus.log", "w")  # noqa: SIM115  (closed below, after the process)
    proc = subprocess.Popen(
        [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={folder / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
         "--log.level=warn"],
        stdout=log, stderr=log, stdin=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"prometheus exited with {proc.returncode}: {(folder / 'prometheus.log').read_text()[-2000:]}"
            try:
                with urllib.request.urlopen(url + "/-/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            assert time.monotonic() < deadline, "prometheus did not become ready within 60 s"
            time.sleep(0.2)
        yield url
    finally:
        stop_server(proc, 15)
        log.close()


def _api(url: str, path: str, **params: str) -> Any:
    with urllib.request.urlopen(f"{url}/api/v1/{path}?{urllib.parse.urlencode(params)}", timeout=10) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", body
    return body["data"]


def _value(url: str, query: str) -> float | None:
    result = _api(url, "query", query=query)["result"]
    return float(result[0]["value"][1]) if result else None


@pytest.mark.spark
@pytest.mark.slow
def test_prometheus_scrapes_a_running_job_with_the_operators_token(spark: Any, tmp_path: Path) -> None:
    write_events(tmp_path / "in", files=2, rows=500, keys=40)
    token = tmp_path / "secret" / "metrics-token"  # as a Kubernetes Secret mounted as a volume
    token.parent.mkdir()
    token.write_text(secrets.token_urlsafe(24) + "\n")
    wrong = tmp_path / "secret" / "wrong-token"
    wrong.write_text("not-the-token")
    port = _free_port()
    events = spark.readStream.schema("key string, value long, ts timestamp").option("maxFilesPerTrigger", 1).parquet(str(tmp_path / "in"))
    job = (ks.stream(events).key_by("key").aggregate(uid="totals", count=ks.aggregates.count())
           .sink(ks.sinks.ParquetSink(str(tmp_path / "out")))
           .start(str(tmp_path / "job"), 2, name="rc", trigger_interval="200 milliseconds",
                  control_host="0.0.0.0", control_port=port, metrics_token_file=str(token)))
    target = f"{_outside_address()}:{port}"
    try:
        deadline = time.monotonic() + 120
        while job.status()["last_checkpoint"] != 1:
            assert time.monotonic() < deadline, job.status()
            time.sleep(0.2)
        # What a kubelet's httpGet probe does: no secret, the pod's address.
        with urllib.request.urlopen(f"http://{target}/health", timeout=10) as r:
            health = json.loads(r.read())
        assert r.status == 200 and health["state"] == "running" and health["last_checkpoint"] == 1

        scrape = {"static_configs": [{"targets": [target]}], "honor_labels": True}  # keep keyscale's own job label
        with prometheus(tmp_path / "prometheus", [
            {"job_name": "keyscale", **scrape, "authorization": {"credentials_file": str(token)}},
            {"job_name": "keyscale-wrong-token", **scrape, "authorization": {"credentials_file": str(wrong)}},
        ]) as url:
            deadline = time.monotonic() + 90

            def eventually(ok: Any, what: str) -> None:
                while not ok():
                    assert time.monotonic() < deadline, f"{what}: {_api(url, 'targets')}"
                    time.sleep(0.5)

            eventually(lambda: _value(url, 'keyscale_records_in_total{job="rc"}') == 1000, "the job's records scraped")
            assert _value(url, 'keyscale_operator_parallelism{job="rc",operator="totals"}') == 2
            assert _value(url, 'keyscale_last_checkpoint_batch{job="rc"}') == 1
            assert _value(url, 'keyscale_job_state{job="rc",state="running"}') == 1
            assert _value(url, 'sum(keyscale_subtask_state_keys{job="rc"})') == 40

            def pool(name: str) -> dict[str, Any]:
                return dict(next(t for t in _api(url, "targets")["activeTargets"] if t["scrapePool"] == name))

            # The series above came with the token; the target with the wrong one is refused.
            eventually(lambda: pool("keyscale-wrong-token")["health"] == "down", "the wrong token's scrape refused")
            assert "401" in pool("keyscale-wrong-token")["lastError"]
            assert _value(url, 'up{job="keyscale-wrong-token"}') == 0
    finally:
        job.stop()
