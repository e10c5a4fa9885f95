"""How keyscale talks to its user: one line per event, prefixed, on one stream."""

from __future__ import annotations

import logging
import sys
from typing import TextIO


def configure_logging(stream: TextIO | None = None, prefix: str = "keyscale: ", level: int = logging.INFO) -> None:
    """Send keyscale's log lines to ``stream`` (default stderr) and quiet py4j's chatter."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(logging.Formatter(prefix + "%(message)s"))
    log = logging.getLogger("keyscale")
    log.handlers[:] = [handler]
    log.setLevel(level)
    log.propagate = False
    logging.getLogger("py4j").setLevel(logging.WARNING)
