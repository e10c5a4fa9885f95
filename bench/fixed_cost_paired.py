"""Paired batches in one process (issue 35, item 2): odd batches the old way, even ones the new.

    PYTHONPATH=src .venv/bin/python bench/fixed_cost_paired.py readers 40   # reader tasks: Python RDD vs kept range
    PYTHONPATH=src .venv/bin/python bench/fixed_cost_paired.py aqe 40       # adaptive query execution on vs off
    PYTHONPATH=src .venv/bin/python bench/fixed_cost_paired.py py4j 10      # Py4J round trips per step, readers old vs new
    PYTHONPATH=src .venv/bin/python bench/fixed_cost_paired.py mapinarrow 40   # PySpark's mapInArrow vs keyscale/_spark_map.py

The job of bench/empty_batch.py (empty batches back to back). On a machine others load,
two variants measured in two runs differ by the load as much as by the change; here both
take turns batch by batch in one driver, so the load falls on both alike. ``readers``:
the odd batches build the reader tasks' input as before (``createDataFrame`` over a Python
RDD, made each batch); ``aqe``: the odd batches run with ``spark.sql.adaptive.enabled``
on; ``mapinarrow``: the odd batches plan each ``mapInArrow`` (readers, keyed stage, the
sink's write) with PySpark's own, the even ones with ``keyscale._spark_map``. Prints the medians of each side's batch and steps (after 5 warm-up batches); ``py4j``
counts the Py4J round trips of each step instead.
"""

from __future__ import annotations

import collections
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import empty_batch

from keyscale.runtime.batch import commit, source_plan, stages
from keyscale.runtime.driver.runner import JobRunner


def main() -> int:
    what, batches = sys.argv[1], int(sys.argv[2])
    new_rows = source_plan.reader_rows
    old = {"now": False}

    def rows(job: Any, n: int) -> Any:
        if old["now"]:
            spark = job.spark
            return spark.createDataFrame(spark.sparkContext.parallelize([(i,) for i in range(n)], n), "subtask int")
        return new_rows(job, n)

    if what in ("readers", "py4j"):
        source_plan.reader_rows = rows  # type: ignore[assignment]
    if what == "mapinarrow":
        from keyscale import _spark_map

        lean = _spark_map._context

        def context(sc: Any) -> Any:
            return _spark_map._Context(usable=False) if old["now"] else lean(sc)

        _spark_map._context = context  # type: ignore[assignment]
    calls = [0]
    per: dict[tuple[str, bool], list[int]] = collections.defaultdict(list)
    if what == "py4j":
        from py4j import clientserver

        send = clientserver.ClientServerConnection.send_command

        def counted(self: Any, command: str) -> Any:
            calls[0] += 1
            return send(self, command)

        clientserver.ClientServerConnection.send_command = counted  # type: ignore[method-assign]
        for mod, name in ((commit, "read_source"), (stages, "plan_stages"), (commit, "write_sinks"), (commit, "record")):
            f = getattr(mod, name)

            def wrapped(*a: Any, _f: Any = f, _name: str = name, **k: Any) -> Any:
                before = calls[0]
                try:
                    return _f(*a, **k)
                finally:
                    per[(_name, old["now"])].append(calls[0] - before)

            setattr(mod, name, wrapped)
    fix_intent = commit.fix_intent

    def turns(job: Any, df: Any, batch_id: int, drain: bool) -> Any:
        old["now"] = batch_id % 2 == 1
        if what == "aqe":
            job.spark.conf.set("spark.sql.adaptive.enabled", "true" if old["now"] else "false")
        before = calls[0]
        try:
            return fix_intent(job, df, batch_id, drain)
        finally:
            per[("fix_intent", old["now"])].append(calls[0] - before)

    commit.fix_intent = turns  # type: ignore[assignment]
    hist: list[dict[str, Any]] = []
    run = JobRunner.run

    def keep(self: JobRunner) -> Any:
        try:
            return run(self)
        finally:
            hist.extend(self.job.history.batches)

    JobRunner.run = keep  # type: ignore[method-assign]
    print(empty_batch.one(batches, 0, 5, "1 millisecond", 2))
    if what == "py4j":
        for (name, was_old), v in sorted(per.items()):
            print(f"{name} {'old' if was_old else 'new'}: median {statistics.median(v[2:] or v)} Py4J round trips ({v})")
        return 0
    for label, parity in (("old (odd batches)", 1), ("new (even batches)", 0)):
        hs = [h for h in hist if h["batch"] >= 5 and h["batch"] % 2 == parity]

        def med(k: str, hs: list[dict[str, Any]] = hs) -> float:
            return statistics.median(h["steps"][k] for h in hs)

        print(f"{what} {label}: {len(hs)} batches, batch {statistics.median(h['seconds'] for h in hs):.3f} s; "
              f"read {med('read'):.4f} s, plan {med('plan'):.4f} s, sink {med('sink'):.4f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
