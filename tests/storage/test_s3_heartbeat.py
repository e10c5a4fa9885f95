"""A job on an object store is seen running from the moment its heartbeat starts (before its
control API answers): found by bench/chaos.py --store s3, where `keyscale rescale` and
`keyscale stop` of a restarted job said "not running" until its first beat, 10 s later."""

from __future__ import annotations

import os
import socket
import time

from keyscale.checkpoint.jobdir import JobDir
from keyscale.runtime.driver.heartbeat import Heartbeat


def test_the_first_heartbeat_is_written_at_once(s3_bucket: str) -> None:
    jd = JobDir(f"{s3_bucket}/job")
    jd.claim("j", 8, 8)
    # The status a killed run left: running, but its process is gone.
    jd.write_status({"pid": 2**22 + 12345, "host": socket.gethostname(), "updated_ms": int(time.time() * 1000), "running": True})
    jd.lock()
    assert not JobDir(f"{s3_bucket}/job").is_running()
    beat = Heartbeat(jd, lambda: {"pid": os.getpid(), "updated_ms": int(time.time() * 1000)}, every=3600)
    try:
        other = JobDir(f"{s3_bucket}/job")  # another process's view (keyscale stop / rescale)
        assert other.is_running() and other.read_status()["pid"] == os.getpid()
    finally:
        beat.close()
