"""The Spark session keyscale runs a job in, and the Spark settings it gets.

:func:`session_conf` is the whole rule, without Spark: keyscale's defaults
(:data:`SESSION_DEFAULTS`), then on a standalone master (``spark://``) those of
:func:`keyscale.cluster.spark_conf_for_cluster`, then the user's settings
(``keyscale run --conf NAME=VALUE``), which always win.

>>> conf = session_conf("spark://10.1.2.3:7077", {"spark.sql.shuffle.partitions": "8"})
>>> conf["spark.sql.shuffle.partitions"], "spark.driver.host" in conf, conf["spark.executor.cores"]
('8', False, '1')
>>> session_conf("spark://127.0.0.1:7077")["spark.driver.host"]
'127.0.0.1'
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from keyscale.errors import KeyscaleError

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from keyscale._steps import JobGraph

log = logging.getLogger("keyscale")

__all__ = ["SESSION_DEFAULTS", "check_classic", "missing_keyscale", "parse_spark_conf", "session_conf", "spark_session", "user_session"]

SESSION_DEFAULTS: dict[str, str] = {
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.shuffle.partitions": "2",
    "spark.sql.execution.arrow.maxRecordsPerBatch": "200000",
    "spark.python.worker.reuse": "true",
    "spark.sql.streaming.forceDeleteTempCheckpointLocation": "true",
    "spark.hadoop.mapreduce.fileoutputcommitter.marksuccessfuljobs": "false",
    "spark.driver.memory": "2g",
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.adaptive.enabled": "false",
}
"""What keyscale sets on every session unless the user's conf says otherwise (docs/reference/spark-settings.md)."""


def parse_spark_conf(items: Iterable[str], option: str = "--conf") -> dict[str, str]:
    """``NAME=VALUE`` items (``keyscale run --conf``) as a dict; a later item wins over an earlier one.

    The value is everything after the first ``=`` (it may hold ``=`` and spaces); the name
    may not be empty or hold spaces. A bad item is a :class:`KeyscaleError` naming it.

    >>> parse_spark_conf(["spark.executor.memory=1g", "spark.executor.extraJavaOptions=-Da=b -Dc=d"])
    {'spark.executor.memory': '1g', 'spark.executor.extraJavaOptions': '-Da=b -Dc=d'}
    >>> parse_spark_conf(["spark.executor.memory"])
    Traceback (most recent call last):
    ...
    keyscale.errors.KeyscaleError: --conf 'spark.executor.memory' must look like NAME=VALUE (a Spark setting, e.g. spark.executor.memory=1g)
    """
    out: dict[str, str] = {}
    for item in items:
        name, eq, value = item.partition("=")
        name = name.strip()
        if not eq or not name or any(c.isspace() for c in name):
            raise KeyscaleError(f"{option} {item!r} must look like NAME=VALUE (a Spark setting, e.g. spark.executor.memory=1g)")
        out[name] = value
    return out


def session_conf(master: str, user_conf: Mapping[str, str] | None = None) -> dict[str, str]:
    """Every Spark setting keyscale gives a session for ``master``: its defaults, then ``user_conf``.

    On a standalone master (``spark://...``) the defaults include
    :func:`~keyscale.cluster.spark_conf_for_cluster`'s, which pin the driver to 127.0.0.1
    only when the master is on this machine's loopback. ``local[...]`` masters get
    :data:`SESSION_DEFAULTS` alone. The user's settings always win.

    >>> session_conf("local[2]", {"spark.ui.enabled": "true"})["spark.ui.enabled"]
    'true'
    """
    conf = dict(SESSION_DEFAULTS)
    if master.startswith("spark://"):
        from keyscale.cluster.executors import spark_conf_for_cluster

        conf.update(spark_conf_for_cluster(master=master))
    conf.update(user_conf or {})
    return conf


def spark_session(master: str = "local[2]", app_name: str = "keyscale", conf: Mapping[str, str] | None = None) -> SparkSession:
    """A Spark session configured for keyscale (or the active one, reconfigured).

    Its settings are :func:`session_conf` of ``master`` and ``conf``. Python workers run
    this interpreter (unless ``PYSPARK_PYTHON`` says otherwise), so they import the same
    keyscale and pyarrow.

    It does not register the ``keyscale`` data source: Spark's lookup of installed Python
    data sources, which the first registration in a JVM starts, costs about 2.9 s of a job's
    start (docs/benchmarks.md, "A job's start"); :func:`keyscale.state_processor.register`
    is the one call that adds it.

    When it starts Spark's JVM (no session in this process yet) and ``KEYSCALE_CLASS_ARCHIVE``
    is set, the JVM maps that class archive (:mod:`keyscale.classarchive`).
    """
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    settings = session_conf(master, conf)
    if SparkContext._gateway is None and "PYSPARK_GATEWAY_PORT" not in os.environ:  # else the JVM runs already (spark-submit)
        from keyscale.classarchive import class_archive_conf

        settings = class_archive_conf(settings)
    builder = SparkSession.builder.master(master).appName(app_name)
    for k, v in settings.items():
        builder = builder.config(k, v)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel(os.environ.get("KEYSCALE_SPARK_LOG_LEVEL", "ERROR"))
    return spark


