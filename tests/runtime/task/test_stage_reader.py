"""A small batch read by its keyed stage's own tasks (``make_stage_reader_function``): each
subtask gets exactly the rows the shuffle would have sent it, with the same arrival sequence
and key group, and each reader's report is sent once (issue 35)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keyscale.errors import decode_error
from keyscale.runtime.task.reader import make_stage_reader_function
from keyscale.runtime.task.report import TaskReport
from keyscale.runtime.task.spec import KG, SEQ
from keyscale.sources import create_log
from keyscale.sources.reader import plan_batch
from keyscale.state.keygroups import subtask_of
from keyscale.state.spark_hash import key_group_of

keys = st.one_of(st.none(), st.text(max_size=6))
partition = st.lists(st.tuples(keys, st.integers(-(2**40), 2**40)), max_size=12)


class Sent:
    """A task's report sender that keeps what was sent."""

    def __init__(self) -> None:
        self.items: list[tuple[str, int, int, object]] = []

    def add(self, items: list[tuple[str, int, int, object]]) -> None:
        self.items.extend(items)


def subtask_rows(fn: object, subtask: int) -> pa.Table:
    one = pa.record_batch([pa.array([subtask], pa.int32())], names=["subtask"])
    batches = list(fn(iter([one])))  # type: ignore[operator]
    schema = pa.schema([("key", pa.string()), ("n", pa.int64()), (SEQ, pa.int64()), (KG, pa.int32())])
    return pa.Table.from_batches(batches, schema) if batches else schema.empty_table()


@settings(max_examples=40, deadline=None)
@given(parts=st.lists(partition, min_size=1, max_size=4), readers=st.integers(1, 3), p=st.integers(1, 4),
       m=st.sampled_from([4, 7, 128]), skip=st.integers(0, 3))
def test_each_subtask_gets_the_rows_the_shuffle_would_send_it(parts: list[list[tuple[str | None, int]]], readers: int, p: int, m: int,
                                                              skip: int) -> None:
    with tempfile.TemporaryDirectory() as d:
        log = create_log(Path(d) / "log", "key string, n long", len(parts))
        for i, rows in enumerate(parts):
            if rows:
                log.append(i, pa.table({"key": [k for k, _ in rows], "n": [n for _, n in rows]}, schema=log.schema))
        # Readers start past a few committed records, as after earlier batches.
        assignment = [[(q, min(skip, len(parts[q]))) for q in range(len(parts)) if q % readers == r] for r in range(readers)]
        plan = plan_batch(assignment, log.end_offsets())
        collected = Sent()
        fn = make_stage_reader_function(log, "reader", 3, plan, log.schema, None, None, None, collected,
                                        ["key", "n"], ["key"], ["string"], m, p)
        got = [subtask_rows(fn, s) for s in range(p)]

        # The model: what the readers yield, in order, numbered as monotonically_increasing_id
        # numbers a reader task's output, routed by Spark's hash of the key.
        expected: list[list[tuple[str | None, int, int, int]]] = [[] for _ in range(p)]
        for r, ranges in enumerate(plan):
            i = 0
            for q, start, end in ranges:
                for k, n in parts[q][start:end]:
                    kg = key_group_of([k], ["string"], m)
                    expected[subtask_of(kg, m, p)].append((k, n, (r << 33) + i, kg))
                    i += 1
        for s in range(p):
            assert list(zip(*(got[s].column(c).to_pylist() for c in ("key", "n", SEQ, KG)), strict=True)) == expected[s]
        # Each reader reported once, whichever subtasks read it.
        assert sorted(subtask for _, _, subtask, _ in collected.items) == list(range(len(plan)))
        for uid, batch, r, wire in collected.items:
            assert (uid, batch) == ("reader", 3) and TaskReport.from_wire(wire).records == sum(e - b for _, b, e in plan[r])


def test_an_error_of_the_read_names_the_source_not_the_operator(tmp_path: Path) -> None:
    """A read that fails in the stage's task says what the reader says: the source, the
    log and what to do (the stage's own error naming passes it on unchanged)."""
    from keyscale.runtime.task.spark import _named_errors

    log = create_log(tmp_path / "log", "key string, n long", 1)
    log.append(0, pa.table({"key": ["a"], "n": [1]}, schema=log.schema))
    plan = plan_batch([[(0, 0)]], [3])  # planned past the log's end: records gone

    class Spec:
        uid, batch_id = "count", 3

    fn = make_stage_reader_function(log, "reader", 3, plan, log.schema, None, None, None, None, ["key", "n"], ["key"], ["string"], 128, 1)
    with pytest.raises(RuntimeError) as err, _named_errors(Spec, 0):
        subtask_rows(fn, 0)
    found = decode_error(str(err.value))
    assert found is not None and found[0] == "KeyscaleError", str(err.value)
    assert "source 'reader': partition 0 of log" in found[1] and "operator 'count'" not in found[1], found[1]
