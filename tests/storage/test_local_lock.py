"""The local lock that says a job or a deployment's supervisor runs on this machine."""

from __future__ import annotations

import fcntl
import itertools
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from keyscale.storage.local import LOCK_GRACE_SECONDS, LocalStore


def _probe_holding(path: Path, seconds: float) -> threading.Thread:
    """What ``is_locked`` does, held longer: a shared flock on its own fd (a status probe)."""
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    ready = threading.Timer(seconds, lambda: (fcntl.flock(fd, fcntl.LOCK_UN), os.close(fd)))
    ready.start()
    return ready


def test_a_probe_at_the_moment_of_start_does_not_block_the_lock(tmp_path: Path) -> None:
    # Reproduces a CI failure: `keyscale apply` polled is_locked while the supervisor it had
    # just launched took its lock; the supervisor saw the probe's lock, said another supervisor
    # ran, and exited, and apply waited 60 s for a supervisor that never came.
    store = LocalStore(tmp_path)
    (tmp_path / "lock").touch()
    probe = _probe_holding(tmp_path / "lock", LOCK_GRACE_SECONDS / 5)
    fd = store.try_lock("lock")
    probe.join()
    assert fd is not None and store.is_locked("lock")
    LocalStore.unlock(fd)
    assert not store.is_locked("lock")


def test_a_lock_held_by_another_holder_is_refused(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    held = store.try_lock("lock")
    assert held is not None
    assert store.try_lock("lock") is None  # a second holder (flock is per open file)
    LocalStore.unlock(held)
    again = store.try_lock("lock")
    assert again is not None
    LocalStore.unlock(again)


def test_processes_of_a_host_take_turns(tmp_path: Path, monkeypatch: Any) -> None:
    """``host_turn``: the Kafka sink's tasks commit one at a time on a host (each holder
    here is a thread with its own descriptor, as each Python worker has)."""
    from keyscale.storage.scratch import host_turn

    monkeypatch.setenv("KEYSCALE_LOCAL_DIR", str(tmp_path))
    spans: list[tuple[float, float]] = []

    def hold() -> None:
        with host_turn("commit"):
            start = time.monotonic()
            time.sleep(0.1)
            spans.append((start, time.monotonic()))

    threads = [threading.Thread(target=hold) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    spans.sort()
    assert len(spans) == 4
    assert all(end <= later for (_, end), (later, _) in itertools.pairwise(spans)), spans
    with pytest.raises(ValueError, match="not a plain name"), host_turn("../x"):
        pass
