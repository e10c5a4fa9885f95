"""FLIP-8 on a partitioned log: the readers' offsets are split/merge operator state.

A log with 4 partitions (KP1-KP4) read by 2 readers (S1: KP1, KP2; S2: KP3, KP4). Scale
down to 1: one reader holds all four and continues each from its offset. Scale up to 4:
each reader holds one. Partitions added while running are read. Live and across a restore
from a savepoint, on the local log and on Redis; the output equals an uninterrupted run.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from conftest import EXAMPLES, read_output, run_job
from keyscale.checkpoint.jobdir import JobDir
from keyscale.cli.main import main as keyscale_main
from keyscale.errors import KeyscaleError
from keyscale.sources import LocalLog, LogWriter, PartitionedLog, create_log
from keyscale.sources.reader import from_state

pytestmark = [pytest.mark.spark, pytest.mark.slow]

JOB = EXAMPLES / "log_count.py"
SCHEMA = "key string, value long"


def produce(log: PartitionedLog, rows: int, seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    df = pd.DataFrame({"key": [f"k{i}" for i in rng.integers(0, 60, rows)], "value": rng.integers(1, 100, rows)})
    LogWriter(log, ["key"]).write(pa.Table.from_pandas(df, preserve_index=False))
    return df


def totals(out: pd.DataFrame) -> pd.DataFrame:
    """Each key's final row (the running count only grows)."""
    return out.sort_values("count").groupby("key").tail(1).set_index("key")[["count", "sum"]].sort_index()


def expected(*frames: pd.DataFrame) -> pd.DataFrame:
    df = pd.concat(frames)
    return df.groupby("key").agg(count=("value", "size"), sum=("value", "sum")).sort_index()


class Assignments(dict[int, list[list[tuple[int, int]]]]):
    """The readers' committed partitions and offsets after each batch (retention keeps few manifests)."""

    def __init__(self, job: Path):
        super().__init__()
        self.jd = JobDir(job)

    def __bool__(self) -> bool:  # a callback, even while still empty
        return True

    def __call__(self, rec: Any) -> None:
        a = from_state(self.jd.read_manifest(rec.batch).operators["reader"].operator_state)
        assert a is not None
        self[rec.batch] = a


def partitions_of(a: list[list[tuple[int, int]]]) -> list[list[int]]:
    return [[p for p, _ in e] for e in a]


def check_offsets_only_grow(history: dict[int, list[list[tuple[int, int]]]]) -> None:
    seen: dict[int, int] = {}
    for _, a in sorted(history.items()):
        flat = [e for entries in a for e in entries]
        assert len({p for p, _ in flat}) == len(flat)  # no partition held twice
        for p, off in flat:
            assert off >= seen.get(p, 0)  # nothing read twice
            seen[p] = off


