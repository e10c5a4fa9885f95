"""A state file damaged in place on an object store (same size, one byte changed: found by
bench/chaos.py --store s3) is never read as state: recovery there checks sizes only, so the
read checks the checksum, and the run that finds the damage sets the checkpoints using the
file aside, so that the restart falls back to an intact one (as on local disk)."""

from __future__ import annotations

import pyarrow as pa
import pytest

from keyscale.checkpoint.files import read_state_slice, write_state_file
from keyscale.checkpoint.jobdir import JobDir
from keyscale.checkpoint.manifest import Manifest, OperatorCheckpoint
from keyscale.errors import StateError
from keyscale.state.keygroups import KeyGroupRange
from keyscale.state.table import KG_COLUMN

pytestmark = [pytest.mark.s3]


def _flip(jd: JobDir, key: str) -> None:
    data = bytearray(jd.store.get(key))
    data[len(data) // 2] ^= 0x10
    jd.store.put(key, bytes(data))


def test_a_byte_flipped_in_place_on_s3_is_refused_then_its_checkpoint_set_aside(s3_bucket: str) -> None:
    jd = JobDir(f"{s3_bucket}/job")
    jd.claim("j", 8, 8)
    jd.lock()
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
    # The run that found it sets checkpoint 2 aside; the restart resumes from 1.
    why = jd.set_aside_damaged()
    assert len(why) == 1 and "checkpoint 2" in why[0] and "checksum" in why[0]
    assert jd.store.exists(jd.manifest_key(2) + ".damaged")
    assert jd.recover().manifest.batch == 1  # type: ignore[union-attr]
    assert read_state_slice(jd.store, files[1], KeyGroupRange(0, 7)).equals(table)
    assert jd.set_aside_damaged() == ()  # the newest left is intact: nothing more set aside
    jd.unlock()
