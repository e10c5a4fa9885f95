"""Each example job file, tested with keyscale.testing's pipeline runner (local Spark, in-memory
batches) against a plain-Python recount of the same input."""

from __future__ import annotations

import datetime as dt
import random
from pathlib import Path
from typing import Any

import pytest

from keyscale.testing import run_job_file

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
EVENTS = "key string, value long, ts timestamp"

pytestmark = [pytest.mark.slow]


def events(batches: int = 3, rows: int = 40, keys: int = 6, seed: int = 1, step_s: float = 2.0) -> list[list[dict[str, Any]]]:
    """Batches of (key, value, ts) in event-time order (none late)."""
    rnd, t, out = random.Random(seed), 0.0, []
    for _ in range(batches):
        batch = []
        for _ in range(rows):
            t += rnd.uniform(0, step_s)
            batch.append({"key": f"k{rnd.randrange(keys)}", "value": rnd.randrange(1, 200), "ts": T0 + dt.timedelta(milliseconds=int(t * 1000))})
        out.append(batch)
    return out


def ms(ts: dt.datetime) -> int:
    return int(ts.timestamp() * 1000)


def test_running_count(spark: Any) -> None:
    data = events()
    got = run_job_file(EXAMPLES / "running_count.py", data, schema=EVENTS)["output"]
    totals: dict[str, list[int]] = {}
    for batch, out in zip(data, got, strict=True):
        for r in batch:
            t = totals.setdefault(r["key"], [0, 0])
            t[0], t[1] = t[0] + 1, t[1] + r["value"]
        assert out == sorted(({"key": k, "count": totals[k][0], "sum": totals[k][1]} for k in {r["key"] for r in batch}), key=lambda r: r["key"])


def test_threshold_alerts(spark: Any) -> None:
    data = events(rows=60, keys=4)
    got = run_job_file(EXAMPLES / "threshold_alerts.py", data, schema=EVENTS, args={"threshold": "400", "window": "5"})["output"]
    state: dict[str, tuple[list[int], bool, int]] = {}
    want = []
    for batch in data:
        rows = []
        for r in batch:
            recent, above, n = state.get(r["key"], ([], False, 0))
            recent = [*recent, r["value"]][-5:]
            now = sum(recent) >= 400
            if now and not above:
                n += 1
                rows.append({"key": r["key"], "ts": r["ts"], "rolling_sum": sum(recent), "alert_number": n})
            state[r["key"]] = (recent, now, n)
        want.append(rows)
    assert [[(r["key"], ms(r["ts"]), r["rolling_sum"], r["alert_number"]) for r in b] for b in got] == [
        sorted((r["key"], ms(r["ts"]), r["rolling_sum"], r["alert_number"]) for r in b) for b in want]
    assert any(want)  # the input does cross the threshold


