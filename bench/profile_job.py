"""Where a suite job's batch time goes (issue 12, item 2): driver, Spark, keyscale's Python tasks.

    PYTHONPATH=src .venv/bin/python bench/profile_job.py --job running_count --files 6 --rows 200000 --keys 100000

Runs one job of bench/suite.py in this process with ``KEYSCALE_PROFILE_DIR`` set
(keyscale.runtime.task.profiling): every subtask in its Python worker and every batch on the
driver writes a cProfile file. Prints per batch: wall time, the Spark job's time (the
sink write, which runs the tasks), the driver's own time (the rest: intent, planning,
manifest, retention), and the keyed tasks' busy time (summed over subtasks); then the top
functions of the tasks (steady batches) and of the driver, by own time.
"""

from __future__ import annotations

import argparse
import logging
import os
import pstats
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


class _BatchLines(logging.Handler):
    """Keeps the driver's "batch N committed in X s (Spark job Y s)" figures."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[tuple[int, float, float]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if str(record.msg).startswith("batch %d committed in"):
            args: Any = record.args
            self.batches.append((int(args[0]), float(args[1]), float(args[2])))


def _stats(files: list[Path]) -> pstats.Stats | None:
    if not files:
        return None
    st = pstats.Stats(str(files[0]), stream=sys.stdout)
    for f in files[1:]:
        st.add(str(f))
    return st


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", default="running_count")
    ap.add_argument("--files", type=int, default=6)
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--keys", type=int, default=100_000)
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="ks-profile-"))
    prof = tmp / "prof"
    prof.mkdir()
    os.environ["KEYSCALE_PROFILE_DIR"] = str(prof)  # before Spark starts: its Python workers inherit it
    import suite

    lines = _BatchLines()
    logging.getLogger("keyscale").addHandler(lines)
    logging.getLogger("keyscale").setLevel(logging.INFO)
    data = suite.make_input(tmp, a.files, a.rows, a.keys)
    run = suite.keyscale(a.job, data, tmp / "run")

    tasks = sorted(prof.glob("task-*.prof"), key=lambda p: p.stat().st_mtime)
    busy = {f: pstats.Stats(str(f)).total_tt for f in tasks}  # type: ignore[attr-defined]
    print(f"job {a.job}: {a.files} batches x {a.rows:,} rows, {a.keys:,} string keys, -p 2 (wall {run['wall_seconds']:.1f} s)")
    print("batch  wall s  spark s  driver s")
    for b, wall, spark_s in lines.batches:
        print(f"{b:5d}  {wall:6.2f}  {spark_s:7.2f}  {wall - spark_s:8.2f}")
    steady = lines.batches[1:] or lines.batches
    print(f"steady medians: wall {statistics.median(w for _, w, _ in steady):.2f} s, spark job {statistics.median(s for *_, s in steady):.2f} s, "
          f"driver {statistics.median(w - s for _, w, s in steady):.2f} s; keyed tasks busy (all subtasks, all batches): "
          f"{sum(busy.values()):.2f} s over {len(tasks)} task runs")
    skip = len(tasks) // max(len(lines.batches), 1)  # batch 0's tasks: warm-up
    st = _stats(tasks[skip:])
    if st is not None:
        print(f"\n== keyed tasks (Python workers), steady batches, top {a.top} by own time ==")
        st.sort_stats("tottime").print_stats(a.top)
    drv = _stats(sorted(prof.glob("driver-batch-*.prof")))
    if drv is not None:
        print(f"\n== driver, all batches, top {a.top} by cumulative time ==")
        drv.sort_stats("cumulative").print_stats(a.top)
    print(f"profiles kept in {prof}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
