"""A job's start, as a user waits for it: a whole ``keyscale run`` process, from the command to
its first committed batch and to its exit, with and without a class archive.

    .venv/bin/python bench/job_start.py --repeats 5
    .venv/bin/python bench/job_start.py --repeats 5 --against /tmp/old/src   # and another checkout's keyscale

The job is ``examples/running_count.py`` at parallelism 2 over two Parquet files of 2,000
rows (``--until-idle``: two batches, then it ends), in a new job directory each run. Modes,
run in turn (A B A B, so that the machine's load hits them alike):

- ``plain``: no class archive;
- ``archive``: ``KEYSCALE_CLASS_ARCHIVE`` set to an archive ``keyscale class-archive`` made
  before the first run (its making is timed once, apart);
- ``against``: with ``--against SRC``, the same command with another checkout's ``src`` first
  on ``PYTHONPATH`` and no archive.

Figures per run: seconds to the job's "running" line (the session and the job set up), to
its first committed batch, and to the process's exit (wall clock). Medians over the
repeats, and each mode's exit time against ``plain``'s, pair by pair. ``SPARK_SUBMIT_OPTS``
is removed from the runs' environment (the test suite's own archive comes through it).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))


def _one(work: Path, env: dict[str, str], tag: str) -> dict[str, float]:
    job, out = work / f"job-{tag}", work / f"out-{tag}"
    cmd = [sys.executable, "-m", "keyscale.cli.main", "run", str(ROOT / "examples" / "running_count.py"), "--job-dir", str(job),
           "-p", "2", "--until-idle", "--set", f"input={work / 'in'}", "--set", f"output={out}"]
    marks: dict[str, float] = {}
    started = time.perf_counter()
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        assert proc.stdout is not None
        said = []
        for line in proc.stdout:
            said.append(line)
            if line.startswith("keyscale: running "):
                marks.setdefault("running", time.perf_counter() - started)
            elif line.startswith("keyscale: batch 0 committed"):
                marks.setdefault("first batch", time.perf_counter() - started)
    marks["exit"] = time.perf_counter() - started
    if proc.returncode != 0 or len(marks) != 3:
        sys.exit(f"job_start: the {tag} run failed (exit {proc.returncode}):\n{''.join(said[-20:])}")
    for folder in (job, out):
        shutil.rmtree(folder)
    return marks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--against", metavar="SRC", help="another checkout's src folder, run as a third mode")
    args = ap.parse_args()
    from conftest import write_events

    base = {k: v for k, v in os.environ.items() if k not in ("SPARK_SUBMIT_OPTS", "KEYSCALE_CLASS_ARCHIVE", "PYTHONPATH")}
    with tempfile.TemporaryDirectory(prefix="job-start-") as tmp:
        work = Path(tmp)
        write_events(work / "in", files=2, rows=2000, keys=100)
        archive = work / "spark.jsa"
        started = time.perf_counter()
        made = subprocess.run([sys.executable, "-m", "keyscale.cli.main", "class-archive", str(archive)],
                              env={**base, "PYTHONPATH": str(ROOT / "src")}, capture_output=True, text=True)
        if made.returncode != 0:
            sys.exit(f"job_start: keyscale class-archive failed:\n{made.stderr[-2000:]}")
        print(f"class archive made in {time.perf_counter() - started:.1f} s ({archive.stat().st_size / 1e6:.0f} MB)", flush=True)
        modes = {
            "plain": {**base, "PYTHONPATH": str(ROOT / "src")},
            "archive": {**base, "PYTHONPATH": str(ROOT / "src"), "KEYSCALE_CLASS_ARCHIVE": str(archive)},
        }
        if args.against:
            modes["against"] = {**base, "PYTHONPATH": str(Path(args.against).resolve())}
        _one(work, modes["plain"], "warm-up")  # the page cache: jars, Python files
        runs: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
        for i in range(args.repeats):
            for mode, env in modes.items():
                runs[mode].append(_one(work, env, mode))
                print(f"repeat {i + 1} {mode:8s}: " + ", ".join(f"{k} {v:.2f} s" for k, v in runs[mode][-1].items()), flush=True)
        print("\n| mode | to running | to first batch | to exit | exit against plain, pair by pair |\n|---|---:|---:|---:|---:|")
        for mode, rs in runs.items():
            ratios = [r["exit"] / p["exit"] for r, p in zip(rs, runs["plain"], strict=True)]
            med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
            print(f"| {mode} | {med['running']:.2f} s | {med['first batch']:.2f} s | {med['exit']:.2f} s | "
                  f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) |")


if __name__ == "__main__":
    main()
