"""Errors keyscale reports to users.

Every error a user can cause (bad job file, bad job directory, bad state) is a
:class:`KeyscaleError`: the CLI prints its message as one line and exits with its
``exit_code``. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class KeyscaleError(Exception):
    """A problem a user can fix; ``str(err)`` is a one-line explanation."""

    exit_code = 2


class JobDefinitionError(KeyscaleError):
    """The job file, its ``build`` function or its pipeline is wrong."""


class JobDirError(KeyscaleError):
    """The job directory belongs to another job, is locked by a running job, or is unusable."""

    exit_code = 3


class StateError(KeyscaleError):
    """State or a checkpoint is damaged, incompatible or missing."""

    exit_code = 4


class StorageError(KeyscaleError):
    """A location (job directory, savepoint, output path) keyscale cannot use: an unsupported URI."""

    exit_code = 3


class InputDataError(KeyscaleError):
    """A batch of input violates the pipeline's contract (missing columns, null keys)."""

    exit_code = 5


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
