"""The partitioned-log interface (keyscale.sources.partitioned): what every backend shares."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pyarrow as pa
import pytest

import keyscale.sources.partitioned as partitioned_module
from keyscale.errors import InputDataError
from keyscale.sources import LocalLog, LogError, PartitionedLog, RedisLog
from keyscale.sources.partitioned import check_count, check_schema, first_line


def test_both_backends_implement_the_interface_and_the_package_exports_it() -> None:
    assert issubclass(LocalLog, PartitionedLog) and issubclass(RedisLog, PartitionedLog)
    assert LogError is partitioned_module.LogError


def test_the_shared_checks() -> None:
    assert check_schema("k string").names == ["k"]
    with pytest.raises((InputDataError, LogError)):
        check_count("the number of partitions", 0, 1)
    assert first_line(ValueError("one\ntwo")) == "one"
    assert first_line(ValueError("")) == "ValueError"
    assert check_schema(pa.schema([("a", pa.int64())])).names == ["a"]


def test_a_local_log_tells_each_records_append_time(tmp_path: Path) -> None:

    from keyscale.sources.local_log import SEGMENT_CLOCK
    from keyscale.sources.union import UnionLog

    log = LocalLog.create(tmp_path / "l", "n long", partitions=1)
    before = time.time()
    log.append(0, pa.table({"n": [1, 2]}))
    log.append(0, pa.table({"n": [3]}))
    seg = sorted((tmp_path / "l" / "p-00000").glob("*.arrow"))[1]
    os.utime(seg, (before + 5.0, before + 5.0))  # the second append "5 s later"
    table, times = log.read_timed(0, 1, 3)
    assert table.column("n").to_pylist() == [2, 3] and times is not None and times.clock == SEGMENT_CLOCK
    assert before - 1 <= times.seconds[0] <= time.time() and times.seconds[1] == pytest.approx(before + 5.0)
    assert log.read(0, 1, 3).equals(table)
    union_table, union_times = UnionLog(log, log).read_timed(0, 1, 3)
    assert union_table.num_rows == 2 and union_times is not None and list(union_times.seconds) == list(times.seconds)
    assert PartitionedLog.read_timed(log, 0, 0, 1)[1] is None  # the interface's default: none kept
