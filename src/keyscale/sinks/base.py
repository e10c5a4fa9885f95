"""What a sink must do: write one micro-batch's output, idempotently for its batch id."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from keyscale.checkpoint.fence import Fence
    from keyscale.checkpoint.lineage import Lineage


@dataclass(frozen=True)
class SinkContext:
    """Who writes through a sink: given to a sink's optional ``open(ctx)`` before the first batch.

    A sink that keeps output per batch marks each batch with ``lineage`` (and the job, job
    directory and run attempt, for error messages) and refuses output of other lineages
    (:func:`keyscale.checkpoint.lineage.decide`). ``committed`` is the last batch the job
    committed (-1 if none): batches after it are the ones it will write.
    """

    lineage: Lineage
    job: str
    job_dir: str
    attempt: str
    committed: int
    fault: str = ""  # test-only: the run's --fault (sinks with fault points of their own)
    #: The run's epoch: a sink (and its tasks: it pickles) checks ``fence.check(...)`` before
    #: an effect that a newer run must not find (docs/design.md, "Exactly-once, effect by
    #: effect"). None outside a job (tests, tools).
    fence: Fence | None = None


class Sink(Protocol):
    """A sink writes batch ``batch_id`` so that writing it again changes nothing.

    ``write`` runs the batch's Spark job (it is the one action per batch). keyscale commits
    its checkpoint only after ``write`` returns, and may call it again for the same batch
    after a crash; an exactly-once sink keeps the first complete write.

    Optional: ``open(ctx: SinkContext) -> None``, called once before the first batch (the
    driver skips sinks without it); an exactly-once sink checks its output against the
    job's lineage there, so a conflict is reported before any batch runs.

    Optional: ``plan_bound(batch_id: int) -> bool``, asked (after ``open``) before a batch
    with an intent is replayed: True if some of the batch's output is already committed in
    units tied to the batch's plan (its Spark tasks: a task number means other key groups
    at another parallelism), so the replay must keep the intent's plan. keyscale then does
    not re-plan the batch at a new ``-p`` (``runtime/batch/commit.py``, ``replay_intent``); the
    new ``-p`` applies from the next batch. A sink without it, or whose idempotence does not
    depend on the plan (a whole batch kept or written anew), lets the replay re-plan.
    """

    exactly_once: bool

    def write(self, df: DataFrame, batch_id: int) -> int:
        """Write the batch; return the number of rows written (or -1 if unknown)."""
        ...

    def describe(self) -> str:
        ...
