"""The Spark daemons of a local cluster (keyscale.cluster.daemons): the parts that need no JVM.
Starting and stopping real daemons is tested through keyscale.cluster.local (test_local.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from keyscale.cluster.daemons import _env, alive_worker_ports, master_json
from keyscale.cluster.processes import free_ports


def test_only_alive_workers_count_as_registered() -> None:
    data = {"workers": [{"port": 1, "state": "ALIVE"}, {"port": 2, "state": "DEAD"}, {"state": "ALIVE"}]}
    assert alive_worker_ports(data) == {1, -1}
    assert alive_worker_ports({}) == set()


def test_a_master_that_does_not_answer_is_none() -> None:
    (port,) = free_ports(1)
    assert master_json(port, timeout=0.5) is None


def test_executors_get_the_archive_through_their_workers_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("JDK_JAVA_OPTIONS", "-Dmine=1")
    env = _env(tmp_path, tmp_path / "spark", executor_archive="/c/executor-classes.jsa")
    assert env["JDK_JAVA_OPTIONS"] == "-Dmine=1 -XX:SharedArchiveFile=/c/executor-classes.jsa"  # the user's first, kept
    # The worker's JVM and spark-class's launcher JVM have other class paths: Java's own archive for them.
    for own in ("SPARK_WORKER_OPTS", "SPARK_LAUNCHER_OPTS"):
        last = env[own].split()[-1]
        assert last == "-Xshare:off" or (last.startswith("-XX:SharedArchiveFile=") and last.endswith("/lib/server/classes.jsa"))
    plain = _env(tmp_path, tmp_path / "spark")
    assert plain["JDK_JAVA_OPTIONS"] == "-Dmine=1" and "SharedArchiveFile" not in plain["SPARK_WORKER_OPTS"]
