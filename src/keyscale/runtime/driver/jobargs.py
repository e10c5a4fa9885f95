"""A job's arguments (``--set NAME=VALUE``, read in ``build`` with ``ctx.arg(NAME)``): which
ones a start uses, which ones the job directory keeps, and names the job never reads.

- A start uses the arguments kept by the job's last *successful* start, under those given
  now (a value given now wins; ``--unset NAME`` drops a kept one), so that a job resumes
  without repeating them.
- The job directory keeps a start's arguments (``args.json``) only once that start has
  proved them: its first batch committed, or it ended without an error (a job stopped
  while waiting for input). A start that fails, at set-up or in its first batch, leaves the
  kept ones as they were: one bad ``--set`` cannot break later runs.
- ``run.json`` still records every start's arguments, for ``keyscale rescale --restart``
  of the run that is going on.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from keyscale.errors import JobDefinitionError, KeyscaleError

if TYPE_CHECKING:
    from keyscale.checkpoint.jobdir import JobDir

__all__ = ["ARGS_FILE", "check_args_read", "keep_args", "kept_args", "parse_sets", "resolve_args", "suggest"]

ARGS_FILE = "args.json"

log = logging.getLogger("keyscale")


def parse_sets(items: Sequence[str]) -> dict[str, str]:
    """``--set NAME=VALUE`` items as a dict (a later item wins)."""
    out = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not eq or not name:
            raise KeyscaleError(f"--set {item!r} must look like NAME=VALUE")
        out[name] = value
    return out


def suggest(name: str, known: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``known``, or ``""``.

    >>> suggest("inptu", ["input", "output"])
    " (did you mean 'input'?)"
    >>> suggest("zzz", ["input"])
    ''
    """
    close = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def kept_args(jobdir: JobDir) -> dict[str, str]:
    """The arguments kept by the job's last successful start ({} if none)."""
    return {str(k): str(v) for k, v in jobdir.read_json(ARGS_FILE).items()}


def keep_args(jobdir: JobDir, args: Mapping[str, str]) -> None:
    """Keep ``args`` as the last successful start's (see the module's docstring); a run a
    newer one took over keeps nothing (the fence, as for status: the newer run's arguments
    are the ones to reuse)."""
    jobdir.fence.check("keeping its arguments for the next start")
    jobdir.write_json(ARGS_FILE, dict(args))


def resolve_args(jobdir: JobDir | None, given: Mapping[str, str], unset: Sequence[str] = (), use_kept: bool = True) -> dict[str, str]:
    """The arguments of a start: the kept ones (unless ``use_kept`` is False or there is no
    job directory yet), without ``unset``, under ``given``. The log says which kept ones
    are used, so a resumed job's inputs are never a surprise."""
    both = sorted(set(unset) & set(given))
    if both:
        raise KeyscaleError(f"--set {both[0]}=... and --unset {both[0]} contradict each other: give one")
    kept = kept_args(jobdir) if jobdir is not None and use_kept else {}
    for name in unset:
        if name not in kept:
            # A misspelt --unset would otherwise leave the value in place without a word.
            have = ", ".join(sorted(kept)) or "none"
            raise KeyscaleError(f"--unset {name}: the job directory keeps no argument '{name}'{suggest(name, kept)} (it keeps: {have})")
    reused = {k: v for k, v in kept.items() if k not in given and k not in unset}
    if reused:
        log.info("using the job's arguments kept from its last successful start: %s (--set NAME=VALUE to change one, "
                 "--unset NAME to drop one)", ", ".join(f"{k}={v}" for k, v in sorted(reused.items())))
    return {**reused, **given}


def check_args_read(args: Mapping[str, str], read: Iterable[str] | None, kept: Mapping[str, str]) -> None:
    """After ``build``: an argument the job did not read is an error when its value is new
    (given now, not what the last successful start ran with), a warning otherwise.

    Why an error: a job that never reads ``--set inptu=...`` runs with its default instead,
    and its output and state, committed exactly once, are then hard to take back; a typo
    costs one more command. Why only a warning for a value the job ran with before: a new
    version of the job that no longer reads it (``keyscale upgrade``, a deployment that
    still lists it) must still start; ``--unset NAME`` drops it. ``read`` None: the job
    listed all its arguments (``dict(ctx.args)``), so keyscale cannot tell.
    """
    if read is None:
        return
    seen = set(read)
    unread = [n for n in args if n not in seen]
    new = [n for n in unread if kept.get(n) != args[n]]
    if new:
        name = new[0]
        reads = ", ".join(sorted(seen)) or "none"
        raise JobDefinitionError(f"--set {name}=...: the job reads no argument '{name}'{suggest(name, seen)}; "
                                 f"the arguments it reads: {reads}")
    for name in unread:
        log.warning("argument '%s' (kept from the job's last successful start) is not read by the job any more; "
                    "--unset %s drops it", name, name)
