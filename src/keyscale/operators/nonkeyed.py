"""Non-keyed functions with operator state, and broadcast state (Flink's FLIP-8 and broadcast pattern).

A :class:`ProcessFunction` runs once per subtask and batch on that subtask's share of the
records. It keeps operator state: named lists of JSON-serialisable entries per subtask,
redistributed when the parallelism changes by the rule each list declares:

- ``"split_merge"``: entries pooled, each new subtask gets a contiguous share (sizes differ
  by at most one) — e.g. work items, buffered records, partitions;
- ``"union"``: every new subtask gets every entry and keeps what it needs.

Broadcast state is a map every subtask holds identically. It is fed by a low-volume rules
stream (:func:`keyscale.sources.broadcast`): per batch, the stream's new records are applied to the
map on the driver, in log order, *before* the main stream's records of that batch are
processed; every subtask of the operator then reads the same map (``ctx.broadcast_state``).

Example (count records per subtask; the counts survive any rescale)::

    class CountPerSubtask(ks.ProcessFunction):
        def open(self, ctx):
            self.seen = ctx.list_state("seen", mode="split_merge")

        def process(self, records, ctx):
            self.seen.add(len(records))
            return [(ctx.subtask_index, sum(self.seen.get()))]
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import pandas as pd

from keyscale.errors import StateError
from keyscale.state.contexts import OperatorContext
from keyscale.state.redistribution import split_merge, union


class ProcessFunction:
    """A non-keyed function: ``process(records, ctx)`` once per subtask and batch.

    ``records`` is a pandas DataFrame (the subtask's share, possibly empty); return output
    rows (a DataFrame, an Arrow table, or tuples/dicts in the output schema).
    """

    def open(self, ctx: OperatorContext) -> None:
        """Declare operator state here."""

    def process(self, records: pd.DataFrame, ctx: OperatorContext) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must override process()")


def describe_lists(fn: ProcessFunction, uid: str) -> dict[str, str]:
    """The list states (name -> mode) a function declares, from ``open`` on a copy."""
    ctx = OperatorContext(uid)
    copy.deepcopy(fn).open(ctx)
    return {name: s.mode for name, s in ctx.lists.items()}


# -- operator state in the manifest ------------------------------------------------------------


def lists_for(state: Mapping[str, Any], modes: Mapping[str, str], parallelism: int, uid: str) -> list[dict[str, list[Any]]]:
    """Each new subtask's entries per list, redistributed from the committed state."""
    out: list[dict[str, list[Any]]] = [{} for _ in range(parallelism)]
    stored = state.get("lists", {})
    for name, mode in modes.items():
        entry = stored.get(name)
        old = entry["subtasks"] if entry else []
        if entry and entry["mode"] != mode:
            raise StateError(f"operator '{uid}': list state '{name}' was checkpointed as {entry['mode']}, the job now declares {mode}")
        shares = union(old, parallelism) if mode == "union" else split_merge(old, parallelism)
        for i, share in enumerate(shares):
            out[i][name] = list(share)
    return out


def lists_state(modes: Mapping[str, str], per_subtask: list[dict[str, list[Any]]]) -> dict[str, Any]:
    """The manifest form: per list its mode and each subtask's entries."""
    return {"lists": {name: {"mode": mode, "subtasks": [s.get(name, []) for s in per_subtask]} for name, mode in modes.items()}}


# -- broadcast input ---------------------------------------------------------------------------


@dataclass(frozen=True)
class BroadcastStream:
    """A rules stream applied to a broadcast state (see :func:`broadcast`)."""

    source: Any  # a log source (keyscale.sources.reader.LogSource, which checks it: broadcast())
    apply: Callable[[dict[str, Any], Any], None]

    @property
    def uid(self) -> str:
        return str(self.source.uid)


def broadcast_to_json(state: Mapping[str, Any]) -> list[list[Any]]:
    """Items as [key, value] pairs (keys of any JSON type survive)."""
    return [[k, v] for k, v in state.items()]


def broadcast_from_json(items: list[list[Any]] | None) -> dict[str, Any]:
    return {k: v for k, v in (items or [])}
