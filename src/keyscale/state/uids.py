"""Operator uids: the one rule for which names a stateful stage, and its state, can have.

A uid names the stage's folder in checkpoints (``state/<uid>/...``) and in savepoints
(``operators/<uid>/...``), and a restore matches savepoint state to stages by it. So every
place that accepts a uid checks it here: a pipeline declaring a stage
(:mod:`keyscale._stream`) and a savepoint bootstrapped from tables
(:mod:`keyscale.state_processor.bootstrap`), which could otherwise hold a uid no pipeline
can declare.
"""

from __future__ import annotations

from keyscale.errors import JobDefinitionError

__all__ = ["check_uid"]


def check_uid(uid: str) -> None:
    """Raise :class:`JobDefinitionError` unless ``uid`` is a non-empty name of letters,
    digits, ``-`` and ``_`` (Unicode letters and digits count: ``str.isalnum``).

    >>> check_uid("totals-by_user2")
    >>> check_uid("../x")
    Traceback (most recent call last):
    ...
    keyscale.errors.JobDefinitionError: uid '../x' must be a non-empty name of letters, digits, '-' and '_'
    """
    if not uid or not uid.replace("-", "").replace("_", "").isalnum():
        raise JobDefinitionError(f"uid {uid!r} must be a non-empty name of letters, digits, '-' and '_'")
