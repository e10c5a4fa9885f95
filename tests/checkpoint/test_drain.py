"""A drained savepoint's Spark log and event time (pure parts of issue 10, case 5)."""

from __future__ import annotations

from keyscale.checkpoint.drain import (
    add_empty_batch,
    drain_extra,
    restored_event_time,
    spark_log_end,
)
from keyscale.checkpoint.manifest import Manifest
from keyscale.operators.eventtime import END_OF_TIME


def _spark_log(offsets: int, commits: int) -> dict[str, bytes]:
    """Spark's checkpoint as a savepoint copies it: relative path -> bytes."""
    files = {f"offsets/{n}": f'v1\n{{"batchWatermarkMs":0}}\n{{"logOffset":{n}}}'.encode() for n in range(offsets + 1)}
    files.update({f"commits/{n}": b'v1\n{"nextBatchWatermarkMs":0}' for n in range(commits + 1)})
    return files


def test_the_drains_id_becomes_an_empty_committed_batch() -> None:
    d = _spark_log(2, 2)  # batches 0-2 consumed; the drain is batch 3
    assert add_empty_batch(d, 2, 3)
    assert d["offsets/3"] == d["offsets/2"]  # reads nothing
    assert d["commits/3"] == d["commits/2"]  # and is done


def test_nothing_consumed_gives_no_spark_positions() -> None:
    d = _spark_log(-1, -1)
    assert not add_empty_batch(d, -1, 0)
    x = _spark_log(4, 4)
    assert add_empty_batch(x, 4, 4) and x == _spark_log(4, 4)  # not drained: nothing to add


def test_a_drain_manifest_names_the_last_spark_batch_and_the_watermark_before() -> None:
    wm = {"watermark_ms": 1234, "inputs": {"source": {"max_event_ms": 3235, "last_active_ms": 1}}}
    m = Manifest(job="j", batch=5, batch_time_ms=0, operators={}, watermark_ms=END_OF_TIME,
                 extra={"watermark": {"watermark_ms": END_OF_TIME, "inputs": {}}, **drain_extra(wm, 5)})
    assert spark_log_end(m) == 4
    assert spark_log_end(Manifest(job="j", batch=5, batch_time_ms=0, operators={})) == 5
    extra, ms = restored_event_time(m.extra)
    assert extra == {"watermark": wm} and ms == 1234 and "drained" not in extra
    assert restored_event_time({}) == ({}, None)
    assert restored_event_time({"drained": True, "drain": {"spark_batch": 3}}) == ({}, None)  # no event time before
