"""A batch's intent: what a batch is fixed to before any of it runs (commit protocol step 2).

``checkpoints/intent-<batch>.json`` in the job directory: the batch's time, the parallelism
of each operator, the watermark it runs with, each log source's plan (per reader: which
offsets of which partitions), the rules streams' plans and the ids of the logs the plans
are for. A replay (after a crash, a failed attempt, a fallback) follows it, so it reads the
same records at the same time with the same key-group split. It crosses a crash boundary:
one run writes it, the next reads it, possibly a newer keyscale.

:class:`BatchIntent` is the one way it is written and read (``JobDir.write_intent`` /
``read_intent``): :meth:`BatchIntent.to_wire` writes version :data:`INTENT_VERSION` (``"v"``);
a file without ``"v"`` (every intent keyscale wrote before the version was recorded) is
version 1, and a later version is refused, naming the file.

>>> i = BatchIntent(batch_time_ms=1000, parallelism={"reader": 2, "count": 4}, watermark_ms=0,
...                 source_plan=(((0, 5, 9),), ((1, 0, 3),)), log_ids={"reader": "a1"})
>>> BatchIntent.from_wire(i.to_wire()) == i
True
>>> i.to_wire()["source_plan"]
[[[0, 5, 9]], [[1, 0, 3]]]
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from keyscale.errors import StateError

#: The version :meth:`BatchIntent.to_wire` writes; an intent without ``"v"`` is version 1.
INTENT_VERSION = 1

ReaderPlan = tuple[tuple[int, int, int], ...]  # one reader's ranges: (partition, start offset, end offset)
SourcePlan = tuple[ReaderPlan, ...]  # a log source's plan: per reader subtask


def source_plan(plan: Iterable[Iterable[Sequence[int]]]) -> SourcePlan:
    """A plan as the intent holds it (from lists, as JSON or ``sources.reader.plan_batch`` give it).

    >>> source_plan([[[0, 5, 9], [2, 1, 1]], []])
    (((0, 5, 9), (2, 1, 1)), ())
    """
    return tuple(tuple((int(p), int(a), int(b)) for p, a, b in ranges) for ranges in plan)


def _plan_wire(plan: SourcePlan) -> list[list[list[int]]]:
    return [[[p, a, b] for p, a, b in ranges] for ranges in plan]


@dataclass(frozen=True)
class BatchIntent:
    """One batch's intent (see the module doc)."""

    batch_time_ms: int  # the batch's processing time: a replay draws the same lines with it
    parallelism: Mapping[str, int] = field(default_factory=dict)  # per operator uid
    watermark_ms: int | None = None  # the watermark the batch runs with (None: an old intent without; the job's)
    drain: bool = False  # a drain's batch (``keyscale stop --drain``): no input, the watermark at the end of time
    source_plan: SourcePlan | None = None  # the log source's plan (None: a Spark source)
    side_plan: SourcePlan | None = None  # the second input's log (``connect``), when it is one
    broadcast_plans: Mapping[str, SourcePlan] = field(default_factory=dict)  # per rules stream (one reader)
    log_ids: Mapping[str, str | None] = field(default_factory=dict)  # per log source uid: the log the plans are for
    replanned_from: Mapping[str, int] | None = None  # a failed batch retried at a new -p: the parallelism it first had
    epoch: int = 0  # the run that wrote it (0: none recorded)

    def stamped(self, epoch: int) -> BatchIntent:
        """This intent as run ``epoch`` writes it."""
        return replace(self, epoch=epoch)

    def to_wire(self) -> dict[str, Any]:
        """The intent file's JSON object."""
        out: dict[str, Any] = {
            "v": INTENT_VERSION, "batch_time_ms": self.batch_time_ms, "parallelism": dict(self.parallelism),
            "broadcast_plans": {uid: _plan_wire(p) for uid, p in self.broadcast_plans.items()}, "log_ids": dict(self.log_ids),
        }
        if self.watermark_ms is not None:
            out["watermark_ms"] = self.watermark_ms
        if self.drain:
            out["drain"] = True
        if self.source_plan is not None:
            out["source_plan"] = _plan_wire(self.source_plan)
        if self.side_plan is not None:
            out["side_plan"] = _plan_wire(self.side_plan)
        if self.replanned_from is not None:
            out["replanned_from"] = dict(self.replanned_from)
        if self.epoch:
            out["epoch"] = self.epoch
        return out

    @staticmethod
    def from_wire(d: Mapping[str, Any], where: str = "a batch intent") -> BatchIntent:
        """The intent from its file's JSON object (``where`` names the file in errors). A
        file without ``"v"`` is version 1; keys a version does not know are ignored."""
        version = d.get("v", 1)
        if version != INTENT_VERSION:
            raise StateError(f"{where} has intent version {version}, this keyscale reads version {INTENT_VERSION}: a newer "
                             "keyscale planned this batch; run the job with that keyscale (or a newer one)")
        try:
            wm, plan, side, replanned = d.get("watermark_ms"), d.get("source_plan"), d.get("side_plan"), d.get("replanned_from")
            return BatchIntent(
                batch_time_ms=int(d["batch_time_ms"]),
                parallelism={str(u): int(p) for u, p in (d.get("parallelism") or {}).items()},
                watermark_ms=None if wm is None else int(wm),
                drain=bool(d.get("drain")),
                source_plan=None if plan is None else source_plan(plan),
                side_plan=None if side is None else source_plan(side),
                broadcast_plans={str(u): source_plan(p) for u, p in (d.get("broadcast_plans") or {}).items()},
                log_ids={str(u): None if i is None else str(i) for u, i in (d.get("log_ids") or {}).items()},
                replanned_from=None if replanned is None else {str(u): int(p) for u, p in replanned.items()},
                epoch=int(d.get("epoch") or 0),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise StateError(f"{where} is not a batch intent keyscale can read ({type(e).__name__}: {e})") from None
