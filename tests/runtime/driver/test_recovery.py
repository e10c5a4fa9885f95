"""Damaged checkpoints: keyscale falls back to the newest intact one, says so, and Spark
replays the batches after it, so nothing is lost and nothing is written twice."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from conftest import EXAMPLES, RUNNING_COUNT, read_output, run_job, write_events
from keyscale.checkpoint.jobdir import JobDir
from keyscale.checkpoint.manifest import restore_files

EVENTS = {"files": 4, "rows": 1500, "keys": 200, "seed": 3}
REFERENCE = {"parallelism": 2}


def _damage_manifest(jd: JobDir) -> str:
    path = (jd.path / jd.manifest_key(jd.manifest_batches()[-1]))
    path.write_text(path.read_text()[:100])  # a torn write
    return path.name


def _delete_state_file(jd: JobDir) -> str:
    m = jd.latest_manifest()
    assert m is not None
    f = max(m.operators["totals"].files, key=lambda f: f.batch)
    (jd.path / f.path).unlink()
    return f.path


def _flip_state_byte(jd: JobDir) -> str:
    m = jd.latest_manifest()
    assert m is not None
    f = max(m.operators["totals"].files, key=lambda f: f.batch)
    p = jd.path / f.path
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p.write_bytes(bytes(data))
    return f.path


@pytest.mark.parametrize("damage", [_damage_manifest, _delete_state_file, _flip_state_byte])
def test_damaged_latest_checkpoint_falls_back(damage: Any, spark: Any, events: Path, reference: pd.DataFrame, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    args = {"input": str(events), "output": str(tmp_path / "out")}
    run_job(RUNNING_COUNT, tmp_path / "job", 2, args)
    jd = JobDir(tmp_path / "job")
    assert jd.manifest_batches()[-1] == 3
    damage(jd)
    caplog.set_level("INFO", logger="keyscale")
    summary = run_job(RUNNING_COUNT, tmp_path / "job", 2, args)
    assert summary.recovered_from == 2
    assert len(summary.discarded) == 1 and "checkpoint 3" in summary.discarded[0]
    assert "checkpoint 3" in caplog.text and "set it aside" in caplog.text
    assert "resuming job 'running_count' from checkpoint 2 (the newer ones were damaged)" in caplog.text
    assert [b.batch for b in summary.batches] == [3]  # Spark replayed the lost batch
    out = read_output(tmp_path / "out")
    assert not out.duplicated(["batch", "key"]).any()
    pd.testing.assert_frame_equal(out, reference)


# -- a damaged file that several checkpoints share; none left ------------------------------------


def _totals(out: pd.DataFrame) -> pd.DataFrame:
    """Each key's totals: its output row with the largest count."""
    last = out.sort_values(["key", "count"]).groupby("key").tail(1)
    return last[["key", "count", "sum"]].sort_values("key").reset_index(drop=True).astype({"count": "int64", "sum": "int64"})


def _recount(events: Path) -> pd.DataFrame:
    df = pd.concat([pd.read_parquet(p) for p in sorted(events.glob("part-*.parquet"))])
    g = df.groupby("key")["value"].agg(["count", "sum"]).reset_index()
    return g.sort_values("key").reset_index(drop=True).astype({"count": "int64", "sum": "int64"})


def _flip(jd: JobDir, rel: str) -> None:
    p = jd.path / rel
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p.write_bytes(bytes(data))


def _file_of_batch(jd: JobDir, batch: int, subtask_start: int = 0) -> str:
    m = jd.latest_manifest()
    assert m is not None
    return next(f.path for f in m.operators["totals"].files if f.batch == batch and f.start == subtask_start)


