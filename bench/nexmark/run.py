"""Nexmark on keyscale against Spark Structured Streaming, same run (issue 16, items 2-3).

    PYTHONPATH=src .venv/bin/python bench/nexmark/run.py                       # the table (2M events, 10 files, 2 repeats)
    PYTHONPATH=src .venv/bin/python bench/nexmark/run.py --verify              # results equal? (50k events)
    PYTHONPATH=src .venv/bin/python bench/nexmark/run.py --rescale q5 q17      # live rescale 2 -> 4 -> 2 mid-run
    PYTHONPATH=src .venv/bin/python bench/nexmark/run.py --floor --queries q17 # and Spark only reading the input

The input comes from ``bench/nexmark/generator.py`` (rate 10,000 events/s of event time,
seed 0, in order), written once under ``bench/data/nexmark-<events>-<files>`` (gitignored):
one file per stream and micro-batch. Per query and repeat, interleaved: keyscale at
parallelism ``-p`` (local[2]) and Spark's native version (2 shuffle partitions, RocksDB state
store), both with a no-op sink, one Spark session. A batch's time is Spark's
``triggerExecution`` of it (keyscale's includes its checkpoint commit). Throughput =
events of the slices in batches 1..N-1 (all three streams: the events the Nexmark source
generated for them, as Flink's Nexmark counts) / the sum of those batches' times; batch 0
(JVM, Python workers, first plans) is left out. Medians over repeats; per core = / 2.

``--verify``: every query on keyscale (Parquet sink, drained at the end) against the pandas
reference of ``queries.reference`` on the whole input, and Spark's (Parquet sink) against the
same; windowed queries compare the windows that end before the last slice's watermark
(both systems have closed those). ``--rescale``: each query at P=2, at P=4, and at P=2 with
live rescales to 4 after batch ``N/3`` and back to 2 after ``2N/3``; the outputs must be
identical (Parquet, drained), and each batch of the rescaled run is compared with the same
batch of the run at the parallelism it ran with.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent
BENCH = HERE.parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))

from spark_baselines import ROCKSDB_PROVIDER, batch_seconds, run_available_now  # noqa: E402

import nexmark.generator as gen  # noqa: E402
import nexmark.queries as Q  # noqa: E402

RATE = 10_000
VERIFY_RATE = 200  # 50,000 events span 250 s of event time: many 10 s windows close in it
FLINK_PER_CORE = {"q5": 22_000, "q17": 117_000}  # Flink 1.13, Nexmark repository README (events/s per core)


def ensure_data(root: Path, events: int, files: int, seed: int = 0, rate: int = RATE) -> Path:
    """The generator's Parquet files for ``events`` events in ``files`` slices (written once)."""
    d = root / f"nexmark-{events}-{files}-r{rate}-s{seed}"
    if (d / "_nexmark.json").exists():
        return d
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".nexmark-"))
    gen.write_dataset(tmp, gen.NexmarkConfig(seed=seed, rate=rate), events=events, files=files)
    if d.exists():
        shutil.rmtree(d)
    tmp.rename(d)
    return d


def slices(data: Path) -> list[int]:
    """Events per slice (file k of every stream)."""
    meta = json.loads((data / "_nexmark.json").read_text())
    return [hi - lo for lo, hi in meta["ranges"]]


def read_tables(data: Path, streams: tuple[str, ...]) -> dict[str, pd.DataFrame]:
    return {s: pq.read_table(data / s).to_pandas() for s in streams}


# ---------------------------------------------------------------------------- the two systems


def run_keyscale(query: str, data: Path, tmp: Path, parallelism: int = 2, output: Path | None = None,
                 plan: dict[int, int] | None = None, drain: bool = False, combine: bool = False, per_record: bool = False) -> dict[str, Any]:
    """One keyscale run of ``query`` (noop sink, or Parquet into ``output``); ``plan`` maps a
    batch to the parallelism to rescale to, live, after it; ``combine``: see Q.COMBINABLE;
    ``per_record``: see Q.PER_RECORD."""
    from keyscale.checkpoint.jobdir import JobDir
    from keyscale.runtime.driver.runner import BatchRecord, JobRunner, RunOptions

    jd = JobDir(tmp / "job")
    plan = plan or {}

    def on_batch(rec: BatchRecord) -> None:
        if rec.batch in plan:
            jd.request_rescale(plan[rec.batch])

    opts = RunOptions(job_file=str(HERE / "queries.py"), job_dir=str(jd.path), parallelism=parallelism, until_idle=True,
                      drain_at_end=drain, args={"query": query, "data": str(data), "output": str(output or "noop"),
                                                "combine": "yes" if combine else "no", "per_record": "yes" if per_record else "no"})
    t0 = time.perf_counter()
    s = JobRunner(opts, on_batch).run()
    return {"batch_seconds": list(s.trigger_seconds), "wall_seconds": time.perf_counter() - t0,
            "rescales": [list(r) for r in s.rescales]}


