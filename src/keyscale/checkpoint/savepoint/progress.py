"""Progress reporting for savepoint work (the CLI's progress bar)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

#: ``progress(phase, done, total)``: called once before the first file and after each file.
Progress = Callable[[str, int, int], None]


def report_progress(progress: Progress | None, phase: str, done: int, total: int) -> None:
    if progress is not None:
        progress(phase, done, total)


def text_progress(label: str, stream: TextIO | None = None, delay: float = 0.5) -> Progress:
    """A progress callback that draws on ``stream`` (default stderr).

    On a terminal: one line redrawn in place (``\\r``); otherwise one line per 10%. Nothing
    is shown for work that finishes within ``delay`` seconds. A phase named like the label
    is not repeated (``text_progress("restore")`` shows ``restore 1/4 (25%)``).

    >>> import io
    >>> out = io.StringIO()
    >>> p = text_progress("restore", out, delay=0)
    >>> for i in range(5):
    ...     p("files", i, 4)
    >>> print(out.getvalue().strip())
    restore: files 1/4 (25%)
    restore: files 2/4 (50%)
    restore: files 3/4 (75%)
    restore: files 4/4 (100%)
    """
    out = stream if stream is not None else sys.stderr
    isatty = getattr(out, "isatty", None)
    tty = bool(isatty()) if callable(isatty) else False
    started: dict[str, float] = {}
    shown: dict[str, int] = {}

    def report(phase: str, done: int, total: int) -> None:
        now = time.monotonic()
        if done <= 0 or phase not in started:
            started[phase] = now
            shown[phase] = 0
        if total <= 0 or done <= 0 or (now - started[phase] < delay and done < total):
            return
        if done >= total and shown[phase] == 0 and now - started[phase] < delay:
            return  # finished before anything was shown
        frac = min(done / total, 1.0)
        title = label if phase == label else f"{label}: {phase}"
        if tty:
            width = 30
            fill = int(width * frac)
            out.write(f"\r{title} [{'#' * fill}{'.' * (width - fill)}] {done}/{total} ({frac:.0%})")
            if done >= total:
                out.write("\n")
            shown[phase] = 10
            out.flush()
            return
        decile = int(frac * 10)
        if decile > shown[phase] or (done >= total and shown[phase] < 10):
            shown[phase] = max(decile, 1)
            out.write(f"{title} {done}/{total} ({frac:.0%})\n")
            out.flush()

    return report
