"""The window join's function on the keyed-stage harness (no Spark): for any rows, batch
splits and parallelism, its pairs are the brute-force join per shared window, late rows
join nothing, and once the watermark passes every window its state is empty."""

from __future__ import annotations

import itertools
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keyscale.operators.coprocess import WindowJoin, adapt
from keyscale.operators.windows import SlidingWindows, TumblingWindows
from keyscale.testing import KeyedHarness

A = pa.struct([("ts", pa.int64()), ("v", pa.string())])
B = pa.struct([("ts", pa.int64()), ("v", pa.string())])
INPUT = pa.schema([("key", pa.string()), ("__side", pa.int8()), ("in1", A), ("in2", B)])
OUTPUT = "ts long, v string, ts_2 long, v_2 string, window_start timestamp, window_end timestamp"


def _harness(assigner: Any, parallelism: int, state_backend: str = "memory") -> KeyedHarness:
    fn = WindowJoin(assigner, "ts", "ts", A, B, ["ts", "v"], ["ts_2", "v_2"])
    return KeyedHarness.of(adapt(fn, 1), key_by=["key"], input_schema=INPUT, output_schema=OUTPUT, parallelism=parallelism,
                           state_backend=state_backend)


def _row(key: str, side: int, ts: int, v: str) -> dict[str, Any]:
    rec = {"ts": ts, "v": v}
    return {"key": key, "__side": side, "in1": rec if side == 0 else None, "in2": rec if side == 1 else None}


def _brute(assigner: Any, rows: list[dict[str, Any]]) -> list[tuple[int, str, int, str, int]]:
    def starts(ts: int) -> set[int]:
        import numpy as np

        return {int(s) for s in assigner.assign(np.array([ts], dtype=np.int64))[1]}

    left = [(r["key"], r["in1"]) for r in rows if r["__side"] == 0]
    right = [(r["key"], r["in2"]) for r in rows if r["__side"] == 1]
    return sorted((a["ts"], a["v"], b["ts"], b["v"], s) for ka, a in left for kb, b in right if ka == kb
                  for s in starts(a["ts"]) & starts(b["ts"]))


rows_strategy = st.lists(
    st.tuples(st.sampled_from(["k1", "k2", "k3"]), st.integers(0, 1), st.integers(0, 10_000)), min_size=1, max_size=30)


@settings(max_examples=30, deadline=None)
@given(rows=rows_strategy, sliding=st.booleans(), parallelism=st.integers(1, 3), cuts=st.lists(st.integers(0, 30), max_size=3))
def test_pairs_are_the_brute_force_join_and_state_ends_empty(rows: list[tuple[str, int, int]], sliding: bool, parallelism: int,
                                                             cuts: list[int]) -> None:
    assigner = SlidingWindows("3 seconds", "1 second") if sliding else TumblingWindows("2 seconds")
    records = [_row(k, side, ts, f"r{i}") for i, (k, side, ts) in enumerate(rows)]
    h = _harness(assigner, parallelism)
    got = []
    bounds = [0, *sorted({min(c, len(records)) for c in cuts}), len(records)]
    for lo, hi in itertools.pairwise(bounds):
        got += h.process(records[lo:hi])  # the watermark stays before every row: nothing is late
    h.advance_watermark(10**9)
    assert h.process() == []  # the windows' end emits nothing new: pairs came as they met
    pairs = sorted((r["ts"], r["v"], r["ts_2"], r["v_2"], int(r["window_start"].timestamp() * 1000)) for r in got)
    assert pairs == _brute(assigner, records)
    for key in ("k1", "k2", "k3"):
        assert h.state(key) is None  # every row left when its last window fired


@pytest.mark.parametrize("backend", ["memory", "rocksdb"])
def test_a_row_whose_windows_have_fired_joins_nothing_and_is_not_kept(backend: str) -> None:
    h = _harness(TumblingWindows("1 second"), 1, backend)
    assert h.process([_row("k", 0, 500, "a")]) == []
    h.advance_watermark(1500)  # window [0, 1000) has fired
    assert h.process([_row("k", 1, 700, "late"), _row("k", 1, 1200, "b"), _row("k", 0, 1900, "c")]) == [
        {"ts": 1900, "v": "c", "ts_2": 1200, "v_2": "b", "window_start": _dt(1000), "window_end": _dt(2000)}]
    state = h.state("k")
    assert state is not None and [r["v"] for r in state["left"]] == ["c"] and [r["v"] for r in state["right"]] == ["b"]


def _dt(ms: int) -> Any:
    import datetime as dt

    return dt.datetime(1970, 1, 1, tzinfo=dt.UTC) + dt.timedelta(milliseconds=ms)