def run_spark(spark: Any, query: str, data: Path, tmp: Path, output: Path | None = None, read_only: bool = False) -> dict[str, Any]:
    """Spark's native version of ``query`` (noop sink, or Parquet into ``output`` with the
    batch id); ``read_only``: its floor instead, the query's input read and nothing done."""
    from pyspark.sql import functions as F

    df, mode, post = (Q.spark_read_only(spark, query, data), "append", None) if read_only else Q.spark_query(spark, query, data)

    def sink(b: Any, bid: int) -> None:
        if post is not None:
            b = post(b)
        if output is None:
            b.write.format("noop").mode("overwrite").save()
        else:
            b.withColumn("batch", F.lit(bid)).write.mode("append").parquet(str(output))

    progress, wall = run_available_now(df, tmp / "ckpt", mode, sink)
    return {"batch_seconds": batch_seconds(progress), "wall_seconds": wall}


def throughput(r: dict[str, Any], per_slice: list[int]) -> float:
    """Events/s over batches 1..N-1 (batch 0 warms up)."""
    secs = r["batch_seconds"][1:len(per_slice)]
    return sum(per_slice[1:len(secs) + 1]) / sum(secs) if secs else float("nan")


# ---------------------------------------------------------------------------- verification


def cutoff_ms(data: Path) -> int:
    """Windows ending at or before this (epoch ms) were closed by both systems: the last
    slice's first event time, less the watermark delay and a window."""
    meta = json.loads((data / "_nexmark.json").read_text())
    cfg = gen.NexmarkConfig(**meta["config"])
    first_of_last = int(gen.time_us(cfg, __import__("numpy").array([meta["ranges"][-1][0]]))[0]) // 1000
    return first_of_last - Q.WATERMARK_MS - Q.WINDOW_MS


def _windows_closed(query: str, df: pd.DataFrame, cut: int) -> pd.DataFrame:
    col = Q.WINDOWED.get(query)
    if col is None or df.empty:
        return df
    end = df[col] + (Q.WINDOW_MS if col in ("window_start", "starttime") else 0)
    return df[end <= cut]


def result_of(query: str, out: Path) -> pd.DataFrame:
    """A run's Parquet output as the result it stands for (keyscale's sink or the Spark side's)."""
    from keyscale.sinks.parquet import read_output

    if not any(out.glob("batch=*")):
        df = pq.read_table(out).to_pandas() if out.exists() else pd.DataFrame()
    else:
        df = read_output(out).to_pandas()
    return Q.final(query, df) if not df.empty else df


def verify(spark: Any, query: str, data: Path, tmp: Path, systems: tuple[str, ...] = ("keyscale", "spark"),
           outputs: dict[str, Path] | None = None) -> dict[str, Any]:
    """Run ``query`` on each system into Parquet and compare each with the pandas reference:
    ``{system: (equal, rows, reference rows)}``; systems are "keyscale", "spark" and, for
    Q.PER_RECORD's queries, "keyscale, per record". ``outputs``: systems already run, the
    folder of their output (a "keyscale" one: :func:`run_keyscale` with ``drain=True``)."""
    ref = Q.final(query, Q.reference(query, read_tables(data, Q.STREAMS[query])).assign(batch=0))
    cut = cutoff_ms(data)
    ref = Q.canonical(_windows_closed(query, ref, cut))
    out: dict[str, Any] = {}
    for system in systems:
        if (system == "spark" and query not in Q.SPARK_QUERIES) or (system == "keyscale, per record" and query not in Q.PER_RECORD):
            continue
        where = tmp / f"{system.replace(', ', '-').replace(' ', '-')}-{query}"
        folder = (outputs or {}).get(system)
        if folder is None:
            folder = where / "out"
            if system.startswith("keyscale"):
                run_keyscale(query, data, where, output=folder, drain=True, per_record=system != "keyscale")
            else:
                run_spark(spark, query, data, where, output=folder)
        got = result_of(query, folder)
        got = Q.canonical(_windows_closed(query, got[[c for c in ref.columns if c in got.columns]], cut)) if len(got) else got
        equal = len(got) == len(ref) and list(got.columns) == list(ref.columns) and got.equals(ref)
        out[system] = {"equal": bool(equal), "rows": len(got), "reference_rows": len(ref), "result": got, "reference": ref}
    return out


