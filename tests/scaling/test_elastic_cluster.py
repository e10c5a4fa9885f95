"""Elastic jobs on a real Spark standalone cluster on localhost (``keyscale cluster``):
reactive mode follows workers joining and leaving; output exactly-once throughout. (The
active autoscaler on a cluster, scaling up under a load step and back down, is tested with
its state on S3 in tests/cluster/test_s3_cluster.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from conftest import EXAMPLES, ROOT, cli, read_output
from keyscale.checkpoint.jobdir import JobDir
from keyscale.cluster import add_worker, read_cluster, start_cluster, stop_cluster, stop_worker
from keyscale.sources import LogWriter, create_log

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Any]:
    info = start_cluster(tmp_path / "cluster", workers=1, cores=1, memory="1g")
    try:
        yield info
    finally:
        stop_cluster(tmp_path / "cluster")
        assert read_cluster(tmp_path / "cluster") is None


class Job:
    """``keyscale run`` in the background, stopped by its PID at the end."""

    def __init__(self, tmp: Path, *argv: str):
        self.dir = tmp / "job"
        self.log = tmp / "job.log"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "keyscale.cli.main", "run", *argv, "--job-dir", str(self.dir)],
                                         cwd=ROOT, stdout=out, stderr=out, env={**os.environ, "PYSPARK_PYTHON": sys.executable})

    def status(self) -> dict[str, Any]:
        try:
            return JobDir(self.dir).read_status()
        except Exception:
            return {}

    def wait(self, what: str, cond: Callable[[dict[str, Any]], bool], timeout: float = 180) -> dict[str, Any]:
        deadline = time.time() + timeout
        while time.time() < deadline:
            assert self.proc.poll() is None, f"job exited while waiting for {what}:\n{self.log.read_text()[-3000:]}"
            st = self.status()
            if st and cond(st):
                return st
            time.sleep(0.5)
        raise AssertionError(f"timed out waiting for {what}; status {json.dumps(self.status())[:2000]}\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        cli("stop", str(self.dir), check=True)
        assert self.proc.wait(timeout=120) == 0

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)


def par(st: dict[str, Any], uid: str = "totals") -> int:
    return int(st["operators"][uid]["parallelism"])


def lag(st: dict[str, Any]) -> int:
    return int(st["operators"]["reader"].get("lag", -1))


def produce(log: Any, rows: int, seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    df = pd.DataFrame({"key": [f"k{i}" for i in rng.integers(0, 50, rows)], "value": rng.integers(1, 100, rows)})
    LogWriter(log, ["key"]).write(pa.Table.from_pandas(df, preserve_index=False))
    return df


def check_exactly_once(out_dir: Path, *frames: pd.DataFrame) -> None:
    out = read_output(out_dir)
    got = out.sort_values("count").groupby("key").tail(1).set_index("key")[["count", "sum"]].sort_index()
    want = pd.concat(frames).groupby("key").agg(count=("value", "size"), sum=("value", "sum")).sort_index()
    pd.testing.assert_frame_equal(got, want, check_dtype=False)


def test_reactive_mode_follows_a_worker_joining_and_leaving(cluster: Any, tmp_path: Path) -> None:
    log = create_log(tmp_path / "log", "key string, value long", 4)
    frames = [produce(log, 2000, 1)]
    job = Job(tmp_path, str(EXAMPLES / "log_count.py"), "--master", cluster.master_url, "--scaling", "reactive", "--scaling-max", "4",
              "--trigger-interval", "500 milliseconds", "--set", f"log={tmp_path / 'log'}", "--set", f"output={tmp_path / 'out'}",
              "--set", "max_records_per_batch=100")
    try:
        job.wait("a first batch at parallelism 1", lambda st: st.get("last_checkpoint") is not None and par(st) == 1)
        worker = add_worker(tmp_path / "cluster", cores=1)
        job.wait("parallelism 2 after a worker joined", lambda st: par(st) == 2 and par(st, "reader") == 2)
        frames.append(produce(log, 1000, 2))
        stop_worker(tmp_path / "cluster", worker.id, kill=True)  # a machine disappears mid-run
        job.wait("parallelism 1 after the worker left", lambda st: par(st) == 1)
        frames.append(produce(log, 1000, 3))
        job.wait("the backlog read", lambda st: lag(st) == 0 and par(st) == 1)
        job.stop()
    finally:
        job.kill()
    events = [e for e in JobDir(tmp_path / "job").read_events() if e["type"] == "reactive"]
    assert [e["to"] for e in events][:2] == [2, 1], events
    check_exactly_once(tmp_path / "out", *frames)
