"""What a Spark session costs keyscale: the session itself, then the ``keyscale`` data
source's registration (``keyscale.state_processor.register``, which job sessions no longer
make: docs/benchmarks.md, "A job's start"), split into Spark's part (the first Python data
source a JVM registers makes Spark look up every installed ``pyspark_*`` module in a Python
worker of its own) and keyscale's.

Each repeat is a new process (a new JVM), as a job's start is::

    .venv/bin/python bench/session_start.py --repeats 5

Phases, in one process: ``session`` (``SparkSession.builder...getOrCreate()`` with
keyscale's settings, ``session_conf("local[2]")``), ``spark lookup`` (the registration of a
trivial data source: Spark's lookup of installed data sources and its worker), ``keyscale
register`` (``keyscale.state_processor.register``: its modules' import, the pickled class,
the pushdown setting). Wall seconds, medians over the repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_ONE = r"""
import json, time
t0 = time.perf_counter()
from pyspark.sql import SparkSession
from pyspark.sql.datasource import DataSource
from keyscale.runtime.driver.session import session_conf
builder = SparkSession.builder.master("local[2]").appName("session-start")
for k, v in session_conf("local[2]").items():
    builder = builder.config(k, v)
spark = builder.getOrCreate()
t1 = time.perf_counter()

class Trivial(DataSource):
    @classmethod
    def name(cls):
        return "session_start_trivial"

spark.dataSource.register(Trivial)
t2 = time.perf_counter()
from keyscale.state_processor import register
register(spark)
t3 = time.perf_counter()
print("RESULT " + json.dumps({"session": t1 - t0, "spark lookup": t2 - t1, "keyscale register": t3 - t2}), flush=True)
spark.stop()
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    runs = []
    for i in range(args.repeats):
        proc = subprocess.run([sys.executable, "-c", _ONE], cwd=ROOT, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            sys.exit(f"session_start: repeat {i + 1} failed:\n{proc.stderr[-2000:]}")
        runs.append(json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:]))
        print(f"repeat {i + 1}: " + ", ".join(f"{k} {v:.2f} s" for k, v in runs[-1].items()), flush=True)
    print("medians: " + ", ".join(f"{k} {statistics.median(r[k] for r in runs):.2f} s" for k in runs[0]))


if __name__ == "__main__":
    main()
