"""keyscale's numeric environment variables, read one way: a value that is not a number in
range is an error naming the variable (never a ``ValueError`` at import, never a silent
default).

Each is read where it is used, not at import, so a bad value fails the command that needs
it, with a :class:`~keyscale.errors.KeyscaleError` the CLI prints as one line.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

from keyscale.errors import KeyscaleError

__all__ = ["env_number"]


def env_number(name: str, default: float, unit: str, *, above: float | None = None, from_: float | None = None,
               environ: Mapping[str, str] | None = None) -> float:
    """Environment variable ``name`` as a finite number (``default`` when unset or empty),
    at least ``from_`` or more than ``above``; otherwise a :class:`KeyscaleError` saying what
    it must be (a number of ``unit``).

    >>> env_number("KEYSCALE_UPLOAD_TIMEOUT", 600, "seconds", above=0, environ={})
    600.0
    >>> env_number("KEYSCALE_STALE_STATE_MB", 256, "megabytes", from_=0, environ={"KEYSCALE_STALE_STATE_MB": "0.5"})
    0.5
    >>> env_number("KEYSCALE_UPLOAD_TIMEOUT", 600, "seconds", above=0, environ={"KEYSCALE_UPLOAD_TIMEOUT": "soon"})
    Traceback (most recent call last):
    ...
    keyscale.errors.KeyscaleError: KEYSCALE_UPLOAD_TIMEOUT must be a number of seconds above 0, not 'soon'
    """
    raw = (os.environ if environ is None else environ).get(name, "")
    if not raw.strip():
        return float(default)
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    fits = math.isfinite(value) and (above is None or value > above) and (from_ is None or value >= from_)
    if not fits:
        bound = f" above {above:g}" if above is not None else f" from {from_:g}" if from_ is not None else ""
        raise KeyscaleError(f"{name} must be a number of {unit}{bound}, not {raw!r}")
    return value
