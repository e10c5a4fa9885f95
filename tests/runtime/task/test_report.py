"""A task's report crosses the process boundary from executor to driver (a Spark
accumulator): TaskReport's wire form round-trips, reads version 1's dict form (no ages) and
version 2's (no GC pauses: 0), version 3's (no companion delta), and refuses a later version
naming the operator, batch and subtask."""

from __future__ import annotations

import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keyscale.checkpoint.manifest import StateFile
from keyscale.errors import KeyscaleError
from keyscale.latency import Ages
from keyscale.runtime.task.report import REPORT_VERSION, PartitionRead, Reports, TaskReport, send

small = st.integers(0, 2**40)
names = st.text(max_size=12)
files = st.builds(StateFile, path=names, batch=small, kind=st.sampled_from(["delta", "snapshot"]), start=small, end=small,
                  rows=small, bytes=small, crc32=st.integers(0, 2**32 - 1), deltas_since=st.none() | small)
reads = st.builds(PartitionRead, records=small, start=small, end=small, max_event_ms=st.none() | st.integers(-(2**63), 2**63 - 1),
                  last_crc=st.none() | st.integers(0, 2**32 - 1))
counts = st.dictionaries(names, small, max_size=4)
seconds = st.floats(0, 1e6, allow_nan=False)
unix = st.floats(0, 4e9, allow_nan=False)
summaries = st.builds(Ages, ended=unix, buckets=st.dictionaries(st.integers(-(10**6), 2000), st.integers(1, 2**40), min_size=1, max_size=5),
                      oldest=unix, newest=unix, clock=st.sampled_from(["kafka LogAppendTime", "log segment write"]))
json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5), lambda inner: st.lists(inner, max_size=3), max_leaves=6)
reports = st.builds(
    TaskReport,
    subtask=st.integers(0, 32_767), records=small, busy_seconds=seconds, gc_seconds=seconds, emitted=small, counters=counts, store_requests=counts,
    range=st.none() | st.tuples(small, small), keys=small, timer_keys=small, max_event_ms=st.none() | small, file=st.none() | files,
    companion=st.none() | files,
    state_keys=small, load_seconds=seconds, warm_key_groups=small, loaded_key_groups=small, files_read=small,
    late_records=st.none() | small, windows_fired=st.none() | small, windows_purged=st.none() | small,
    fetched_keys=st.none() | small, copied_from=st.none() | names,
    lists=st.none() | st.dictionaries(names, st.lists(json_values, max_size=3), max_size=3),
    partitions=st.none() | st.dictionaries(st.integers(0, 10_000), reads, max_size=4),
    ages=st.none() | summaries,
)


@settings(max_examples=300, deadline=None)
@given(reports)
def test_a_report_survives_its_wire_form_and_the_accumulator(report: TaskReport) -> None:
    assert TaskReport.from_wire(report.to_wire()) == report
    assert TaskReport.from_wire(pickle.loads(pickle.dumps(report.to_wire()))) == report  # as Spark carries it
    collected = Reports()
    send(collected.sender, "op", 4, 0, report)
    assert collected.take("op", 4, 1) == [report]


# Version 1 reports, as the three task kinds sent them before the version was recorded.
TODAYS_KEYED = {
    "subtask": 1, "range": [64, 127], "records": 120, "max_event_ms": 1_700_000_000_000, "timer_keys": 0, "keys": 7, "emitted": 7,
    "file": {"path": "state/count/000000000003-s00001-delta-0123456789ab.arrow", "batch": 3, "kind": "delta", "start": 64, "end": 127,
             "rows": 7, "bytes": 1234, "crc32": 99},
    "state_keys": 40, "busy_seconds": 0.25, "load_seconds": 0.01, "warm_key_groups": 64, "loaded_key_groups": 0, "files_read": 0,
    "late_records": 2, "windows_fired": 3, "windows_purged": 1, "counters": {"late": 2, "dropped": 2}, "store_requests": {"put": 1},
}
TODAYS_ROCKSDB_KEYED = {**TODAYS_KEYED, "file": None, "fetched_keys": 7, "copied_from": None}
TODAYS_NONKEYED = {"subtask": 0, "records": 3, "emitted": 3, "lists": {"seen": [1, 2, 3]}, "busy_seconds": 0.1}
TODAYS_READER = {
    "subtask": 0, "partitions": {"0": {"records": 3, "start": 0, "end": 3, "max_event_ms": 9, "last_crc": 77},
                                 "2": {"records": 0, "start": 5, "end": 5, "max_event_ms": None}},
    "records": 3, "counters": {"too_far_ahead": 1}, "busy_seconds": 0.02,
}


