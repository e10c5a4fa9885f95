"""A running job's heartbeat on an object store, where no lock tells that it runs."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from keyscale.checkpoint.jobdir import JobDir
from keyscale.checkpoint.jobfiles import heartbeat_every
from keyscale.errors import FencedError, KeyscaleError

log = logging.getLogger("keyscale")


class Heartbeat:
    """Writes the job's status every ``every`` seconds (default :func:`heartbeat_every`),
    with batches or without, so another process can tell a running job from one that died;
    stops once a newer run took over the job directory (this run is fenced: it must not
    write there any more)."""

    def __init__(self, jobdir: JobDir, status: Callable[[], dict[str, Any]], every: float | None = None):
        self.jobdir, self.status = jobdir, status
        self.every = heartbeat_every() if every is None else every
        # Called after each beat that wrote the status (the control API re-asserts its files).
        self.also: Callable[[], None] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="keyscale-heartbeat", daemon=True)
        # The first beat before returning: until it, `keyscale stop/rescale/savepoint` would find the
        # job "not running" (the status of a run that is gone, or none) although it runs.
        if self._beat():
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            if not self._beat():
                return

    def _beat(self) -> bool:
        """Write the status once; False when this run is fenced (it must stop writing)."""
        try:
            self.jobdir.write_status({**self.status(), "running": True})  # checks this run's epoch first
            if self.also is not None:
                self.also()
        except FencedError as e:
            log.error("%s", e)
            return False
        except KeyscaleError as e:  # the store is unreachable for a while: try again later
            log.warning("could not write the job's heartbeat: %s", e)
        return True

    def close(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:  # not started when the first beat found this run fenced
            self._thread.join(timeout=5)
