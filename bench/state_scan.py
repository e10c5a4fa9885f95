"""Full scans of keyed state (issue 37, item 2): the ``keyscale`` Spark data source reading
every key of a job directory's newest checkpoint, against ``read_keyed_state`` (the whole
state rebuilt in the driver) on the same checkpoint, in one run.

The job directory is bench/state_lookup.py's: N string keys with a ``count`` (long) and a
``recent`` (list of 2 longs) state, a snapshot per subtask, then ``--deltas`` deltas of 1%
of the keys each (0: the state just after a compaction, every key group one file).

Timed, ``--repeat`` times each (medians): the scan's parts read in this process without
Spark (``StateScan.read``, the tasks' work); ``df.count()`` of the data source after one
warm-up count (every row through Spark: Python data sources read no column subset); the same for
``read_keyed_state`` (with ``--compare``); and a single-key filter (its planned partitions
and time). Prints one JSON line: keys per second for each.

    .venv/bin/python bench/state_scan.py --keys 10000000 --deltas 0 --compare
    .venv/bin/python bench/state_scan.py --keys 10000000 --deltas 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from state_lookup import build

from keyscale.runtime.driver.session import spark_session
from keyscale.state_processor import read_keyed_state
from keyscale.state_processor.datasource import register
from keyscale.state_processor.scan import open_scan


def _median(fn: Any, repeat: int) -> tuple[float, Any]:
    times, out = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, default=1_000_000)
    ap.add_argument("--max-parallelism", type=int, default=128)
    ap.add_argument("-p", "--parallelism", type=int, default=4)
    ap.add_argument("--deltas", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--compare", action="store_true", help="also time read_keyed_state on the same checkpoint")
    ap.add_argument("--where", help="job directory to create (default: a temporary folder)")
    a = ap.parse_args()
    where = a.where or tempfile.mkdtemp(prefix="scan-bench-") + "/job"
    t0 = time.perf_counter()
    jd = build(where, a.keys, a.max_parallelism, a.parallelism, a.deltas)
    out: dict[str, Any] = {"keys": a.keys, "deltas": a.deltas, "max_parallelism": a.max_parallelism, "parallelism": a.parallelism,
                           "master": a.master, "build_s": round(time.perf_counter() - t0, 1)}
    scan = open_scan(where, "op", flatten=False)
    parts = scan.parts()
    out["partitions"] = len(parts)
    secs, rows = _median(lambda: sum(scan.read(p).num_rows for p in parts), a.repeat)
    assert rows == a.keys, rows
    out["arrow_read_s"] = round(secs, 2)
    out["arrow_read_keys_per_s"] = round(a.keys / secs)

    spark = spark_session(a.master)
    register(spark)  # a session gets the data source only when asked (keyscale.state_processor.datasource.register)
    df = spark.read.format("keyscale").option("uid", "op").option("flatten", "false").load(where)
    df.count()  # warm-up: the Python workers' first imports are not the scan's
    secs, rows = _median(df.count, a.repeat)
    assert rows == a.keys, rows
    out["datasource_count_s"] = round(secs, 2)
    out["datasource_keys_per_s"] = round(a.keys / secs)
    one = df.where("user = 'user-000000042'")
    secs, got = _median(one.collect, a.repeat)
    out["one_key"] = {"partitions": one.rdd.getNumPartitions(), "rows": len(got), "s": round(secs, 3)}
    if a.compare:
        secs, rows = _median(lambda: read_keyed_state(spark, where, "op", flatten=False).count(), a.repeat)
        assert rows == a.keys, rows
        out["read_keyed_state_s"] = round(secs, 2)
        out["read_keyed_state_keys_per_s"] = round(a.keys / secs)
        out["ratio_datasource_over_read_keyed_state"] = round(out["read_keyed_state_s"] / out["datasource_count_s"], 2)
    spark.stop()
    jd.store.delete_prefix("")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