def test_version_1_reports_are_read_and_have_no_ages() -> None:
    keyed = TaskReport.from_wire(TODAYS_KEYED)
    assert keyed.range == (64, 127) and keyed.file is not None and keyed.file.crc32 == 99 and keyed.windows_fired == 3
    assert keyed.counters == {"late": 2, "dropped": 2} and keyed.lists is None and keyed.partitions is None
    assert keyed.to_wire() == {**TODAYS_KEYED, "v": REPORT_VERSION, "gc_seconds": 0.0}
    rocks = TaskReport.from_wire(TODAYS_ROCKSDB_KEYED)
    assert rocks.file is None and rocks.fetched_keys == 7 and rocks.copied_from is None
    nonkeyed = TaskReport.from_wire(TODAYS_NONKEYED)
    assert nonkeyed.lists == {"seen": [1, 2, 3]} and nonkeyed.counters == {} and nonkeyed.range is None
    reader = TaskReport.from_wire(TODAYS_READER)
    assert reader.partitions == {0: PartitionRead(3, 0, 3, 9, 77), 2: PartitionRead(0, 5, 5)} and reader.ages is None
    assert reader.to_wire() == {**TODAYS_READER, "v": REPORT_VERSION, "gc_seconds": 0.0, "emitted": 0, "store_requests": {}, "keys": 0, "timer_keys": 0, "state_keys": 0,
                                "load_seconds": 0.0, "warm_key_groups": 0, "loaded_key_groups": 0, "files_read": 0}


def test_version_2_reports_are_read_with_no_gc_pauses() -> None:
    # A version 2 keyed report (ages, no gc_seconds), as an executor of the previous keyscale sends it.
    v2 = {**TODAYS_KEYED, "v": 2}
    keyed = TaskReport.from_wire(v2)
    assert keyed.gc_seconds == 0.0 and keyed.busy_seconds == 0.25 and keyed.windows_fired == 3
    assert keyed.to_wire() == {**v2, "v": REPORT_VERSION, "gc_seconds": 0.0}
    assert TaskReport.from_wire({**TODAYS_NONKEYED, "v": 2}).gc_seconds == 0.0


def test_gc_seconds_travel_in_the_current_version() -> None:
    report = TaskReport(subtask=2, records=10, busy_seconds=0.5, gc_seconds=0.125)
    wire = report.to_wire()
    assert wire["v"] == REPORT_VERSION == 4 and wire["gc_seconds"] == 0.125
    collected = Reports()
    send(collected.sender, "count", 7, 0, report)
    assert collected.take("count", 7, 1)[0].gc_seconds == 0.125


def test_a_snapshot_and_its_companion_travel_in_the_current_version() -> None:
    snapshot = StateFile("state/op/000000000009-s00001-snapshot-a.arrow", 9, "snapshot", 8, 15, 100, 4096, 7, deltas_since=5)
    delta = StateFile("state/op/000000000009-s00001-delta-a.arrow", 9, "delta", 8, 15, 3, 512, 8)
    report = TaskReport(subtask=0, records=3, busy_seconds=0.1, file=snapshot, companion=delta)
    collected = Reports()
    send(collected.sender, "count", 9, 0, report)
    got = collected.take("count", 9, 1)[0]
    assert got.state_files() == [snapshot, delta] and got.file is not None and got.file.deltas_since == 5
    # A version 3 report (no companion) reads as a plain snapshot's.
    v3 = {k: v for k, v in report.to_wire().items() if k != "companion"} | {"v": 3}
    assert TaskReport.from_wire(v3).state_files() == [snapshot]


def test_a_later_version_is_refused_naming_the_subtask() -> None:
    collected = Reports()
    collected.sender.add([("count", 3, 1, {**TODAYS_NONKEYED, "v": REPORT_VERSION + 1})])
    collected.sender.add([("count", 3, 0, TODAYS_NONKEYED)])
    with pytest.raises(KeyscaleError, match=rf"the report of subtask 1 of operator 'count' for batch 3 is of version {REPORT_VERSION + 1}, which this keyscale"):
        collected.take("count", 3, 2)
