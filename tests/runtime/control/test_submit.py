"""A job file under spark-submit (``ks.main``) takes the control API's options as ``keyscale
run`` does: the way to set them on Spark on Kubernetes, YARN or a managed Spark (docs/kubernetes.md)."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest

import keyscale as ks
from conftest import write_events


def build(ctx: Any) -> Any:
    events = ctx.spark.readStream.schema("key string, value long, ts timestamp").parquet(ctx.arg("input"))
    return ks.stream(events).key_by("key").aggregate(uid="n", n=ks.aggregates.count()).sink(ks.sinks.NoopSink())


@pytest.mark.spark
@pytest.mark.slow
def test_ks_main_listens_where_told_and_refuses_a_missing_token_file(spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_events(tmp_path / "in", files=1, rows=100, keys=5)
    given = ["--until-idle", "--set", f"input={tmp_path / 'in'}"]
    code = ks.main(build, ["--job-dir", str(tmp_path / "a"), *given, "--metrics-token-file", str(tmp_path / "missing")])
    assert code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"keyscale: error: the metrics token file {tmp_path / 'missing'} (metrics_token_file (--metrics-token-file)) does not exist")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert ks.main(build, ["--job-dir", str(tmp_path / "b"), *given, "--control-host", "0.0.0.0", "--control-port", str(port)]) == 0
    assert f"listening on 0.0.0.0 port {port}" in capsys.readouterr().err
