"""Exactly-once across crashes: the driver is killed (SIGKILL) at the worst moments, the
job is restarted, and the output equals an uninterrupted run with no row twice."""

from __future__ import annotations

import signal
from pathlib import Path

import pandas as pd
import pytest

from conftest import RUNNING_COUNT, cli, cli_here, read_output
from keyscale.checkpoint.jobdir import JobDir

pytestmark = [pytest.mark.slow]
EVENTS = {"files": 5, "rows": 2000, "keys": 300, "seed": 7}
REFERENCE = {"parallelism": 2, "max_chain": 2}


@pytest.mark.parametrize(
    ("fault", "backend"),
    [
        ("mid-batch:2", "memory"),  # a task kills the driver while the batch is being processed
        ("mid-upload:2", "memory"),  # a task kills the driver while its state file uploads (its output streaming on)
        ("after-sink:2", "memory"),  # output written, checkpoint not committed
        ("in-compaction:2", "memory"),  # a task kills the driver while writing a snapshot
        # RocksDB: the tasks' databases are at batch 2, which never commits: the restart
        # must reload them from the checkpoint, not reuse them.
        ("in-compaction:2", "rocksdb"),
    ],
)
def test_killed_driver_restarts_exactly_once(fault: str, backend: str, events: Path, reference: pd.DataFrame, tmp_path: Path) -> None:
    base = ["run", str(RUNNING_COUNT), "--job-dir", str(tmp_path / "job"), "-p", "2", "--until-idle",
            "--compaction-chain", "2", "--set", f"input={events}", "--set", f"output={tmp_path / 'out'}", "--state-backend", backend]
    crashed = cli(*base, "--fault", fault)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    jd = JobDir(tmp_path / "job")
    assert jd.manifest_batches()[-1] == 1  # batch 2 never committed
    if fault.startswith("after-sink"):
        assert (tmp_path / "out" / "batch=000000000002").exists()

    resumed = cli_here(*base, check=True)  # a new driver: the killed one's JVM and workers are gone with it
    assert "resuming job 'running_count' from checkpoint 1" in resumed.stderr
    out = read_output(tmp_path / "out")
    assert not out.duplicated(["batch", "key"]).any()
    pd.testing.assert_frame_equal(out, reference)
    assert jd.manifest_batches()[-1] == 4
