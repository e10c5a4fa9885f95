"""A vectorized keyed function on a subtask's batch: one call for the batch's keys, event
timers drained, and poison keys found by bisection (``on_error``) without applying any
key twice. Called by :mod:`keyscale.runtime.task.keyed`, which owns the batch; ``state``
is the table its state backend gives it (:mod:`keyscale.runtime.task.backend`)."""

from __future__ import annotations

from types import MappingProxyType

import numpy as np
import pandas as pd
import pyarrow as pa

from keyscale.errors import JobDefinitionError, KeyscaleError
from keyscale.operators.eventtime import END_OF_TIME
from keyscale.operators.poison import ErrorCollector, bisect_failures, one_line
from keyscale.operators.vectorized import VectorizedKeyedFunction, masked, to_frame, unmasked
from keyscale.runtime.task.grouping import Grouped
from keyscale.runtime.task.spec import StageTask
from keyscale.state.batches import TIMER, KeyedBatch
from keyscale.state.factorize import make_index
from keyscale.state.handles import TIMER_STATES, ttl_column
from keyscale.state.table import KeyedStateTable

TIMER_COLUMNS = frozenset(c for pair in TIMER_STATES.values() for c in pair)  # kept by keyscale, not the function's


def run_vectorized(fn: VectorizedKeyedFunction, spec: StageTask, state: KeyedStateTable, g: Grouped, user: pa.Table,
                   due: np.ndarray | None) -> tuple[pa.Table, np.ndarray]:
    """One call for the whole batch; every key of the batch is written back (their rows are
    returned). ``due``: with event timers, which keys' timers are due (keys after the
    records' own may have no records)."""
    pos = state.positions(g.probe)
    # Only the columns the function says it reads become pandas (a string key column is costly).
    reads = user if fn.input_columns is None else user.select(fn.input_columns)
    timer = None if due is None else masked(*state.gather(TIMER, pos), pa.int64())
    batch = KeyedBatch(
        records=to_frame(reads) if fn.pandas_records else pd.DataFrame(index=range(reads.num_rows)),
        codes=g.codes,
        keys=pd.DataFrame({k: u for k, u in zip(spec.key_names, g.keys, strict=True)}),
        state=pd.DataFrame({s.name: masked(*state.gather(s.name, pos), s.column_type) for s in spec.states if s.name not in TIMER_COLUMNS}),
        order=g.order,
        starts=g.starts,
        batch_id=spec.batch_id,
        processing_time=spec.batch_time_ms,
        broadcast_state=MappingProxyType(spec.broadcast_state or {}),
        arrow=reads,
        watermark=spec.watermark_ms,
        timer=None if timer is None else pd.Series(timer),
        due=due,
    )
    new_state, result = fn.process_batch(batch)
    updates = {s.name: unmasked(new_state[s.name], s.column_type) for s in spec.states if s.name in new_state and s.name not in TIMER_COLUMNS}
    for s in spec.states:  # what was written restarts its TTL clock
        if s.ttl_seconds is not None and s.name in updates:
            ok = updates[s.name][1]
            updates[ttl_column(s.name)] = (np.full(len(ok), spec.batch_time_ms, dtype=np.int64), ok.copy())
    if due is not None:  # a due timer is spent unless the function gives the key a new one
        assert timer is not None
        updates[TIMER] = unmasked(new_state[TIMER], pa.int64()) if TIMER in new_state else unmasked(timer, pa.int64())
        if TIMER not in new_state:
            updates[TIMER][1][due] = False
    rows = state.upsert(g.probe, g.kgs, updates, pos=pos)
    return as_output(spec, result), rows


def as_output(spec: StageTask, result: pd.DataFrame | pa.Table) -> pa.Table:
    """A vectorized function's output rows as the stage's output schema (an Arrow table is
    cast: a column of nothing but nulls comes back typed null)."""
    if not isinstance(result, pa.Table):
        return pa.Table.from_pandas(result, schema=spec.output_schema, preserve_index=False)
    if result.schema == spec.output_schema:
        return result
    try:
        return result.select(spec.output_schema.names).cast(spec.output_schema)
    except (KeyError, pa.ArrowInvalid, pa.ArrowNotImplementedError):
        want = ", ".join(f"{f.name} {f.type}" for f in spec.output_schema)
        got = ", ".join(f"{f.name} {f.type}" for f in result.schema)
        raise JobDefinitionError(f"operator '{spec.uid}' returned rows ({got}) that do not fit its output schema ({want})") from None


