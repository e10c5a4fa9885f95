"""A run's epoch, as every writer of one of its effects checks it.

Each run of a job claims the next epoch of its job directory (``epochs/<n>.json``, created
only if absent: :meth:`keyscale.checkpoint.jobdir.JobDir.claim_epoch`). Epoch ``n + 1`` is
claimed only once ``n`` exists, so run ``n`` is *fenced* (a newer run took over) exactly
when ``epochs/<n + 1>.json`` exists: one HEAD answers it, from the driver or from a task.

A :class:`Fence` is that question in a picklable object: the driver hands it to sinks
(:class:`keyscale.sinks.base.SinkContext`) and through them to their Spark tasks, so the
rule "a fenced run writes nothing more" is checked in one place by every effect of a batch:
intent, Spark's bundle, sink output, commit records, manifest, status and control files
(docs/design.md, "Exactly-once, effect by effect").

A check and the write after it are two requests: a run paused between them writes once
more. What makes that late write harmless is said per effect in docs/design.md (an
object created only if absent, a Kafka producer fenced by its transactional id, a check
after the write).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from keyscale.errors import FencedError
from keyscale.storage import Store

EPOCHS = "epochs"


def epoch_key(n: int) -> str:
    """The key of epoch ``n``'s claim.

    >>> epoch_key(7)
    'epochs/0000000007.json'
    """
    return f"{EPOCHS}/{n:010d}.json"


@dataclass(frozen=True)
class Fence:
    """Run ``epoch`` of the job directory ``store``; epoch 0: a tool, never fenced."""

    store: Store
    epoch: int

    def newer(self) -> dict[str, Any] | None:
        """The claim of the run that took over from this one, None while this run is current."""
        if not self.epoch or not self.store.exists(epoch_key(self.epoch + 1)):
            return None
        try:
            return dict(json.loads(self.store.get_text(epoch_key(self.epoch + 1)) or "{}"))
        except ValueError:
            return {}

    def check(self, doing: str) -> None:
        """Raise :class:`FencedError` if a newer run took over; ``doing`` says what this run
        does not do (``"committing batch 3"``)."""
        newer = self.newer()
        if newer is not None:
            raise FencedError(
                f"job directory {self.store.url()}: a newer run took over (pid {newer.get('pid', '?')} on {newer.get('host', '?')}); "
                f"this run (epoch {self.epoch}, pid {os.getpid()}) stops without {doing}"
            )

    def is_fenced(self) -> bool:
        return self.newer() is not None


def resumed_key(n: int) -> str:
    """The key of the record of which checkpoint run ``n`` resumed from."""
    return f"{EPOCHS}/{n:010d}-resumed.json"


def superseded(epochs: Mapping[int, int], resumed: Mapping[int, tuple[int, int]]) -> list[int]:
    """The checkpoints a fenced run created too late: of ``epochs`` (checkpoint batch -> the
    epoch of the run that created it), every one whose batch is after the checkpoint a
    newer run resumed from, unless a run resumed from it. ``resumed``: epoch -> (batch,
    epoch) of the checkpoint that run resumed from ((-1, 0) for none).

    A newer run listed the checkpoints when it started and resumed from the newest: an
    older run's checkpoint after that one was created afterwards (an old run that passed
    its fence check, then paused), for a batch the newer run recomputes. Each run records
    where it resumed from beside its epoch claim (:func:`resumed_key`); each manifest
    carries its run's epoch (:meth:`keyscale.checkpoint.jobdir.JobDir.commit`). A late
    checkpoint that a later run found newest and resumed from is that run's history.

    >>> superseded({1: 1, 2: 1, 3: 2, 4: 2}, {1: (-1, 0), 2: (1, 1)})
    [2]
    >>> superseded({1: 1, 2: 1, 3: 3}, {2: (1, 1), 3: (2, 1)})
    []
    """
    return sorted(
        b for b, epoch in epochs.items()
        if any(e > epoch and b > r for e, (r, _) in resumed.items()) and (b, epoch) not in resumed.values()
    )
