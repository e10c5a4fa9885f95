"""Several keyed stages with stateless PySpark between them; each operator rescales alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from conftest import EXAMPLES, read_output, run_job, write_events
from keyscale.checkpoint.jobdir import JobDir

pytestmark = [pytest.mark.spark]
TWO_STAGE = EXAMPLES / "two_stage.py"


def _expected(events: Path) -> pd.DataFrame:
    """Pandas reference: per batch, users whose running total first reaches each tier."""
    files = sorted(events.glob("part-*.parquet"))
    totals: dict[str, int] = {}
    members: dict[int, set[str]] = {}
    rows = []
    for b, f in enumerate(files):
        df = pd.read_parquet(f)
        for key, v in df.groupby("key")["value"].sum().items():
            totals[key] = totals.get(key, 0) + int(v)
        updated = df["key"].unique()
        entered: dict[int, int] = {}
        for key in updated:
            tier = min(totals[key] // 500, 9)
            if key not in members.setdefault(tier, set()):
                members[tier].add(key)
                entered[tier] = entered.get(tier, 0) + 1
        rows += [{"tier": t, "members": len(members[t]), "entered": n, "batch": b} for t, n in entered.items()]
    return pd.DataFrame(rows)


def test_two_keyed_stages_rescaled_separately(spark: Any, tmp_path: Path) -> None:
    write_events(tmp_path / "in", files=5, rows=800, keys=150, seed=11)
    jd = JobDir(tmp_path / "job")
    plan = {1: ("user_totals", 3), 2: ("tier_entries", 1), 3: ("user_totals", 1)}

    def rescale(rec: Any) -> None:
        if rec.batch in plan:
            uid, p = plan[rec.batch]
            jd.request_rescale(p, uid)

    summary = run_job(TWO_STAGE, tmp_path / "job", 2, {"input": str(tmp_path / "in"), "output": str(tmp_path / "out")}, on_batch=rescale)
    assert [b.parallelism for b in summary.batches] == [
        {"user_totals": 2, "tier_entries": 2},
        {"user_totals": 2, "tier_entries": 2},
        {"user_totals": 3, "tier_entries": 2},
        {"user_totals": 3, "tier_entries": 1},
        {"user_totals": 1, "tier_entries": 1},
    ]
    out = read_output(tmp_path / "out")
    want = _expected(tmp_path / "in")
    got = out.astype({"tier": "int64", "members": "int64", "entered": "int64", "batch": "int64"})
    cols = ["batch", "tier", "members", "entered"]
    pd.testing.assert_frame_equal(got[cols].sort_values(cols).reset_index(drop=True), want[cols].sort_values(cols).reset_index(drop=True))
    m = jd.latest_manifest()
    assert m is not None and set(m.operators) == {"user_totals", "tier_entries"}


def test_event_time_mistakes_are_named(spark: Any, tmp_path: Path) -> None:
    import keyscale as ks
    from keyscale.errors import JobDefinitionError

    events = spark.readStream.schema("key string, value long, ts timestamp").parquet(str(tmp_path))
    s = ks.stream(events)
    with pytest.raises(JobDefinitionError, match="event-time column 'when' is not in the stream"):
        s.with_watermark("when")
    with pytest.raises(JobDefinitionError, match="event-time column 'key' has type string"):
        s.with_watermark("key")
    with pytest.raises(JobDefinitionError, match="window\\(\\) needs event time"):
        s.key_by("key").window(ks.windows.TumblingWindows("1 minute"))
    with pytest.raises(JobDefinitionError, match="max_out_of_orderness 'soon'"):
        s.with_watermark("ts", "soon")
    timed = s.with_watermark("ts", "5 seconds")
    with pytest.raises(JobDefinitionError, match="already has a watermark"):
        timed.with_watermark("ts")
    with pytest.raises(JobDefinitionError, match="column 'nope' is not in the stream"):
        timed.key_by("key").window(ks.windows.TumblingWindows("1 minute")).aggregate(uid="w", s=ks.aggregates.sum("nope"))
    with pytest.raises(JobDefinitionError, match="is not a ProcessFunction"):
        timed.process(object(), "n long", uid="x")  # type: ignore[arg-type]