# ---------------------------------------------------------------------------- main


def spark_session() -> Any:
    from keyscale.runtime.driver.session import spark_session as make

    return make("local[2]", "keyscale-nexmark", {"spark.sql.streaming.stateStore.providerClass": ROCKSDB_PROVIDER,
                                                 "spark.sql.shuffle.partitions": "2"})


def _tmp() -> Path:
    return Path(tempfile.mkdtemp(prefix="ks-nexmark-"))


def bench(spark: Any, data: Path, queries: list[str], repeats: int, parallelism: int, floor: bool = False) -> list[dict[str, Any]]:
    per_slice = slices(data)
    rows = []
    for query in queries:
        systems: dict[str, Callable[[Path], dict[str, Any]]] = {
            "keyscale": lambda t, q=query: run_keyscale(q, data, t, parallelism)}
        if query in Q.COMBINABLE:  # the same with aggregate(combine=True), beside it
            systems["keyscale, combine=True"] = lambda t, q=query: run_keyscale(q, data, t, parallelism, combine=True)
        if query in Q.PER_RECORD:  # the per-record co-process function, beside the batch-at-a-time one
            systems["keyscale, per record"] = lambda t, q=query: run_keyscale(q, data, t, parallelism, per_record=True)
        if query in Q.SPARK_QUERIES:
            systems["spark"] = lambda t, q=query: run_spark(spark, q, data, t)
        if floor and query in Q.READS:
            systems["spark, read only"] = lambda t, q=query: run_spark(spark, q, data, t, read_only=True)
        runs: dict[str, list[dict[str, Any]]] = {k: [] for k in systems}
        for rep in range(repeats):
            for name, fn in systems.items():
                tmp = _tmp()
                try:
                    r = fn(tmp)
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
                r["events_per_s"] = throughput(r, per_slice)
                runs[name].append(r)
                print(f"{query} rep {rep + 1}: {name:8} {r['events_per_s']:>10,.0f} events/s  e2e {r['wall_seconds']:6.1f} s  "
                      f"batches {[round(x, 2) for x in r['batch_seconds']]}", flush=True)
        med = {k: statistics.median(r["events_per_s"] for r in v) for k, v in runs.items()}
        rows.append({"query": query, "events_per_s": med, "runs": runs})
    return rows


