"""The executors of a running Spark application: how many cores it has, and asking for more or fewer.

How it works on Spark 4.3 standalone (measured with ``keyscale cluster`` on 127.0.0.1, 1-core
workers, 512m executors, a shared 2-core machine; see ``tests/cluster``):

* **Dynamic allocation off, ``spark.executor.cores`` set, ``spark.cores.max`` unset**
  (:func:`spark_conf_for_cluster`). The master gives the application every free core, one
  executor per ``spark.executor.cores`` cores, and keeps doing so as workers join, with
  nothing asked: ``add_worker`` returns 2-5 s after it is called (worker JVM start and
  registration) and the application has an executor there 3-5 s later (executor JVM
  start). A worker that goes away takes its executors with it, and the driver drops them
  at once because their connections close: within 0.1 s of a SIGKILL of the worker's
  process group, under 1 s for an orderly stop. (A host that vanishes without closing
  connections would take ``spark.network.timeout``.) Jobs submitted afterwards run on the
  executors that are left.
* **Fewer executors:** ``SparkContext.killExecutors(ids)`` (through py4j) stops those
  executors and lowers the application's executor target, so the master does not replace
  them; the driver has dropped them about 1 s later. That needs
  ``spark.standalone.executorRemoveDelayOnDisconnection=1s`` (set by
  :func:`spark_conf_for_cluster`): with the default 5 s the driver keeps a disconnected
  executor 5 s waiting for the master to say why it left. ``requestTotalExecutors(n)``
  alone never removes an executor.
* **More executors:** ``SparkContext.requestTotalExecutors(n, 0, {})`` sets the
  application's executor limit at the master to ``n``; the master launches executors on
  free cores up to it (2-5 s for one) and keeps launching as cores free up or workers join,
  until the application has ``n``. Before any request the limit is unbounded; after one it
  stays ``n``, so a joining worker adds nothing beyond it. :data:`UNLIMITED` restores "take
  every core".
* **Dynamic allocation on** (with ``shuffleTracking``, as standalone needs without an
  external shuffle service) was tried and not chosen: executors come only after tasks
  have been pending for ``schedulerBacklogTimeout`` and then ramp up (a 4-task job on two
  free 1-core workers got its second executor ~7 s in); executors holding data of a live
  shuffle are not released before ``shuffleTracking.timeout`` (default: never), which in a
  streaming job that shuffles every batch means rarely; and ``killExecutors`` is refused
  ("unsupported with Dynamic Allocation turned on"). It also makes cores follow pending
  tasks, while reactive scaling makes parallelism follow cores: each would wait for the
  other.

:func:`executor_cores` reads the scheduler backend's core count
(``CoarseGrainedSchedulerBackend.totalCoreCount``): it is updated synchronously when an
executor registers or is removed, counts exactly the task slots the scheduler uses
(``defaultParallelism`` is derived from it), excludes the driver, needs no web UI (keyscale
runs with ``spark.ui.enabled=false``, so the REST API at ``uiWebUrl/api/v1/...`` is not
there) and costs one py4j call. ``getExecutorMemoryStatus`` lists executors but not their
cores; the status store (what the REST API serves) has cores but is filled asynchronously
by the listener bus. It is the fallback.

>>> conf = spark_conf_for_cluster(cores_per_executor=2)
>>> conf["spark.executor.cores"], conf["spark.dynamicAllocation.enabled"], "spark.cores.max" in conf
('2', 'false', False)
"""

from __future__ import annotations

import ipaddress
import logging
import time
from typing import Any

from keyscale.errors import ClusterError

__all__ = [
    "UNLIMITED",
    "executor_cores",
    "executor_ids",
    "is_loopback_master",
    "request_executors",
    "sizes_executors",
    "spark_conf_for_cluster",
    "wait_for_executor_cores",
]

log = logging.getLogger("keyscale.cluster")

UNLIMITED = 2**31 - 1
"""``request_executors(spark, UNLIMITED)``: every core the cluster offers, as before any request."""


def sizes_executors(master: str) -> bool:
    """Whether keyscale asks Spark for executors under ``master``: a cluster manager whose
    scheduler backend takes ``requestTotalExecutors`` / ``killExecutors`` (standalone,
    Kubernetes, YARN); not ``local[...]``, whose one executor is the driver.

    >>> [sizes_executors(m) for m in ("spark://h:7077", "k8s://https://api:6443", "yarn", "local[2]")]
    [True, True, True, False]
    """
    return master.startswith(("spark://", "k8s://")) or master == "yarn"


