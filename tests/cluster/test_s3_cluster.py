"""Jobs on an isolated standalone cluster with their job directory and output on S3.

The workers run as another Unix user in a private mount namespace (``start_cluster(...,
isolated=True)``): like executors on other machines, they cannot read or write the
driver's local folders (pytest's tmp dirs are mode 0700). Everything a task touches must
go through keyscale's storage layer to S3 (a SeaweedFS server) or over the network (the
Redis log). The S3 endpoint and keys are in the driver's environment only (the
``s3_bucket`` fixture sets them after the workers started): they must travel with the job.

One cluster (2 workers x 1 core) for the module; every test has its own bucket and runs
``keyscale run --master spark://...`` in a subprocess (its own driver).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from conftest import EXAMPLES, ROOT, cli, read_output
from keyscale.checkpoint.jobdir import JobDir
from keyscale.cluster import add_worker, cluster_status, start_cluster, stop_cluster
from keyscale.errors import StorageError
from keyscale.sources import LogWriter, PartitionedLog, create_log, start_generator

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.slow,
    pytest.mark.skipif(
        os.geteuid() != 0 or not (shutil.which("setpriv") and shutil.which("unshare")),
        reason="isolated workers need root, setpriv and unshare",
    ),
]

LOG_COUNT = EXAMPLES / "log_count.py"
SLOW_COUNT = ROOT / "bench" / "jobs" / "slow_count.py"
SCHEMA = "key string, value long"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    folder = tmp_path_factory.mktemp("s3cluster") / "cluster"
    info = start_cluster(folder, workers=2, cores=1, isolated=True)
    try:
        yield info
    finally:
        stop_cluster(folder)


class Job:
    """``keyscale run`` in the background against the cluster, stopped by its PID at the end."""

    def __init__(self, tmp: Path, job_dir: str, *argv: str):
        self.dir = job_dir
        self.jd = JobDir(job_dir)
        self.log = tmp / f"job-{uuid.uuid4().hex[:6]}.log"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "keyscale.cli.main", "run", *argv, "--job-dir", job_dir],
                cwd=ROOT, stdout=out, stderr=out,
                # A heartbeat (status.json on S3, what the test polls) every 2 s, not every 10 s.
                env={**os.environ, "PYSPARK_PYTHON": sys.executable, "KEYSCALE_SPARK_LOG_LEVEL": "ERROR", "KEYSCALE_TAKEOVER_AFTER": "6"},
            )  # fmt: skip

    def status(self) -> dict[str, Any]:
        try:
            return self.jd.read_status()
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
        cli("stop", self.dir, check=True)
        assert self.proc.wait(timeout=120) == 0, self.log.read_text()[-3000:]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)


def par(st: dict[str, Any], uid: str = "totals") -> int:
    return int(st["operators"][uid]["parallelism"])


def lag(st: dict[str, Any]) -> int:
    return int(st["operators"]["reader"].get("lag", -1))


def batch(st: dict[str, Any]) -> int:
    return -1 if st.get("last_checkpoint") is None else int(st["last_checkpoint"])


def produce(log: PartitionedLog, rows: int, seed: int, keys: int = 60) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    df = pd.DataFrame({"key": [f"k{i}" for i in rng.integers(0, keys, rows)], "value": rng.integers(1, 100, rows)})
    LogWriter(log, ["key"]).write(pa.Table.from_pandas(df, preserve_index=False))
    return df


def totals(out: pd.DataFrame) -> pd.DataFrame:
    """Each key's final row (the running count only grows)."""
    return out.sort_values("count").groupby("key").tail(1).set_index("key")[["count", "sum"]].sort_index()


def expected(*frames: pd.DataFrame) -> pd.DataFrame:
    return pd.concat(frames).groupby("key").agg(count=("value", "size"), sum=("value", "sum")).sort_index()


def partitions(st: dict[str, Any]) -> list[list[int]]:
    """The readers' partitions as of the status's batch (the status, not the manifest:
    retention may have deleted the manifest of a batch the status names)."""
    return [sorted(int(p) for p in r["partitions"]) for r in st["operators"]["reader"]["readers"]]


def offsets(st: dict[str, Any]) -> dict[int, int]:
    return {int(p): int(v["offset"]) for r in st["operators"]["reader"]["readers"] for p, v in r["partitions"].items()}


