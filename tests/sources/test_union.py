"""Two logs read as one (the input of a two-input stage over logs): partition numbering,
records, event time, and what the union passes on to each log."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keyscale.sources.log import create_log
from keyscale.sources.partitioned import LogError, PartitionedLog
from keyscale.sources.union import UnionLog


def _logs(root: Path, n1: int, n2: int) -> tuple[PartitionedLog, PartitionedLog]:
    return (create_log(root / "users", "id string, name string, ts timestamp", partitions=n1),
            create_log(root / "clicks", "user string, page string, at long", partitions=n2))


@settings(max_examples=25, deadline=None)
@given(n1=st.integers(1, 3), n2=st.integers(1, 3), sizes=st.lists(st.integers(0, 4), min_size=6, max_size=6), grow=st.sampled_from([0, 1]))
def test_every_record_of_both_logs_is_read_once_under_a_stable_partition_number(
    tmp_path_factory: pytest.TempPathFactory, n1: int, n2: int, sizes: list[int], grow: int,
) -> None:
    a, b = _logs(tmp_path_factory.mktemp("u"), n1, n2)
    t0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    for p in range(n1):
        a.append(p, pa.table({"id": [f"a{p}-{i}" for i in range(sizes[p])], "name": ["x"] * sizes[p], "ts": [t0] * sizes[p]}))
    for p in range(n2):
        b.append(p, pa.table({"user": [f"b{p}-{i}" for i in range(sizes[3 + p])], "page": ["/"] * sizes[3 + p], "at": [0] * sizes[3 + p]}))
    u = UnionLog(a, b)
    before = u.end_offsets()
    # A partition added to either log later leaves every existing number where it was.
    (a if grow == 0 else b).add_partitions(1)
    after = u.end_offsets()
    assert after[: len(before)] == before and len(after) == u.num_partitions() >= len(before)
    seen: dict[int, list[str]] = {0: [], 1: []}
    for p, end in enumerate(after):
        t = u.read(p, 0, end)
        assert t.schema == u.schema and t.num_rows == end
        for row in t.to_pylist():
            side = row["__side"]
            assert row["in2" if side == 0 else "in1"] is None
            seen[side].append(row["in1"]["id"] if side == 0 else row["in2"]["user"])
    assert sorted(seen[0]) == sorted(f"a{p}-{i}" for p in range(n1) for i in range(sizes[p]))
    assert sorted(seen[1]) == sorted(f"b{p}-{i}" for p in range(n2) for i in range(sizes[3 + p]))


def test_event_time_is_each_logs_own_column_and_long_times_are_milliseconds(tmp_path: Path) -> None:
    a, b = _logs(tmp_path, 1, 1)
    t = dt.datetime(2026, 1, 1, 12, tzinfo=dt.UTC)
    a.append(0, pa.table({"id": ["u"], "name": ["n"], "ts": [t]}))
    b.append(0, pa.table({"user": ["u"], "page": ["/"], "at": [int(t.timestamp() * 1000) + 1500]}))
    u = UnionLog(a, b, ("ts", "at"))
    assert u.read(0, 0, 1).column("__event_time").to_pylist() == [t]
    assert u.read(1, 0, 1).column("__event_time").to_pylist() == [t + dt.timedelta(milliseconds=1500)]
    with pytest.raises(LogError, match="has no column 'when' for event time"):
        UnionLog(a, b, ("ts", "when"))


def test_a_union_is_read_only_and_a_missing_partition_is_empty(tmp_path: Path) -> None:
    a, b = _logs(tmp_path, 1, 2)
    u = UnionLog(a, b)
    assert u.end_offsets() == [0, 0, 0, 0] and u.read(2, 0, 0).num_rows == 0  # the users log has no partition 1
    with pytest.raises(LogError, match="cannot read"):
        u.read(2, 0, 1)
    with pytest.raises(LogError, match="append to either log"):
        u.append(0, pa.table({}))
    with pytest.raises(LogError, match="add partitions to either log"):
        u.add_partitions(1)


class _Recording(PartitionedLog):
    """A log that records what the union tells it (positions, skipped records, its id)."""

    def __init__(self, parts: int, ident: str | None, skipped: int) -> None:
        self.parts, self.ident, self.skipped = parts, ident, skipped
        self.committed: list[dict[int, int]] = []

    schema = property(lambda self: pa.schema([("v", pa.int64())]))  # type: ignore[assignment]
    uri = property(lambda self: f"rec://{self.ident}")  # type: ignore[assignment]

    def num_partitions(self) -> int:
        return self.parts

    def end_offsets(self) -> list[int]:
        return [0] * self.parts

    def first_offsets(self) -> list[int]:
        return [7] * self.parts

    def read(self, partition: int, start: int, end: int) -> pa.Table:
        return self.schema.empty_table()

    def append(self, partition: int, table: pa.Table) -> tuple[int, int]:
        raise NotImplementedError

    def add_partitions(self, n: int) -> int:
        raise NotImplementedError

    def describe(self) -> str:
        return self.uri

    def fingerprints(self) -> bool:
        return self.ident != "kafka"

    def positions_committed(self, positions: dict[int, int]) -> None:
        self.committed.append(positions)

    def take_skipped(self) -> int:
        n, self.skipped = self.skipped, 0
        return n

    def identity(self) -> str | None:
        return self.ident


def test_each_log_hears_of_its_own_positions_skips_and_identity() -> None:
    a, b = _Recording(2, "kafka", 3), _Recording(1, None, 4)
    u = UnionLog(a, b)
    assert u.first_offsets() == [7, 7, 7, 0]
    u.positions_committed({0: 10, 1: 20, 2: 30, 3: 0})
    assert a.committed == [{0: 10, 1: 30}] and b.committed == [{0: 20}]
    assert u.take_skipped() == 7 and u.take_skipped() == 0
    assert u.identity() == "kafka+None" and not u.fingerprints()
    assert UnionLog(_Recording(1, None, 0), _Recording(1, None, 0)).identity() is None
