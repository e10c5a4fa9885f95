"""Step 4 of the commit protocol reads what each sink's ``write`` returns: ``KEPT`` (the
sink already had the batch's complete output) is said in the log, rows are not."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

from keyscale.runtime.batch.commit import write_sinks
from keyscale.sinks.base import KEPT
from keyscale.sinks.noop import NoopSink


class Answering:
    exactly_once = True

    def __init__(self, answer: int):
        self.answer = answer

    def describe(self) -> str:
        return f"a sink answering {self.answer}"

    def write(self, df: Any, batch_id: int) -> int:
        return self.answer


def test_a_kept_batch_is_logged_and_a_written_one_is_not(caplog: pytest.LogCaptureFixture) -> None:
    job: Any = SimpleNamespace(fault=lambda name, batch: False)
    unpersisted: list[str] = []
    plan: Any = SimpleNamespace(
        writes=[(Answering(3), "rows"), (Answering(KEPT), "rows")], cached=[SimpleNamespace(unpersist=lambda: unpersisted.append("x"))],
    )
    with caplog.at_level(logging.INFO, logger="keyscale"):
        write_sinks(job, plan, 7)
    said = [r.getMessage() for r in caplog.records]
    assert said == ["batch 7: a sink answering -1 already had this batch's output: the earlier write is kept"]
    assert unpersisted == ["x"]


def test_the_noop_sink_keeps_nothing() -> None:
    class Frame:
        @property
        def write(self) -> Any:
            w = SimpleNamespace()
            w.format = lambda _f: w
            w.mode = lambda _m: w
            w.save = lambda: None
            return w

    assert NoopSink().write(Frame(), 0) == 0  # type: ignore[arg-type]