def test_flip8_on_an_isolated_cluster_with_state_and_output_on_s3(cluster: Any, redis_url: str, s3_bucket: str, tmp_path: Path) -> None:
    """FLIP-8 on a cluster: 4 partitions read by 2 readers, live to 1 reader then 4, two
    partitions added while running; job dir and output on S3, the log on Redis. The output
    equals the expected totals."""
    log = create_log(f"{redis_url}?name=c-{uuid.uuid4().hex[:12]}", SCHEMA, 4)
    frames = [produce(log, 2000, seed=1)]
    job_dir, out = f"{s3_bucket}/jobs/lc", f"{s3_bucket}/out"
    job = Job(tmp_path, job_dir, str(LOG_COUNT), "--master", cluster.master_url, "-p", "2", "--trigger-interval", "500 milliseconds",
              "--set", f"log={log.uri}", "--set", f"output={out}", "--set", "max_records_per_batch=200")  # fmt: skip
    jd = job.jd
    try:
        st = job.wait("a first batch on the cluster", lambda st: batch(st) >= 0, timeout=240)
        assert partitions(st) == [[0, 1], [2, 3]]  # S1: KP1, KP2; S2: KP3, KP4
        jd.request_rescale(1, "reader")  # 2 -> 1, live
        frames.append(produce(log, 1000, seed=2))
        st = job.wait("one reader", lambda st: par(st, "reader") == 1)
        assert partitions(st) == [[0, 1, 2, 3]]  # one reader holds all four
        jd.request_rescale(4, "reader")  # 1 -> 4, live
        frames.append(produce(log, 1000, seed=3))
        st = job.wait("four readers", lambda st: par(st, "reader") == 4)
        assert partitions(st) == [[0], [1], [2], [3]]  # each reader one: none idles
        log.add_partitions(2)  # KP5, KP6 while running
        frames.append(produce(log, 1500, seed=4))
        ends = log.end_offsets()
        st = job.wait("the six partitions read to their end",
                      lambda st: lag(st) == 0 and sorted(p for e in partitions(st) for p in e) == list(range(6)), timeout=240)  # fmt: skip
        assert len(partitions(st)) == 4 and offsets(st) == dict(enumerate(ends))
        job.stop()
    finally:
        job.kill()
    said = job.log.read_text()
    assert "rescaling 'reader' live from 2 to 1" in said and "rescaling 'reader' live from 1 to 4" in said, said[-3000:]
    pd.testing.assert_frame_equal(totals(read_output(out)), expected(*frames), check_dtype=False)
    # Nothing of the job on the driver's disk: the job ran on S3 alone.
    assert not (ROOT / "s3:").exists() and not list(tmp_path.glob("**/manifest-*"))


def test_a_local_output_folder_fails_on_isolated_workers(cluster: Any, redis_url: str, s3_bucket: str, tmp_path: Path) -> None:
    """The isolation bites: the same job with its output in the driver's private tmp dir
    fails, naming the folder, because the executors (another user) cannot write there.
    (The same job with its output on S3 is the test above.)"""
    log = create_log(f"{redis_url}?name=c-{uuid.uuid4().hex[:12]}", SCHEMA, 2)
    produce(log, 200, seed=5)
    out = tmp_path / "out"
    r = cli("run", str(LOG_COUNT), "--job-dir", f"{s3_bucket}/jobs/local-out", "--master", cluster.master_url, "-p", "2",
            "--until-idle", "--set", f"log={log.uri}", "--set", f"output={out}", "--conf", "spark.task.maxFailures=1",
            timeout=240)  # fmt: skip
    assert r.returncode == StorageError.exit_code, r.stderr[-3000:]
    # One line says what failed, where, and what to do; no Python traceback.
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    said = next(line for line in r.stderr.splitlines() if "Parquet sink, batch 0" in line)
    assert f"cannot write {out}/batch=000000000000/part-" in said and "as user 'keyscale-worker'" in said, said
    assert "Permission denied" in said and "use an object store: s3://" in said, said
    assert not JobDir(f"{s3_bucket}/jobs/local-out").manifest_batches()  # nothing committed