def rescale_runs(data: Path, queries: list[str]) -> list[dict[str, Any]]:
    """Per query: a run at P=2, one at P=4 and one at P=2 rescaled live to 4 after batch N/3
    and back to 2 after 2N/3 (Parquet, drained). The rescaled run's output must equal the
    P=2 run's; each of its batches is compared with the same batch of the run already at
    that parallelism (P=4 for the batches at 4, P=2 for the others), as bench/rescale.py does."""
    n = len(slices(data))
    up, down = n // 3, 2 * n // 3
    rows = []
    for query in queries:
        res: dict[str, Any] = {}
        for name, p, plan in (("p2", 2, {}), ("p4", 4, {}), ("rescaled", 2, {up: 4, down: 2})):
            tmp = _tmp()
            try:
                r = run_keyscale(query, data, tmp, p, output=tmp / "out", plan=plan, drain=True)
                r["result"] = Q.canonical(result_of(query, tmp / "out"))
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            res[name] = r
        same = res["p2"]["result"].equals(res["rescaled"]["result"]) and res["p2"]["result"].equals(res["p4"]["result"])
        a, b, c = (res[k]["batch_seconds"][:n] for k in ("p2", "rescaled", "p4"))
        # The batch at P (batch > up and <= down: 4) against the run at that P, batch by batch.
        ratios = [b[i] / (c[i] if up < i <= down else a[i]) for i in range(1, n)]
        after = ratios[up:]  # batches up+1 .. n-1: from the first at 4
        print(f"{query}: outputs identical (P=2, P=4, rescaled 2->4 after batch {up}, 4->2 after batch {down}): {same}; "
              f"rescales {res['rescaled']['rescales']}\n  P=2       {[round(x, 2) for x in a]}\n"
              f"  P=4       {[round(x, 2) for x in c]}\n  rescaled  {[round(x, 2) for x in b]}\n"
              f"  rescaled / same batch at its P: {[round(x, 2) for x in ratios]}; worst after the rescale {max(after):.2f}x",
              flush=True)
        rows.append({"query": query, "identical": bool(same), "rows": len(res["p2"]["result"]), "rescale_after": [up, down],
                     "p2_batches": a, "p4_batches": c, "rescaled_batches": b, "rescales": res["rescaled"]["rescales"],
                     "ratio_to_same_parallelism": ratios, "worst_after_rescale": max(after)})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--queries", nargs="+", default=Q.QUERIES)
    ap.add_argument("--events", type=int, default=2_000_000)
    ap.add_argument("--files", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("-p", "--parallelism", type=int, default=2)
    ap.add_argument("--verify", action="store_true", help="compare results on a small input (default 50,000 events, 5 files)")
    ap.add_argument("--rescale", nargs="*", metavar="QUERY", help="live rescale 2 -> 4 -> 2 runs of these queries (default q5 q17)")
    ap.add_argument("--floor", action="store_true",
                    help="also run each query's floor: Spark reading the columns the query reads and doing nothing else "
                         "(the most any engine on Spark can reach, and that ceiling over Spark's own query)")
    ap.add_argument("--data-root", type=Path, default=BENCH / "data")
    ap.add_argument("--out", type=Path, default=BENCH / "out" / "nexmark.json")
    a = ap.parse_args(argv)
    unknown = sorted(set(a.queries) - set(Q.QUERIES))
    if unknown:
        ap.error(f"unknown queries {unknown} (known: {' '.join(Q.QUERIES)})")
    logging.getLogger("keyscale").setLevel(logging.WARNING)
    a.data_root.mkdir(parents=True, exist_ok=True)
    spark = spark_session()
    report: dict[str, Any] = {"command": " ".join(["bench/nexmark/run.py", *(argv if argv is not None else sys.argv[1:])])}
    if a.verify:
        events, files = (a.events, a.files) if "--events" in (argv or sys.argv) else (50_000, 5)
        data = ensure_data(a.data_root, events, files, rate=VERIFY_RATE)
        ok = True
        for query in a.queries:
            tmp = _tmp()
            try:
                res = verify(spark, query, data, tmp, ("keyscale", "keyscale, per record", "spark"))
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            for system, r in res.items():
                ok &= r["equal"]
                print(f"{query} {system:8}: {'equal' if r['equal'] else 'DIFFERENT'} ({r['rows']} rows, reference {r['reference_rows']})",
                      flush=True)
        return 0 if ok else 1
    data = ensure_data(a.data_root, a.events, a.files)
    if a.rescale is not None:
        report["rescale"] = rescale_runs(data, a.rescale or ["q5", "q17"])
    else:
        rows = bench(spark, data, a.queries, a.repeats, a.parallelism, a.floor)
        report["results"] = rows
        print(f"\n{a.events:,} events, {a.files} batches, -p {a.parallelism}, local[2], medians of {a.repeats}\n"
              "| query | keyscale events/s | per core | Spark events/s | per core | keyscale / Spark |\n|---|---|---|---|---|---|")
        for r in rows:
            k, s = r["events_per_s"]["keyscale"], r["events_per_s"].get("spark")
            sp = f"{s:,.0f} | {s / 2:,.0f} | {k / s:.2f}x" if s else "- | - | -"
            flink = f" (Flink 1.13: {FLINK_PER_CORE[r['query']]:,}/core)" if r["query"] in FLINK_PER_CORE else ""
            print(f"| {r['query']}{flink} | {k:,.0f} | {k / 2:,.0f} | {sp} |")
            for variant, e in r["events_per_s"].items():
                if variant.startswith("keyscale, "):
                    print(f"| {r['query']} ({variant[10:]}) | {e:,.0f} | {e / 2:,.0f} | "
                          + (f"{s:,.0f} | {s / 2:,.0f} | {e / s:.2f}x |" if s else "- | - | - |"))
        floors = [r for r in rows if "spark, read only" in r["events_per_s"]]
        if floors:
            print("\nThe floor: Spark reading the query's columns and doing nothing else; its events/s is the most any\n"
                  "engine on Spark reaches, and floor / Spark the most any can be ahead of Spark's own query.\n"
                  "| query | keyscale events/s | Spark events/s | floor events/s | keyscale / floor | floor / Spark |\n|---|---|---|---|---|---|")
            for r in floors:
                e = r["events_per_s"]
                k, s, f = e["keyscale"], e.get("spark"), e["spark, read only"]
                print(f"| {r['query']} | {k:,.0f} | {f'{s:,.0f}' if s else '-'} | {f:,.0f} | {k / f:.2f} | {f'{f / s:.2f}x' if s else '-'} |")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=1, default=str))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
