"""The cluster module without a cluster: arguments, state files, process identity, docs."""

from __future__ import annotations

import doctest
import json
import os
import subprocess
from pathlib import Path

import pytest

import keyscale.cluster as cluster_package
import keyscale.cluster.cli as cli_module
import keyscale.cluster.executors as executors_module
import keyscale.cluster.local as local_module
from keyscale.cli.main import main
from keyscale.cluster import (
    ClusterInfo,
    WorkerInfo,
    add_worker,
    cluster_status,
    read_cluster,
    spark_conf_for_cluster,
    spark_home,
    start_cluster,
    stop_cluster,
    stop_worker,
)
from keyscale.cluster.processes import alive, free_ports, group_members, proc_stat
from keyscale.cluster.statefile import write_state
from keyscale.errors import ClusterError


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"cores": 0}, "worker cores must be at least 1, got 0"),
        ({"memory": "lots"}, "worker memory 'lots' must look like 512m or 1g"),
        ({"memory": "1.5g"}, "must look like 512m or 1g"),
        ({"workers": -1}, "the number of workers must be 0 or more, got -1"),
    ],
)
def test_start_rejects_bad_arguments(tmp_path: Path, kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ClusterError, match=message):
        start_cluster(tmp_path / "c", **kwargs)  # type: ignore[arg-type]
    assert not (tmp_path / "c" / "cluster.json").exists()


def test_no_cluster_in_the_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert read_cluster(tmp_path) is None
    assert stop_cluster(tmp_path) is False
    with pytest.raises(ClusterError, match=f"no cluster in {tmp_path}; start one with: keyscale cluster start --dir"):
        cluster_status(tmp_path)
    with pytest.raises(ClusterError, match="no cluster in"):
        add_worker(tmp_path)
    with pytest.raises(ClusterError, match="no cluster in"):
        stop_worker(tmp_path, "worker-1")
    assert main(["cluster", "stop", "--dir", str(tmp_path)]) == 0
    assert "no cluster is running" in capsys.readouterr().err
    assert main(["cluster", "status", "--dir", str(tmp_path)]) == 6
    assert main(["cluster", "add-worker", "--dir", str(tmp_path), "--cores", "0"]) == 6
    err = capsys.readouterr().err.splitlines()
    assert err == [f"keyscale: error: no cluster in {tmp_path}; start one with: keyscale cluster start --dir {tmp_path}",
                   "keyscale: error: worker cores must be at least 1, got 0"]


def test_a_damaged_state_file_is_named(tmp_path: Path) -> None:
    (tmp_path / "cluster.json").write_text("{not json")
    with pytest.raises(ClusterError, match=r"cluster.json is damaged"):
        read_cluster(tmp_path)


def _dead_pid() -> int:
    pid = 4_194_304 + 4242  # above PID_MAX_LIMIT (2**22): never a process
    assert proc_stat(pid) is None
    return pid


def test_state_round_trip_and_a_dead_cluster(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dead = _dead_pid()
    w = WorkerInfo("worker-1", dead, 2, "1g", 1, 2, tmp_path / "logs" / "worker-1.log", tmp_path / "work", 5)
    info = ClusterInfo(tmp_path.resolve(), "spark://127.0.0.1:1", "http://127.0.0.1:2", dead, 1, 2,
                       tmp_path / "logs" / "master.log", 5, (w,), 2)  # fmt: skip
    write_state(info)
    assert read_cluster(tmp_path) == info
    assert json.loads((tmp_path / "cluster.json").read_text())["workers"][0]["cores"] == 2
    st = cluster_status(tmp_path)
    assert not st.running and st.dead_processes == ("master", "worker-1") and st.total_cores == 0
    assert main(["cluster", "status", "--dir", str(tmp_path)]) == 1
    assert "is not answering (processes gone: master, worker-1)" in capsys.readouterr().out
    with pytest.raises(ClusterError, match=r"master of the cluster in .* is not running"):
        add_worker(tmp_path)
    assert stop_cluster(tmp_path) is True  # nothing alive: just forgets it
    assert read_cluster(tmp_path) is None


def test_process_identity_guards_against_pid_reuse() -> None:
    me = os.getpid()
    stat = proc_stat(me)
    assert stat is not None
    _state, pgrp, started = stat
    assert alive(me, started) and alive(me, 0)
    assert not alive(me, started + 1)  # same PID, another process: not ours
    assert not alive(_dead_pid(), 0)
    assert group_members(pgrp, 0)  # our own group has members ...
    # ... but a group is not ours if its leader is foreign (a group of its own: ours may have lost its leader)
    child = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        leader = proc_stat(child.pid)
        assert leader is not None
        assert group_members(child.pid, leader[2]) == [child.pid]
        assert group_members(child.pid, leader[2] + 1) == []
    finally:
        child.kill()
        child.wait()


def test_free_ports_are_distinct_and_bindable() -> None:
    ports = free_ports(4)
    assert len(set(ports)) == 4 and all(1024 < p < 65536 for p in ports)


def test_spark_home_is_the_pyspark_install() -> None:
    import pyspark

    home = spark_home()
    assert home == Path(pyspark.__file__).parent
    assert (home / "bin" / "spark-class").is_file()


def test_conf_for_the_cluster() -> None:
    conf = spark_conf_for_cluster(cores_per_executor=2, memory_per_executor="768m", driver_host="10.0.0.5")
    assert conf["spark.executor.cores"] == "2" and conf["spark.executor.memory"] == "768m"
    assert conf["spark.dynamicAllocation.enabled"] == "false" and "spark.cores.max" not in conf
    assert conf["spark.driver.host"] == conf["spark.driver.bindAddress"] == "10.0.0.5"


@pytest.mark.parametrize("module", [cluster_package, local_module, cli_module, executors_module])
def test_docstring_examples_run(module: object) -> None:
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)  # type: ignore[arg-type]
    assert result.failed == 0 and result.attempted > 0


def test_a_daemon_that_cannot_start_is_a_clear_error_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("JAVA_HOME", str(tmp_path / "no-java"))  # spark-class fails at once
    with pytest.raises(ClusterError, match=r"the Spark master exited with code \d+ while starting; see .*logs/master.log$"):
        start_cluster(tmp_path / "c")
    assert read_cluster(tmp_path / "c") is None
    assert (tmp_path / "c" / "logs" / "master.log").exists()


@pytest.mark.parametrize("module", ["processes", "records", "statefile"])
def test_the_module_examples_run(module: str) -> None:
    import doctest
    import importlib

    assert doctest.testmod(importlib.import_module(f"keyscale.cluster.{module}")).failed == 0
