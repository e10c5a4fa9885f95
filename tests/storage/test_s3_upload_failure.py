"""A detached upload that failed leaves a record on the object store beside its file, and a
wait for the file ends at once (issue 32, case 9): the record works where the waiters are,
on S3 as on local disk."""

from __future__ import annotations

import time

import pytest

from keyscale.checkpoint.manifest import StateFile
from keyscale.checkpoint.uploads import record_upload_failure, wait_stored
from keyscale.errors import StateError
from keyscale.storage import open_store


def test_a_failed_upload_ends_the_wait_at_once_on_s3(s3_bucket: str) -> None:
    store = open_store(f"{s3_bucket}/job", "job directory")
    f = StateFile("state/op/000000000004-s00001-delta-abc.arrow", 4, "delta", 8, 15, 1, 1, 0)
    assert record_upload_failure(store, f.path, OSError("503 Slow Down"))
    started = time.monotonic()
    with pytest.raises(StateError, match=r"000000000004-s00001-delta-abc\.arrow of batch 4 was not stored: its upload failed \(OSError: 503 Slow Down\)"):
        wait_stored(store, [f], 600, "the commit of batch 4 waits for it")
    assert time.monotonic() - started < 10
