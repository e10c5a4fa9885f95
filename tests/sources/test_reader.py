"""The log source's pure planning: offsets as split/merge operator state (FLIP-8)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from keyscale.errors import decode_error
from keyscale.sources.reader import (
    add_partitions,
    advance,
    from_state,
    initial_assignment,
    lag,
    plan_batch,
    rescale_assignment,
    to_state,
)


def flat(a: list[list[tuple[int, int]]]) -> list[tuple[int, int]]:
    return [e for entries in a for e in entries]


def test_flip8_example() -> None:
    a = initial_assignment(4, 2)
    assert [[p for p, _ in e] for e in a] == [[0, 1], [2, 3]]  # S1: KP1, KP2; S2: KP3, KP4
    a = advance(plan_batch(a, [10, 20, 30, 40], limit=5))
    down = rescale_assignment(a, 1)
    assert down == [[(0, 5), (1, 5), (2, 5), (3, 5)]]  # one reader, each partition from its offset
    up = rescale_assignment(down, 4)
    assert up == [[(0, 5)], [(1, 5)], [(2, 5)], [(3, 5)]]  # no reader idles


@given(st.integers(1, 40), st.integers(1, 12), st.integers(1, 12), st.integers(0, 6))
def test_rescale_never_drops_or_duplicates_a_partition(partitions: int, p_old: int, p_new: int, added: int) -> None:
    a = initial_assignment(partitions, p_old)
    a = [[(p, p * 7) for p, _ in e] for e in a]
    a, new = add_partitions(a, partitions + added)
    assert [p for p, _ in new] == list(range(partitions, partitions + added))
    b = rescale_assignment(a, p_new)
    assert sorted(flat(b)) == sorted(flat(a))  # same partitions, same offsets
    sizes = [len(e) for e in b]
    assert max(sizes) - min(sizes) <= 1
    if partitions + added >= p_new:
        assert min(sizes) >= 1  # no idle reader while there are partitions for it
    assert rescale_assignment(a, p_new) == b  # deterministic
    assert from_state(to_state(b)) == b


@given(st.lists(st.integers(0, 50), min_size=1, max_size=8), st.none() | st.integers(1, 20))
def test_plans_read_each_record_once(ends: list[int], limit: int | None) -> None:
    a = initial_assignment(len(ends), 3)
    seen = [0] * len(ends)
    for _ in range(60):
        for ranges in plan_batch(a, ends, limit):
            for p, start, end in ranges:
                assert start == seen[p] and end <= ends[p]
                seen[p] = end
        a = advance(plan_batch(a, ends, limit))
    assert seen == ends
    assert set(lag(a, ends).values()) == {0}


def test_new_partitions_go_to_the_reader_holding_fewest() -> None:
    a, added = add_partitions([[(0, 3), (1, 0)], [(2, 9)]], 5)
    assert added == [(3, 1), (4, 0)]
    assert a == [[(0, 3), (1, 0), (4, 0)], [(2, 9), (3, 0)]]


def test_a_reader_leaves_far_future_event_times_out_of_its_partitions_clocks(tmp_path: Any) -> None:
    """Issue 10, case 7: a partition's clock (its largest event time) ignores records beyond
    the batch's bound; they are counted and passed on."""
    import pyarrow as pa

    from keyscale.runtime.task.report import Reports
    from keyscale.sources import create_log
    from keyscale.sources.reader import make_reader_function

    log = create_log(tmp_path / "log", "key string, ts long", 2)
    log.append(0, pa.table({"key": ["a", "b", "c"], "ts": [1_000, 253_402_300_799_000, 2_000]}))
    log.append(1, pa.table({"key": ["d"], "ts": [1_700_000_000_000_000]}))  # microseconds read as ms
    plan = plan_batch([[(0, 0), (1, 0)]], log.end_offsets())
    collected = Reports()
    fn = make_reader_function(log, "reader", 0, plan, log.schema, "ts", event_time_limit_ms=10_000, report_to=collected.sender)
    rows = list(fn(iter([pa.record_batch([pa.array([0], pa.int32())], names=["subtask"])])))
    assert sum(b.num_rows for b in rows) == 4  # every record goes on
    (report,) = collected.take("reader", 0, 1)
    assert report["partitions"]["0"]["max_event_ms"] == 2_000
    assert report["partitions"]["1"]["max_event_ms"] is None
    assert report["counters"] == {"too_far_ahead": 2}


