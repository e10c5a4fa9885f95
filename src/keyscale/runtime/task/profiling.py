"""Opt-in profiles of keyscale's own Python work, for ``bench/profile_job.py``.

With ``KEYSCALE_PROFILE_DIR`` set (in the driver's environment, which local Python workers
inherit), every keyed or non-keyed subtask (in its Python worker) and every batch on the
driver writes a cProfile file ``<what>-<pid>-<ns>.prof`` there. Unset, nothing changes.
A profile is a developer's tool, not job state or output: it is written beside the store.
"""

from __future__ import annotations

import cProfile
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

ENV = "KEYSCALE_PROFILE_DIR"


@contextmanager
def profiled(what: str) -> Iterator[None]:
    """Profile the block into ``$KEYSCALE_PROFILE_DIR/<what>-<pid>-<ns>.prof`` when set."""
    folder = os.environ.get(ENV)
    if not folder:
        yield
        return
    prof = cProfile.Profile()
    prof.enable()
    try:
        yield
    finally:
        prof.disable()
        prof.dump_stats(os.path.join(folder, f"{what}-{os.getpid()}-{time.time_ns()}.prof"))
