"""Class archives for the JVMs keyscale starts: the classes a JVM's start loads, read once
and mapped by every later start (Java's application class-data sharing).

Most of a job's first ten seconds are Spark's JVM finding, reading and verifying the
thousands of classes a session, a streaming query and its first batch need. A JVM started
with ``-XX:SharedArchiveFile`` maps them from one file instead. ``keyscale class-archive
PATH`` makes that file by running a small keyed job in a JVM that writes the classes it
loaded when it exits (``-XX:ArchiveClassesAtExit``, a dynamic archive, Java 13+); with
``KEYSCALE_CLASS_ARCHIVE=PATH`` set, every session keyscale starts
(:func:`keyscale.runtime.driver.session.spark_session`: ``keyscale run``, so also a restart
in a new process and a deployment's runs) starts its JVM with it. Measured in docs/benchmarks.md, "A job's start
with a class archive".

An archive is only good for the Java and the Spark jars it was made with (the JVM checks
the class path it was made on, and ignores an archive that does not match with one line of
warning). So keyscale keeps their fingerprint beside it (``PATH.json``, a
:class:`ArchiveStamp`) and refuses an archive made for another Java or Spark, naming both,
rather than start slower without saying so. That archive is for the driver's JVM: in local
mode that is all of Spark. A cluster's executors have another class path (their worker's
conf folder first): ``keyscale cluster start --class-archive`` makes them one of their own
(:func:`create_executor_archive`, kept in the cluster's folder; :mod:`keyscale.cluster.local`).

The archive's option goes into ``spark.driver.defaultJavaOptions`` (Spark puts it before
``spark.driver.extraJavaOptions``, which stays the user's), after any value the user gave
it with ``--conf`` or in ``spark-defaults.conf``:

>>> archive_java_options({"spark.driver.memory": "2g"}, "/c/spark.jsa")["spark.driver.defaultJavaOptions"]
'-XX:SharedArchiveFile=/c/spark.jsa'
>>> archive_java_options({"spark.driver.defaultJavaOptions": "-Dx=1"}, "/c/spark.jsa")["spark.driver.defaultJavaOptions"]
'-Dx=1 -XX:SharedArchiveFile=/c/spark.jsa'
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from keyscale.errors import KeyscaleError

__all__ = [
    "ARCHIVE_ENV", "STAMP_VERSION", "ArchiveStamp", "archive_java_options", "archive_problems", "class_archive_conf",
    "create_archive", "create_executor_archive", "current_stamp",
]

ARCHIVE_ENV = "KEYSCALE_CLASS_ARCHIVE"
"""The environment variable naming the archive keyscale's sessions start their JVM with."""

#: The version :meth:`ArchiveStamp.to_wire` writes.
STAMP_VERSION = 1

_JAVA_OPTIONS = "spark.driver.defaultJavaOptions"


@dataclass(frozen=True)
class ArchiveStamp:
    """What an archive was made for (``PATH.json``): written by ``keyscale class-archive``,
    read by every later start, possibly of a newer keyscale.

    >>> s = ArchiveStamp(java="/usr/lib/jvm/17/bin/java", jvm="21e6d8-1745000000", spark_jars="/v/pyspark/jars", jars="ab12",
    ...                  conf_dir="/v/pyspark/conf")
    >>> ArchiveStamp.from_wire(s.to_wire(), "x.json") == s
    True
    >>> ArchiveStamp.from_wire({"v": 2}, "x.json")
    Traceback (most recent call last):
    ...
    keyscale.errors.KeyscaleError: x.json has class archive stamp version 2, this keyscale reads version 1: make the archive again with `keyscale class-archive`
    """

    java: str  # the java executable Spark starts (its real path)
    jvm: str  # size and modification time of its libjvm.so: an update in place changes them
    spark_jars: str  # the folder of Spark's jars, the class path the archive was made on
    jars: str  # a hash of the names and sizes of the jars in it
    conf_dir: str  # Spark's conf folder, first on that class path

    def to_wire(self) -> dict[str, Any]:
        return {"v": STAMP_VERSION, **asdict(self)}

    @staticmethod
    def from_wire(d: Mapping[str, Any], where: str) -> ArchiveStamp:
        version = d.get("v")
        if version != STAMP_VERSION:
            raise KeyscaleError(f"{where} has class archive stamp version {version}, this keyscale reads version {STAMP_VERSION}: "
                                "make the archive again with `keyscale class-archive`")
        try:
            return ArchiveStamp(java=str(d["java"]), jvm=str(d["jvm"]), spark_jars=str(d["spark_jars"]), jars=str(d["jars"]),
                                conf_dir=str(d["conf_dir"]))
        except KeyError as e:
            raise KeyscaleError(f"{where} is not a class archive stamp (no {e.args[0]!r})") from None

    def differences(self, other: ArchiveStamp) -> list[str]:
        """What ``other`` (this machine's) has that this stamp (the archive's) does not, in words.

        >>> a = ArchiveStamp(java="/j17", jvm="1-2", spark_jars="/a/jars", jars="x", conf_dir="/a/conf")
        >>> a.differences(ArchiveStamp(java="/j17", jvm="1-2", spark_jars="/b/jars", jars="y", conf_dir="/a/conf"))
        ["Spark's jars in /b/jars (the archive: /a/jars)", "other Spark jars in /b/jars than the archive's"]
        """
        out = []
        if self.java != other.java:
            out.append(f"Java {other.java} (the archive: {self.java})")
        elif self.jvm != other.jvm:
            out.append(f"another build of Java {other.java} than the archive's")
        if self.spark_jars != other.spark_jars:
            out.append(f"Spark's jars in {other.spark_jars} (the archive: {self.spark_jars})")
        if self.jars != other.jars:
            out.append(f"other Spark jars in {other.spark_jars} than the archive's")
        if self.conf_dir != other.conf_dir:
            out.append(f"Spark's conf folder {other.conf_dir} (the archive: {self.conf_dir})")
        return out


