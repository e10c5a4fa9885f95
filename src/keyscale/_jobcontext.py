"""What a job file's ``build(ctx)`` gets: the Spark session and the job's ``--set`` arguments.

Made on the driver by whoever runs a job file (``keyscale run``: runtime.driver.runner;
``ks.main``: runtime.control.submit); the API re-exports it as ``keyscale.JobContext``.
Imports nothing of keyscale but its errors.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from keyscale.errors import JobDefinitionError

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = ["JobArgs", "JobContext"]


class JobArgs(dict[str, str]):
    """The job's arguments (``ctx.args``), remembering the names the job looks up, so that a
    ``--set`` the job never reads is flagged (keyscale.runtime.driver.jobargs.check_args_read)."""

    def __init__(self, args: Mapping[str, str] | None = None) -> None:
        super().__init__(args or {})
        self._looked_up: set[str] = set()
        self._listed = False

    def __getitem__(self, name: str) -> str:
        self._looked_up.add(name)
        return super().__getitem__(name)

    def get(self, name: str, default: Any = None) -> Any:  # type: ignore[override]
        self._looked_up.add(name)
        return super().get(name, default)

    def setdefault(self, name: str, default: str = "") -> str:  # type: ignore[override]
        self._looked_up.add(name)
        return super().setdefault(name, default)

    def pop(self, name: str, *default: Any) -> Any:  # type: ignore[override]
        self._looked_up.add(name)
        return super().pop(name, *default)

    def __contains__(self, name: object) -> bool:
        if isinstance(name, str):
            self._looked_up.add(name)
        return super().__contains__(name)

    # A job that lists its arguments (passes them all on, say) reads every one of them.
    def __iter__(self) -> Iterator[str]:
        self._listed = True
        return super().__iter__()

    def keys(self) -> Any:
        self._listed = True
        return super().keys()

    def items(self) -> Any:
        self._listed = True
        return super().items()

    def values(self) -> Any:
        self._listed = True
        return super().values()

    def copy(self) -> dict[str, str]:
        self._listed = True
        return dict(super().items())

    @property
    def read(self) -> set[str] | None:
        """The names the job looked up; None when it listed them all."""
        return None if self._listed else set(self._looked_up)


@dataclass
class JobContext:
    """What ``build`` gets: the Spark session and the job's ``--set`` arguments."""

    spark: SparkSession
    args: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.args, JobArgs):
            self.args = JobArgs(self.args)

    def arg(self, name: str, default: str | None = None) -> str:
        """The ``--set NAME=VALUE`` argument ``name`` (or ``default``; missing and no default is an error)."""
        if name in self.args:
            return self.args[name]
        if default is None:
            close = difflib.get_close_matches(name, list(dict.keys(self.args)), n=1)  # dict.keys: not a listing by the job
            hint = f" (--set {close[0]}=... was given: misspelt?)" if close else ""
            raise JobDefinitionError(f"the job needs the argument '{name}': pass --set {name}=VALUE{hint}")
        return default