# With asynchronous checkpoints, each replayed batch must be committed before the next is
# replayed: batch 1's files appear 2 s after its tasks end (a slow upload), and a replay
# that went on without waiting skipped batch 2.
@pytest.mark.parametrize("asynchronous", [False, True], ids=["", "async-checkpoints"])
def test_a_damaged_file_several_checkpoints_share_replays_every_batch_after_the_intact_one(
    asynchronous: bool, spark: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    events = tmp_path / "events"
    write_events(events, files=4, rows=1500, keys=400, seed=11)
    args = {"input": str(events), "output": str(tmp_path / "out")}
    run_job(RUNNING_COUNT, tmp_path / "job", 2, args, async_checkpoints=asynchronous)
    jd = JobDir(tmp_path / "job")
    # --retain 3, and 0: the fallback kept for when checkpoint 3's oldest files are compacted
    assert jd.manifest_batches() == [0, 1, 2, 3]
    _flip(jd, _file_of_batch(jd, 1))  # checkpoints 1, 2 and 3 use it
    write_events(events, files=1, rows=1500, keys=400, seed=11, first=4)
    caplog.set_level("INFO", logger="keyscale")
    summary = run_job(RUNNING_COUNT, tmp_path / "job", 2, args, async_checkpoints=asynchronous, fault="slow-upload:1" if asynchronous else None)
    assert summary.recovered_from == 0
    assert len(summary.discarded) == 3
    assert [b.batch for b in summary.batches] == [1, 2, 3, 4]  # every batch after the fallback, then the new one
    assert "replaying batches 1 to 2 one at a time" in caplog.text
    out = read_output(tmp_path / "out")
    assert not out.duplicated(["batch", "key"]).any()
    pd.testing.assert_frame_equal(_totals(out), _recount(events))


def test_no_intact_checkpoint_left_refuses_to_start_then_restarts_empty_when_allowed(spark: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from keyscale.errors import StateError

    events = tmp_path / "events"
    write_events(events, files=3, rows=1000, keys=300, seed=12)
    args = {"input": str(events), "output": str(tmp_path / "out")}
    run_job(RUNNING_COUNT, tmp_path / "job", 2, args, retain=1)
    jd = JobDir(tmp_path / "job")
    kept = [jd.read_manifest(b) for b in jd.manifest_batches()]
    used_by_all = set.intersection(*({f.path for f in m.operators["totals"].files} for m in kept))
    damaged = sorted(used_by_all)[0]  # a young job: its first files are in every checkpoint
    _flip(jd, damaged)
    with pytest.raises(StateError, match="--allow-empty-restart") as e:
        run_job(RUNNING_COUNT, tmp_path / "job", 2, args, retain=1)
    assert damaged in str(e.value) and "no intact checkpoint" in str(e.value)
    assert jd.manifest_batches() == [m.batch for m in kept]  # nothing changed: the same refusal at the next try
    assert not jd.is_running()

    caplog.set_level("INFO", logger="keyscale")
    again = {**args, "output": str(tmp_path / "out2")}
    summary = run_job(RUNNING_COUNT, tmp_path / "job", 2, again, retain=1, allow_empty_restart=True)
    assert summary.recovered_from is None
    assert "starts again with empty state and reads its input again from the beginning" in caplog.text
    assert list(tmp_path.joinpath("job").glob("spark.set-aside-*"))
    pd.testing.assert_frame_equal(_totals(read_output(tmp_path / "out2")), _recount(events))


def test_with_speculative_execution_every_checkpoint_verifies_and_output_is_exactly_once(spark: Any, events: Path, reference: pd.DataFrame, tmp_path: Path) -> None:
    # Spark never runs a speculative copy on a host where an attempt runs, so on one machine
    # this shows the settings change nothing; two attempts of one subtask are tested without
    # Spark (tests/runtime/test_task.py, test_two_attempts_...).
    conf = {"spark.speculation": "true", "spark.speculation.quantile": "0.1", "spark.speculation.multiplier": "1.1", "spark.speculation.interval": "50ms"}
    args = {"input": str(events), "output": str(tmp_path / "out")}
    run_job(RUNNING_COUNT, tmp_path / "job", 2, args, spark_conf=conf)
    jd = JobDir(tmp_path / "job")
    for b in jd.manifest_batches():
        assert jd.check_manifest(b)[1] is None
    out = read_output(tmp_path / "out")
    assert not out.duplicated(["batch", "key"]).any()
    pd.testing.assert_frame_equal(out, reference)


def test_log_source_deep_fallback_replays_from_intents_and_empty_restart_reads_from_offset_0(spark: Any, tmp_path: Path) -> None:
    import numpy as np
    import pyarrow as pa

    from keyscale.errors import StateError
    from keyscale.sources import LogWriter, create_log

    log = create_log(tmp_path / "log", "key string, value long", 2)
    rng = np.random.default_rng(7)
    frames = []

    def produce(rows: int) -> None:
        df = pd.DataFrame({"key": [f"k{i}" for i in rng.integers(0, 80, rows)], "value": rng.integers(1, 100, rows)})
        LogWriter(log, ["key"]).write(pa.Table.from_pandas(df, preserve_index=False))
        frames.append(df)

    def expected() -> pd.DataFrame:
        df = pd.concat(frames)
        g = df.groupby("key")["value"].agg(["count", "sum"]).reset_index()
        return g.sort_values("key").reset_index(drop=True).astype({"count": "int64", "sum": "int64"})

    job = EXAMPLES / "log_count.py"
    produce(1200)
    args = {"log": str(tmp_path / "log"), "output": str(tmp_path / "out"), "max_records_per_batch": "150"}
    # No snapshot in these ~10 batches (a small state is snapshotted at batches 16, 32, ...):
    # the job's first deltas stay in every checkpoint's restore.
    chain = {"max_chain": 16}
    run_job(job, tmp_path / "job", 2, args, **chain)
    jd = JobDir(tmp_path / "job")
    newest = jd.manifest_batches()[-1]
    assert newest >= 4
    # A delta the newest three checkpoints share: the fallback is two or more batches back.
    _flip(jd, _file_of_batch(jd, newest - 2))
    produce(300)
    summary = run_job(job, tmp_path / "job", 2, args, **chain)
    assert summary.recovered_from is not None and summary.recovered_from < newest - 2
    assert [b.batch for b in summary.batches][:3] == list(range(summary.recovered_from + 1, summary.recovered_from + 4))
    pd.testing.assert_frame_equal(_totals(read_output(tmp_path / "out")), expected())

    kept = [jd.read_manifest(b).operators["totals"] for b in jd.manifest_batches()]
    shared = set.intersection(*({f.path for f in restore_files(op.files, op.max_parallelism)} for op in kept))
    assert shared  # a young job: its first files are in every checkpoint's restore
    _flip(jd, sorted(shared)[0])
    with pytest.raises(StateError, match="--allow-empty-restart"):
        run_job(job, tmp_path / "job", 2, args, **chain)
    again = {**args, "output": str(tmp_path / "out2")}
    run_job(job, tmp_path / "job", 2, again, allow_empty_restart=True, **chain)
    pd.testing.assert_frame_equal(_totals(read_output(tmp_path / "out2")), expected())  # every record read again