def _java() -> Path:
    """The java Spark's launcher starts: ``$JAVA_HOME/bin/java``, else the first on the PATH."""
    home = os.environ.get("JAVA_HOME")
    found = str(Path(home) / "bin" / "java") if home else shutil.which("java")
    if not found or not Path(found).exists():
        raise KeyscaleError("no java found (JAVA_HOME, or java on the PATH): Spark needs one")
    return Path(found).resolve()


def _spark_jars() -> Path:
    from pyspark.find_spark_home import _find_spark_home

    return Path(_find_spark_home()).resolve() / "jars"


def _conf_dir() -> Path:
    """Spark's conf folder for a JVM started from here: ``$SPARK_CONF_DIR``, else ``$SPARK_HOME/conf``."""
    return Path(os.environ.get("SPARK_CONF_DIR") or _spark_jars().parent / "conf").resolve()


def current_stamp(conf_dir: Path | None = None) -> ArchiveStamp:
    """This machine's Java and Spark jars, as an archive made here now would be stamped
    (``conf_dir``: the conf folder of the JVMs it is for; default: a driver's started from here)."""
    java = _java()
    libjvm = next(iter(sorted(java.parent.parent.glob("lib/*/libjvm.so"))), None)
    jvm = "unknown" if libjvm is None else f"{libjvm.stat().st_size}-{int(libjvm.stat().st_mtime)}"
    jars = _spark_jars()
    listing = "\n".join(f"{p.name}:{p.stat().st_size}" for p in sorted(jars.glob("*.jar")))
    return ArchiveStamp(java=str(java), jvm=jvm, spark_jars=str(jars), jars=hashlib.sha256(listing.encode()).hexdigest()[:16],
                        conf_dir=str((conf_dir or _conf_dir()).resolve()))


def _stamp_path(archive: Path) -> Path:
    return archive.with_name(archive.name + ".json")


def archive_problems(archive: Path, conf_dir: Path | None = None) -> list[str]:
    """Why ``archive`` would not serve a JVM started here (with ``conf_dir``), in words; empty if it would."""
    stamp = _stamp_path(archive)
    if not archive.is_file() or not stamp.is_file():
        return [f"no class archive there (or no {stamp.name} beside it)"]
    made_for = ArchiveStamp.from_wire(json.loads(stamp.read_text()), str(stamp))
    return made_for.differences(current_stamp(conf_dir))


def _spark_defaults(name: str) -> str | None:
    """``name``'s value in Spark's ``spark-defaults.conf`` (``$SPARK_CONF_DIR``, else
    ``$SPARK_HOME/conf``), which a ``--conf`` of the same name would replace."""
    path = _conf_dir() / "spark-defaults.conf"
    if not path.is_file():
        return None
    for line in path.read_text().splitlines():  # java.util.Properties' forms: "key value", "key=value", "key: value"
        m = re.match(r"\s*([^\s=:#!]+)\s*[=:\s]\s*(.*)$", line)
        if m and m[1] == name:
            return m[2].strip()
    return None