def check_classic(obj: object) -> None:
    """Refuse a Spark Connect session or DataFrame: keyscale drives Spark from the driver's
    JVM in this process (the tasks' reports, the executors, the plan), which a Connect
    client does not have.

    >>> class DataFrame: ...
    >>> DataFrame.__module__ = "pyspark.sql.connect.dataframe"
    >>> check_classic(DataFrame())
    Traceback (most recent call last):
    ...
    keyscale.errors.KeyscaleError: keyscale needs a classic SparkSession, with Spark's driver in this Python process; this DataFrame is of a Spark Connect session (SparkSession.builder.remote(...) or SPARK_REMOTE): create the session with SparkSession.builder.getOrCreate(), or run the job with `keyscale run`
    """
    if type(obj).__module__.startswith("pyspark.sql.connect."):
        what = "session" if type(obj).__name__ == "SparkSession" else type(obj).__name__
        raise KeyscaleError(
            f"keyscale needs a classic SparkSession, with Spark's driver in this Python process; this {what} is of a Spark Connect "
            "session (SparkSession.builder.remote(...) or SPARK_REMOTE): create the session with SparkSession.builder.getOrCreate(), "
            "or run the job with `keyscale run`")


def user_session(pipeline: JobGraph) -> SparkSession:
    """The caller's own session, for a pipeline built on it (the Python API).

    keyscale changes none of its settings. One thing it fills in when the user left it
    unset: on a ``local`` master, Python workers run this interpreter (``sys.executable``)
    rather than whatever ``python3`` is first on the PATH, which in a notebook or an IDE is
    often not the environment keyscale is installed in. ``PYSPARK_PYTHON`` or
    ``spark.pyspark.python``, if set, win; on a cluster, set one of them (docs/guides/notebook.md).
    """
    from pyspark.sql import DataFrame, SparkSession

    src = pipeline.source
    spark = src.sparkSession if isinstance(src, DataFrame) else SparkSession.getActiveSession()
    if spark is None:
        raise KeyscaleError("no active SparkSession: create one (SparkSession.builder.getOrCreate()) before starting the job")
    check_classic(spark)
    sc = spark.sparkContext
    chosen = os.environ.get("PYSPARK_PYTHON") or sc.getConf().get("spark.pyspark.python")
    if not chosen and str(sc.master).startswith("local"):
        sc.pythonExec = sys.executable
        log.info("Python workers run %s (the driver's interpreter; set PYSPARK_PYTHON or spark.pyspark.python to choose)", sys.executable)
    return spark


def missing_keyscale(error_text: str, python: str) -> str | None:
    """The one-line explanation of a task failure that is Python workers without keyscale.

    >>> missing_keyscale("... ModuleNotFoundError: No module named 'keyscale' ...", "python3")
    "Spark's Python workers (python3) cannot import keyscale: set spark.pyspark.python (or PYSPARK_PYTHON) to the Python that has keyscale installed, e.g. .config('spark.pyspark.python', sys.executable) on a single machine"
    >>> missing_keyscale("ValueError: bad", "python3") is None
    True
    """
    if "No module named 'keyscale'" not in error_text:
        return None
    return (f"Spark's Python workers ({python}) cannot import keyscale: set spark.pyspark.python (or PYSPARK_PYTHON) to the "
            "Python that has keyscale installed, e.g. .config('spark.pyspark.python', sys.executable) on a single machine")


def crashed_worker(error_text: str) -> str | None:
    """The one-line explanation of a task failure that is a Python worker dying under it.

    >>> crashed_worker("SparkException: Python worker exited unexpectedly (crashed). Consider ...")[:44]
    'a Python worker died while running a task of'
    >>> crashed_worker("SparkException: EOFException occurred while reading the port number from pyspark.daemon's stdout")[:44]
    'a Python worker died while running a task of'
    >>> crashed_worker("ValueError: bad") is None
    True
    """
    if "Python worker exited unexpectedly (crashed)" in error_text:
        spark_said = "Python worker exited unexpectedly"
    elif "reading the port number from pyspark.daemon" in error_text:  # the daemon that forks the workers died
        spark_said = "no port number from pyspark.daemon"
    else:
        return None
    return (f"a Python worker died while running a task of the batch (Spark: {spark_said}); most often the "
            "operating system killed it for lack of memory (check the executors' memory, or dmesg). Nothing is lost: the next "
            "start replays the batch")
