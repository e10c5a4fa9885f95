"""A state file damaged in place on an object store (same size, one byte changed: found by
bench/chaos.py --store s3) is never read as state: recovery there checks sizes only, so the
read checks the checksum, and the run that finds the damage reports it, so that the next start checks in full and falls back to an intact one, or refuses
when none is left (as on local disk)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from keyscale.checkpoint.encode import write_state_file
from keyscale.checkpoint.files import read_state_slice
from keyscale.checkpoint.jobdir import JobDir
from keyscale.checkpoint.manifest import Manifest, OperatorCheckpoint
from keyscale.errors import StateError
from keyscale.state.keygroups import KeyGroupRange
from keyscale.state.table import KG_COLUMN


def _flip(jd: JobDir, key: str) -> None:
    data = bytearray(jd.store.get(key))
    data[len(data) // 2] ^= 0x10
    jd.store.put(key, bytes(data))


@pytest.fixture(autouse=True)
def _spark_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEYSCALE_SPARK_CACHE", str(tmp_path / "spark"))  # recover() of a job on S3 keeps Spark's folder here


def test_a_byte_flipped_in_place_on_s3_is_refused_then_the_restart_falls_back(s3_bucket: str) -> None:
    jd = JobDir(f"{s3_bucket}/job")
    jd.claim("j", 8, 8)
    table = pa.table({"key": [f"k{i}" for i in range(50)], KG_COLUMN: pa.array([i % 8 for i in range(50)], pa.int32()),
                      "n": pa.array(range(50), pa.int64())}).sort_by(KG_COLUMN)
    files = []
    for b in range(3):
        f = write_state_file(jd.store, f"state/op/{b:012d}-s00000-snapshot-a.arrow", table, "snapshot", b, KeyGroupRange(0, 7))
        files.append(f)
        jd.commit(Manifest("j", b, b, {"op": OperatorCheckpoint("op", 8, 1, (), (), (f,))}))
    _flip(jd, files[2].path)

    # Sizes match, so recovery (sizes only on an object store) still picks checkpoint 2 ...
    assert jd.recover().manifest is not None and jd.recover().manifest.batch == 2  # type: ignore[union-attr]
    # ... but reading the file refuses it, naming it, instead of returning changed state.
    with pytest.raises(StateError, match=r"state file s3://.*000000000002-s00000-snapshot-a\.arrow is damaged \(checksum mismatch\)"):
        read_state_slice(jd.store, files[2], KeyGroupRange(0, 7))
    # The run that found it reports the damage: the next start checks in full and resumes from 1.
    jd.report_damage("state file ... is damaged (checksum mismatch)")
    rec = jd.recover()
    assert rec.manifest is not None and rec.manifest.batch == 1
    assert len(rec.discarded) == 1 and "checkpoint 2" in rec.discarded[0] and "checksum" in rec.discarded[0]
    assert jd.store.exists(jd.manifest_key(2) + ".damaged")
    assert read_state_slice(jd.store, files[1], KeyGroupRange(0, 7)).equals(table)
    assert jd.recover().manifest.batch == 1  # type: ignore[union-attr]  # the request is done with


def test_damage_in_the_only_checkpoint_on_s3_is_refused_not_an_empty_restart(s3_bucket: str) -> None:
    """With no intact checkpoint left the start refuses, as on local disk, instead of starting
    over with empty state because the damaged checkpoint was moved out of sight."""
    jd = JobDir(f"{s3_bucket}/job")
    jd.claim("j", 8, 8)
    table = pa.table({"key": ["a", "b"], KG_COLUMN: pa.array([1, 2], pa.int32()), "n": pa.array([1, 2], pa.int64())})
    f = write_state_file(jd.store, "state/op/000000000000-s00000-snapshot-a.arrow", table, "snapshot", 0, KeyGroupRange(0, 7))
    jd.commit(Manifest("j", 0, 0, {"op": OperatorCheckpoint("op", 8, 1, (), (), (f,))}))
    _flip(jd, f.path)
    jd.report_damage("state file ... is damaged (checksum mismatch)")
    for _ in range(2):  # and again: the refusal changes nothing
        with pytest.raises(StateError, match=r"no intact checkpoint is left.*checkpoint 0.*checksum.*--allow-empty-restart"):
            jd.recover()
    rec = jd.recover(allow_empty_restart=True)
    assert rec.empty_restart and rec.manifest is None
    assert not jd.store.exists("damage.json")
