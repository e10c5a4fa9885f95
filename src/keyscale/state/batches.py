"""The batches a vectorized keyed function is given: one subtask's records, keys and state as columns.

A ``VectorizedKeyedFunction`` gets a :class:`KeyedBatch`, a
``VectorizedKeyedCoProcessFunction`` a :class:`KeyedCoBatch`; :data:`TIMER` is the column of
the state they return that sets each key's event-time timer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import pandas as pd
import pyarrow as pa

from keyscale.state.handles import TIMER_STATES

#: The key of ``process_batch``'s returned state that sets each key's event-time timer
#: (functions with ``event_timers = True``; epoch ms, missing for none).
TIMER = TIMER_STATES["event_time"][1]


@dataclass
class KeyedBatch:
    """What a :class:`keyscale.VectorizedKeyedFunction` gets for one subtask and batch.

    ``records`` are the subtask's records in arrival order; ``codes[i]`` is the index in
    ``keys`` of record i's key; ``order``/``starts`` group records by key (records of key j
    are ``order[starts[j]:starts[j+1]]``); ``state`` holds each declared state per key as
    a pandas column with missing values where a key has none yet.
    """

    records: pd.DataFrame
    codes: np.ndarray
    keys: pd.DataFrame
    state: pd.DataFrame
    order: np.ndarray
    starts: np.ndarray
    batch_id: int
    processing_time: int
    #: The stage's broadcast state (read-only), when it has a broadcast input.
    broadcast_state: Mapping[str, Any] = field(default_factory=dict)
    #: The same records as Arrow (the columns of ``input_columns``; set by keyscale).
    arrow: pa.Table | None = None
    #: The stage's watermark for this batch (epoch ms).
    watermark: int | None = None
    #: With ``event_timers``: each key's pending event-time timer (epoch ms, missing for none)
    #: and whether it is due (at or before the watermark): this call is its firing. A key
    #: with a due timer is in the batch even without records (after the keys that have some).
    timer: pd.Series | None = None
    due: np.ndarray | None = None

    def count(self, column: str | None = None) -> np.ndarray:
        """Records per key (with ``column``: records whose ``column`` is not null)."""
        if column is None:
            return np.diff(self.starts)
        valid = self.records[column].notna().to_numpy(dtype=np.int64)[self.order]
        return self._per_key(valid, np.add, 0, np.dtype(np.int64))

    def reduce(self, column: str, how: Literal["sum", "min", "max"]) -> np.ndarray:
        """Per-key sum, min or max of a record column, skipping nulls (exact for integers).

        A key whose values are all null, or that has no records (a due timer's), gets the
        operation's identity (0, +max, -max);
        use :meth:`count` with the column to tell.
        """
        col = self.records[column]
        dtype = np.dtype(np.float64) if pd.api.types.is_float_dtype(col.dtype) else np.dtype(np.int64)
        if len(self.keys) == 0:
            return np.empty(0, dtype=dtype)
        big: float | int = np.inf if dtype.kind == "f" else int(np.iinfo(np.int64).max)
        small: float | int = -np.inf if dtype.kind == "f" else int(np.iinfo(np.int64).min)
        identity = {"sum": 0, "min": big, "max": small}[how]
        values = np.asarray(col.fillna(identity), dtype=dtype)[self.order]
        op = {"sum": np.add, "min": np.minimum, "max": np.maximum}[how]
        return self._per_key(values, op, identity, dtype)

    def _per_key(self, values: np.ndarray, op: np.ufunc, identity: float | int, dtype: np.dtype[Any]) -> np.ndarray:
        """``op`` over each key's records (in ``order``); keys without records (a due timer's)
        get the identity (``reduceat`` would give them their neighbour's value)."""
        out = np.full(len(self.keys), identity, dtype=dtype)
        some = np.diff(self.starts) > 0
        if some.any():  # the non-empty groups are contiguous: each runs to the next one's start
            out[some] = op.reduceat(values, self.starts[:-1][some])
        return out


@dataclass
class KeyedCoBatch:
    """What a :class:`keyscale.VectorizedKeyedCoProcessFunction` gets for one subtask and batch.

    ``keys`` are the batch's distinct keys (of either input) and ``state`` each declared
    state per key (missing where a key has none yet), as in :class:`keyscale.state.KeyedBatch`.
    ``records1`` are the first input's records in arrival order (pandas, the columns of
    ``input_columns1``), ``codes1[i]`` the index in ``keys`` of record i's key, and
    ``positions1[i]`` its position in the batch's arrival order across both inputs (to
    tell which of two records came first); the same for the second input. ``arrow1`` and
    ``arrow2`` are the same records as Arrow. ``watermark``, ``timer`` and ``due`` as in
    :class:`keyscale.state.KeyedBatch`.
    """

    keys: pd.DataFrame
    state: pd.DataFrame
    records1: pd.DataFrame
    codes1: np.ndarray
    positions1: np.ndarray
    records2: pd.DataFrame
    codes2: np.ndarray
    positions2: np.ndarray
    batch_id: int
    processing_time: int
    arrow1: pa.Table | None = None
    arrow2: pa.Table | None = None
    #: The watermark, and with ``event_timers`` each key's timer and whether it is due, as in
    #: :class:`keyscale.state.KeyedBatch`.
    watermark: int | None = None
    timer: pd.Series | None = None
    due: np.ndarray | None = None
