"""A Spark standalone cluster on this machine, and the executors a job gets from it.

* :mod:`keyscale.cluster.local`: start a master and workers from the PySpark install
  (``start_cluster``, ``add_worker``, ``stop_worker``, ``stop_cluster``, ``cluster_status``);
  ``keyscale cluster ...`` on the command line (:mod:`keyscale.cluster.cli`).
  ``start_cluster(..., isolated=True)`` runs the workers as another Unix user that cannot
  read the driver's private files (:mod:`keyscale.cluster.isolation`).
* :mod:`keyscale.cluster.executors`: in a running Spark application, its executor cores
  (``executor_cores``), asking for a number of executors (``request_executors``), and the
  conf a keyscale job needs on such a cluster (``spark_conf_for_cluster``).

>>> from keyscale.cluster import spark_conf_for_cluster
>>> spark_conf_for_cluster()["spark.executor.cores"]
'1'
"""

from keyscale.cluster.executors import (
    UNLIMITED,
    executor_cores,
    executor_ids,
    is_loopback_master,
    request_executors,
    spark_conf_for_cluster,
    wait_for_executor_cores,
)
from keyscale.cluster.local import (
    ClusterInfo,
    ClusterStatus,
    WorkerInfo,
    WorkerStatus,
    add_worker,
    cluster_status,
    read_cluster,
    spark_home,
    start_cluster,
    stop_cluster,
    stop_worker,
)

__all__ = [
    "UNLIMITED",
    "ClusterInfo",
    "ClusterStatus",
    "WorkerInfo",
    "WorkerStatus",
    "add_worker",
    "cluster_status",
    "executor_cores",
    "executor_ids",
    "is_loopback_master",
    "read_cluster",
    "request_executors",
    "spark_conf_for_cluster",
    "spark_home",
    "start_cluster",
    "stop_cluster",
    "stop_worker",
    "wait_for_executor_cores",
]
