"""A class-data-sharing archive of the Spark driver's classes, for the tests' JVMs.

The suite starts well over a hundred short-lived Spark drivers (each CLI run, each test
session) on a 2-core machine where it is CPU-bound; each spends most of its start loading
and verifying the same ~20,000 classes. A dynamic CDS archive (JDK 13+) made once from a
run that touches what the tests touch (a batch job, Python UDFs through Arrow, a streaming
query with ``foreachBatch``) lets every later JVM map them instead: the suite on a clean
clone took 24-27 minutes with it against 31 without (docs/getting-started.md; an ad-hoc timing of one
session start under the suite's load, not a benchmark: 15 s against 26 s).

The archive belongs to one JDK and one set of Spark jars; its name carries a digest of
both, so a change makes a new one. A JVM that cannot use it (another JDK) runs without it:
``-Xshare:auto`` is the default. Made once per virtualenv (it lives there: ``make clean``
drops it), under a file lock, so parallel test processes make it once.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

_QUIET = "-Xlog:cds=off -Xlog:cds+dynamic=off"  # CDS warns of every class it skips
# What the archive's run does: the classes the tests' drivers load.
_TRAINING = r"""
import sys, tempfile
from pathlib import Path
from pyspark.sql import SparkSession
tmp = Path(tempfile.mkdtemp())
s = SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false").getOrCreate()
df = s.range(2000).selectExpr("id", "cast(id % 7 as string) as key", "current_timestamp() as ts")
df.write.parquet(str(tmp / "in"))
def double(batches):
    for b in batches:
        yield b
s.read.parquet(str(tmp / "in")).repartition(2, "key").mapInArrow(double, df.schema).groupBy("key").count().collect()
q = (s.readStream.schema(df.schema).parquet(str(tmp / "in")).writeStream.trigger(availableNow=True)
     .option("checkpointLocation", str(tmp / "ckpt")).foreachBatch(lambda b, i: b.write.format("noop").mode("overwrite").save())
     .start())
q.awaitTermination()
s.stop()
"""


def _java() -> Path | None:
    home = os.environ.get("JAVA_HOME")
    found = Path(home) / "bin" / "java" if home else (Path(w) if (w := shutil.which("java")) else None)
    return found.resolve() if found and found.exists() else None


def _digest(java: Path) -> str:
    import pyspark

    jars = Path(pyspark.__file__).parent / "jars"
    h = hashlib.sha256(f"{java}:{java.stat().st_mtime_ns}:{pyspark.__version__}".encode())
    for jar in sorted(jars.glob("*.jar")):
        h.update(f"{jar.name}:{jar.stat().st_size}".encode())
    return h.hexdigest()[:16]


def ensure(base_opts: str) -> str | None:
    """The JVM options that use the archive (made now if missing), or None if it cannot be made."""
    java = _java()
    if java is None:
        return None
    archive = Path(sys.prefix) / f"keyscale-tests-{_digest(java)}.jsa"
    failed = archive.with_suffix(".failed")  # tried once: the other test processes do not try again
    use = f"-XX:SharedArchiveFile={archive} {_QUIET}"
    with open(Path(sys.prefix) / ".keyscale-tests-jsa.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if failed.exists():
            return None
        if not archive.exists():
            with tempfile.TemporaryDirectory() as tmp:
                made = Path(tmp) / "spark.jsa"
                env = {**os.environ, "SPARK_SUBMIT_OPTS": f"{base_opts} -XX:ArchiveClassesAtExit={made} {_QUIET}"}
                proc = subprocess.run([sys.executable, "-c", _TRAINING], env=env, capture_output=True, text=True, timeout=600)
                if proc.returncode != 0 or not made.exists():
                    failed.write_text(proc.stderr[-5000:])
                    sys.stderr.write(f"tests: no JVM class archive (the tests run without it): {proc.stderr[-500:]}\n")
                    return None
                shutil.move(str(made), archive)
    return use
