"""A task's state files uploaded in a thread of the task: waited for, its error raised in the
task; detached (asynchronous checkpoints), a spilled file's folder removed once it is stored,
and a failure recorded beside every file it did not store."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from keyscale.checkpoint.uploads import upload_failure
from keyscale.errors import StorageError
from keyscale.runtime.task.upload import Upload
from keyscale.storage import LocalStore
from keyscale.storage.scratch import scratch_dir


def _spec(store: Any, detach: bool = False) -> Any:
    return SimpleNamespace(store=store, fault=None, driver_pid=0, detach_upload=detach)


def test_wait_returns_once_the_file_is_stored(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "job")
    Upload(_spec(store), [("state/op/a.arrow", b"bytes")]).wait()
    assert (tmp_path / "job" / "state" / "op" / "a.arrow").read_bytes() == b"bytes"


def test_a_failed_upload_fails_the_task_that_waits(tmp_path: Path) -> None:
    class Refusing:
        def put(self, rel_path: str, data: bytes) -> None:
            raise OSError("read-only")

        def url(self, rel_path: str) -> str:
            return f"/nowhere/{rel_path}"

    with pytest.raises(StorageError, match="state file"):
        Upload(_spec(Refusing()), [("state/op/a.arrow", b"bytes")]).wait()


def test_a_detached_upload_goes_on_and_removes_its_spilled_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEYSCALE_LOCAL_DIR", str(tmp_path / "local"))
    store = LocalStore(tmp_path / "job")
    spilled = scratch_dir("spill-1") / "a.arrow"
    spilled.write_bytes(b"snapshot")
    up = Upload(_spec(store, detach=True), [("state/op/a.arrow", spilled)])
    up.detach()
    up._thread.join(10)
    assert (tmp_path / "job" / "state" / "op" / "a.arrow").read_bytes() == b"snapshot"
    assert not spilled.parent.exists()


def test_a_snapshot_and_its_companion_whose_upload_fails_leave_a_record_beside_each(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Detached: the driver's commit waits for both files; each gets a failure record, so
    neither wait lasts until the timeout, and the spilled snapshot's folder is removed."""
    monkeypatch.setenv("KEYSCALE_LOCAL_DIR", str(tmp_path / "local"))
    store = LocalStore(tmp_path / "job")

    class FailingPuts(LocalStore):
        def put_file(self, key: str, source: Path) -> None:
            raise OSError("disk full")

    failing = FailingPuts(tmp_path / "job")
    spilled = scratch_dir("spill-2") / "s.arrow"
    spilled.write_bytes(b"snapshot")
    up = Upload(_spec(failing, detach=True), [("state/op/s.arrow", spilled), ("state/op/d.arrow", b"delta")])
    up.detach()
    up._thread.join(10)
    assert not spilled.parent.exists()
    assert upload_failure(store, "state/op/s.arrow") and upload_failure(store, "state/op/d.arrow")
    assert not store.exists("state/op/d.arrow")