def test_two_stage(spark: Any) -> None:
    data = events(rows=50, keys=8)
    got = run_job_file(EXAMPLES / "two_stage.py", data, schema=EVENTS)["output"]
    totals: dict[str, int] = {}
    members: dict[int, set[str]] = {}
    for batch, out in zip(data, got, strict=True):
        for r in batch:
            totals[r["key"]] = totals.get(r["key"], 0) + r["value"]
        entered: dict[int, int] = {}
        for user in {r["key"] for r in batch}:
            tier = min(totals[user] // 500, 9)
            if user not in members.setdefault(tier, set()):
                members[tier].add(user)
                entered[tier] = entered.get(tier, 0) + 1
        assert out == [{"tier": t, "members": len(members[t]), "entered": n} for t, n in sorted(entered.items())]


def _windows(data: list[list[dict[str, Any]]], size_ms: int) -> dict[tuple[str, int], list[int]]:
    out: dict[tuple[str, int], list[int]] = {}
    for r in (r for b in data for r in b):
        w = out.setdefault((r["key"], ms(r["ts"]) // size_ms * size_ms), [0, 0])
        w[0], w[1] = w[0] + 1, w[1] + r["value"]
    return out


def test_tumbling_count(spark: Any) -> None:
    data = events(rows=50, step_s=4.0)
    got = run_job_file(EXAMPLES / "tumbling_count.py", data, schema=EVENTS, args={"size": "1 minute"}, drain_at_end=True)["output"]
    last: dict[tuple[str, int], list[int]] = {}
    for r in (r for b in got for r in b):  # a window's last row is its result
        last[(r["key"], ms(r["window_start"]))] = [r["count"], r["total"]]
    assert last == _windows(data, 60_000)


def _sessions(data: list[list[dict[str, Any]]], key: str, gap_ms: int) -> list[tuple[str, int, int, int]]:
    by_key: dict[str, list[int]] = {}
    for r in (r for b in data for r in b):
        by_key.setdefault(r[key], []).append(ms(r["ts"]))
    out = []
    for k, times in by_key.items():
        times.sort()
        start = prev = times[0]
        n = 1
        for t in times[1:]:
            if t - prev > gap_ms:
                out.append((k, start, prev + gap_ms, n))
                start, n = t, 0
            prev, n = t, n + 1
        out.append((k, start, prev + gap_ms, n))
    return sorted(out)


def test_sessionization(spark: Any) -> None:
    data = events(rows=30, keys=3, step_s=12.0)
    got = run_job_file(EXAMPLES / "sessionization.py", data, schema=EVENTS, args={"gap": "30 seconds"}, drain_at_end=True)["output"]
    sessions = sorted((r["key"], ms(r["window_start"]), ms(r["window_end"]), r["events"]) for b in got for r in b)
    assert sessions == _sessions(data, "key", 30_000)


def test_clickstream(spark: Any) -> None:
    rnd = random.Random(5)
    views = [[{"user": f"u{rnd.randrange(4)}", "page": f"/p{rnd.randrange(3)}", "ts": T0 + dt.timedelta(seconds=b * 100 + i * 2.5)}
              for i in range(40)] for b in range(3)]
    got = run_job_file(EXAMPLES / "clickstream.py", views, schema="user string, page string, ts timestamp",
                       outputs=["sessions", "pages"], drain_at_end=True)
    sessions = sorted((r["user"], ms(r["window_start"]), ms(r["window_end"]), r["views"]) for b in got["sessions"] for r in b)
    assert sessions == _sessions(views, "user", 30_000)
    counts: dict[str, int] = {}
    assert len(got["pages"]) == len(views) + 1 and got["pages"][-1] == []  # the drain's batch: windows only
    for batch, out in zip(views, got["pages"], strict=False):
        for r in batch:
            counts[r["page"]] = counts.get(r["page"], 0) + 1
        assert out == [{"page": p, "views": counts[p]} for p in sorted({r["page"] for r in batch})]


def test_log_count(spark: Any) -> None:
    rnd = random.Random(7)
    records = [{"key": f"k{rnd.randrange(5)}", "value": rnd.randrange(10), "ts": T0 + dt.timedelta(seconds=i)} for i in range(30)]
    got = run_job_file(EXAMPLES / "log_count.py", logs={"log": (EVENTS, records)}, args={"max_records_per_batch": "10"})["output"]
    totals: dict[str, list[int]] = {}
    want = []
    for b in range(3):  # one partition, 10 records a batch, in log order
        part = records[b * 10:(b + 1) * 10]
        for r in part:
            t = totals.setdefault(r["key"], [0, 0])
            t[0], t[1] = t[0] + 1, t[1] + r["value"]
        want.append([{"key": k, "count": totals[k][0], "sum": totals[k][1]} for k in sorted({r["key"] for r in part})])
    assert got[:3] == want and not any(got[3:])


def test_threshold_rules(spark: Any) -> None:
    rules = [{"key": "a", "threshold": 10}, {"key": "b", "threshold": 1000}]
    events_ = [{"key": k, "value": v} for k, v in [("a", 4), ("b", 600), ("c", 70), ("a", 7), ("c", 40), ("b", 500)]]
    got = run_job_file(EXAMPLES / "threshold_rules.py", logs={"events": ("key string, value long", events_),
                                                               "rules": ("key string, threshold long", rules)})["output"]
    totals: dict[str, int] = {}
    want = []
    for e in events_:
        before = totals.get(e["key"], 0)
        totals[e["key"]] = before + e["value"]
        threshold = {"a": 10, "b": 1000}.get(e["key"], 100)
        want.append({"key": e["key"], "total": totals[e["key"]], "threshold": threshold,
                     "alert": before < threshold <= totals[e["key"]], "version": 2})  # both rules apply before the first events
    assert [r for b in got for r in b] == sorted(want, key=lambda r: tuple(str(v) for v in r.values()))


def test_demo_running_count_rescaled_live_twice(spark: Any) -> None:
    """examples/demo.py (`make run`): the running count rescaled live 2 -> 4 after batch 1, -> 1 after batch 3."""
    data = events(batches=6, rows=30, keys=10, seed=4)
    run = run_job_file(EXAMPLES / "running_count.py", data, schema=EVENTS, parallelism=2, rescales={1: 4, 3: 1})
    assert [(b, old, new) for b, _, old, new in run.rescales] == [(2, 2, 4), (4, 4, 1)]
    assert run["output"] == run_job_file(EXAMPLES / "running_count.py", data, schema=EVENTS, parallelism=1)["output"]
