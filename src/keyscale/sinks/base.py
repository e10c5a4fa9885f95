"""What a sink must do: write one micro-batch's output, idempotently for its batch id."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pyspark.sql import DataFrame


class Sink(Protocol):
    """A sink writes batch ``batch_id`` so that writing it again changes nothing.

    ``write`` runs the batch's Spark job (it is the one action per batch). keyscale commits
    its checkpoint only after ``write`` returns, and may call it again for the same batch
    after a crash; an exactly-once sink keeps the first complete write.
    """

    exactly_once: bool

    def write(self, df: DataFrame, batch_id: int) -> int:
        """Write the batch; return the number of rows written (or -1 if unknown)."""
        ...

    def describe(self) -> str:
        ...