def test_flip8_live_scale_down_up_and_new_partitions(spark: Any, make_log: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = make_log(SCHEMA, 4)
    first = produce(log, 4000, seed=1)
    later: list[pd.DataFrame] = []
    jd = JobDir(tmp_path / "job")
    a = Assignments(tmp_path / "job")

    def during(rec: Any) -> None:
        a(rec)
        if rec.batch == 1:
            jd.request_rescale(1, "reader")  # 2 -> 1
        elif rec.batch == 3:
            jd.request_rescale(4, "reader")  # 1 -> 4
        elif rec.batch == 5:
            log.add_partitions(2)  # KP5, KP6 while running
            later.append(produce(log, 1500, seed=2))

    args = {"log": log.uri, "output": str(tmp_path / "out"), "max_records_per_batch": "200"}
    summary = run_job(JOB, tmp_path / "job", 2, args, on_batch=during)
    assert [(b, u, f, t) for b, u, f, t in summary.rescales] == [(2, "reader", 2, 1), (4, "reader", 1, 4)]

    assert partitions_of(a[0]) == [[0, 1], [2, 3]]  # S1: KP1, KP2; S2: KP3, KP4
    assert partitions_of(a[2]) == [[0, 1, 2, 3]]  # one reader holds all four...
    assert all(off > 0 for _, off in a[1][0] + a[1][1])
    assert partitions_of(a[4]) == [[0], [1], [2], [3]]  # ...then each reader one: none idles
    last = a[max(a)]
    assert sorted(p for e in last for p, _ in e) == [0, 1, 2, 3, 4, 5]  # the new partitions were picked up
    assert all(len(e) in (1, 2) for e in last)
    assert {p: off for e in last for p, off in e} == dict(enumerate(log.end_offsets()))  # read to the end
    check_offsets_only_grow(a)
    got = totals(read_output(tmp_path / "out"))
    pd.testing.assert_frame_equal(got, expected(first, *later), check_dtype=False)
    status = JobDir(tmp_path / "job").read_status()["operators"]["reader"]
    assert status["lag"] == 0 and len(status["readers"]) == 4
    assert keyscale_main(["status", str(tmp_path / "job")]) == 0
    shown = capsys.readouterr().out
    assert "operator 'reader': parallelism 4 (operator state), lag 0 records" in shown
    assert all(f"reader {i}: partition" in shown for i in range(4))


def test_flip8_across_savepoint_restores(spark: Any, make_log: Any, tmp_path: Path) -> None:
    log = make_log(SCHEMA, 4)
    batches = [produce(log, 1200, seed=3)]
    args = {"log": log.uri, "output": str(tmp_path / "out"), "max_records_per_batch": "150"}
    hist = {n: Assignments(tmp_path / f"job{n}p") for n in (2, 1, 4)}
    run_job(JOB, tmp_path / "job2p", 2, args, on_batch=hist[2])
    assert partitions_of(hist[2][0]) == [[0, 1], [2, 3]]
    assert keyscale_main(["savepoint", str(tmp_path / "job2p"), "--dest", str(tmp_path / "sp1")]) == 0
    batches.append(produce(log, 900, seed=4))
    run_job(JOB, tmp_path / "job1p", 1, args, from_savepoint=str(tmp_path / "sp1"), on_batch=hist[1])
    assert partitions_of(hist[1][min(hist[1])]) == [[0, 1, 2, 3]]
    assert min(hist[1]) == max(hist[2]) + 1  # the restored job goes on with the next batch
    assert keyscale_main(["savepoint", str(tmp_path / "job1p"), "--dest", str(tmp_path / "sp2")]) == 0
    batches.append(produce(log, 900, seed=5))
    run_job(JOB, tmp_path / "job4p", 4, args, from_savepoint=str(tmp_path / "sp2"), on_batch=hist[4])
    assert partitions_of(hist[4][min(hist[4])]) == [[0], [1], [2], [3]]
    check_offsets_only_grow({b: a for h in hist.values() for b, a in h.items()})
    # One output folder across the three runs: the batches continue, nothing is written twice.
    got = totals(read_output(tmp_path / "out"))
    pd.testing.assert_frame_equal(got, expected(*batches), check_dtype=False)


IDLE_JOB = '''
import keyscale as ks

NAME = "idle"


def build(ctx):
    idleness = ctx.args.get("idleness")
    return (
        ks.stream(ks.sources.log_source(ctx.arg("log"), uid="reader"))
        .with_watermark("ts", "0 seconds", idleness=idleness or None)
        .key_by("key")
        .window(ks.windows.TumblingWindows("10 seconds"))
        .aggregate(uid="counts", n=ks.aggregates.count())
        .sink(ks.sinks.ParquetSink(ctx.arg("output")))
    )
'''


@pytest.mark.parametrize("idleness", [None, "1 second"])
def test_an_idle_partition_holds_the_watermark_only_without_idleness(spark: Any, tmp_path: Path, idleness: str | None) -> None:
    import datetime as dt
    import textwrap
    import time

    job = tmp_path / "idle.py"
    job.write_text(textwrap.dedent(IDLE_JOB))
    log = create_log(tmp_path / "log", "key string, value long, ts timestamp", 2)
    t0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)

    def at(seconds: int) -> Any:
        return pa.array([t0 + dt.timedelta(seconds=seconds)], pa.timestamp("us", tz="UTC"))

    log.append(1, pa.table({"key": ["quiet"], "value": [1], "ts": at(5)}))  # partition 1 then falls silent
    log.append(0, pa.table({"key": ["busy"], "value": [1], "ts": at(5)}))

    def more(rec: Any) -> None:
        if rec.batch < 6:
            time.sleep(0.4)
            log.append(0, pa.table({"key": ["busy"], "value": [1], "ts": at(20 * (rec.batch + 1))}))

    args = {"log": str(tmp_path / "log"), "output": str(tmp_path / "out"), **({"idleness": idleness} if idleness else {})}
    run_job(job, tmp_path / "job", 1, args, on_batch=more, trigger_interval="200 milliseconds")
    jd = JobDir(tmp_path / "job")
    wm = jd.read_manifest(max(jd.manifest_batches())).watermark_ms
    quiet_ms = int((t0 + dt.timedelta(seconds=5)).timestamp() * 1000)
    if idleness is None:
        assert wm == quiet_ms - 1  # the quiet partition holds it back for good
    else:
        assert wm >= quiet_ms + 100_000  # partition 1 is idle: partition 0 alone moves it
        out = read_output(tmp_path / "out")
        assert set(out.key) == {"busy", "quiet"}  # windows fired


