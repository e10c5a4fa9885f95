"""Choosing a state backend: per stage and per job, with clear errors naming the operator."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

import keyscale as ks
from keyscale.errors import JobDefinitionError
from keyscale.runtime.driver.runner import JobRunner, RunOptions
from keyscale.sources import create_log
from keyscale.state.backends import check_state_backend


def _keyed(tmp_path: Path, key_type: pa.DataType | None = None) -> ks.streams.KeyedStream:
    log = create_log(tmp_path / "log", pa.schema([("key", key_type or pa.string()), ("value", pa.int64())]), 1)
    return ks.stream(ks.sources.log_source(log, uid="reader")).key_by("key")


def test_a_stage_takes_memory_or_rocksdb_and_names_itself_otherwise(tmp_path: Path) -> None:
    keyed = _keyed(tmp_path)
    for backend in ("memory", "rocksdb", None):
        stream = keyed.aggregate(uid=f"n_{backend}", n=ks.aggregates.count(), state_backend=backend)
        (step,) = stream._steps[-1:]
        assert step.state_backend == backend  # type: ignore[union-attr]
    with pytest.raises(JobDefinitionError, match="operator 'totals': state_backend must be 'memory' or 'rocksdb', not 'disk'"):
        keyed.aggregate(uid="totals", n=ks.aggregates.count(), state_backend="disk")


def test_rocksdb_refuses_a_key_it_cannot_order_naming_operator_and_column(tmp_path: Path) -> None:
    keyed = _keyed(tmp_path, pa.decimal128(10, 2))
    with pytest.raises(JobDefinitionError, match="operator 'sums': the rocksdb state backend cannot key by column 'key' of type decimal128"):
        keyed.aggregate(uid="sums", n=ks.aggregates.count(), state_backend="rocksdb")
    keyed.aggregate(uid="sums", n=ks.aggregates.count(), state_backend="memory")


def test_the_jobs_option_is_checked_when_the_job_is_set_up(tmp_path: Path) -> None:
    with pytest.raises(JobDefinitionError, match="the job's option: state_backend must be 'memory' or 'rocksdb', not 'Memory'"):
        JobRunner(RunOptions(job_file="x.py", job_dir=str(tmp_path / "job"), state_backend="Memory"))
    assert RunOptions(job_file="x.py", job_dir=str(tmp_path)).state_backend == "memory"  # the documented default


def test_the_cli_takes_the_option() -> None:
    from keyscale.cli.main import build_parser

    a = build_parser().parse_args(["run", "job.py", "--job-dir", "d", "--state-backend", "rocksdb"])
    assert a.state_backend == "rocksdb"
    assert build_parser().parse_args(["run", "job.py", "--job-dir", "d"]).state_backend == "memory"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "job.py", "--job-dir", "d", "--state-backend", "disk"])


def test_check_state_backend() -> None:
    assert check_state_backend("memory", "x") == "memory"
