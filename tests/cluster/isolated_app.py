"""A Spark application that probes what its tasks can see (tests only).

Run as ``python isolated_app.py MASTER_URL PATH``: it runs two jobs on the cluster and
prints one JSON line:

* ``compute``: a task that only computes, reporting who it runs as:
  ``{"sum": ..., "uid": ..., "user": ..., "tmp": ..., "home": ...}``;
* ``read``: a task that opens ``PATH`` (a file in the driver's private folder):
  ``{"ok": true, "text": ...}`` if it could, else ``{"ok": false, "error": "PermissionError", "message": ...}``.

It runs in its own process because a test process may already hold a local SparkContext.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("KEYSCALE_SPARK_LOG_LEVEL", "ERROR")

from keyscale.runtime.driver.session import spark_session


def who(values: Any) -> Any:
    import getpass
    import tempfile

    total = sum(values)
    yield {"sum": total, "uid": os.getuid(), "user": getpass.getuser(), "tmp": tempfile.gettempdir(),
           "home": os.environ.get("HOME")}


def read(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            return {"ok": True, "text": f.read()}
    except OSError as e:
        return {"ok": False, "error": type(e).__name__, "message": str(e)}


def main(master: str, path: str) -> None:
    spark = spark_session(master, app_name="keyscale-isolation-test")
    sc = spark.sparkContext
    compute = sc.parallelize(range(100), 2).mapPartitions(who).collect()
    probe = sc.parallelize([path], 1).map(read).collect()
    print(json.dumps({"driver_uid": os.getuid(), "compute": compute, "read": probe[0]}), flush=True)
    spark.stop()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