def test_a_job_run_until_idle_ends_after_all_its_inputs_went_idle(spark: Any, tmp_path: Path) -> None:
    """Once every input is idle the watermark follows the clock and so moved on each batch:
    a job run until idle never ended (CI hung 15 minutes on a slow machine, where the last
    busy partition fell idle before the run had seen an empty batch). It ends now, its
    windows fired, after at most one batch moved only by the clock."""
    import datetime as dt
    import textwrap
    import time

    job = tmp_path / "idle.py"
    job.write_text(textwrap.dedent(IDLE_JOB))
    log = create_log(tmp_path / "log", "key string, value long, ts timestamp", 2)
    t0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    for partition, key in enumerate(["a", "b"]):
        log.append(partition, pa.table({"key": [key], "value": [1], "ts": pa.array([t0], pa.timestamp("us", tz="UTC"))}))
    seen: list[int] = []

    def slow_then_count(rec: Any) -> None:
        seen.append(rec.batch)
        if rec.batch == 0:
            time.sleep(0.5)  # longer than the idleness: both inputs are idle from the next batch
        assert rec.batch < 10, "a job run until idle went on batch after batch"

    args = {"log": str(tmp_path / "log"), "output": str(tmp_path / "out"), "idleness": "200 milliseconds"}
    run_job(job, tmp_path / "job", 1, args, on_batch=slow_then_count, trigger_interval="100 milliseconds")
    assert len(seen) <= 3
    assert set(read_output(tmp_path / "out").key) == {"a", "b"}  # the clock fired their windows


def _shrink(log: PartitionedLog, partition: int, records: int) -> None:
    """Remove the last ``records`` of a partition, as a Redis failover to a replica that was behind does."""
    end = log.end_offsets()[partition]
    if isinstance(log, LocalLog):
        segments = sorted(log.path.glob(f"p-{partition:05d}/*.arrow"))
        while sum(int(s.stem.split("-")[1]) for s in segments) > end - records:
            segments.pop().unlink()
    else:
        import redis

        client = redis.Redis.from_url(log.uri.split("?")[0])
        key = f"keyscale:{{{log.name}}}:{partition}"
        kept: Any = client.xrange(key, "-", f"{end - records}-0")  # type: ignore[attr-defined]
        client.delete(key)
        for entry_id, fields in kept:
            client.xadd(key, fields, id=entry_id)
    assert log.end_offsets()[partition] < end


@pytest.mark.parametrize("how", ["shrunk", "recreated", "failover"])
def test_a_log_that_went_backwards_stops_the_job(spark: Any, make_log: Any, tmp_path: Path, how: str) -> None:
    """Issue 10, case 9: a partition whose end went back below the committed offset, or a log
    recreated at the same URI (even with more records), used to be read on from the old
    offsets: records skipped without a sign. So was a partition that lost records and got
    more than it lost (a Redis failover under load). Now the job stops and says what to do."""
    log = make_log(SCHEMA, 2)
    produce(log, 300, seed=1)
    produce(log, 300, seed=2)
    args = {"log": log.uri, "output": str(tmp_path / "out")}
    run_job(JOB, tmp_path / "job", 1, args)
    jd = JobDir(tmp_path / "job")
    done = jd.manifest_batches()
    committed = from_state(jd.read_manifest(max(done)).operators["reader"].operator_state)
    assert committed is not None
    if how == "shrunk":
        _shrink(log, 0, 50)
        want = rf"source 'reader': partition 0 of log .* ends at offset {log.end_offsets()[0]}, but the job has committed offset {committed[0][0][1]}"
    elif how == "failover":
        _shrink(log, 0, 50)
        produce(log, 1200, seed=4)  # the offsets grow past the committed ones again
        assert log.end_offsets()[0] > committed[0][0][1]
        want = rf"source 'reader': partition 0 of log .* holds another record at offset {committed[0][0][1] - 1} than the job read there"
    else:
        uri = log.uri
        if isinstance(log, LocalLog):
            shutil.rmtree(log.path)
        else:
            log.delete()
        log = create_log(uri, SCHEMA, 2)
        produce(log, 3000, seed=3)  # more than before: the offsets alone cannot tell
        want = r"source 'reader': log .* was recreated"
    with pytest.raises(KeyscaleError, match=want) as err:
        run_job(JOB, tmp_path / "job", 1, args)
    assert "--allow-non-restored-state" in str(err.value)
    assert jd.manifest_batches() == done  # nothing read, nothing committed