def archive_java_options(conf: Mapping[str, str], archive: str) -> dict[str, str]:
    """``conf`` with the JVM option that maps ``archive``, after the user's own default Java options."""
    theirs = conf.get(_JAVA_OPTIONS, "")
    return {**conf, _JAVA_OPTIONS: f"{theirs} -XX:SharedArchiveFile={archive}".strip()}


def class_archive_conf(conf: Mapping[str, str], env: Mapping[str, str] = os.environ) -> dict[str, str]:
    """``conf`` for a JVM keyscale starts: with ``KEYSCALE_CLASS_ARCHIVE``'s archive when it
    is set (checked against this machine's Java and Spark), else unchanged."""
    name = env.get(ARCHIVE_ENV)
    if not name:
        return dict(conf)
    archive = Path(name).resolve()
    if not archive.is_file() or not _stamp_path(archive).is_file():
        raise KeyscaleError(f"{ARCHIVE_ENV}={name}: no class archive there (or no {_stamp_path(archive).name} beside it): make "
                            f"one with `keyscale class-archive {name}`, or unset {ARCHIVE_ENV}")
    wrong = archive_problems(archive)
    if wrong:
        raise KeyscaleError(f"{ARCHIVE_ENV}={name} was made for another Java or Spark than this job's: this one has "
                            f"{'; '.join(wrong)}. Make it again with `keyscale class-archive {name}`, or unset {ARCHIVE_ENV}")
    if _JAVA_OPTIONS not in conf and (defaults := _spark_defaults(_JAVA_OPTIONS)):
        conf = {**conf, _JAVA_OPTIONS: defaults}
    return archive_java_options(conf, str(archive))


# The job an archive is made from: a session as keyscale configures it, a streaming file
# source, a keyed aggregate at parallelism 2 and a Parquet sink, two batches. The JVM that
# writes the archive is the driver's or (on a standalone master, with one executor) the
# executor's, by the Spark setting given; it writes it as it exits, and its own log says
# when the archive is whole ("Written dynamic archive"). A JVM stopped from outside may be
# killed while it writes (a standalone worker kills an executor 10 s after asking it to
# stop, at an application's end): so each ends by itself. The driver's exits when Spark's
# gateway sees its stdin close; the executor is decommissioned (SIGPWR, with
# spark.decommission.enabled), which makes it exit once idle, after the application's
# executor limit went to 0 so that the master starts no other in its place.
_WORKLOAD = r"""
import os, signal, sys, time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from pyspark import SparkContext

import keyscale as ks
from keyscale.classarchive import _executors_writing
from keyscale.runtime.driver.session import spark_session

work, archive, master, option = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
(work / "in").mkdir()
for i in range(2):
    keys = [f"key-{(i * 7 + j) % 50}" for j in range(1000)]
    pq.write_table(pa.table({"key": keys, "value": list(range(1000))}), work / "in" / f"part-{i}.parquet")
conf = {option: f"-XX:ArchiveClassesAtExit={archive} -Xlog:cds+dynamic=info:file={work}/cds-%p.log"}
executor = master.startswith("spark://")
if executor:
    conf.update({"spark.cores.max": "1", "spark.decommission.enabled": "true"})  # one executor writes the archive
spark = spark_session(master, "keyscale-class-archive", conf)
events = spark.readStream.schema("key string, value long").option("maxFilesPerTrigger", 1).parquet(str(work / "in"))
job = (ks.stream(events).key_by("key")
       .aggregate(uid="totals", count=ks.aggregates.count(), total=ks.aggregates.sum("value"))
       .sink(ks.sinks.ParquetSink(str(work / "out"))))
job.start(str(work / "job"), 2, until_idle=True).await_termination()
if executor:
    sc = spark.sparkContext
    jvm = sc._jvm
    sc._jsc.sc().requestTotalExecutors(0, 0, jvm.org.apache.spark.api.python.PythonUtils.toScalaMap(jvm.java.util.HashMap()))
    pids = _executors_writing(Path(archive))
    for pid in pids:
        os.kill(pid, signal.SIGPWR)
    deadline = time.monotonic() + 240
    while _executors_writing(Path(archive)) and time.monotonic() < deadline:
        time.sleep(0.2)
gateway = SparkContext._gateway.proc
spark.stop()
gateway.stdin.close()
gateway.wait(timeout=300)
"""

