"""End-to-end latency on a real job (issue 35 item 1): records appended to a local log at
times the test sets (each append's segment file time), a running count into Parquet; the
status, the batch record and /metrics report p50/p99/max that the test brackets from
outside: the commit lies between the sink's last write and the manifest's creation."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from conftest import EXAMPLES, run_job
from keyscale.checkpoint.jobdir import JobDir
from keyscale.cli.main import main
from keyscale.latency import ALPHA
from keyscale.runtime.control.metrics import families
from keyscale.sources import create_log
from keyscale.sources.local_log import SEGMENT_CLOCK

pytestmark = [pytest.mark.slow]


def test_status_and_metrics_latency_bracket_the_append_and_commit_times(spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = create_log(tmp_path / "log", "key string, value long", partitions=2)
    now = time.time()
    # (partition, records, seconds before now it was appended): 100 records, 20 + 50 + 30.
    appends = [(0, 20, 1.0), (1, 50, 4.0), (0, 30, 10.0)]
    for partition, n, _ in appends:
        log.append(partition, pa.table({"key": [f"k{i % 7}" for i in range(n)], "value": list(range(n))}))
    segments = {0: sorted((tmp_path / "log" / "p-00000").glob("*.arrow")), 1: sorted((tmp_path / "log" / "p-00001").glob("*.arrow"))}
    used = {0: 0, 1: 0}
    appended: list[float] = []
    for partition, n, ago in appends:
        seg = segments[partition][used[partition]]
        used[partition] += 1
        os.utime(seg, (now - ago, now - ago))
        appended += [now - ago] * n

    records: list[Any] = []
    summary = run_job(EXAMPLES / "log_count.py", tmp_path / "job", 2, {"log": str(tmp_path / "log"), "output": str(tmp_path / "out")},
                      on_batch=records.append)
    measured = [r for r in records if r.records]
    assert len(measured) == 1
    rec = measured[0]
    lat = rec.latency
    assert lat is not None and lat.records == 100 and lat.clock == SEGMENT_CLOCK

    # The commit: after the sink's last write (its entry in Spark's file-sink log, after its
    # marker), before the manifest was created.
    marker = os.stat(tmp_path / "out" / "_spark_metadata" / str(rec.batch)).st_mtime
    manifest = JobDir(tmp_path / "job").read_manifest(rec.batch).created_ms / 1000
    assert marker - 0.01 <= lat.committed <= manifest + 0.01

    def bracket(ago: float) -> tuple[float, float]:
        return marker - (now - ago) - 0.01, manifest - (now - ago) + 0.01

    lo, hi = bracket(10.0)
    assert lo <= lat.max_seconds <= hi  # exact: the oldest append to the commit
    lo, hi = bracket(1.0)
    assert lo <= lat.min_seconds <= hi
    # Nearest rank over 100 records: the 50th (of the 50 appended 4 s ago) and the 99th (10 s ago).
    for got, ago in ((lat.p50_seconds, 4.0), (lat.p99_seconds, 10.0)):
        lo, hi = bracket(ago)
        assert lo * (1 - ALPHA) <= got <= hi * (1 + ALPHA)

    # The lag: the oldest record (appended 10 s before the run) had waited at least that long
    # when the batch began, and its latency is that wait plus the batch's own time.
    assert lat.lag_seconds is not None and 10.0 - 0.01 <= lat.lag_seconds <= lat.max_seconds
    assert lat.max_seconds - lat.lag_seconds <= rec.seconds + 0.01

    status = JobDir(tmp_path / "job").read_status()
    assert status["latency"] is not None and status["latency"]["batch"] == rec.batch  # the empty batch after it measured none
    assert status["latency"]["records"] == 100 and status["latency"]["append_time"] == SEGMENT_CLOCK
    assert status["latency"]["max_seconds"] == pytest.approx(lat.max_seconds, abs=1e-3)
    assert status["latency"]["lag_seconds"] == pytest.approx(lat.lag_seconds, abs=1e-3)
    assert main(["status", str(tmp_path / "job")]) == 0
    said = capsys.readouterr().out
    assert f"end-to-end latency (batch {rec.batch}, 100 records, from {SEGMENT_CLOCK})" in said
    assert f"lag: {lat.lag_seconds:.3f} s (how long the oldest record of batch {rec.batch} had waited when the batch began)" in said, said

    hist = next(f for f in families(status, None, summary, int(time.time() * 1000)) if f.name == "keyscale_end_to_end_latency_seconds")
    counts = {s.labels.get("le"): s.value for s in hist.samples if s.name.endswith("_bucket")}
    assert counts["+Inf"] == 100
    # Every record waited between 1 s and ~10 s plus the run: none at or below 0.5 s, all by 300 s.
    assert counts["0.5"] == 0 and counts["300.0"] == 100
