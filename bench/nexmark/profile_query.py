"""Where a Nexmark query's driver time goes per batch (the plan, the Spark job, the commit).

    PYTHONPATH=src .venv/bin/python bench/nexmark/profile_query.py --query q17 [--combine] [--top 20]

One keyscale run of the query on the benchmark's input (2M events, 10 batches, -p 2) with
``KEYSCALE_PROFILE_DIR`` set (keyscale.runtime.profiling: a cProfile file per batch on the
driver); prints keyscale's own functions by cumulative time over batches 3.., with the
batches counted, so per-batch figures are the cumulative time / that count.
"""

from __future__ import annotations

import argparse
import io
import os
import pstats
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from nexmark import run as R  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--query", default="q17")
    ap.add_argument("--combine", action="store_true")
    ap.add_argument("--top", type=int, default=20)
    a = ap.parse_args(argv)
    data = R.ensure_data(HERE.parent / "data", 2_000_000, 10)
    profiles = Path(tempfile.mkdtemp(prefix="ks-nexmark-prof-"))
    os.environ["KEYSCALE_PROFILE_DIR"] = str(profiles)
    r = R.run_keyscale(a.query, data, Path(tempfile.mkdtemp(prefix="ks-nexmark-")), 2, combine=a.combine)
    print(f"{a.query}{' combine=True' if a.combine else ''}: batches {[round(x, 2) for x in r['batch_seconds']]}")
    driver = sorted(profiles.rglob("driver*"))[3:]
    out = io.StringIO()
    pstats.Stats(*map(str, driver), stream=out).sort_stats("cumulative").print_stats("keyscale|queries.py", a.top)
    print(f"{len(driver)} batches profiled\n" + out.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
