"""/metrics and /health on a running job's control API (issue 13): Prometheus' own parser
reads them, the values match GET /status; /metrics needs the job's secret (or the operator's
token: tests/runtime/test_control_settings.py), /health needs none (a Kubernetes probe)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

import keyscale as ks
from conftest import write_events
from keyscale.checkpoint.jobdir import JobDir
from keyscale.latency import ALPHA
from keyscale.runtime.batch.jobstate import BatchRecord, RunSummary
from keyscale.runtime.control.auth import auth_header, read_secret
from keyscale.runtime.control.metrics import families, health
from keyscale.runtime.control.server import ADDRESS, call
from keyscale.runtime.task.arrival import FILE_CLOCK


def _get(job_dir: Path, path: str, auth: bool = True) -> tuple[int, str]:
    jd = JobDir(str(job_dir))
    url = jd.read_json(ADDRESS)["url"]
    headers = auth_header(read_secret(jd.store)) if auth else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url + path, headers=headers), timeout=30) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_metrics_match_the_status_of_a_running_job(spark: Any, tmp_path: Path) -> None:
    write_events(tmp_path / "in", files=2, rows=500, keys=40)
    events = spark.readStream.schema("key string, value long, ts timestamp").option("maxFilesPerTrigger", 1).parquet(str(tmp_path / "in"))
    # The autoscaler recommends only (it changes nothing) with an SLO the 2023 files miss.
    job = (ks.stream(events).key_by("key").aggregate(uid="totals", count=ks.aggregates.count())
           .sink(ks.sinks.ParquetSink(str(tmp_path / "out"))).start(str(tmp_path / "job"), 2, name="rc", trigger_interval="200 milliseconds",
                                                                    scaling="auto", autoscaler_mode="recommend", slo="latency=10min"))
    try:
        deadline = time.monotonic() + 120
        while job.status()["last_checkpoint"] != 1:
            assert time.monotonic() < deadline, job.status()
            time.sleep(0.2)
        code, body = _get(tmp_path / "job", "/health", auth=False)  # a probe has no secret
        assert code == 200 and json.loads(body)["state"] == "running" and json.loads(body)["last_checkpoint"] == 1
        assert _get(tmp_path / "job", "/metrics", auth=False)[0] == 401  # Prometheus sends the secret (credentials_file)
        code, text = _get(tmp_path / "job", "/metrics")
        assert code == 200
        status = call(JobDir(str(tmp_path / "job")), "GET", "/status")
        m = _samples(text)
        assert m[("keyscale_operator_parallelism", (("job", "rc"), ("operator", "totals")))] == 2
        assert m[("keyscale_last_checkpoint_batch", (("job", "rc"),))] == status["last_checkpoint"] == 1
        assert m[("keyscale_records_in_total", (("job", "rc"),))] == 1000
        assert m[("keyscale_job_state", (("job", "rc"), ("state", "running")))] == 1
        for s in status["operators"]["totals"]["subtasks"]:
            labels = (("job", "rc"), ("operator", "totals"), ("subtask", str(s["subtask"])))
            assert m[("keyscale_subtask_state_keys", labels)] == s["state_keys"]
            assert m[("keyscale_subtask_state_bytes", labels)] > 0
        assert sum(v for (name, _), v in m.items() if name == "keyscale_subtask_state_keys") == 40
        # A file source: each record's append time is its file's modification time (write_events
        # dates its files in 2023), measured by the keyed stage, to the commit of its batch.
        lat = status["latency"]
        assert lat is not None and lat["append_time"] == FILE_CLOCK and lat["records"] == 500
        ago = time.time() - (1_700_000_000 + lat["batch"])
        assert ago - 60 < lat["max_seconds"] <= ago and lat["p50_seconds"] <= lat["p99_seconds"] <= lat["max_seconds"] * (1 + ALPHA)
        assert m[("keyscale_end_to_end_latency_seconds_count", (("job", "rc"),))] == 1000  # both batches' records, all past 300 s
        assert m[("keyscale_end_to_end_latency_seconds_bucket", (("job", "rc"), ("le", "300.0")))] == 0
        assert m[("keyscale_last_batch_latency_seconds", (("job", "rc"), ("quantile", "1")))] == pytest.approx(lat["max_seconds"], abs=1e-3)
        # The lag: the oldest record's wait when its batch began, which is its latency less the
        # batch's own time (the batch began after the job started, and ran at most its duration).
        took = next(b.seconds for b in job.summary.batches if b.batch == lat["batch"])
        assert lat["max_seconds"] - took - 0.05 <= lat["lag_seconds"] <= lat["max_seconds"] and ago - 60 < lat["lag_seconds"]
        assert m[("keyscale_lag_seconds", (("job", "rc"),))] == pytest.approx(lat["lag_seconds"], abs=1e-3)
        # The SLO: its target, the autoscaler's reading of it (records three years old miss it) and the run's share within it.
        slo_labels = (("job", "rc"), ("kind", "latency"), ("operator", "totals"))
        assert m[("keyscale_slo_target_seconds", slo_labels)] == 600
        assert m[("keyscale_slo_value_seconds", slo_labels)] > 86_400 and m[("keyscale_slo_attainment", (("job", "rc"),))] == 0
        assert m[("keyscale_autoscaler_forecast_input_rate", (("job", "rc"), ("operator", "totals")))] >= 0
    finally:
        job.stop()


def test_families_from_a_status_without_spark() -> None:
    summary = RunSummary("rc", "d", batches=[BatchRecord(0, 1.5, 100, 7, {"totals": 2}), BatchRecord(1, 0.5, 50, 3, {"totals": 4})],
                         rescales=[(1, "totals", 2, 4)])
    status = {"job": "rc", "state": "failed", "pending_rescale": {"parallelism": {"*": 3}},
              "operators": {"reader": {"parallelism": 1, "readers": [{"subtask": 0, "partitions": {"0": {"offset": 5, "lag": 12}}}]}},
              "counters": {"total": {"w": {"late": 4}}},
              "scaling": {"last_decisions": {"totals": {"target_parallelism": 8}}}}
    got = {(s.name, tuple(sorted(s.labels.values()))): s.value for f in families(status, None, summary, 0) for s in f.samples}
    assert got[("keyscale_records_in_total", ("rc",))] == 150 and got[("keyscale_records_out_total", ("rc",))] == 10
    assert got[("keyscale_rescales_total", ("rc", "totals"))] == 1
    assert got[("keyscale_last_batch_duration_seconds", ("rc",))] == 0.5
    assert got[("keyscale_job_state", ("failed", "rc"))] == 1 and got[("keyscale_job_state", ("rc", "running"))] == 0
    assert got[("keyscale_source_lag_records", ("0", "rc", "reader"))] == 12
    assert got[("keyscale_records_not_processed_total", ("late", "rc", "w"))] == 4
    assert got[("keyscale_autoscaler_recommended_parallelism", ("rc", "totals"))] == 8
    assert got[("keyscale_rescale_pending", ("rc",))] == 1
    # Neither batch measured a latency (a source without append times): an empty histogram, no made-up number.
    assert got[("keyscale_end_to_end_latency_seconds_count", ("rc",))] == 0
    assert ("keyscale_last_batch_latency_seconds", ("0.99", "rc")) not in got


@pytest.mark.parametrize(("state", "active", "code"), [("running", True, 200), ("running", None, 200), ("draining", True, 200),
                                                        ("running", False, 503), ("failed", None, 503), ("starting", None, 503)])
def test_health(state: str, active: bool | None, code: int) -> None:
    assert health(state, active)[0] == code
