"""The running job's HTTP control API, called directly as a client would."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from conftest import RUNNING_COUNT, write_events
from keyscale.checkpoint.jobdir import JobDir
from keyscale.checkpoint.savepoint import read_savepoint
from keyscale.runtime.control.auth import read_secret
from keyscale.runtime.control.server import control_api
from keyscale.runtime.driver.runner import JobRunner, RunOptions


def _post(url: str, body: dict[str, Any], secret: str | None, content_type: str = "application/json") -> tuple[int, dict[str, Any]]:
    headers = {"Content-Type": content_type, **({"Authorization": f"Bearer {secret}"} if secret else {})}
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_status_rescale_savepoint_stop_over_http(spark: Any, tmp_path: Path) -> None:
    write_events(tmp_path / "in", files=2, rows=300, keys=30)
    opts = RunOptions(job_file=str(RUNNING_COUNT), job_dir=str(tmp_path / "job"), parallelism=2, trigger_interval="100 milliseconds",
                      args={"input": str(tmp_path / "in"), "output": str(tmp_path / "out")})
    runner = JobRunner(opts, serve=control_api(opts))
    result: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: result.setdefault("summary", runner.run()), daemon=True)
    thread.start()
    jd = JobDir(tmp_path / "job")
    deadline = time.time() + 120
    while (1 not in jd.manifest_batches() or not ((jd.path / "control") / "http.json").exists()) and time.time() < deadline:
        time.sleep(0.2)
    url = json.loads(((jd.path / "control") / "http.json").read_text())["url"]
    assert url.startswith("http://127.0.0.1:")
    secret = read_secret(jd.store)

    # Without the job's secret (any local user, a web page's text/plain POST) nothing is done.
    assert _post(url + "/rescale", {"parallelism": 4}, None)[0] == 401
    assert _post(url + "/rescale", {"parallelism": 4}, None, "text/plain")[0] == 401
    assert _post(url + "/stop", {"drain": True}, None)[0] == 401
    assert _post(url + "/rescale", {"parallelism": 4}, secret, "text/plain")[0] == 415
    assert jd.read_rescale_requests() == {} and jd.is_running()

    with urllib.request.urlopen(urllib.request.Request(url + "/status", headers={"Authorization": f"Bearer {secret}"}), timeout=30) as r:
        status = json.loads(r.read())
    assert status["running"] and status["operators"]["totals"]["parallelism"] == 2 and status["last_checkpoint"] == 1

    code, body = _post(url + "/rescale", {"parallelism": 999}, secret)
    assert code == 409 and "parallelism 999" in body["error"]
    code, body = _post(url + "/rescale", {"parallelism": 3, "operator": "nope"}, secret)
    assert code == 409 and "no keyed operator 'nope'" in body["error"]
    code, body = _post(url + "/rescale", {}, secret)
    assert code == 400
    code, body = _post(url + "/rescale", {"parallelism": 3}, secret)
    assert code == 202
    write_events(tmp_path / "in", files=1, rows=300, keys=30, first=2)
    while 2 not in jd.manifest_batches() and time.time() < deadline:
        time.sleep(0.2)
    m = jd.latest_manifest()
    assert m is not None and m.batch == 2 and m.operators["totals"].parallelism == 3

    code, body = _post(url + "/savepoint", {"dest": str(tmp_path / "sp")}, secret)
    assert code == 200 and body["savepoint"] == str(tmp_path / "sp")
    assert read_savepoint(tmp_path / "sp").batch == 2

    code, body = _post(url + "/nope", {}, secret)
    assert code == 404
    code, body = _post(url + "/stop", {}, secret)
    assert code == 200 and body == {"stopping": True}
    thread.join(timeout=120)
    assert not thread.is_alive() and "summary" in result
    assert not jd.is_running() and not ((jd.path / "control") / "http.json").exists() and not ((jd.path / "control") / "secret").exists()
    final = jd.read_status()
    assert final["running"] is False and final["epoch"] == runner.jobdir.epoch == 1  # whose status it is


@pytest.mark.parametrize("asynchronous", [False, True], ids=["", "async-checkpoints"])
def test_a_fenced_run_leaves_the_live_runs_control_files_and_status(asynchronous: bool, spark: Any, tmp_path: Path) -> None:
    """Issue 32, case 4: a run that a newer run took over (its epoch + 1 exists: the old driver
    was paused past the takeover time) must not delete the newer run's control secret and
    address, nor write its own status over the newer run's, as it exits. With asynchronous
    checkpoints batch 1 runs and records its status before batch 0's commit finds the fence."""
    from keyscale.checkpoint.fence import epoch_key
    from keyscale.errors import FencedError

    write_events(tmp_path / "in", files=2, rows=300, keys=30)
    jd = JobDir(tmp_path / "job")
    newer: dict[str, Any] = {}

    def take_over(rec: Any) -> None:
        """After batch 0 a newer run claims the next epoch and writes its files, as its start does."""
        if rec.batch != 0:
            return
        epoch = runner.jobdir.epoch
        jd.store.create(epoch_key(epoch + 1), json.dumps({"pid": 1, "host": "elsewhere", "run": "newer"}).encode())
        newer["secret"], newer["address"] = "the-newer-runs-secret", {"url": "http://127.0.0.1:1", "epoch": epoch + 1}
        newer["status"] = {"running": True, "state": "running", "epoch": epoch + 1, "pid": 1, "host": "elsewhere", "updated_ms": 1}
        jd.store.put("control/secret", newer["secret"].encode(), private=True)
        jd.write_json("control/http.json", newer["address"])
        jd.store.put("status.json", json.dumps(newer["status"]).encode())

    opts = RunOptions(job_file=str(RUNNING_COUNT), job_dir=str(tmp_path / "job"), parallelism=2, until_idle=True,
                      async_checkpoints=asynchronous, args={"input": str(tmp_path / "in"), "output": str(tmp_path / "out")})
    runner = JobRunner(opts, on_batch=take_over, serve=control_api(opts))
    with pytest.raises(FencedError, match="a newer run took over"):
        runner.run()  # the next commit finds the newer epoch
    assert newer, "the job never ran batch 0"
    assert (jd.store.get_text("control/secret") or "") == newer["secret"]
    assert jd.read_json("control/http.json") == newer["address"]
    assert jd.read_status() == newer["status"]
    assert 1 not in jd.manifest_batches()