def test_offsets_of_another_or_a_shorter_log_stop_the_job() -> None:
    """Issue 10, case 9: check_positions names the source, the log, the partition, the committed
    offset and the end found, and says what to do."""
    import pytest

    from keyscale.sources.partitioned import LogError
    from keyscale.sources.reader import check_positions, log_id_of

    committed = [[(0, 50), (1, 7)], [(2, 0)]]
    check_positions("reader", "/l", committed, [50, 9, 0], "id1", "id1")  # at the end or beyond: fine
    check_positions("reader", "/l", committed, [50, 9, 0], None, "id1")  # a checkpoint from before ids: adopt
    with pytest.raises(LogError, match=r"source 'reader': partition 1 of log /l ends at offset 3, but the job has committed offset 7") as e:
        check_positions("reader", "/l", committed, [60, 3, 0], "id1", "id1")
    assert "records [3, 7) it read are gone" in str(e.value) and "--from-savepoint" in str(e.value)
    with pytest.raises(LogError, match=r"log /l was recreated \(its id is id2; the job's offsets belong to the log with id id1\)"):
        check_positions("reader", "/l", committed, [500, 900, 100], "id1", "id2")
    with pytest.raises(LogError, match="has no partition 2 any more"):
        check_positions("reader", "/l", committed, [60, 9], "id1", "id1")
    assert log_id_of(to_state(committed, "id1")) == "id1"
    assert from_state(to_state(committed, "id1")) == committed
    assert log_id_of(to_state(committed)) is None


def test_a_reader_stops_on_a_log_recreated_or_shrunk_after_planning(tmp_path: Any) -> None:
    """A replayed batch's plan is fixed in its intent: the readers check the log is still the
    one (and as long as) the plan was made for, in one line that survives Spark's wrapping."""
    import shutil

    import pyarrow as pa
    import pytest

    from keyscale.sources import create_log
    from keyscale.sources.reader import make_reader_function

    log = create_log(tmp_path / "log", "key string", 1)
    log.append(0, pa.table({"key": ["a", "b", "c"]}))
    plan = plan_batch([[(0, 0)]], [3])
    one = pa.record_batch([pa.array([0], pa.int32())], names=["subtask"])
    fn = make_reader_function(log, "reader", 4, plan, log.schema, None, log_id="the-old-one")
    with pytest.raises(RuntimeError) as err:  # the error crosses Spark as one marked line (keyscale.errors)
        list(fn(iter([one])))
    found = decode_error(str(err.value))
    assert found is not None and found[0] == "KeyscaleError"
    assert re.match(r"source 'reader': log .* was recreated after batch 4 was planned", found[1]), found[1]
    shutil.rmtree(tmp_path / "log")
    create_log(tmp_path / "log", "key string", 1).append(0, pa.table({"key": ["a"]}))
    fn = make_reader_function(log, "reader", 4, plan, log.schema, None)
    with pytest.raises(RuntimeError) as err:
        list(fn(iter([one])))
    found = decode_error(str(err.value))
    assert found is not None and found[0] == "KeyscaleError"
    assert re.search(r"partition 0 of log .* ends at offset 1, but batch 4 was planned to read \[0, 3\)", found[1]), found[1]


def test_a_partition_that_lost_records_and_got_others_is_caught_by_its_last_record(tmp_path: Any) -> None:
    """A failover that lost records and then got more than it lost: the offsets look fine, the
    last record read is another one."""
    import pyarrow as pa
    import pytest

    from keyscale.runtime.task.report import Reports
    from keyscale.sources import create_log
    from keyscale.sources.partitioned import LogError
    from keyscale.sources.reader import (
        check_last_records,
        last_records_after,
        last_records_of,
        make_reader_function,
    )

    log = create_log(tmp_path / "log", "key string", 1)
    log.append(0, pa.table({"key": ["a", "b"]}))
    log.append(0, pa.table({"key": ["c"]}))
    plan = plan_batch([[(0, 0)]], log.end_offsets())
    collected = Reports()
    fn = make_reader_function(log, "reader", 0, plan, log.schema, None, report_to=collected.sender)
    list(fn(iter([pa.record_batch([pa.array([0], pa.int32())], names=["subtask"])])))
    last = last_records_after(None, collected.take("reader", 0, 1))
    assert list(last) == [0] and last[0][0] == 2
    state = to_state(advance(plan), "id", last)
    assert last_records_of(state) == last
    committed = from_state(state)
    assert committed == [[(0, 3)]]
    check_last_records("reader", log, committed, last)  # the same log: fine
    log.append(0, pa.table({"key": ["d"]}))
    check_last_records("reader", log, committed, last)  # more records: fine
    for segment in sorted(log.path.glob("p-00000/*.arrow"))[1:]:  # lose "c" and "d"...
        segment.unlink()
    log.append(0, pa.table({"key": ["x", "y"]}))  # ...and get others in their place
    with pytest.raises(LogError, match=r"partition 0 of log .* holds another record at offset 2 than the job read there"):
        check_last_records("reader", log, committed, last)


def test_broadcast_takes_a_log_source_and_a_function(tmp_path: Path) -> None:
    from keyscale.errors import JobDefinitionError
    from keyscale.operators.nonkeyed import BroadcastStream
    from keyscale.sources import create_log
    from keyscale.sources.reader import broadcast, log_source

    rules = log_source(create_log(tmp_path / "rules", "key string", partitions=1), uid="rules")
    stream = broadcast(rules, lambda state, row: None)
    assert isinstance(stream, BroadcastStream) and stream.uid == "rules"
    with pytest.raises(JobDefinitionError, match="takes a log_source"):
        broadcast("not a source", lambda state, row: None)  # type: ignore[arg-type]
    with pytest.raises(JobDefinitionError, match="apply must be a function"):
        broadcast(rules, None)  # type: ignore[arg-type]
