"""Event time end to end on Spark: windows, sessions and timers over shuffled, late and
out-of-order batches equal a record-by-record model, also across a live rescale in the
middle of open windows, a restore from a savepoint at another parallelism, and a crash."""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pytest
from tests.operators.window_reference import batches, fixed_windows, last_rows, sessions, watermarks

from conftest import EXAMPLES, ROOT, cli, cli_here, read_output, run_job, write_input_file
from keyscale.checkpoint.jobdir import JobDir
from keyscale.cli.main import main as keyscale_main
from keyscale.operators.eventtime import END_OF_TIME

pytestmark = [pytest.mark.slow]

EPOCH = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
EPOCH_MS = int(EPOCH.timestamp() * 1000)
OOO = "2 seconds"


def write_batches(folder: Path, data: list[pd.DataFrame], first: int = 0) -> None:
    """One Parquet file per batch (ts: ms after EPOCH, as a timestamp)."""
    folder.mkdir(parents=True, exist_ok=True)
    for i, df in enumerate(data, start=first):
        table = pa.table({
            "key": pa.array(df["key"], pa.string()),
            "value": pa.array(df["value"], pa.int64()),
            "ts": pa.array(df["ts"] + EPOCH_MS, pa.int64()).cast(pa.timestamp("ms", tz="UTC")).cast(pa.timestamp("us", tz="UTC")),
        })
        write_input_file(table, folder / f"part-{i:05d}.parquet", i)