# What the JVM's log (-Xlog:cds+dynamic) says once the archive's last byte is written.
_WRITTEN = "Written dynamic archive"


def _executors_writing(archive: Path) -> list[int]:
    """The executors on this machine that are to write ``archive`` as they exit (their JVM
    still runs)."""
    needle = f"-XX:ArchiveClassesAtExit={archive}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                line = (proc / "cmdline").read_bytes()
            except OSError:  # gone meanwhile, or not ours to read
                continue
            # The driver's command line names the executors' option too (a --conf): the JVM
            # that writes has it as an argument of its own.
            if needle in line.split(b"\0") and b"CoarseGrainedExecutorBackend" in line:
                found.append(int(proc.name))
    return found


def _make(target: Path, master: str, option: str, stamp: ArchiveStamp, what: str, progress: Callable[[str], None]) -> Path:
    # SPARK_SUBMIT_OPTS reaches the driver's JVM only; the other two every JVM started from here.
    for var in ("SPARK_SUBMIT_OPTS", "JDK_JAVA_OPTIONS", "JAVA_TOOL_OPTIONS")[0 if option == _JAVA_OPTIONS else 1:]:
        if "-XX:SharedArchiveFile" in os.environ.get(var, ""):
            raise KeyscaleError(f"{var} gives Spark's JVM a class archive already (-XX:SharedArchiveFile), and a JVM cannot "
                                f"write one on top of another: make the class archive without it in {var}")
    target.parent.mkdir(parents=True, exist_ok=True)
    progress(f"making a class archive of {what} in {target}: a small keyed job runs, then the JVM writes the "
             "classes it loaded (about a minute)")
    started = time.monotonic()
    env = {k: v for k, v in os.environ.items() if k != ARCHIVE_ENV}
    with tempfile.TemporaryDirectory(prefix="keyscale-class-archive-", dir=target.parent) as tmp:
        written = Path(tmp) / "archive.jsa"
        proc = subprocess.run([sys.executable, "-c", _WORKLOAD, tmp, str(written), master, option], env=env,
                              capture_output=True, text=True)
        logs = [p.read_text(errors="replace") for p in Path(tmp).glob("cds-*.log")]
        whole = [text for text in logs if _WRITTEN in text]
        if proc.returncode != 0 or len(whole) != 1 or not written.is_file():
            # The JVM says why it would not start on stdout; Python's traceback ends stderr.
            said = [line for line in proc.stdout.splitlines() if line.strip() and "[warning]" not in line][-5:]
            why = "" if proc.returncode != 0 else f" (the JVM's log says the archive was written whole {len(whole)} times, not once)"
            tail = "\n".join([*said, *proc.stderr.strip().splitlines()[-5:]])
            raise KeyscaleError(f"the class archive's job failed (exit {proc.returncode}){why}; nothing written to {target}:\n{tail}")
        stamp_file = Path(tmp) / "stamp.json"
        stamp_file.write_text(json.dumps(stamp.to_wire(), indent=1) + "\n")
        os.replace(written, target)
        os.replace(stamp_file, _stamp_path(target))
    progress(f"class archive written ({target.stat().st_size / 1e6:,.0f} MB, {time.monotonic() - started:.0f} s)")
    return target


def _say(line: str) -> None:
    print(f"keyscale: {line}", flush=True)


def create_archive(path: str, progress: Callable[[str], None] = _say) -> Path:
    """Make the class archive of a driver's JVM at ``path`` (and its stamp, ``path.json``): run
    the small job in a child process whose JVM writes the archive as it exits, then move it
    into place.

    A running job keeps the archive it mapped; a job starting while this runs sees the old
    archive or the new one, never half of one (both files are moved into place whole).
    """
    target = Path(path).resolve()
    _make(target, "local[2]", _JAVA_OPTIONS, current_stamp(), "Spark's driver JVM", progress)
    progress(f"start jobs with {ARCHIVE_ENV}={target} to use it")
    return target


def create_executor_archive(path: Path, master: str, conf_dir: Path, progress: Callable[[str], None]) -> Path:
    """Make the class archive of the executors of the standalone cluster at ``master`` (whose
    workers' conf folder is ``conf_dir``) at ``path``: the small job runs with one executor,
    which is then decommissioned and writes the archive as it exits, before the job's
    application ends."""
    return _make(path.resolve(), master, "spark.executor.extraJavaOptions", current_stamp(conf_dir), "Spark's executor JVMs", progress)
