"""Two keyed-stage harnesses (a function and its oracle) fed the same batches in lockstep."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from keyscale.testing import KeyedHarness


def run_in_lockstep(runs: list[KeyedHarness], batches: Iterable[tuple[list[dict[str, Any]], int, int | None]],
                    keys: Sequence[Any] = ()) -> list[KeyedHarness]:
    """Each batch is (records, watermark, parallelism to restore both at first or None):
    both emit the same rows in every batch, and hold the same state for ``keys`` after it.
    Returns the harnesses (restored ones replace the others)."""
    for records, watermark, restore_at in batches:
        if restore_at is not None:
            runs = [h.snapshot().restore(restore_at) for h in runs]
        outs = []
        for h in runs:
            h.advance_watermark(watermark)
            outs.append(h.process(records))
        assert outs[0] == outs[1]
        for key in keys:
            assert runs[0].state(key) == runs[1].state(key), key
    return runs
