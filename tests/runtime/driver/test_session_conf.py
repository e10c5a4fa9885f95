"""The Spark settings a job's session gets: keyscale's defaults, a cluster's, the user's --conf (no Spark)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from keyscale.cli.main import main
from keyscale.cluster import is_loopback_master, spark_conf_for_cluster
from keyscale.errors import KeyscaleError
from keyscale.runtime.driver.session import SESSION_DEFAULTS, parse_spark_conf, session_conf

DRIVER_KEYS = ("spark.driver.host", "spark.driver.bindAddress")


def test_conf_items_parse_and_a_later_one_wins() -> None:
    conf = parse_spark_conf([
        "spark.executor.memory=1g",
        "spark.executor.extraJavaOptions=-Dx=1 -Dy=2",  # the value is everything after the first '='
        " spark.sql.shuffle.partitions =4",
        "spark.executor.memory=2g",
        "spark.empty=",
    ])  # fmt: skip
    assert conf == {
        "spark.executor.memory": "2g",
        "spark.executor.extraJavaOptions": "-Dx=1 -Dy=2",
        "spark.sql.shuffle.partitions": "4",
        "spark.empty": "",
    }


@pytest.mark.parametrize("bad", ["spark.executor.memory", "=1g", "spark executor.memory=1g", ""])
def test_a_bad_conf_item_is_named(bad: str) -> None:
    with pytest.raises(KeyscaleError) as e:
        parse_spark_conf(["spark.ok=1", bad])
    assert str(e.value) == f"--conf {bad!r} must look like NAME=VALUE (a Spark setting, e.g. spark.executor.memory=1g)"


def test_local_masters_get_keyscales_defaults_only() -> None:
    assert session_conf("local[2]") == SESSION_DEFAULTS
    assert session_conf("local[*]", None) == SESSION_DEFAULTS
    assert not any(k in session_conf("local[4]") for k in (*DRIVER_KEYS, "spark.executor.cores"))


def test_the_users_conf_wins_over_every_default() -> None:
    user = {
        "spark.sql.shuffle.partitions": "16",  # a keyscale default
        "spark.executor.cores": "2",  # a cluster default
        "spark.driver.host": "10.0.0.9",  # a pinned one
        "spark.custom.setting": "x",
    }
    for master in ("local[2]", "spark://127.0.0.1:7077", "spark://spark-master:7077"):
        conf = session_conf(master, user)
        assert {k: conf[k] for k in user} == user, master
        # The rest of the defaults stay.
        assert conf["spark.sql.session.timeZone"] == "UTC"


def test_a_cluster_gets_its_defaults_and_the_driver_is_pinned_only_on_loopback() -> None:
    cluster = spark_conf_for_cluster()
    for master in ("spark://127.0.0.1:7077", "spark://localhost:41393", "spark://[::1]:7077"):
        conf = session_conf(master)
        assert {k: conf[k] for k in cluster} == cluster
        assert conf["spark.driver.host"] == conf["spark.driver.bindAddress"] == "127.0.0.1", master
    for master in ("spark://10.0.0.5:7077", "spark://spark-master.example.com:7077", "spark://127.0.0.1:7077,node2:7077"):
        conf = session_conf(master)
        assert {k: conf[k] for k in cluster} == cluster
        assert not any(k in conf for k in DRIVER_KEYS), master
    # The user can pin it for a remote master.
    conf = session_conf("spark://10.0.0.5:7077", {"spark.driver.host": "10.0.0.7", "spark.driver.bindAddress": "0.0.0.0"})
    assert (conf["spark.driver.host"], conf["spark.driver.bindAddress"]) == ("10.0.0.7", "0.0.0.0")


@pytest.mark.parametrize(
    ("master", "loopback"),
    [
        ("spark://127.0.0.1:7077", True), ("spark://127.0.1.1:7077", True), ("spark://LOCALHOST:7077", True),
        ("spark://localhost", True), ("spark://[::1]:7077", True), ("spark://localhost:1,127.0.0.1:2", True),
        ("spark://10.0.0.5:7077", False), ("spark://0.0.0.0:7077", False), ("spark://my-host:7077", False),
        ("spark://localhost.example.com:7077", False), ("spark://127.0.0.1:1,10.0.0.5:2", False),
        ("local[2]", False), ("yarn", False),
    ],
)  # fmt: skip
def test_loopback_masters(master: str, loopback: bool) -> None:
    assert is_loopback_master(master) is loopback


def test_run_passes_conf_to_the_job(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import keyscale.runtime.driver.runner as driver

    seen: dict[str, Any] = {}

    class Runner:
        def __init__(self, opts: Any, serve: Any = None) -> None:
            seen["conf"] = opts.spark_conf
            raise KeyscaleError("stop here")

    monkeypatch.setattr(driver, "JobRunner", Runner)
    code = main(["run", "job.py", "--job-dir", str(tmp_path), "--conf", "spark.executor.memory=1g",
                 "--conf", "spark.driver.host=10.0.0.7", "--conf", "spark.executor.memory=3g"])  # fmt: skip
    assert code != 0
    assert seen["conf"] == {"spark.executor.memory": "3g", "spark.driver.host": "10.0.0.7"}


def test_run_names_a_bad_conf_item(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code = main(["run", "job.py", "--job-dir", str(tmp_path), "--conf", "spark.executor.memory"])
    assert code != 0
    err = capsys.readouterr().err
    assert "keyscale: error: --conf 'spark.executor.memory' must look like NAME=VALUE" in err
    assert not any(tmp_path.iterdir())
