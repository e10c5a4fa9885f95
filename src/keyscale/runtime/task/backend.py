"""What a keyed subtask asks of its state backend, whichever keeps the keys between batches.

A task (:mod:`keyscale.runtime.task.keyed`) runs one path for both backends that
:mod:`keyscale.state.backends` names: it loads the subtask's key groups at the committed
checkpoint, works on :attr:`TaskStateBackend.table` (state values, timers, TTL clocks and
windows are columns of it), writes the rows that changed back, and hands the state file
a delta of those rows or a snapshot of the whole range. The two implementations:

- :class:`keyscale.runtime.task.memory.MemoryBackend`: the table *is* the subtask's state,
  a warm copy kept in the Python worker between batches;
- :class:`keyscale.runtime.task.rocks.RocksSession`: the table holds the batch's working
  set, fetched from a RocksDB on the executor's disk and written back to it.

Both write the same state files (docs/design.md, "State backends: memory and RocksDB").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np
import pyarrow as pa

from keyscale.state.keygroups import KeyGroupRange
from keyscale.state.table import KeyedStateTable


class TaskStateBackend(Protocol):
    """One task's use of its subtask's keyed state, in the order the task calls it:
    :meth:`load`, work on :attr:`table`, :meth:`write_back`, :meth:`snapshot` (when the task
    writes one), :meth:`finish`, :meth:`state_keys`; :meth:`close` always, at the end."""

    @property
    def table(self) -> KeyedStateTable:
        """The state the batch reads and changes (after :meth:`load`): row numbers in it are
        what the task's functions return as the rows they changed."""
        ...

    def load(self, records: Callable[[], pa.Table]) -> dict[str, Any]:
        """Bring the subtask's key groups to the committed checkpoint (``spec.committed``)
        and make them unusable until :meth:`finish` (a failed attempt leaves nothing that
        claims a version). ``records()`` is the batch's records, for a backend that fetches
        the state of their keys. Returns what it did, for the task's report (files read,
        key groups loaded or warm, ...)."""
        ...

    def write_back(self, rows: np.ndarray) -> None:
        """Keep the batch's changed ``rows`` of :attr:`table` beyond the batch."""
        ...

    def snapshot(self, changed: np.ndarray, part: KeyGroupRange) -> Iterator[pa.Table]:
        """Key groups ``part`` of the subtask's range, after the batch (``changed``: the rows
        of :attr:`table` it changed), in parts of a state file (never whole in memory), its
        rows in file order (key group, then sub key: :func:`keyscale.state.order.order_rows`),
        which lets the snapshot keep fences for point lookups."""
        ...

    def finish(self, batch: int) -> None:
        """The range now reflects ``batch``: usable again, at that version."""
        ...

    def state_keys(self) -> int:
        """The live keys of the range (after :meth:`finish`)."""
        ...

    def close(self) -> None:
        ...
