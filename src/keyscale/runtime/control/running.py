"""What the control plane needs of a running job: :class:`RunningJob` (driver process).

The control API (:mod:`.server`), its metrics (:mod:`.metrics`) and a
:class:`~keyscale.runtime.control.handle.JobHandle` talk to a job through this protocol
only; :class:`keyscale.runtime.driver.runner.JobRunner` implements it. Nothing in this
module runs: it names the members, each safe to call from any thread (the control API's
request threads, the caller's thread of a JobHandle).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from collections.abc import Sequence

    from keyscale.checkpoint.jobdir import JobDir
    from keyscale.checkpoint.manifest import Manifest
    from keyscale.runtime.batch.jobstate import RunSummary

__all__ = ["RunningJob"]


class RunningJob(Protocol):
    """A job that runs (or ran) in this process, as its control plane sees it."""

    # -- what it is and what it says ------------------------------------------------------
    @property
    def jobdir(self) -> JobDir:
        """Its job directory (the control API keeps its secret and address there)."""

    @property
    def name(self) -> str: ...

    @property
    def state(self) -> str:
        """``starting``, ``running``, ``draining``, ``restarting``, ``stopped`` or ``failed``."""

    @property
    def summary(self) -> RunSummary:
        """Batches run so far (their records, parallelism, rescales)."""

    def live_status(self) -> dict[str, Any]:
        """``GET /status``: the status, current, with ``running: true``."""

    def last_status(self) -> dict[str, Any]:
        """The status with the last batch's reports (a job that ended: without ``running``)."""

    def history(self) -> dict[str, Any]:
        """``GET /history``: the recent batches, events and savepoints."""

    def last_committed(self) -> Manifest | None:
        """The newest committed manifest (``GET /health``, the metrics)."""

    def lookup_state(self, uid: str, keys: Sequence[Any]) -> list[dict[str, Any]]:
        """What each key of ``keys`` of keyed operator ``uid`` holds at the last committed
        checkpoint (``GET /state/<uid>``, :meth:`JobHandle.state`;
        :class:`keyscale.state_processor.StateLookup` answers)."""

    def query_active(self) -> bool | None:
        """Whether its Spark query runs (None: no query)."""

    def stop_requested(self) -> bool:
        """Whether it was asked to stop (it ends after the current batch)."""

    # -- what it is asked to do ---------------------------------------------------------
    def run(self) -> RunSummary:
        """Run until idle, stopped or failed (a JobHandle's thread)."""

    def request_rescale(self, parallelism: int, operator: str | None = None) -> None:
        """Rescale live between two batches; a KeyscaleError, changing nothing, if it cannot."""

    def take_savepoint(self, dest: str | None = None, then_stop: bool = False) -> str:
        """A savepoint of the last committed batch, taken between two batches; its path."""

    def drain(self, dest: str | None = None, timeout: float = 600) -> str:
        """Stop with a drain and a final savepoint; its path."""

    def request_restart(self, parallelism: int | None, job_file: str | None = None) -> str:
        """A savepoint, then the run ends and ``keyscale run`` starts it again; the savepoint's path."""

    def stop(self) -> None:
        """Stop after the current batch."""