def is_loopback_master(master: str) -> bool:
    """Whether the standalone master URL ``master`` names this machine's loopback only.

    ``spark://127.0.0.1:P``, ``spark://localhost:P``, any ``127.x.y.z``, ``[::1]``; with
    several masters (``spark://h1:p1,h2:p2``) all of them must be.

    >>> is_loopback_master("spark://localhost:7077"), is_loopback_master("spark://[::1]:7077")
    (True, True)
    >>> is_loopback_master("spark://10.0.0.5:7077"), is_loopback_master("spark://127.0.0.1:1,node2:2")
    (False, False)
    >>> is_loopback_master("local[2]")
    False
    """
    if not master.startswith("spark://"):
        return False
    hosts = []
    for hp in master[len("spark://") :].split(","):
        host = hp.rsplit(":", 1)[0] if hp.count(":") == 1 or hp.startswith("[") else hp
        hosts.append(host.strip("[]").lower())
    for host in hosts:
        if host == "localhost":
            continue
        try:
            if not ipaddress.ip_address(host).is_loopback:
                return False
        except ValueError:
            return False
    return bool(hosts)


def spark_conf_for_cluster(
    cores_per_executor: int = 1,
    memory_per_executor: str = "512m",
    *,
    master: str | None = None,
    driver_host: str | None = None,
) -> dict[str, str]:
    """Spark conf for a keyscale job on a standalone cluster (pass it to ``spark_session``).

    Executors of ``cores_per_executor`` cores and ``memory_per_executor`` heap (small: the
    machine is shared; a worker fits ``its memory / memory_per_executor`` of them); dynamic
    allocation off and ``spark.cores.max`` unset, so the application takes every core offered,
    including those of workers that join later (see the module docstring for why); no
    locality wait, so a new executor gets tasks in the next batch; a disconnected executor
    dropped after 1 s instead of 5 (a released executor is gone sooner; the price: if the
    master's word on why an executor left comes later than that, a task that was running
    there counts as a task failure).

    The driver's host (``spark.driver.host`` and ``spark.driver.bindAddress``: where the
    executors connect back to) is ``driver_host`` if given; else 127.0.0.1 when ``master``
    is on this machine's loopback (:func:`is_loopback_master`: a ``keyscale cluster``,
    whose executors are local and reach the driver there whatever the machine's hostname
    resolves to); else not set, so Spark picks this machine's address as usual (a remote
    master's executors could not reach a driver on 127.0.0.1). ``keyscale run --conf``
    can set both.

    >>> spark_conf_for_cluster(memory_per_executor="1g")["spark.executor.memory"]
    '1g'
    >>> spark_conf_for_cluster(master="spark://localhost:7077")["spark.driver.bindAddress"]
    '127.0.0.1'
    >>> "spark.driver.host" in spark_conf_for_cluster(master="spark://spark-master.example:7077")
    False
    >>> spark_conf_for_cluster(cores_per_executor=0)
    Traceback (most recent call last):
    ...
    keyscale.errors.ClusterError: cores per executor must be at least 1, got 0
    """
    if cores_per_executor < 1:
        raise ClusterError(f"cores per executor must be at least 1, got {cores_per_executor}")
    conf = {
        "spark.executor.cores": str(cores_per_executor),
        "spark.executor.memory": memory_per_executor,
        "spark.dynamicAllocation.enabled": "false",
        "spark.locality.wait": "0s",
        "spark.standalone.executorRemoveDelayOnDisconnection": "1s",
    }
    if driver_host is None and master is not None and is_loopback_master(master):
        driver_host = "127.0.0.1"
    if driver_host is not None:
        conf["spark.driver.host"] = conf["spark.driver.bindAddress"] = driver_host
    return conf


def _backend(spark: Any) -> Any:
    return spark.sparkContext._jsc.sc().schedulerBackend()


def _is_local(backend: Any) -> bool:
    return str(backend.getClass().getSimpleName()) == "LocalSchedulerBackend"