def to_ms(out: pd.DataFrame, *cols: str) -> pd.DataFrame:
    out = out.copy()
    for c in cols:
        out[c] = (pd.to_datetime(out[c], utc=True).astype("int64") // 1_000_000 - EPOCH_MS).astype("int64")
    return out


def watermarks_committed(job: Path) -> list[int]:
    jd = JobDir(job)
    return [jd.read_manifest(b).watermark_ms or 0 for b in jd.manifest_batches()]


@pytest.fixture(scope="module")
def data() -> list[pd.DataFrame]:
    return batches(seed=7, n_batches=7, rows=300, keys=40)


def test_tumbling_windows_with_late_data_across_a_live_rescale(spark: Any, data: list[pd.DataFrame], tmp_path: Path) -> None:
    write_batches(tmp_path / "in", data)
    jd = JobDir(tmp_path / "job")
    plan = {1: 3, 3: 1}  # rescale live while windows are open

    def rescale(rec: Any) -> None:
        if rec.batch in plan:
            jd.request_rescale(plan[rec.batch])

    args = {"input": str(tmp_path / "in"), "output": str(tmp_path / "out"), "late": str(tmp_path / "late"),
            "size": "10 seconds", "lateness": "3 seconds", "out_of_orderness": OOO}
    summary = run_job(EXAMPLES / "tumbling_count.py", tmp_path / "job", 2, args, on_batch=rescale, drain_at_end=True)
    assert [(b, f, t) for b, _, f, t in summary.rescales] == [(2, 2, 3), (4, 3, 1)]

    want, want_late = fixed_windows(data, 2000, 3000, 10_000)
    got = last_rows(to_ms(read_output(tmp_path / "out"), "window_start", "window_end"), ["key", "window_start"])
    cols = ["key", "window_start", "window_end", "count", "total"]
    pd.testing.assert_frame_equal(
        got[cols].sort_values(cols).reset_index(drop=True), want[cols].sort_values(cols).reset_index(drop=True), check_dtype=False
    )
    late = to_ms(read_output(tmp_path / "late").drop(columns="batch"), "ts")
    assert len(want_late) > 0
    assert sorted(map(tuple, late[["key", "value", "ts"]].values.tolist())) == sorted(map(tuple, want_late[["key", "value", "ts"]].values.tolist()))
    marks = watermarks_committed(tmp_path / "job")
    assert marks == sorted(marks) and marks[-1] == END_OF_TIME  # never back; the drain ends it


def test_sessions_restored_from_a_savepoint_at_another_parallelism(spark: Any, data: list[pd.DataFrame], tmp_path: Path) -> None:
    args = {"input": str(tmp_path / "in"), "output": str(tmp_path / "out"), "gap": "2.999 seconds", "out_of_orderness": OOO}
    write_batches(tmp_path / "in", data[:4])
    run_job(EXAMPLES / "sessionization.py", tmp_path / "job", 2, args)
    before = watermarks_committed(tmp_path / "job")[-1]
    dropped = JobDir(tmp_path / "job").latest_manifest().extra["counters"]["sessions"]["dropped"]  # type: ignore[union-attr]
    assert dropped > 0  # late records: no late output
    assert keyscale_main(["savepoint", str(tmp_path / "job"), "--dest", str(tmp_path / "sp")]) == 0
    write_batches(tmp_path / "in", data[4:], first=4)
    run_job(EXAMPLES / "sessionization.py", tmp_path / "job2", 3, args, from_savepoint=str(tmp_path / "sp"), drain_at_end=True)
    after = watermarks_committed(tmp_path / "job2")
    assert after[0] >= before and after == sorted(after)  # restored, never back
    # The counts of dropped records travel with the savepoint: the restored job's totals go on from there.
    jd2 = JobDir(tmp_path / "job2")
    own = sum(e["operators"].get("sessions", {}).get("dropped", 0) for e in jd2.read_events() if e["type"] == "records_not_processed_normally")
    assert jd2.latest_manifest().extra["counters"]["sessions"]["dropped"] == dropped + own  # type: ignore[union-attr]

    want, _ = sessions(data, 2000, 0, 2999)
    got = last_rows(to_ms(read_output(tmp_path / "out"), "window_start", "window_end"), ["key", "window_start"])
    cols = ["key", "window_start", "window_end", "events", "total"]
    pd.testing.assert_frame_equal(
        got[cols].sort_values(cols).reset_index(drop=True), want[cols].sort_values(cols).reset_index(drop=True), check_dtype=False
    )


TIMER_JOB = '''
import keyscale as ks

NAME = "timers"


class Reminders(ks.KeyedProcessFunction):
    """Per record, an event-time timer 5 s later; every firing numbered per key."""

    def open(self, ctx):
        self.fired = ctx.value_state("fired", "long")

    def process_element(self, row, ctx):
        ts = int(row.ts.timestamp() * 1000)
        ctx.timer_service.register_event_time_timer(ts + 5000)
        return []

    def on_timer(self, key, timestamp, ctx):
        n = (self.fired.value() or 0) + 1
        self.fired.update(n)
        assert ctx.time_domain == "event_time" and timestamp <= ctx.current_watermark
        yield (key, timestamp, n)


def build(ctx):
    events = ctx.spark.readStream.schema("key string, value long, ts timestamp").option("maxFilesPerTrigger", 1).parquet(ctx.arg("input"))
    return (
        ks.stream(events).with_watermark("ts", "2 seconds").key_by("key")
        .process(Reminders(), "key string, at long, n long", uid="reminders")
        .sink(ks.sinks.ParquetSink(ctx.arg("output")))
    )
'''


def expected_firings(data: list[pd.DataFrame]) -> list[tuple[str, int]]:
    """Batch by batch: timers due at W(b) fire, then the batch's records register theirs
    (a time already pending is one timer; one registered again after it fired fires again)."""
    pending: dict[str, set[int]] = {}
    fired: list[tuple[str, int]] = []
    for df, w in zip([*data, None], [*watermarks(data, 2000), END_OF_TIME], strict=True):
        for k, ts in pending.items():
            fired += [(k, t) for t in sorted(ts) if t <= w]
            pending[k] = {t for t in ts if t > w}
        if df is not None:
            for k, t in zip(df["key"], df["ts"], strict=True):
                pending.setdefault(k, set()).add(int(t) + 5000)
    return sorted((k, t + EPOCH_MS) for k, t in fired)


def check_timers(out: pd.DataFrame, data: list[pd.DataFrame]) -> None:
    """Every timer fired exactly once, per key in timestamp order."""
    assert sorted(zip(out["key"], out["at"], strict=True)) == expected_firings(data)
    for _, g in out.groupby("key"):
        g = g.sort_values("n")
        assert g["n"].tolist() == list(range(1, len(g) + 1))  # none lost or fired twice
        assert g.groupby("batch")["at"].is_monotonic_increasing.all()  # in timestamp order within a firing


def test_timers_fire_once_in_order_across_rescale_crash_and_restore(spark: Any, data: list[pd.DataFrame], tmp_path: Path) -> None:
    job = tmp_path / "timers.py"
    job.write_text(textwrap.dedent(TIMER_JOB))
    write_batches(tmp_path / "in", data[:4])
    common = ["--set", f"input={tmp_path / 'in'}", "--set", f"output={tmp_path / 'out'}", "--until-idle"]
    # Killed in the middle of batch 2 (timers registered in 0-1 are due), then resumed at another P.
    crashed = cli("run", str(job), "--job-dir", str(tmp_path / "job"), "-p", "2", *common, "--fault", "mid-batch:2")
    assert crashed.returncode != 0
    # The runs after the kill are a new driver's: the killed one's JVM went with it.
    cli_here("run", str(job), "--job-dir", str(tmp_path / "job"), "-p", "3", *common, check=True)
    cli_here("savepoint", str(tmp_path / "job"), "--dest", str(tmp_path / "sp"), check=True)
    write_batches(tmp_path / "in", data[4:], first=4)
    cli_here("run", str(job), "--job-dir", str(tmp_path / "job2"), "-p", "1", *common, "--from-savepoint", str(tmp_path / "sp"), "--drain-at-end", check=True)
    check_timers(read_output(tmp_path / "out"), data)
    # A drained job is finished: it refuses to resume.
    again = cli_here("run", str(job), "--job-dir", str(tmp_path / "job2"), *common)
    assert again.returncode != 0 and "was drained" in again.stderr


def test_status_shows_the_watermark(spark: Any, data: list[pd.DataFrame], tmp_path: Path) -> None:
    write_batches(tmp_path / "in", data[:2])
    run_job(EXAMPLES / "tumbling_count.py", tmp_path / "job", 1, {"input": str(tmp_path / "in"), "output": str(tmp_path / "out")})
    status = json.loads((tmp_path / "job" / "status.json").read_text()) if (tmp_path / "job" / "status.json").exists() else JobDir(tmp_path / "job").read_status()
    want = int(data[0]["ts"].max()) + EPOCH_MS - 10_000 - 1
    assert status["watermark_ms"] >= want and status["watermark"].startswith("2026-01-01T")


@pytest.mark.parametrize("asynchronous", [False, True], ids=["", "async-checkpoints"])
def test_stop_with_drain_fires_every_window_of_a_running_job(asynchronous: bool, data: list[pd.DataFrame], tmp_path: Path) -> None:
    """With asynchronous checkpoints the stop comes while a checkpoint may be in flight: it
    commits before the drain batch, and the drain's own before its savepoint."""
    write_batches(tmp_path / "in", data)
    job, log_path = tmp_path / "job", tmp_path / "job.log"
    args = ["--set", f"input={tmp_path / 'in'}", "--set", f"output={tmp_path / 'out'}", "--set", "size=10 seconds",
            "--set", "lateness=3 seconds", "--set", f"out_of_orderness={OOO}"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "keyscale.cli.main", "run", str(EXAMPLES / "tumbling_count.py"), "--job-dir", str(job), "-p", "2",
             "--trigger-interval", "200 milliseconds", *args, *(["--async-checkpoints"] if asynchronous else [])],
            cwd=ROOT, stdout=log, stderr=log, env=os.environ.copy(),
        )
        try:
            jd = JobDir(job)
            deadline = time.time() + 300
            while len(data) - 1 not in jd.manifest_batches() and time.time() < deadline:
                assert proc.poll() is None, log_path.read_text()[-3000:]
                time.sleep(0.3)
            stop = cli("stop", str(job), "--drain", "--dest", str(tmp_path / "sp"), check=True)
            assert stop.stdout.strip() == str(tmp_path / "sp")
            assert proc.wait(timeout=120) == 0
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
    want, _ = fixed_windows(data, 2000, 3000, 10_000)
    got = last_rows(to_ms(read_output(tmp_path / "out"), "window_start", "window_end"), ["key", "window_start"])
    assert len(got) == len(want)  # nothing left pending: every window fired before the savepoint
    assert "draining" in log_path.read_text()


