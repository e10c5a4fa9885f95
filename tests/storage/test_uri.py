"""A location keyscale cannot serve is an error, never a local folder named after its scheme."""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import ROOT, RUNNING_COUNT
from keyscale.checkpoint.jobdir import JobDir
from keyscale.errors import StorageError
from keyscale.sinks.parquet import ParquetSink
from keyscale.storage import ObjectStore, local_path, open_store


@pytest.mark.parametrize("uri", ["s3://bucket/jobs/rc", "S3A://b/x", "gs://b/x", "hdfs://nn:8020/x", "abfss://c@a.dfs.core.windows.net/x"])
def test_local_only_locations_refuse_uris_by_name(uri: str) -> None:
    with pytest.raises(StorageError, match="must be a local path") as e:
        local_path(uri, "log folder")
    assert uri in str(e.value)


@pytest.mark.parametrize("uri", ["hdfs://nn:8020/x", "webhdfs://nn/x", "ftp://h/x", "s3://"])
def test_unserved_schemes_are_refused_by_name(uri: str) -> None:
    with pytest.raises(StorageError, match="job directory") as e:
        open_store(uri, "job directory")
    assert uri in str(e.value)
    with pytest.raises(StorageError):
        JobDir(uri)
    with pytest.raises(StorageError, match="Parquet sink path"):
        ParquetSink(uri)


@pytest.mark.parametrize("uri", ["s3://bucket/jobs/rc", "s3a://b/x", "gs://b/x", "az://c/x"])
def test_object_store_uris_open_stores(uri: str) -> None:
    store = open_store(uri, "job directory")
    assert isinstance(store, ObjectStore) and store.url("a/b") == store.uri + "/a/b"
    assert store.local_root is None


def test_upload_concurrency_is_keyscales_setting_checked_by_name() -> None:
    """``--storage-option upload_concurrency=N``: the parts of one upload in flight; obstore
    never sees the key (it refuses keys it does not know), and a value that is not a whole
    number from 1 is an error naming the setting and the location, not a default."""
    store = open_store("s3://bucket/jobs/rc", "job directory", {"upload_concurrency": "5", "endpoint": "http://127.0.0.1:1"})
    assert isinstance(store, ObjectStore) and store.upload_concurrency == 5
    assert store.client is not None
    assert open_store("s3://bucket/jobs/rc", "job directory").upload_concurrency == 2  # type: ignore[attr-defined]
    assert pickle.loads(pickle.dumps(store.sub("state"))).upload_concurrency == 5  # it travels with the store to the tasks
    for bad in ("0", "-1", "two", "1.5", ""):
        with pytest.raises(StorageError, match=rf"job directory s3://bucket/jobs/rc: storage option upload_concurrency='{re.escape(bad)}'"):
            open_store("s3://bucket/jobs/rc", "job directory", {"upload_concurrency": bad})


def test_file_uris_and_paths_are_local(tmp_path: Path) -> None:
    assert local_path(f"file://{tmp_path}/a", "x") == tmp_path / "a"
    assert local_path(f"file://localhost{tmp_path}/a", "x") == tmp_path / "a"
    assert local_path(tmp_path / "a", "x") == tmp_path / "a"
    assert local_path("out:2024", "x") == Path("out:2024").absolute()  # no "//": a path
    with pytest.raises(StorageError, match="names a host"):
        local_path("file://otherhost/x", "x")


@given(st.from_regex(r"[a-z][a-z0-9+.-]{1,8}", fullmatch=True).filter(lambda s: s != "file"), st.text(min_size=1, max_size=20))
def test_any_other_scheme_is_refused(scheme: str, rest: str) -> None:
    with pytest.raises(StorageError, match=re.escape(f"{scheme}://")):
        local_path(f"{scheme}://{rest}", "job directory")
    if scheme not in ("s3", "s3a", "gs", "az", "abfs", "abfss"):
        with pytest.raises(StorageError, match=re.escape(f"{scheme}://")):
            open_store(f"{scheme}://{rest}", "job directory")


def test_run_with_an_s3_job_dir_writes_nothing_locally(tmp_path: Path) -> None:
    """Reported: `keyscale run ... --job-dir s3://bucket/jobs/rc` exited 0 after writing
    state and output into a folder named `s3:` in the current directory."""
    proc = subprocess.run(
        [sys.executable, "-m", "keyscale.cli.main", "run", str(ROOT / RUNNING_COUNT), "--job-dir", "s3://bucket/jobs/rc",
         "--set", f"input={tmp_path / 'in'}", "--set", "output=s3://bucket/out", "--until-idle"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env={**os.environ, "KEYSCALE_SPARK_LOG_LEVEL": "ERROR"},
    )
    assert proc.returncode == StorageError.exit_code, proc.stderr[-2000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("keyscale: error:")]
    assert len(errors) == 1 and "s3://bucket/jobs/rc" in errors[0], proc.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []
