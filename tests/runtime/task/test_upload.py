"""A state file's upload in a thread of the task: waited for, its error raised in the task;
detached (asynchronous checkpoints), a spilled file's folder removed once it is stored."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from keyscale.errors import StorageError
from keyscale.runtime.task.upload import Upload
from keyscale.storage import LocalStore
from keyscale.storage.scratch import scratch_dir


def _spec(store: Any, detach: bool = False) -> Any:
    return SimpleNamespace(store=store, fault=None, driver_pid=0, detach_upload=detach)


def test_wait_returns_once_the_file_is_stored(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "job")
    Upload(_spec(store), "state/op/a.arrow", b"bytes").wait()
    assert (tmp_path / "job" / "state" / "op" / "a.arrow").read_bytes() == b"bytes"


def test_a_failed_upload_fails_the_task_that_waits(tmp_path: Path) -> None:
    class Refusing:
        def put(self, rel_path: str, data: bytes) -> None:
            raise OSError("read-only")

        def url(self, rel_path: str) -> str:
            return f"/nowhere/{rel_path}"

    with pytest.raises(StorageError, match="state file"):
        Upload(_spec(Refusing()), "state/op/a.arrow", b"bytes").wait()


def test_a_detached_upload_goes_on_and_removes_its_spilled_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEYSCALE_LOCAL_DIR", str(tmp_path / "local"))
    store = LocalStore(tmp_path / "job")
    spilled = scratch_dir("spill-1") / "a.arrow"
    spilled.write_bytes(b"snapshot")
    up = Upload(_spec(store, detach=True), "state/op/a.arrow", spilled)
    up.detach()
    up._thread.join(10)
    assert (tmp_path / "job" / "state" / "op" / "a.arrow").read_bytes() == b"snapshot"
    assert not spilled.parent.exists()
