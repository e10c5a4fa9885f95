"""keyscale's numeric environment variables: each one's reader refuses a value it cannot
serve with an error naming the variable (before, three of them were read at import: a bare
ValueError for a word, a negative value taken as given)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conftest import RUNNING_COUNT, cli, write_events
from keyscale.checkpoint import jobfiles, uploads
from keyscale.errors import KeyscaleError
from keyscale.runtime.task import memory
from keyscale.state import rocksdb


def _rocksdb_options() -> Any:
    rocksdb._CACHE = None  # the block cache is made once per process: read its size again
    return rocksdb._options()


READERS: dict[str, tuple[Callable[[], Any], list[str]]] = {
    "KEYSCALE_UPLOAD_TIMEOUT": (uploads.upload_timeout, ["soon", "0", "-1", "nan", "inf"]),
    "KEYSCALE_TAKEOVER_AFTER": (jobfiles.takeover_after, ["30s", "0", "nan"]),
    "KEYSCALE_STALE_STATE_MB": (memory.stale_copy_bytes, ["lots", "-1", "1e400"]),
    "KEYSCALE_ROCKSDB_BLOCK_CACHE_MB": (_rocksdb_options, ["64MB", "0"]),
    "KEYSCALE_ROCKSDB_WRITE_BUFFER_MB": (_rocksdb_options, ["big", "-32"]),
}


@pytest.mark.parametrize("name", sorted(READERS))
def test_a_bad_value_is_refused_by_name(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    read, bad = READERS[name]
    monkeypatch.setattr(rocksdb, "_CACHE", None)  # restored after the test
    for value in bad:
        monkeypatch.setenv(name, value)
        with pytest.raises(KeyscaleError, match=f"^{name} must be a number of .*, not '{value}'$"):
            read()


def test_values_are_read_when_used() -> None:
    """Unset, each has its documented default; set, the reader sees the value of now (so a
    test, or a long-lived process, that changes the environment is obeyed)."""
    with pytest.MonkeyPatch.context() as mp:
        for name in READERS:
            mp.delenv(name, raising=False)
        assert uploads.upload_timeout() == 600
        assert jobfiles.takeover_after() == 30 and jobfiles.heartbeat_every() == 10
        assert memory.stale_copy_bytes() == 256 * 2**20
        mp.setenv("KEYSCALE_UPLOAD_TIMEOUT", "2.5")
        mp.setenv("KEYSCALE_TAKEOVER_AFTER", "6")
        mp.setenv("KEYSCALE_STALE_STATE_MB", "0")
        assert uploads.upload_timeout() == 2.5
        assert jobfiles.heartbeat_every() == 2 and memory.stale_copy_bytes() == 0


def test_a_bad_executor_setting_stops_the_run_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A setting the executors read (here in their Python workers, which inherit the
    driver's environment on a local master) fails the batch with the variable's name on one
    line, a non-zero exit and no output."""
    write_events(tmp_path / "in", 2, 100, 10)
    monkeypatch.setenv("KEYSCALE_STALE_STATE_MB", "lots")
    r = cli("run", str(RUNNING_COUNT), "--job-dir", str(tmp_path / "job"), "-p", "2", "--until-idle",
            "--set", f"input={tmp_path / 'in'}", "--set", f"output={tmp_path / 'out'}")
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1] == "keyscale: error: KEYSCALE_STALE_STATE_MB must be a number of megabytes from 0, not 'lots'"
    assert not (tmp_path / "out").exists()
