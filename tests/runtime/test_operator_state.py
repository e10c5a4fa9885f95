"""Operator state on Spark: a non-keyed function's list state (split/merge and union) across
live rescales, and broadcast state fed by a rules stream (the rules example)."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.dataset as pads
import pytest

from conftest import EXAMPLES, read_output, run_job
from keyscale.checkpoint.jobdir import JobDir
from keyscale.sources import LogWriter, create_log

pytestmark = [pytest.mark.spark, pytest.mark.slow]

COUNTING_JOB = '''
import keyscale as ks

NAME = "per_subtask"


class Count(ks.ProcessFunction):
    def open(self, ctx):
        self.counts = ctx.list_state("counts", mode="split_merge")
        self.members = ctx.list_state("members", mode="union")

    def process(self, records, ctx):
        if len(records):
            self.counts.add(len(records))
        if ctx.subtask_index not in self.members.get():
            self.members.add(ctx.subtask_index)
        return [(ctx.subtask_index, ctx.parallelism, sum(self.counts.get()), len(self.counts.get()), sorted(set(self.members.get())))]


def build(ctx):
    source = ks.sources.log_source(ctx.arg("log"), uid="reader", max_records_per_batch=100)
    return (
        ks.stream(source)
        .process(Count(), "subtask int, parallelism int, seen long, entries int, members array<int>", uid="count")
        .sink(ks.sinks.ParquetSink(ctx.arg("output")))
    )
'''


def test_list_state_split_merge_and_union_across_live_rescales(spark: Any, tmp_path: Path) -> None:
    job = tmp_path / "job.py"
    job.write_text(textwrap.dedent(COUNTING_JOB))
    log = create_log(tmp_path / "log", "key string, value long", 3)
    LogWriter(log, ["key"]).write(pa.table({"key": [f"k{i % 97}" for i in range(2400)], "value": list(range(2400))}))
    jd = JobDir(tmp_path / "job")
    plan = {1: 3, 3: 1, 4: 4}
    entries_after: dict[int, list[int]] = {}

    def during(rec: Any) -> None:
        entries_after[rec.batch] = [len(x) for x in jd.read_manifest(rec.batch).operators["count"].operator_state["lists"]["counts"]["subtasks"]]
        if rec.batch in plan:
            jd.request_rescale(plan[rec.batch], "count")

    run_job(job, tmp_path / "job", 2, {"log": str(tmp_path / "log"), "output": str(tmp_path / "out")}, on_batch=during)
    out = pads.dataset(str(tmp_path / "out"), partitioning="hive").to_table().to_pandas()
    last = out[out.batch == out.batch.max()]
    assert last.seen.sum() == 2400  # every record counted once: no entry lost or duplicated
    # Split/merge: after 1 -> 4 the entries are dealt out evenly (sizes differ by at most one).
    b4 = out[out.batch == 5]
    sizes = [entries_after[4][0]]  # at P=1 one subtask held them all
    assert len(sizes) == 1 and sorted(b4.parallelism.unique()) == [4]
    per = entries_after[5]
    assert max(per) - min(per) <= 2  # each subtask got an even share and may have added one
    # Union: every subtask sees every subtask that ever ran.
    members = {tuple(m) for m in out[out.batch >= 5].members}
    assert all(set(m) >= {0, 1, 2} for m in members)


def test_rules_stream_as_broadcast_state(spark: Any, tmp_path: Path) -> None:
    events = create_log(tmp_path / "events", "key string, value long", 4)
    rules = create_log(tmp_path / "rules", "key string, threshold long", 1)
    rng = np.random.default_rng(3)
    df = pd.DataFrame({"key": [f"k{i}" for i in rng.integers(0, 20, 3000)], "value": rng.integers(1, 20, 3000)})
    LogWriter(events, ["key"]).write(pa.Table.from_pandas(df, preserve_index=False))
    rules.append(0, pa.table({"key": ["k1", "k2"], "threshold": [50, 70]}))
    jd = JobDir(tmp_path / "job")

    def during(rec: Any) -> None:
        if rec.batch == 1:
            rules.append(0, pa.table({"key": ["k1", "k3"], "threshold": [500, 5]}))  # in force from batch 2
            jd.request_rescale(3, "alerts")

    args = {"events": str(tmp_path / "events"), "rules": str(tmp_path / "rules"), "output": str(tmp_path / "out"), "max_records_per_batch": "150"}
    run_job(EXAMPLES / "threshold_rules.py", tmp_path / "job", 2, args, on_batch=during)
    out = read_output(tmp_path / "out")
    assert len(out) == 3000
    # Every subtask saw the same rules in a batch, before and after the rescale.
    assert (out.groupby("batch").version.nunique() == 1).all()
    early, late = out[out.batch <= 1], out[out.batch >= 2]
    assert set(early.version) == {2} and set(late.version) == {4}
    assert set(early[early.key == "k1"].threshold) == {50} and set(late[late.key == "k1"].threshold) == {500}
    assert set(late[late.key == "k3"].threshold) == {5} and set(early[early.key == "k3"].threshold) == {100}
    # The alert fires where the running total crosses the threshold in force.
    ordered = out.sort_values(["key", "total"])
    before = ordered.groupby("key").total.shift(1).fillna(0)
    assert (ordered.alert == ((before < ordered.threshold) & (ordered.threshold <= ordered.total))).all()
    assert ordered.alert.any()
    state = jd.read_manifest(max(jd.manifest_batches())).operators["rules"].operator_state
    assert dict(map(tuple, state["broadcast"])) == {"k1": 500, "k2": 70, "k3": 5, "__version": 4}
