"""A drained savepoint restores with no batch lost and event time that goes on (issue 10,
case 5): the drain reuses the id of a batch Spark planned with real input and that the stop
refused; restored with --from-savepoint, that input is read, once, and new events are on time."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from tests.operators.window_reference import last_rows
from tests.runtime.test_event_time import EPOCH_MS, to_ms, write_batches

from conftest import EXAMPLES, cli, cli_here, read_output, run_job
from keyscale.checkpoint.jobdir import JobDir
from keyscale.checkpoint.savepoint import read_savepoint
from keyscale.operators.eventtime import END_OF_TIME
from keyscale.runtime.driver.runner import JobRunner, RunOptions
from keyscale.sinks.parquet import SUPERSEDED, batch_folder_name

pytestmark = [pytest.mark.slow]

ARGS = {"size": "10 seconds", "lateness": "3 seconds", "out_of_orderness": "2 seconds"}


def _file(rng: np.random.Generator, lo: int, hi: int, rows: int = 120) -> pd.DataFrame:
    return pd.DataFrame({"key": [f"k{i}" for i in rng.integers(0, 5, rows)], "value": rng.integers(1, 50, rows),
                         "ts": np.sort(rng.integers(lo, hi, rows))})


@pytest.fixture(scope="module")
def files() -> list[pd.DataFrame]:
    rng = np.random.default_rng(11)
    # event time in order across files: nothing is late in a run without the drain
    return [_file(rng, 0, 25_000), _file(rng, 25_000, 45_000), _file(rng, 45_000, 70_000)]


def _drain_when_spark_plans_batch_1(job: Path, inp: Path, out: Path, sp: Path, files: list[pd.DataFrame]) -> None:
    """Run the job (not until idle); batch 0 reads file 0; file 1 arrives; `stop --drain`
    lands just as Spark has planned batch 1 with it (its offsets written, the batch refused)."""
    write_batches(inp, files[:1])
    opts = RunOptions(job_file=str(EXAMPLES / "tumbling_count.py"), job_dir=str(job), parallelism=2, until_idle=False,
                      trigger_interval="100 milliseconds", args={**ARGS, "input": str(inp), "output": str(out)})
    runner = JobRunner(opts, on_batch=lambda rec: write_batches(inp, files[1:2], first=1) if rec.batch == 0 else None)
    run_batch = runner._run_batch

    def planned(df: Any, batch_id: int) -> None:
        if batch_id == 1:
            threading.Thread(target=runner.drain, args=(str(sp),), daemon=True).start()
            runner._stop.wait(60)  # drain() sets it first thing
        run_batch(df, batch_id)

    runner._run_batch = planned  # type: ignore[method-assign]
    runner.run()
    jd = JobDir(job)
    assert (jd.spark_checkpoint / "offsets" / "1").exists() and not (jd.spark_checkpoint / "commits" / "1").exists()
    assert jd.manifest_batches()[-1] == 1 and jd.read_manifest(1).extra["drained"]  # the drain took id 1


def test_a_drained_savepoint_restores_with_no_batch_lost(spark: Any, files: list[pd.DataFrame], tmp_path: Path) -> None:
    inp, out, sp = tmp_path / "in", tmp_path / "out", tmp_path / "sp"
    _drain_when_spark_plans_batch_1(tmp_path / "job", inp, out, sp, files)
    info = read_savepoint(sp)
    assert info.batch == 1 and info.watermark_ms == END_OF_TIME
    drained = read_output(out)
    write_batches(inp, files[2:], first=2)  # new events after the drain
    # Restored as the drained job's message advises, into a new job directory, same output.
    run_job(EXAMPLES / "tumbling_count.py", tmp_path / "job2", 2, {**ARGS, "input": str(inp), "output": str(out)},
            from_savepoint=str(sp), drain_at_end=True, retain=10)
    restored = JobDir(tmp_path / "job2")
    first = restored.read_manifest(restored.manifest_batches()[0])
    assert first.batch == 1 and "drained" not in first.extra
    # Event time resumes at the watermark from before the drain, not at the end of time.
    assert first.watermark_ms == int(files[0].ts.max()) + EPOCH_MS - 2_000 - 1

    # A run without the drain (all three files, drained only at its end).
    run_job(EXAMPLES / "tumbling_count.py", tmp_path / "ref", 2, {**ARGS, "input": str(inp), "output": str(tmp_path / "ref_out")},
            drain_at_end=True)
    ref = last_rows(to_ms(read_output(tmp_path / "ref_out"), "window_start", "window_end"), ["key", "window_start"])
    got = to_ms(read_output(out), "window_start", "window_end")
    assert len(got) > len(drained)
    # Every record counted once: the input of the refused batch (file 1) was read after the restore.
    assert ref["count"].sum() == sum(len(f) for f in files)
    # The drain fired windows up to [20 s, 30 s) early. After the restore, a record for such a
    # window opens it again and it fires with the new records only: per window, the drained
    # run's result plus the restored run's equals the run without the drain.
    before = last_rows(got[got.batch <= 1], ["key", "window_start"])
    after = last_rows(got[got.batch > 1], ["key", "window_start"])
    both = pd.concat([before, after]).groupby(["key", "window_start", "window_end"], as_index=False)[["count", "total"]].sum()
    cols = ["key", "window_start", "window_end", "count", "total"]
    pd.testing.assert_frame_equal(
        both[cols].sort_values(cols).reset_index(drop=True), ref[cols].sort_values(cols).reset_index(drop=True), check_dtype=False,
    )
    # Windows after the drain's are exactly those of the run without it (new events are on time).
    assert (after.window_start >= 30_000).any()
    late = after[after.window_start >= 30_000][cols].sort_values(cols).reset_index(drop=True)
    pd.testing.assert_frame_equal(late, ref[ref.window_start >= 30_000][cols].sort_values(cols).reset_index(drop=True), check_dtype=False)


def test_an_interrupted_drain_does_not_take_the_next_input_batch(spark: Any, files: list[pd.DataFrame], tmp_path: Path) -> None:
    """Killed after the drain wrote its output, before it committed: the next run is not a
    drain. Spark's next batch takes the drain's id with real input: it runs at the job's
    watermark (not the end of time), and its output replaces the drain's (set aside)."""
    inp, out = tmp_path / "in", tmp_path / "out"
    write_batches(inp, files[:2])
    common = [f"--set=input={inp}", f"--set=output={out}", *(f"--set={k}={v}" for k, v in ARGS.items()), "--until-idle", "-p", "2"]
    job = EXAMPLES / "tumbling_count.py"
    crashed = cli("run", str(job), "--job-dir", str(tmp_path / "job"), *common, "--drain-at-end", "--fault", "after-sink:2")
    assert crashed.returncode != 0 and (out / batch_folder_name(2)).exists()  # the drain's output, not committed
    write_batches(inp, files[2:], first=2)
    cli_here("run", str(job), "--job-dir", str(tmp_path / "job"), *common, check=True)  # a new driver
    run_job(job, tmp_path / "ref", 2, {**ARGS, "input": str(inp), "output": str(tmp_path / "ref_out")})
    pd.testing.assert_frame_equal(read_output(out), read_output(tmp_path / "ref_out"))
    assert list((out / SUPERSEDED).glob(f"*/{batch_folder_name(2)}"))
