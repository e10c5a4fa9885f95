"""Several sinks per job (issue 13, item 6): a pipeline that branches (sessions to one
table, page counts to another) and a stage whose rows go to two sinks; each stage runs
once per batch and each sink gets every batch exactly once, across a kill between sinks."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

import keyscale as ks
from conftest import cli, cli_here, read_output, run_job, write_events, write_input_file
from keyscale.checkpoint.jobdir import JobDir
from keyscale.errors import JobDefinitionError

HERE = Path(__file__).resolve().parent
CLICKSTREAM = HERE.parents[1] / "examples" / "clickstream.py"
GAP_MS = 30_000


def write_views(folder: Path, files: int, rows: int, seed: int = 3) -> pd.DataFrame:
    """Page views in event-time order across files (none late): user, page, ts (ms)."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    n = files * rows
    ms = 1_767_225_600_000 + np.cumsum(rng.integers(0, 1_500, n))
    views = pd.DataFrame({
        "user": [f"u{x}" for x in rng.integers(0, 40, n)],
        "page": [f"/p/{x}" for x in rng.integers(0, 15, n)],
        "ts": pd.to_datetime(ms, unit="ms", utc=True),
    })
    for i in range(files):
        part = pa.Table.from_pandas(views.iloc[i * rows:(i + 1) * rows], preserve_index=False)
        write_input_file(part.cast(pa.schema([("user", pa.string()), ("page", pa.string()), ("ts", pa.timestamp("us", tz="UTC"))])),
                         folder / f"part-{i:05d}.parquet", i)
    return views


def expected_sessions(views: pd.DataFrame) -> pd.DataFrame:
    """Sessions by the gap rule (a gap longer than GAP_MS starts a new one)."""
    v = views.assign(ms=views.ts.astype("int64") // 1_000_000).sort_values(["user", "ms"])
    new = v.groupby("user").ms.diff().fillna(GAP_MS + 1) > GAP_MS
    v["session"] = new.cumsum()
    s = v.groupby(["user", "session"]).agg(start=("ms", "min"), last=("ms", "max"), views=("ms", "size")).reset_index()
    return pd.DataFrame({"user": s.user, "start": s.start, "end": s["last"] + GAP_MS, "views": s.views}).sort_values(["user", "start"]).reset_index(drop=True)


@pytest.mark.slow
def test_a_branching_job_writes_each_output_exactly_once_across_a_kill_between_its_sinks(spark: Any, tmp_path: Path) -> None:
    views = write_views(tmp_path / "in", files=4, rows=800)
    base = ["run", str(CLICKSTREAM), "--job-dir", str(tmp_path / "job"), "--until-idle", "--drain-at-end",
            "--set", f"input={tmp_path / 'in'}", "--set", f"sessions={tmp_path / 'sessions'}", "--set", f"pages={tmp_path / 'pages'}"]
    crashed = cli(*base, "-p", "2", "--fault", "between-sinks:2")
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-3000:]
    # Killed after the first output took batch 2 and before the second did.
    assert JobDir(tmp_path / "job").manifest_batches()[-1] == 1
    assert (tmp_path / "sessions" / "batch=000000000002" / "_keyscale.json").exists()
    assert not (tmp_path / "pages" / "batch=000000000002").exists()

    cli_here(*base, "-p", "3", check=True)  # resumed at another parallelism, by a new driver in this process
    shown = cli("status", str(tmp_path / "job"), check=True).stdout
    assert f"output of 'sessions': parquet files in {tmp_path / 'sessions'}" in shown
    assert f"output of 'page_views': parquet files in {tmp_path / 'pages'}" in shown
    pages = read_output(tmp_path / "pages")
    assert not pages.duplicated(["batch", "page"]).any()
    last = pages.sort_values("views").groupby("page").views.last().sort_index()
    pd.testing.assert_series_equal(last, views.groupby("page").size().sort_index().rename("views"), check_dtype=False)

    sessions = read_output(tmp_path / "sessions")
    got = pd.DataFrame({
        "user": sessions.user, "start": sessions.window_start.astype("int64") // 1_000_000,
        "end": sessions.window_end.astype("int64") // 1_000_000, "views": sessions.views,
    }).sort_values(["user", "start"]).reset_index(drop=True)
    pd.testing.assert_frame_equal(got, expected_sessions(views), check_dtype=False)


def test_a_stage_read_by_two_sinks_runs_once_per_batch(spark: Any, tmp_path: Path) -> None:
    write_events(tmp_path / "in", files=3, rows=500, keys=40)
    (tmp_path / "notes").mkdir()
    args = {k: str(tmp_path / k) for k in ("in", "a", "b", "notes")}
    run_job(HERE / "branch_probe_job.py", tmp_path / "job", 2, {"input": args.pop("in"), **args})
    a, b = read_output(tmp_path / "a"), read_output(tmp_path / "b")
    assert len(a) > 0
    pd.testing.assert_frame_equal(a, b)
    processed: dict[int, int] = {}
    for note in (tmp_path / "notes").iterdir():
        for line in note.read_text().splitlines():
            batch, n = map(int, line.split())
            processed[batch] = processed.get(batch, 0) + n
    assert processed == {0: 500, 1: 500, 2: 500}  # each record once, not once per sink


