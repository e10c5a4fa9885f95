"""The test fault points' one table (keyscale/_faults.py) is the whole list: every entry is
reached somewhere in src, every call names an entry, and the tests it names arm it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from keyscale import _faults
from keyscale._faults import FAULTS, armed, fault_point

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "keyscale"


def _calls() -> dict[str, set[str]]:
    """Per fault name: the modules that call ``fault_point("name"...)``."""
    found: dict[str, set[str]] = {}
    for path in SRC.rglob("*.py"):
        if path.name == "_faults.py":
            continue
        text = path.read_text()
        for m in re.finditer(r"\bfault_point\(\s*([^,)\s]+)", text):
            arg = m.group(1)
            assert re.fullmatch(r'"[a-z-]+"', arg), f"{path.relative_to(ROOT)}: fault_point({arg}...) must name its fault point literally"
            found.setdefault(arg.strip('"'), set()).add(str(path.relative_to(SRC)))
    return found


def test_every_fault_point_in_the_table_is_called_and_every_call_is_in_the_table() -> None:
    calls = _calls()
    assert set(calls) == set(FAULTS), (set(FAULTS) - set(calls), set(calls) - set(FAULTS))
    for name, point in FAULTS.items():
        module = point.where.split(",")[0]
        assert module in calls[name], f"{name}: the table says {module}, the calls are in {sorted(calls[name])}"


def test_no_other_sigkill_of_the_driver_or_a_worker_in_the_run() -> None:
    """Production code kills for a test only through fault_point (processes it started itself
    are stopped with SIGKILL elsewhere: servers, clusters, the supervisor's jobs)."""
    for path in [SRC / "runtime", SRC / "kafka" / "sink.py", SRC / "sinks", SRC / "checkpoint", SRC / "sources"]:
        for f in [path] if path.is_file() else path.rglob("*.py"):
            assert "SIGKILL)" not in f.read_text(), f


def test_the_tests_a_fault_point_names_arm_it() -> None:
    for name, point in FAULTS.items():
        assert point.tests, name
        for test in point.tests:
            assert re.search(rf'["\(]{re.escape(name)}:\d', (ROOT / test).read_text()), f"{test} does not arm {name}"


def test_armed_checks_the_name_and_the_batch() -> None:
    assert armed("mid-batch:2", "mid-batch", 2)
    assert not armed("mid-batch:2", "mid-batch", 1)
    assert not armed("mid-batch:2", "after-sink", 2)
    assert not armed(None, "after-sink", 2)
    with pytest.raises(KeyError, match="no test fault point named 'typo'"):
        armed("typo:1", "typo", 1)
    with pytest.raises(KeyError, match="no test fault point named 'typo'"):
        fault_point("typo")


def test_fault_point_effects(monkeypatch: pytest.MonkeyPatch) -> None:
    killed: list[tuple[int, int]] = []
    monkeypatch.setattr(_faults.os, "kill", lambda pid, sig: killed.append((pid, sig)))
    monkeypatch.setattr(_faults.time, "sleep", lambda s: None)
    fault_point("mid-batch", 0)  # no driver to kill (a task run without one)
    assert killed == []
    fault_point("mid-batch", 4242)
    fault_point("worker-dies-mid-upload")
    assert [pid for pid, _ in killed] == [4242, _faults.os.getpid()] and {s for _, s in killed} == {_faults.signal.SIGKILL}
    fault_point("slow-upload")
    with pytest.raises(OSError, match="the store refused the upload"):
        fault_point("fail-upload")