def run_vectorized_guarded(
    fn: VectorizedKeyedFunction, spec: StageTask, state: KeyedStateTable, g: Grouped, user: pa.Table, errors: ErrorCollector, due_rows: np.ndarray,
) -> tuple[pa.Table, np.ndarray]:
    """``run_vectorized``; when it raises under skip/dead_letter, the keys it fails on are
    found by bisection and set aside (all their records of the batch), the others processed.
    In a drain, the timers the calls set fire after them (``drain_timers``)."""
    due: np.ndarray | None = None
    if fn.event_timers:  # keys whose timers are due join the batch's, once
        g, due = with_due_keys(g, state, due_rows)
    draining = due is not None and spec.watermark_ms >= END_OF_TIME
    try:
        out, changed = run_vectorized(fn, spec, state, g, user, due)
    except KeyscaleError:
        raise
    except Exception as e:
        if not errors.policy.isolates or not len(g.index):
            errors.fail_batch(e, "in a vectorized function (it sees the subtask's whole batch)")
            raise
    else:  # the state is written: a failure from here on fails the batch (bisecting would apply it twice)
        return drain_timers(fn, spec, state, g, user, out, changed, errors) if draining else (out, changed)

    def attempt(idx: np.ndarray) -> tuple[pa.Table, np.ndarray]:
        sub, sub_user = subset(g, user, idx)
        return run_vectorized(fn, spec, state, sub, sub_user, None if due is None else due[np.sort(idx)])

    results, failed = bisect_failures(np.arange(len(g.index)), attempt)
    for j, exc in sorted(failed, key=lambda f: f[0]):
        rows = np.sort(g.order[g.starts[j] : g.starts[j + 1]])
        errors.add(one_line(exc), g.index[j], user.take(rows).to_pylist(), exc)
    out = pa.concat_tables([o for o, _ in results]) if results else spec.output_schema.empty_table()
    changed = np.concatenate([c for _, c in results]) if results else np.empty(0, dtype=np.intp)
    if draining:  # the keys that went through: their timers set in the drain fire in it
        ok = np.setdiff1d(np.arange(len(g.index)), np.array([j for j, _ in failed], dtype=np.int64))
        return drain_timers(fn, spec, state, subset(g, user, ok)[0], user, out, changed, errors)
    return out, changed


def drain_timers(fn: VectorizedKeyedFunction, spec: StageTask, state: KeyedStateTable, g: Grouped, user: pa.Table, out: pa.Table,
                 changed: np.ndarray, errors: ErrorCollector) -> tuple[pa.Table, np.ndarray]:
    """At the end of time (a drain) no batch follows: timers the function has just set fire
    now, in further calls with those keys due and no records, until none is left."""
    try:
        return fire_until_none(fn, spec, state, g, user, out, changed)
    except KeyscaleError:
        raise
    except Exception as e:
        errors.fail_batch(e, "in a vectorized function firing the timers it set at the end of time (a drain)")
        raise


def fire_until_none(fn: VectorizedKeyedFunction, spec: StageTask, state: KeyedStateTable, g: Grouped, user: pa.Table, out: pa.Table,
                    changed: np.ndarray) -> tuple[pa.Table, np.ndarray]:
    outs = [out]
    while True:
        vals, ok = state.gather(TIMER, state.positions(g.probe))
        idx = np.flatnonzero(ok & (vals <= spec.watermark_ms))
        if not len(idx):
            return pa.concat_tables(outs), changed
        g = Grouped(np.empty(0, dtype=np.int64), g.index[idx], [k[idx] for k in g.keys], g.kgs[idx], np.empty(0, dtype=np.int64),
                     np.zeros(len(idx) + 1, dtype=np.int64), g.take(idx))
        more, rows = run_vectorized(fn, spec, state, g, user.slice(0, 0), np.ones(len(idx), dtype=bool))
        outs.append(more)
        changed = state.rows_union(changed, rows)


def subset(g: Grouped, user: pa.Table, idx: np.ndarray) -> tuple[Grouped, pa.Table]:
    """The keys ``idx`` (positions in ``g.index``) of a grouped batch, with their records in arrival order."""
    idx = np.sort(idx)
    rows = np.sort(np.concatenate([g.order[g.starts[j] : g.starts[j + 1]] for j in idx]))
    remap = np.full(len(g.index), -1, dtype=np.int64)
    remap[idx] = np.arange(len(idx))
    codes = remap[g.codes[rows]]
    starts = np.concatenate([[0], np.cumsum(np.bincount(codes, minlength=len(idx)))]).astype(np.int64)
    sub = Grouped(codes, g.index[idx], [k[idx] for k in g.keys], g.kgs[idx], np.argsort(codes, kind="stable"), starts, g.take(idx))
    return sub, user.take(rows)


def with_due_keys(g: Grouped, state: KeyedStateTable, due_rows: np.ndarray) -> tuple[Grouped, np.ndarray]:
    """The batch's keys followed by keys that have only due timers; and which keys are due."""
    if not len(due_rows):
        return g, np.zeros(len(g.index), dtype=bool)
    due_keys = state.key_values(due_rows)
    due_index = make_index(due_keys)
    extra = ~np.asarray(due_index.isin(g.index), dtype=bool)
    index = g.index.append(due_index[extra])
    keys = [np.concatenate([a, b[extra].astype(a.dtype, copy=False)]) for a, b in zip(g.keys, due_keys, strict=True)]
    kgs = np.concatenate([g.kgs, state.kg[due_rows][extra]]).astype(np.int32)
    starts = np.concatenate([g.starts, np.full(int(extra.sum()), g.starts[-1], dtype=np.int64)])
    due = np.asarray(index.isin(due_index), dtype=bool)
    return Grouped(g.codes, index, keys, kgs, g.order, starts, keys), due