def executor_cores(spark: Any) -> int:
    """Total cores of the executors the application has now, the driver excluded.

    In local mode the driver *is* the executor: ``local[N]`` gives ``N``.

    >>> from keyscale.runtime.driver.session import spark_session    # doctest: +SKIP
    >>> executor_cores(spark_session("spark://127.0.0.1:41393", conf=spark_conf_for_cluster()))  # doctest: +SKIP
    1
    """
    backend = _backend(spark)
    if _is_local(backend):
        return int(backend.totalCores())
    try:
        value = backend.totalCoreCount()
        return int(value if isinstance(value, int) else value.get())
    except Exception:  # a backend without the field: ask the status store
        store = spark.sparkContext._jsc.sc().statusStore()
        it = store.executorList(True).iterator()
        total = 0
        while it.hasNext():
            e = it.next()
            if str(e.id()) != "driver":
                total += int(e.totalCores())
        return total


def executor_ids(spark: Any) -> list[str]:
    """Ids of the application's executors now (none in local mode), oldest first.

    >>> executor_ids(spark)  # doctest: +SKIP
    ['0', '2']
    """
    sc = spark.sparkContext
    if _is_local(_backend(spark)):
        return []
    ids = sc._jvm.scala.jdk.javaapi.CollectionConverters.asJava(sc._jsc.sc().getExecutorIds())
    return sorted((str(i) for i in ids), key=lambda s: (len(s), s))


def _busy_executors(spark: Any) -> set[str]:
    """Executors running a task now (best effort: empty if the status store cannot say)."""
    try:
        it = spark.sparkContext._jsc.sc().statusStore().executorList(True).iterator()
        busy = set()
        while it.hasNext():
            e = it.next()
            if int(e.activeTasks()) > 0:
                busy.add(str(e.id()))
        return busy
    except Exception:
        return set()


def request_executors(spark: Any, total: int) -> bool:
    """Ask Spark for ``total`` executors in all; ``True`` if the scheduler accepted the request.

    Asynchronous: watch :func:`executor_cores` (or use :func:`wait_for_executor_cores`) for
    the effect. Fewer executors than now: idle ones (then the newest) are killed, and the
    application's executor target drops so the master does not replace them. More:
    the master's limit for the application is raised to ``total`` and executors are
    launched on free cores as they appear. Either way the limit is ``total`` afterwards
    (:data:`UNLIMITED`: no limit). Returns ``False`` (and does nothing) in local mode and
    with dynamic allocation on, where Spark does not take such requests.

    >>> request_executors(spark, 2)  # doctest: +SKIP
    True
    """
    if total < 0:
        raise ClusterError(f"the number of executors must be 0 or more, got {total}")
    sc = spark.sparkContext
    backend = _backend(spark)
    if _is_local(backend):
        log.warning("request_executors: local mode has no executors to request")
        return False
    if sc.getConf().get("spark.dynamicAllocation.enabled", "false").lower() == "true":
        log.warning("request_executors: dynamic allocation manages this application's executors")
        return False
    jsc = sc._jsc.sc()
    jvm = sc._jvm
    ok = True
    ids = executor_ids(spark)
    if total < len(ids):
        busy = _busy_executors(spark)
        # Idle executors first, then the newest: the oldest have the warmest caches.
        order = sorted(ids, key=lambda i: (i in busy, -int(i) if i.isdigit() else 0))
        victims = jvm.java.util.ArrayList()
        for i in order[: len(ids) - total]:
            victims.add(i)
        ok = bool(jsc.killExecutors(jvm.scala.jdk.javaapi.CollectionConverters.asScala(victims).toSeq()))
    # The limit at the master, exactly: killExecutors lowers it by what it killed, which
    # is only right if it was exact before.
    empty = jvm.org.apache.spark.api.python.PythonUtils.toScalaMap(jvm.java.util.HashMap())
    return bool(jsc.requestTotalExecutors(total, 0, empty)) and ok


def wait_for_executor_cores(spark: Any, cores: int, timeout: float = 60.0, *, at_least: bool = False) -> float:
    """Wait until the application has exactly (or ``at_least``) ``cores`` executor cores.

    Returns the seconds waited; :class:`ClusterError` after ``timeout`` seconds.

    >>> wait_for_executor_cores(spark, 2, timeout=30)  # doctest: +SKIP
    3.1
    """
    start = time.monotonic()
    while True:
        have = executor_cores(spark)
        if have == cores or (at_least and have >= cores):
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            want = f"at least {cores}" if at_least else str(cores)
            raise ClusterError(f"the application has {have} executor cores, not {want}, after {timeout:.0f} s")
        time.sleep(0.1)