def test_a_far_future_record_neither_stops_event_time_nor_vanishes(spark: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 10, cases 7 and 8: one record stamped in the year 9999 used to move the watermark
    to the end of time (every later record late); late and dropped records left no sign."""
    import logging

    year_9999 = int(dt.datetime(9999, 12, 31, tzinfo=dt.UTC).timestamp() * 1000) - EPOCH_MS
    on_time = [pd.DataFrame({"key": ["a"] * 30, "value": range(30), "ts": [i * 1000 for i in range(30)]})]
    first = pd.concat([on_time[0], pd.DataFrame({"key": ["far"], "value": [99], "ts": [year_9999]})], ignore_index=True)
    second = pd.DataFrame({"key": ["b"] * 30, "value": range(30), "ts": [30_000 + i * 1000 for i in range(30)]})
    write_batches(tmp_path / "in", [first, second])
    args = {"input": str(tmp_path / "in"), "output": str(tmp_path / "out"), "late": str(tmp_path / "late"),
            "size": "10 seconds", "lateness": "0 seconds", "out_of_orderness": "1 second"}
    with caplog.at_level(logging.WARNING, logger="keyscale"):
        run_job(EXAMPLES / "tumbling_count.py", tmp_path / "job", 2, args, retain=1)
    late = to_ms(read_output(tmp_path / "late"), "ts")
    assert late.key.tolist() == ["far"]  # only the far-future record; batch 1's records are on time
    jd = JobDir(tmp_path / "job")
    m = jd.read_manifest(max(jd.manifest_batches()))
    assert m.watermark_ms == EPOCH_MS + 59_000 - 1000 - 1
    assert m.extra["counters"] == {"per_minute": {"to_late_output": 1, "too_far_ahead": 1}}
    assert "batch 0: window 'per_minute' got 1 record too far ahead (event time more than 1 hour after the batch time): 1 to the late output" in caplog.text
    events = [e for e in jd.read_events() if e["type"] == "records_not_processed_normally"]
    assert events == [{"type": "records_not_processed_normally", "batch": 0, "operators": {"per_minute": {"to_late_output": 1, "too_far_ahead": 1}}}]

    # Restarted, with records beyond the allowed lateness: the totals carry on (retention kept one manifest).
    write_batches(tmp_path / "in", [pd.DataFrame({"key": ["c"] * 3, "value": [1, 2, 3], "ts": [1000, 2000, 70_000]})], first=2)
    run_job(EXAMPLES / "tumbling_count.py", tmp_path / "job", 2, args, retain=1)
    m = jd.read_manifest(max(jd.manifest_batches()))
    assert 1 not in jd.manifest_batches()  # retention removed batch 1's manifest: the totals are the newest manifest's own
    assert m.extra["counters"] == {"per_minute": {"late": 2, "to_late_output": 3, "too_far_ahead": 1}}
    status = jd.read_status()["counters"]
    assert status == {"last_batch": {"per_minute": {"late": 2, "to_late_output": 2}}, "total": m.extra["counters"]}
    shown = cli("status", str(tmp_path / "job"), check=True).stdout
    assert "records not processed normally by 'per_minute': 2 late, 3 to the late output, 1 too far ahead in all; last batch: 2 late, 2 to the late output" in shown
