"""``state_backend``: a test module that uses it (pytestmark) runs its keyed harnesses on both state backends."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from keyscale.testing import KeyedHarness


@pytest.fixture(params=["memory", "rocksdb"])
def state_backend(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setenv("KEYSCALE_LOCAL_DIR", str(tmp_path / "local"))
    monkeypatch.setattr(KeyedHarness, "default_state_backend", request.param)
    yield request.param
