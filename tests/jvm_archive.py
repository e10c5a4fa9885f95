"""The class archive of Spark's driver classes that the tests' JVMs start with.

The suite starts well over a hundred short-lived Spark drivers (each CLI run, each test
session) on a 2-core machine where it is CPU-bound; each spends most of its start loading
and verifying the same ~20,000 classes. keyscale's own class archive
(:mod:`keyscale.classarchive`, ``keyscale class-archive``) lets every later
JVM map them instead: the suite on a clean clone took 24-27 minutes with an archive against
31 without (docs/getting-started.md). The tests pass it through ``SPARK_SUBMIT_OPTS``
rather than ``KEYSCALE_CLASS_ARCHIVE``, so that the sessions they start without keyscale
(Spark's own baselines, spark-submit runs) map it too.

The archive belongs to one JDK and one set of Spark jars; its name carries a digest of
keyscale's stamp of both, so a change makes a new one. Made once per virtualenv (it lives
there: ``make clean`` drops it), under a file lock, so parallel test processes make it once.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import sys
from pathlib import Path

from keyscale.classarchive import create_archive, current_stamp
from keyscale.errors import KeyscaleError

_QUIET = "-Xlog:cds=off -Xlog:cds+dynamic=off"  # CDS warns of every class it skips


def ensure() -> str | None:
    """The JVM options that use the archive (made now if missing), or None if it cannot be made."""
    try:
        stamp = current_stamp()
    except KeyscaleError:  # no java: the tests that need one fail on their own
        return None
    archive = Path(sys.prefix) / f"keyscale-tests-{hashlib.sha256(json.dumps(stamp.to_wire()).encode()).hexdigest()[:16]}.jsa"
    failed = archive.with_suffix(".failed")  # tried once: the other test processes do not try again
    with open(Path(sys.prefix) / ".keyscale-tests-jsa.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if failed.exists():
            return None
        if not archive.exists():
            try:
                create_archive(str(archive), progress=lambda _said: None)
            except KeyscaleError as e:
                failed.write_text(str(e))
                sys.stderr.write(f"tests: no JVM class archive (the tests run without it): {e}\n")
                return None
    return f"-XX:SharedArchiveFile={archive} {_QUIET}"