def test_active_autoscaler_asks_for_executors_with_state_on_s3(cluster: Any, redis_url: str, s3_bucket: str, tmp_path: Path) -> None:
    """The active autoscaler under a load step on the cluster (a third worker joins first):
    it scales up, asks Spark for executors to match and waits for them, scales back down after its delay once
    the load dropped, without oscillating, and the output on S3 is exactly once. With
    asynchronous checkpoints: the executors a scale-down releases go only once the state
    files they upload after their tasks are stored. The last test of the module: the
    worker it adds stays until the cluster stops."""
    add_worker(cluster.folder, cores=1)
    log = create_log(f"{redis_url}?name=c-{uuid.uuid4().hex[:12]}", "key string, value long, ts timestamp, seq long", 4)
    job_dir, out = f"{s3_bucket}/jobs/slow", f"{s3_bucket}/out"
    job = Job(tmp_path, job_dir, str(SLOW_COUNT), "--master", cluster.master_url, "-p", "1", "--scaling", "auto", "--autoscaler", "active",
              "--scaling-max", "4", "--trigger-interval", "1 second", "--async-checkpoints",
              "--autoscaler-option", "stabilization_seconds=4", "--autoscaler-option", "scale_down_delay_seconds=8",
              "--autoscaler-option", "metrics_window_seconds=6", "--autoscaler-option", "warmup_batches=1",
              "--autoscaler-option", "catch_up_seconds=10", "--autoscaler-option", "min_busy_seconds=0",
              "--set", f"log={log.uri}", "--set", f"output={out}", "--set", "cost_ms=1")  # fmt: skip
    gen = None
    try:
        job.wait("a first batch", lambda st: batch(st) >= 0, timeout=240)
        # Sized for P=1 from the start: one executor core, though Spark may have launched one
        # on each of the three workers before the job's first request reached the master.
        deadline = time.time() + 120
        while cluster_status(cluster.folder).cores_used != 1:
            assert time.time() < deadline, f"the job holds {cluster_status(cluster.folder).cores_used} executor cores at P=1"
            time.sleep(1)
        gen = start_generator(log, "1200/s for 15s, 100/s for 10s", keys=50)
        job.wait("a scale-up under the load step", lambda st: par(st) >= 2, timeout=120)
        job.wait("a scale-down after the load dropped", lambda st: par(st) == 1, timeout=180)
        gen.join(120)
        job.wait("the backlog read", lambda st: lag(st) == 0)
        job.stop()
    finally:
        if gen is not None:
            gen.stop()
        job.kill()
    assert gen.error is None
    events = job.jd.read_events()
    actions = [e["action"] for e in events if e["type"] == "autoscaler" and e["uid"] == "totals" and e["action"] != "none"]
    assert actions[0] == "scale_up" and actions[-1] == "scale_down"
    assert sum(1 for a, b in pairwise(actions) if a != b) <= 2  # no oscillation
    asked = [e for e in events if e["type"] == "executors"]
    assert any(e["requested"] >= 2 and e["requested"] > e["had"] for e in asked), asked  # more executors for the scale-up
    # The scale-up waited for them: the job said when they came (or that they came late),
    # after asking, and a "ready" means the cores it wanted were there.
    kinds = [e["type"] for e in events]
    waited = [e for e in events if e["type"] in ("executors_ready", "executors_late")]
    assert waited and kinds.index("executors") < kinds.index(waited[0]["type"]), kinds
    assert all(e["cores"] >= e["wanted"] for e in waited if e["type"] == "executors_ready"), waited
    # Exactly once: each key's final count is its number of records in the log.
    got = read_output(out).groupby("key")["count"].max().sort_index()
    records = pd.concat([log.read(p, 0, e).to_pandas() for p, e in enumerate(log.end_offsets())])
    pd.testing.assert_series_equal(got, records.groupby("key").size().sort_index(), check_names=False, check_dtype=False)


def test_running_count_on_an_isolated_cluster_restarts_3_to_2_after_a_kill_exactly_once(
    cluster: Any, s3_bucket: str, spark: Any, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A Spark-source job on the isolated cluster, state and output on S3: the driver is
    killed after the sink wrote batch 1 (before its commit), then restarted at parallelism 2
    with more input. Output equals a run at parallelism 1 on local disk."""
    from conftest import RUNNING_COUNT, reference_output, write_events

    events = tmp_path / "events"
    write_events(events, files=5, rows=1200, keys=200, seed=5)
    reference = reference_output(tmp_path_factory, events, 1)
    # The input must be readable by the workers' user: a world-readable folder of its own.
    inp = Path(tempfile.mkdtemp(prefix="ks-cluster-input-", dir="/tmp"))
    try:
        inp.chmod(0o755)

        def feed(upto: int) -> None:
            for p in sorted(events.glob("part-*.parquet"))[:upto]:
                if not (inp / p.name).exists():
                    shutil.copy2(p, inp / p.name)
                    (inp / p.name).chmod(0o644)

        job, out = f"{s3_bucket}/jobs/rc", f"{s3_bucket}/out"
        base = ["run", str(RUNNING_COUNT), "--job-dir", job, "--master", cluster.master_url, "--until-idle",
                "--set", f"input={inp}", "--set", f"output={out}"]
        feed(3)
        killed = cli(*base, "-p", "3", "--fault", "after-sink:1", timeout=600)
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
        assert JobDir(job).manifest_batches()[-1] == 0
        feed(5)
        resumed = cli(*base, "-p", "2", check=True, timeout=600)
        assert "resuming job 'running_count' from checkpoint 0" in resumed.stderr
        assert JobDir(job).manifest_batches()[-1] == 4
        got = read_output(out)
        assert not got.duplicated(["batch", "key"]).any()
        pd.testing.assert_frame_equal(got.reset_index(drop=True), reference.reset_index(drop=True), check_dtype=False)
    finally:
        shutil.rmtree(inp, ignore_errors=True)
