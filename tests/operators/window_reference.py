"""A plain-Python model of keyscale's window semantics, record by record: what the
vectorized operator must equal. Batches arrive in order; batch b runs with watermark W(b)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

NO_WM = -(2**63)


def watermarks(batches: list[pd.DataFrame], ooo_ms: int) -> list[int]:
    """W(b) for each batch: max over earlier batches of (max ts - ooo - 1)."""
    out, w = [], NO_WM
    for df in batches:
        out.append(w)
        if len(df):
            w = max(w, int(df["ts"].max()) - ooo_ms - 1)
    return out


def fixed_windows(batches: list[pd.DataFrame], ooo_ms: int, lateness_ms: int, size_ms: int, slide_ms: int | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(final count/sum per key and window, records too late for every window)."""
    slide = slide_ms or size_ms
    rows, late = [], []
    for df, w in zip(batches, watermarks(batches, ooo_ms), strict=True):
        for r in df.itertuples(index=False):
            starts = [s for s in range(r.ts - r.ts % slide - size_ms + slide, r.ts + 1, slide) if s + size_ms > r.ts]
            kept = [s for s in starts if (s + size_ms) - 1 + lateness_ms > w]
            if not kept:
                late.append(r._asdict())
            rows += [{"key": r.key, "window_start": s, "window_end": s + size_ms, "value": r.value} for s in kept]
    frame = pd.DataFrame(rows, columns=["key", "window_start", "window_end", "value"])
    agg = frame.groupby(["key", "window_start", "window_end"], as_index=False).agg(count=("value", "size"), total=("value", "sum"))
    return agg, pd.DataFrame(late, columns=list(batches[0].columns))


@dataclass
class _Session:
    start: int
    end: int
    values: list[int] = field(default_factory=list)


def sessions(batches: list[pd.DataFrame], ooo_ms: int, lateness_ms: int, gap_ms: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(every session ever formed, with its final events/total; too-late records)."""
    open_: dict[Any, list[_Session]] = defaultdict(list)
    done: list[tuple[Any, _Session]] = []
    late = []
    for df, w in zip(batches, watermarks(batches, ooo_ms), strict=True):
        closed_upto = w + 1 - lateness_ms if w > NO_WM else NO_WM
        for r in df.itertuples(index=False):
            if r.ts + gap_ms <= closed_upto:
                late.append(r._asdict())
                continue
            s = _Session(r.ts, r.ts + gap_ms, [r.value])
            keep = []
            for o in open_[r.key]:
                if o.start <= s.end and s.start <= o.end:  # touching merges
                    s = _Session(min(o.start, s.start), max(o.end, s.end), o.values + s.values)
                else:
                    keep.append(o)
            open_[r.key] = [*keep, s]
        for k in list(open_):
            for o in [o for o in open_[k] if o.end <= closed_upto]:
                done.append((k, o))
                open_[k].remove(o)
    done += [(k, o) for k, lst in open_.items() for o in lst]
    rows = [{"key": k, "window_start": o.start, "window_end": o.end, "events": len(o.values), "total": int(np.sum(o.values))} for k, o in done]
    return pd.DataFrame(rows), pd.DataFrame(late, columns=list(batches[0].columns))


def last_rows(out: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """The last row each window emitted (``out`` has a ``batch`` column)."""
    return out.sort_values("batch", kind="stable").groupby(keys, as_index=False).tail(1).drop(columns="batch")


def batches(seed: int, n_batches: int = 6, rows: int = 40, keys: int = 4, span: int = 20_000, late_share: float = 0.15) -> list[pd.DataFrame]:
    """Shuffled, out-of-order batches; some records far behind (late). Timestamps are even."""
    rng = np.random.default_rng(seed)
    out = []
    for b in range(n_batches):
        ts = b * span + rng.integers(0, span, rows) - rng.integers(0, 4000, rows)
        far = rng.random(rows) < late_share
        ts = np.where(far, ts - rng.integers(5_000, 60_000, rows), ts)
        ts = np.maximum(ts, 0) // 2 * 2
        out.append(pd.DataFrame({"key": [f"u{k}" for k in rng.integers(0, keys, rows)], "value": rng.integers(0, 50, rows), "ts": ts}))
    return out
