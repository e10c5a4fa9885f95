"""A job file importing its sibling module and package runs through `keyscale run` on a
Spark standalone cluster (`keyscale cluster`): the executors' Python workers run in the
workers' own folders, where only what keyscale ships reaches them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow.parquet as pq
import pytest
from tests.cli.job_project import expected_totals, final_totals, write_project

from conftest import cli, read_output, write_events
from keyscale.cluster import read_cluster, start_cluster, stop_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(420)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    folder = tmp_path_factory.mktemp("modules-cluster") / "cluster"
    info = start_cluster(folder, workers=1, cores=1, memory="1g")
    try:
        yield info
    finally:
        stop_cluster(folder)
        assert read_cluster(folder) is None


def test_a_job_file_importing_a_sibling_module_and_package_runs_on_the_cluster(cluster: Any, tmp_path: Path) -> None:
    job = write_project(tmp_path / "project")
    write_events(tmp_path / "in", files=2, rows=100, keys=8)
    cli("run", str(job), "--job-dir", str(tmp_path / "job"), "-p", "2", "--until-idle", "--master", cluster.master_url,
        "--set", f"input={tmp_path / 'in'}", "--set", f"output={tmp_path / 'out'}", timeout=400, check=True)
    events = pd.concat(pq.read_table(f).to_pandas() for f in sorted((tmp_path / "in").glob("*.parquet")))
    assert final_totals(read_output(tmp_path / "out")) == expected_totals(events)
