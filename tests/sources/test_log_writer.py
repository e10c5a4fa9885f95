"""LogWriter and partition_of: same key, same partition, in every batch and every process."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keyscale.errors import InputDataError
from keyscale.sources import LogWriter, create_log, partition_of

keys = st.none() | st.text(max_size=6)


@settings(max_examples=200, deadline=None)
@given(st.lists(keys, min_size=1, max_size=30), st.integers(1, 64), st.randoms(use_true_random=False))
def test_a_key_has_one_partition_whatever_the_batch(batch: list[str | None], n: int, rnd: object) -> None:
    parts = partition_of(pa.table({"k": pa.array(batch, pa.string())}), ["k"], n)
    assert all(0 <= p < n for p in parts.tolist())
    by_key: dict[str | None, int] = {}
    for k, p in zip(batch, parts.tolist(), strict=True):
        assert by_key.setdefault(k, p) == p
    # alone, or shuffled into another batch: the same partition
    shuffled = list(batch)
    rnd.shuffle(shuffled)  # type: ignore[attr-defined]
    again = partition_of(pa.table({"k": pa.array([*shuffled, "other"], pa.string())}), ["k"], n)
    for k, p in zip(shuffled, again.tolist(), strict=False):
        assert by_key[k] == p
    for k in batch[:3]:
        assert partition_of(pa.table({"k": pa.array([k], pa.string())}), ["k"], n).tolist() == [by_key[k]]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(-(2**63), 2**63 - 1), st.none() | st.integers(0, 5)), min_size=1, max_size=20), st.integers(1, 16))
def test_integer_and_compound_keys_are_stable(rows: list[tuple[int, int | None]], n: int) -> None:
    a = pa.array([r[0] for r in rows], pa.int64())
    b = pa.array([r[1] for r in rows], pa.int64())
    t = pa.table({"a": a, "b": b})
    parts = partition_of(t, ["a", "b"], n).tolist()
    for i, row in enumerate(rows):
        one = pa.table({"a": pa.array([row[0]], pa.int64()), "b": pa.array([row[1]], pa.int64())})
        assert partition_of(one, ["a", "b"], n).tolist() == [parts[i]]
    # an int column's values hash the same whatever the column's width
    small = [r[1] for r in rows if r[1] is not None]
    if small:
        assert partition_of(pa.table({"x": pa.array(small, pa.int8())}), ["x"], n).tolist() == partition_of(pa.table({"x": pa.array(small, pa.int64())}), ["x"], n).tolist()


GOLDEN = """
import json, pyarrow as pa, datetime as dt
from keyscale.sources import partition_of
t = pa.table({"k": ["a", "b", "user-42", "", None, "é✓"], "ts": pa.array([dt.datetime(2026, 1, i + 1) for i in range(6)], pa.timestamp("us", tz="UTC"))})
print(json.dumps([partition_of(t, ["k"], 7).tolist(), partition_of(t, ["k", "ts"], 100).tolist()]))
"""


def test_partitions_are_the_same_in_other_processes() -> None:
    outs = []
    for seed in ("1", "2"):
        proc = subprocess.run([sys.executable, "-c", GOLDEN], capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONHASHSEED": seed})
        assert proc.returncode == 0, proc.stderr[-2000:]
        outs.append(json.loads(proc.stdout))
    assert outs[0] == outs[1]
    t = pa.table({"k": ["a", "b", "user-42", "", None, "é✓"], "ts": pa.array([dt.datetime(2026, 1, i + 1) for i in range(6)], pa.timestamp("us", tz="UTC"))})
    assert outs[0] == [partition_of(t, ["k"], 7).tolist(), partition_of(t, ["k", "ts"], 100).tolist()]
    # pinned: a change of the hash moves every key of every existing log
    assert outs[0][0] == GOLDEN_PARTITIONS


GOLDEN_PARTITIONS = [3, 0, 5, 6, 0, 6]


def test_writer_splits_by_key_or_round_robins(tmp_path: Path) -> None:
    log = create_log(tmp_path / "l", "key string, n long", 3)
    w = LogWriter(log, key_columns=["key"])
    t = pa.table({"key": [f"k{i % 10}" for i in range(100)], "n": list(range(100))})
    ranges = w.write(t)
    assert sum(e - s for s, e in ranges.values()) == 100
    for p, end in enumerate(log.end_offsets()):
        part = log.read(p, 0, end)
        assert set(partition_of(part, ["key"], 3).tolist()) <= {p}
        assert part.column("n").to_pylist() == sorted(part.column("n").to_pylist())  # row order kept
    rr = LogWriter(log)
    before = log.end_offsets()
    assert list(rr.write(t.slice(0, 5))) == [0]
    assert list(rr.write(t.slice(0, 5))) == [1]
    assert list(rr.write(t.slice(0, 5))) == [2]
    assert list(rr.write(t.slice(0, 5))) == [0]
    assert rr.write(t.slice(0, 0)) == {}
    assert [a - b for a, b in zip(log.end_offsets(), before, strict=True)] == [10, 5, 5]


def test_writer_errors_name_the_column(tmp_path: Path) -> None:
    log = create_log(tmp_path / "l", "key string, n long", 2)
    with pytest.raises(InputDataError, match="key column 'user' is not a column of log"):
        LogWriter(log, key_columns=["user"])
    with pytest.raises(InputDataError, match="key column 'x' is not one of"):
        partition_of(pa.table({"k": [1]}), ["x"], 2)
    with pytest.raises(InputDataError, match="key column 'l' has type list"):
        partition_of(pa.table({"l": [[1]]}), ["l"], 2)
