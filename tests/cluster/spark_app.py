"""A Spark application on a keyscale cluster, driven line by line over stdin/stdout (tests only).

Run as ``python spark_app.py MASTER_URL``: it connects with :func:`spark_conf_for_cluster`,
prints ``{"ready": true}`` and then answers one JSON line per JSON command line:

* ``{"op": "cores"}`` -> ``{"cores": N, "ids": [...]}``
* ``{"op": "wait", "cores": N, "timeout": S}`` -> ``{"ok": bool, "seconds": s, "cores": N}``
* ``{"op": "hold", "cores": N, "seconds": S}`` -> ``{"ok": bool, "cores": N}``: N the whole time
* ``{"op": "job"}`` -> ``{"ok": true, "sum": ..., "groups": ..., "seconds": s}``
* ``{"op": "request", "total": N}`` -> ``{"ok": bool}``
* ``{"op": "stop"}`` -> stops the session and exits

It runs in its own process because a test process may already hold a local SparkContext.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("KEYSCALE_SPARK_LOG_LEVEL", "ERROR")

from keyscale.cluster.executors import (
    executor_cores,
    executor_ids,
    request_executors,
    spark_conf_for_cluster,
)
from keyscale.runtime.driver.session import spark_session


def reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main(master: str) -> None:
    spark = spark_session(master, app_name="keyscale-cluster-test", conf=spark_conf_for_cluster())
    sc = spark.sparkContext
    reply({"ready": True, "app_id": sc.applicationId})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        start = time.monotonic()
        if op == "cores":
            reply({"cores": executor_cores(spark), "ids": executor_ids(spark)})
        elif op == "wait":
            ok = False
            while time.monotonic() - start < cmd["timeout"]:
                if executor_cores(spark) == cmd["cores"]:
                    ok = True
                    break
                time.sleep(0.05)
            reply({"ok": ok, "seconds": round(time.monotonic() - start, 2), "cores": executor_cores(spark)})
        elif op == "hold":
            ok = True
            while time.monotonic() - start < cmd["seconds"]:
                if executor_cores(spark) != cmd["cores"]:
                    ok = False
                    break
                time.sleep(0.1)
            reply({"ok": ok, "cores": executor_cores(spark)})
        elif op == "job":
            total = sc.parallelize(range(1000), 4).map(lambda x: x * x).sum()
            groups = spark.range(0, 10_000, numPartitions=4).selectExpr("id % 7 AS k").groupBy("k").count().count()
            reply({"ok": True, "sum": total, "groups": groups, "seconds": round(time.monotonic() - start, 2)})
        elif op == "request":
            reply({"ok": request_executors(spark, cmd["total"])})
        elif op == "stop":
            spark.stop()
            reply({"stopped": True})
            return
        else:
            reply({"error": f"unknown op {op!r}"})


if __name__ == "__main__":
    main(sys.argv[1])
