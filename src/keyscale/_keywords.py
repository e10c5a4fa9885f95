"""Misspelt keyword arguments on keyscale's public entry points: a short error naming the
function, the word, and the closest one it takes (Python's own TypeError, on 3.11 and 3.12,
names neither the closest word nor which of a chain of calls it came from)."""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any, TypeVar, cast

from keyscale.errors import JobDefinitionError

__all__ = ["checked_keywords", "unknown_keyword"]

F = TypeVar("F", bound=Callable[..., Any])


def unknown_keyword(where: str, name: str, known: Iterable[str]) -> JobDefinitionError:
    """The error for keyword ``name`` that ``where`` does not take.

    >>> str(unknown_keyword("Pipeline.start()", "paralelism", ["parallelism", "name", "until_idle"]))
    "Pipeline.start() got an unknown keyword argument 'paralelism' (did you mean 'parallelism'?)"
    """
    close = difflib.get_close_matches(name, list(known), n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else f" (it takes: {', '.join(sorted(known))})"
    return JobDefinitionError(f"{where} got an unknown keyword argument '{name}'{hint}")


def checked_keywords(fn: F) -> F:
    """``fn``, refusing a keyword argument it does not take with :func:`unknown_keyword`
    (a function with ``**kwargs`` checks its own)."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind == p.VAR_KEYWORD for p in params):
        return fn
    known = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"]
    owner, _, method = fn.__qualname__.rpartition(".")
    where = f"{owner}()" if method == "__init__" else f"{fn.__qualname__}()"

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        for name in kwargs:
            if name not in known:
                raise unknown_keyword(where, name, known)
        return fn(*args, **kwargs)

    return cast(F, call)
