"""Where a Nexmark query's driver time goes per batch (the plan, the Spark job, the commit).

    PYTHONPATH=src .venv/bin/python bench/nexmark/profile_query.py --query q17 [--combine] [--top 20]
    PYTHONPATH=src .venv/bin/python bench/nexmark/profile_query.py --query q8 --timing
    PYTHONPATH=src .venv/bin/python bench/nexmark/profile_query.py --query q18 --tasks

One keyscale run of the query on the benchmark's input (2M events, 10 batches, -p 2) with
``KEYSCALE_PROFILE_DIR`` set (keyscale.runtime.task.profiling: a cProfile file per batch on the
driver); prints keyscale's own functions by cumulative time over batches 3.., with the
batches counted, so per-batch figures are the cumulative time / that count.

``--tasks``: the keyed subtasks' profiles instead (one per subtask run, in the Python
workers), over the runs after the first three batches' (warm-up).

``--timing``: no profiler (it inflates the many short calls to the JVM that planning
makes); the steps of a batch timed with a clock instead, medians of batches 3..
"""

from __future__ import annotations

import argparse
import io
import os
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from nexmark import run as R  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--query", default="q17")
    ap.add_argument("--combine", action="store_true")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--timing", action="store_true", help="time the batch's steps with a clock, no profiler")
    ap.add_argument("--tasks", action="store_true", help="the subtasks' profiles instead of the driver's")
    a = ap.parse_args(argv)
    data = R.ensure_data(HERE.parent / "data", 2_000_000, 10)
    if a.timing:
        return timing(a.query, data, a.combine)
    profiles = Path(tempfile.mkdtemp(prefix="ks-nexmark-prof-"))
    os.environ["KEYSCALE_PROFILE_DIR"] = str(profiles)
    r = R.run_keyscale(a.query, data, Path(tempfile.mkdtemp(prefix="ks-nexmark-")), 2, combine=a.combine)
    print(f"{a.query}{' combine=True' if a.combine else ''}: batches {[round(x, 2) for x in r['batch_seconds']]}")
    files = sorted(f for f in profiles.rglob("*") if f.is_file())
    driver = [f for f in files if f.name.startswith("driver")]
    chosen = [f for f in files if f not in driver][6:] if a.tasks else driver[3:]  # two subtasks a batch
    out = io.StringIO()
    restrict = (a.top,) if a.tasks else ("keyscale|queries.py", a.top)
    pstats.Stats(*map(str, chosen), stream=out).sort_stats("cumulative").print_stats(*restrict)
    print(f"{len(chosen)} {'subtask runs' if a.tasks else 'batches'} profiled\n" + out.getvalue())
    return 0


def timing(query: str, data: Path, combine: bool) -> int:
    """Each step of a batch (commit.py's and the keyed stage's plan) timed around its call."""
    from keyscale.runtime.batch import commit, stages

    times: dict[str, list[float]] = {}

    def clock(module: Any, name: str) -> None:
        fn: Callable[..., Any] = getattr(module, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                times.setdefault(name, []).append(time.perf_counter() - t0)

        setattr(module, name, timed)

    for module, name in ((commit, "fix_intent"), (stages, "plan_stages"), (stages, "routed"), (commit, "write_sinks"),
                         (commit, "commit_manifest"), (commit, "record")):
        clock(module, name)
    r = R.run_keyscale(query, data, Path(tempfile.mkdtemp(prefix="ks-nexmark-")), 2, combine=combine)
    print(f"{query}{' combine=True' if combine else ''}: batches {[round(x, 2) for x in r['batch_seconds']]}")
    print("| step | ms per batch (median of batches 3..) |\n|---|---|")
    for name, ts in times.items():
        print(f"| {name} | {statistics.median(ts[3:]) * 1000:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