def test_branches_must_share_one_stream_and_each_need_their_own_sink(spark: Any, tmp_path: Path) -> None:
    def source() -> ks.streams.Stream:
        return ks.stream(spark.readStream.schema("key string, value long, ts timestamp").parquet(str(tmp_path)))

    events = source()
    counts = events.key_by("key").aggregate(uid="counts", n=ks.aggregates.count())
    sums = events.key_by("key").aggregate(uid="sums", total=ks.aggregates.sum("value"))
    out = ks.pipeline(counts.sink(ks.sinks.ParquetSink(str(tmp_path / "a"))), sums.sink(ks.sinks.ParquetSink(str(tmp_path / "b"))))
    assert [s.uid for s in out.steps] == ["counts", "sums"] and out.output_uids == ["counts", "sums"]

    with pytest.raises(JobDefinitionError, match="each needs a sink of its own"):
        ks.pipeline(counts.sink(ks.sinks.ParquetSink(str(tmp_path / "a"))), sums.sink(ks.sinks.ParquetSink(str(tmp_path / "a"))))
    with pytest.raises(JobDefinitionError, match="different streams"):
        other = source().key_by("key").aggregate(uid="other", n=ks.aggregates.count())
        ks.pipeline(counts.sink(ks.sinks.ParquetSink(str(tmp_path / "a"))), other.sink(ks.sinks.ParquetSink(str(tmp_path / "b"))))
    with pytest.raises(JobDefinitionError, match="two stages have the uid 'counts'"):
        clash = events.key_by("value").aggregate(uid="counts", n=ks.aggregates.count())
        ks.pipeline(counts.sink(ks.sinks.ParquetSink(str(tmp_path / "a"))), clash.sink(ks.sinks.ParquetSink(str(tmp_path / "b"))))
    with pytest.raises(JobDefinitionError, match="'counts' is in two branches"):
        ks.pipeline(counts.sink(ks.sinks.ParquetSink(str(tmp_path / "a")), on_error="skip"), counts.sink(ks.sinks.ParquetSink(str(tmp_path / "b"))))
    with pytest.raises(JobDefinitionError, match="branches ending in"):
        ks.pipeline(counts)  # type: ignore[arg-type]


def test_a_stage_gets_only_the_columns_its_function_reads(spark: Any, tmp_path: Path) -> None:
    from keyscale.runtime.batch.stages import task_input

    events = ks.stream(spark.readStream.schema("key string, value long, ts timestamp, note string").parquet(str(tmp_path)))
    totals = events.key_by("key").aggregate(uid="totals", n=ks.aggregates.count(), total=ks.aggregates.sum("value"))
    step = totals.sink(ks.sinks.ParquetSink(str(tmp_path / "a"))).keyed_steps[0]
    assert task_input(step, dead_letters=False).names == ["key", "value"]  # ts and note never cross the shuffle
    assert task_input(step, dead_letters=True).names == ["key", "value", "ts", "note"]  # a dead letter is the whole record

    class Declared(ks.VectorizedKeyedFunction):
        def __init__(self) -> None:
            self.input_columns = ["note"]

    timed = events.with_watermark("ts", "1 second").key_by("key").process(Declared(), "key string", uid="declared")
    assert task_input(timed.sink(ks.sinks.ParquetSink(str(tmp_path / "b"))).keyed_steps[0], False).names == ["key", "ts", "note"]
    undeclared = events.key_by("key").process(ks.VectorizedKeyedFunction(), "key string", uid="all")
    assert task_input(undeclared.sink(ks.sinks.ParquetSink(str(tmp_path / "c"))).keyed_steps[0], False).names == ["key", "value", "ts", "note"]
    # A window aggregate reads its aggregates' columns, its keys and its event time.
    windowed = events.with_watermark("ts", "1 second").key_by("key").window(ks.windows.SessionWindows("10 seconds"))
    counted = windowed.aggregate(uid="sessions", n=ks.aggregates.count()).sink(ks.sinks.ParquetSink(str(tmp_path / "d"))).keyed_steps[0]
    assert task_input(counted, False).names == ["key", "ts"]
    summed = windowed.aggregate(uid="sums", total=ks.aggregates.sum("value")).sink(ks.sinks.ParquetSink(str(tmp_path / "e")))
    assert task_input(summed.keyed_steps[0], False).names == ["key", "value", "ts"]
