"""A subtask's batch grouped by key, and the counts taken on the way (pure: no Spark, no state).

The records arrive in Arrow with their key columns, the key group (``KG``) and the arrival
sequence; ``group_keys`` gives every record its key's index and each key its records, in
arrival order::

    >>> import pyarrow as pa
    >>> from keyscale.runtime.task.grouping import group_keys
    >>> from keyscale.runtime.task.spec import KG
    >>> class Spec: uid, batch_id, key_names, key_types = "op", 0, ["k"], [pa.string()]
    >>> g = group_keys(Spec, pa.table({"k": ["a", "b", "a"], KG: [3, 5, 3]}))
    >>> g.codes.tolist(), list(g.index), g.kgs.tolist()
    ([0, 1, 0], ['a', 'b'], [3, 5])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from keyscale.errors import InputDataError, KeyColumnMissingError
from keyscale.operators.eventtime import event_time_ms, max_event_within
from keyscale.operators.poison import null_key_mask
from keyscale.runtime.task.spec import (
    COMBINED_AHEAD,
    COMBINED_EVENT_MS,
    COMBINED_RECORDS,
    KG,
    StageTask,
)
from keyscale.state.factorize import factorize_keys
from keyscale.state.types import is_numeric


def records(spec: StageTask, table: pa.Table) -> int:
    """The stream's records a batch's rows stand for (a combined row stands for several)."""
    if not spec.combined:
        return table.num_rows
    return int(pc.sum(table.column(COMBINED_RECORDS)).as_py() or 0)


def max_event(spec: StageTask, table: pa.Table) -> tuple[int | None, int]:
    """The largest event time within the batch's bound, and how many were beyond it."""
    assert spec.event_time is not None
    if not spec.combined:
        return max_event_within(event_time_ms(table, spec.event_time), spec.event_time_limit_ms)
    top = pc.max(table.column(COMBINED_EVENT_MS)).as_py()
    return (int(top) if top is not None else None), int(pc.sum(table.column(COMBINED_AHEAD)).as_py() or 0)


def null_check(spec: StageTask, table: pa.Table) -> pa.Table:
    """Apply the null-key rule (a NaN key is a null key): stop, naming the column, or drop them."""
    drop = np.zeros(table.num_rows, dtype=bool)
    weight = table.column(COMBINED_RECORDS).to_numpy() if spec.combined else None
    for k in spec.key_names:
        col = table.column(k)
        bad = null_key_mask(col)
        n = int(bad.sum() if weight is None else weight[bad].sum())  # records
        if n and spec.null_keys == "error":
            nan = " (NaN counts as a null key)" if int(bad.sum()) > col.null_count else ""
            # Not one key among the subtask's records: perhaps none in the whole batch, the
            # column missing from the input (Spark reads a column that a given schema names and
            # a file lacks as null). Only the driver can tell (it sees the batch): it rewords
            # the error then, instead of advising to drop null keys, that is, every record.
            error = KeyColumnMissingError if col.null_count == table.num_rows else InputDataError
            raise error(
                f"null key in column '{k}' of operator '{spec.uid}' (batch {spec.batch_id}, {n} records){nan}; "
                "filter them out before key_by() or use key_by(..., null_keys='drop')"
            )
        drop |= bad
    return table.filter(pa.array(~drop)) if drop.any() else table



@dataclass(frozen=True)
class Grouped:
    """A batch's records grouped by key: ``order[starts[j]:starts[j+1]]`` are key j's records."""

    codes: np.ndarray  # per record, the index of its key
    index: pd.Index  # the distinct keys, in order of first record
    keys: list[np.ndarray]  # the same, one array per key column
    kgs: np.ndarray  # key group per distinct key
    order: np.ndarray
    starts: np.ndarray
    probe: list[Any]  # the same keys as the state table looks them up (Arrow for a string key: no objects to convert)

    def take(self, idx: np.ndarray) -> list[Any]:
        """The probe columns of keys ``idx``."""
        return [p[idx] if isinstance(p, np.ndarray) else p.take(pa.array(idx, type=pa.int64())) for p in self.probe]


def group_keys(spec: StageTask, table: pa.Table) -> Grouped:
    """Factorize the key columns: codes per record, unique keys (first-appearance order), etc."""
    if len(spec.key_names) == 1 and not is_numeric(spec.key_types[0]):
        # One string-like key: Arrow's hash encoding (first-appearance order, as pd.factorize)
        # makes Python objects of the distinct keys only, not of every record's.
        enc: Any = pc.dictionary_encode(table.column(spec.key_names[0]).combine_chunks())
        codes = enc.indices.fill_null(-1).to_numpy(zero_copy_only=False)
        uniques = np.empty(len(enc.dictionary), dtype=object)
        uniques[:] = enc.dictionary.to_pylist()
        index = pd.Index(uniques)
        ukeys = [uniques]
        return finish_grouping(spec, table, codes, index, ukeys, [enc.dictionary])
    key_arrays = []
    for k, t in zip(spec.key_names, spec.key_types, strict=True):
        col = table.column(k)
        key_arrays.append(np.asarray(col.to_numpy()) if is_numeric(t) else np.asarray(col.to_pylist(), dtype=object))
    codes, index, ukeys = factorize_keys(key_arrays)
    return finish_grouping(spec, table, codes, index, ukeys)


def finish_grouping(spec: StageTask, table: pa.Table, codes: Any, index: pd.Index, ukeys: list[np.ndarray], probe: list[Any] | None = None) -> Grouped:
    codes = np.asarray(codes, dtype=np.int64)
    if len(codes) and codes.min() < 0:  # never after null_check; never a raw numpy error either
        raise InputDataError(f"operator '{spec.uid}' (batch {spec.batch_id}): a key that cannot be grouped (null or NaN) in {', '.join(spec.key_names)}")
    n = len(index)
    _, first = np.unique(codes, return_index=True)
    kgs = table.column(KG).to_numpy().astype(np.int32)[first] if n else np.empty(0, dtype=np.int32)
    order = np.argsort(codes, kind="stable")
    starts = np.concatenate([[0], np.cumsum(np.bincount(codes, minlength=n))]).astype(np.int64)
    return Grouped(codes, index, ukeys, kgs, order, starts, probe if probe is not None else ukeys)
