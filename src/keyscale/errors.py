"""Errors keyscale reports to users.

Every error a user can cause (bad job file, bad job directory, bad state) is a
:class:`KeyscaleError`: the CLI prints its message as one line and exits with its
``exit_code``. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import contextlib
import json
import re
import sys


class KeyscaleError(Exception):
    """A problem a user can fix; ``str(err)`` is a one-line explanation."""

    exit_code = 2


def cli_exit(err: KeyscaleError) -> int:
    """What a ``keyscale`` command does with ``err``: print it as one line on stderr, and
    return its exit code (every command line, ``keyscale`` and the deployment commands alone).

    >>> cli_exit(JobDirError("no such job directory"))
    3
    """
    print(f"keyscale: error: {err}", file=sys.stderr)
    return err.exit_code


class JobDefinitionError(KeyscaleError):
    """The job file, its ``build`` function or its pipeline is wrong."""


class JobDirError(KeyscaleError):
    """The job directory belongs to another job, is locked by a running job, or is unusable."""

    exit_code = 3


class FencedError(JobDirError):
    """A newer run of the job took over its job directory: this one must not commit."""

    exit_code = 9


class StateError(KeyscaleError):
    """State or a checkpoint is damaged, incompatible or missing."""

    exit_code = 4


class StorageError(KeyscaleError):
    """A location (job directory, savepoint, output path) keyscale cannot use: an unsupported URI."""

    exit_code = 3


class InputDataError(KeyscaleError):
    """A batch of input violates the pipeline's contract (missing columns, null keys)."""

    exit_code = 5


class KeyColumnMissingError(InputDataError):
    """A subtask got only null keys: perhaps the whole batch has no key, the input lacking
    the column (a misspelled name, or a schema naming a column the files do not have). The
    driver checks the batch and rewords the message when so."""


class ClusterError(KeyscaleError):
    """A local Spark standalone cluster (``keyscale cluster``) cannot be started, reached or changed."""

    exit_code = 6


class RecordError(KeyscaleError):
    """A record could not be processed (the user's function raised on it, or it has no
    event time) and the operator's ``on_error`` policy, or its bound, says to stop.

    Several lines: where (operator, key, batch), the record, the user's own frames, and
    the cause on the last line.
    """

    exit_code = 7


class OutputError(KeyscaleError):
    """A sink's output path holds output of another job lineage (see keyscale.checkpoint.lineage)."""

    exit_code = 8


# -- across Spark --------------------------------------------------------------------------
# An error raised in a Spark task reaches the driver as text inside Spark's own exception.
# One marked line carries the error's class and message (JSON, so a message of several
# lines survives); the driver turns it back into the error it was.

_KEYSCALE = re.compile(r'KEYSCALE-ERROR (\w+): ("(?:[^"\\]|\\.)*"|.+)')


def encode_error(exc: KeyscaleError) -> str:
    """One line that survives Spark's wrapping of a task's Python error (JSON keeps newlines).

    >>> decode_error("RuntimeError: " + encode_error(StateError("checkpoint 3 is damaged")))
    ('StateError', 'checkpoint 3 is damaged')
    """
    return f"KEYSCALE-ERROR {type(exc).__name__}: {json.dumps(str(exc))}"


def decode_error(text: str) -> tuple[str, str] | None:
    """(error class name, message) of the first KEYSCALE-ERROR line in ``text``."""
    found = _KEYSCALE.search(text)
    if found is None:
        return None
    msg = found.group(2).strip()
    if msg.startswith('"'):
        with contextlib.suppress(ValueError):
            msg = str(json.loads(msg))
    return found.group(1), msg
