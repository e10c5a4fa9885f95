"""Restart at a new parallelism without a new JVM (issue 12), against a cold restart and
Spark's offline repartition + restart, on the same state in the same run.

    .venv/bin/python bench/restart.py --repeats 3

State: W-1M's 5 files (~865k keys) counted at P=2 by ``bench/jobs/w_count.py``. Then, per
repeat, from the same copy of that state:

- **in place**: a running ``keyscale run -p 2`` (resumed from the state, then one batch of
  an already counted file, so that its JVM and Python workers are warm as a running job's
  are) is told ``keyscale rescale -p 4 --restart``;
  it takes a savepoint, ends its query, starts it again at P=4 in the same process and Spark
  application; one more file arrives as it is back; time from the request to that file's
  batch committed.
- **cold**: the same running job told ``keyscale rescale -p 4 --restart --new-process``: a
  new process (JVM, Python workers) from the same checkpoint; time from the request to the
  new file's batch.
- **Spark**: new session + ``_streamingCheckpointManager.repartition(ckpt, 4)`` + restart
  until the first batch (``bench/spark_baselines.offline_repartition``, the same W-1M files).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from _workload import DEFAULT_DATA_ROOT, ensure_workload  # noqa: E402
from spark_baselines import make_spark, offline_repartition  # noqa: E402

from keyscale.checkpoint.jobdir import JobDir  # noqa: E402


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, "-m", "keyscale.cli.main", *args], capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"keyscale {' '.join(args)} failed (exit {done.returncode}): {done.stderr[-2000:]}")
    return done


def build_state(data: Path, root: Path) -> tuple[Path, Path]:
    """The count's state at P=2 over the workload's files: (its input folder, its job dir)."""
    inp = root / "in"
    inp.mkdir(parents=True)
    for f in sorted(data.glob("part-*.parquet")):
        os.link(f, inp / f.name)
    _cli("run", str(HERE / "jobs" / "w_count.py"), "--job-dir", str(root / "job"), "-p", "2", "--until-idle",
         "--set", f"input={inp}", "--set", "mode=vectorized", "--set", "sink=noop")
    shutil.copytree(root / "job", root / "job.built", symlinks=True)
    return inp, root / "job"


WARM_UP = "part-99998.parquet"


def _next_batch(jd: JobDir, after: int, proc: subprocess.Popen[bytes] | None = None, tmp: Path | None = None) -> Any:
    """The first manifest of a batch after ``after`` (waits for it)."""
    while True:
        m = jd.latest_manifest()
        if m is not None and m.batch > after:
            return m
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the job exited: {(tmp / 'job.log').read_text()[-2000:] if tmp else ''}")
        time.sleep(0.05)


def restart_once(state: tuple[Path, Path], data: Path, new_process: bool) -> float:
    """Seconds from the restart request to the first batch committed at P=4 (the state is
    put back as built first: Spark's checkpoint names the input folder, so it stays put)."""
    inp, job = state
    tmp = Path(tempfile.mkdtemp(prefix="ks-restart-"))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        shutil.rmtree(job, ignore_errors=True)
        shutil.copytree(job.with_name("job.built"), job, symlinks=True)
        for extra in (WARM_UP, "part-99999.parquet"):
            (inp / extra).unlink(missing_ok=True)
        jd = JobDir(job)
        committed = jd.latest_manifest()
        assert committed is not None
        with open(tmp / "job.log", "w") as log:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "keyscale.cli.main", "run", str(HERE / "jobs" / "w_count.py"), "--job-dir", str(job),
                 "-p", "2", "--trigger-interval", "200 milliseconds", "--set", f"input={inp}", "--set", "mode=vectorized",
                 "--set", "sink=noop"], cwd=ROOT, stdout=log, stderr=log))
        while not jd.read_json("control/http.json"):
            assert procs[0].poll() is None, (tmp / "job.log").read_text()[-2000:]
            time.sleep(0.1)
        time.sleep(2)  # the resumed query is up and idle
        newest = sorted(data.glob("part-*.parquet"))[0]
        # A running job has run batches: its JVM is warm and its Python workers are up (an
        # in-place restart keeps both). One batch of a file it already counted (no new keys).
        shutil.copyfile(newest, inp / WARM_UP)
        committed = _next_batch(jd, committed.batch, procs[0], tmp)
        t0 = time.perf_counter()
        try:
            done = _cli("rescale", str(job), "-p", "4", "--restart", *(["--new-process"] if new_process else []))
        except RuntimeError:
            print((tmp / "job.log").read_text()[-3000:], file=sys.stderr)
            raise
        pid = int(done.stdout.split("pid ")[1].split(",")[0].rstrip(")")) if new_process else None
        shutil.copyfile(newest, inp / "part-99999.parquet")  # one more file: the first batch of the restarted job
        m = _next_batch(jd, committed.batch)
        seconds = time.perf_counter() - t0
        assert m.operators["count"].parallelism == 4
        _cli("stop", str(job))
        if pid is not None:  # the new process is not our child: wait until it is gone
            while Path(f"/proc/{pid}").exists():
                time.sleep(0.1)
        return seconds
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(HERE / "out" / "restart.json"))
    a = ap.parse_args(argv)
    logging.getLogger("keyscale").setLevel(logging.WARNING)
    w1m = ensure_workload(DEFAULT_DATA_ROOT, "W-1M", keys=1_000_000)
    root = Path(tempfile.mkdtemp(prefix="ks-restart-state-"))
    try:
        state = build_state(w1m, root)
        runs: dict[str, list[float]] = {"in_place": [], "cold": [], "spark": []}
        for rep in range(a.repeats):  # interleaved: the machine's load hits all three alike
            runs["in_place"].append(restart_once(state, w1m, new_process=False))
            runs["cold"].append(restart_once(state, w1m, new_process=True))
            r: dict[str, Any] = offline_repartition(make_spark, w1m, 2, 4)
            runs["spark"].append(float(r["total_seconds"]))
            print(f"repeat {rep + 1}: in place {runs['in_place'][-1]:.2f} s, cold {runs['cold'][-1]:.2f} s, "
                  f"Spark repartition + restart {runs['spark'][-1]:.2f} s", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    print(f"median: in place {med['in_place']:.2f} s, cold {med['cold']:.2f} s, Spark {med['spark']:.2f} s; "
          f"in place / Spark {med['in_place'] / med['spark']:.2f}, cold / Spark {med['cold'] / med['spark']:.2f}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"command": "bench/restart.py " + " ".join(argv or sys.argv[1:]), "runs": runs, "median": med}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
