"""The Nexmark queries (bench/nexmark/queries.py) on real Spark: keyscale's result and Spark
Structured Streaming's equal a pandas reference computed on the whole input, and a live
rescale 2 -> 4 -> 2 mid-run changes no output row.

50,000 events at 200 events/s of event time (250 s: about 20 tumbling windows of 10 s close
before the last batch), 5 micro-batches.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
try:
    from nexmark import queries as Q
    from nexmark import run as R
finally:
    sys.path.remove(str(ROOT / "bench"))

pytestmark = [pytest.mark.spark, pytest.mark.slow]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return R.ensure_data(tmp_path_factory.mktemp("nexmark"), 50_000, 5, rate=R.VERIFY_RATE)


@pytest.fixture(scope="module")
def keyscale_output(data: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """The output folder of a plain keyscale run of a query (parallelism 2, drained at the
    end), run once for the module: the reference check and the rescale check both read it."""
    done: dict[str, Path] = {}

    def output(query: str) -> Path:
        if query not in done:
            tmp = tmp_path_factory.mktemp(f"keyscale-{query}")
            run = R.run_keyscale(query, data, tmp, 2, output=tmp / "out", drain=True)
            assert not run["rescales"], f"{query}: the plain run rescaled"
            done[query] = tmp / "out"
        return done[query]

    return output


@pytest.mark.parametrize("query", Q.QUERIES)
def test_keyscale_and_spark_equal_the_reference(spark: Any, data: Path, tmp_path: Path, query: str, keyscale_output: Callable[[str], Path]) -> None:
    res = R.verify(spark, query, data, tmp_path, ("keyscale", "keyscale, per record", "spark"), outputs={"keyscale": keyscale_output(query)})
    assert set(res) == {"keyscale", *(["keyscale, per record"] if query in Q.PER_RECORD else []), *(["spark"] if query in Q.SPARK_QUERIES else [])}
    for system, r in res.items():
        assert r["reference_rows"] > 0, f"{query}: the reference is empty, nothing is compared"
        if not r["equal"]:
            got, ref = r["result"], r["reference"]
            merged = got.merge(ref, how="outer", indicator=True)
            pytest.fail(f"{query} on {system}: {len(got)} rows, reference {len(ref)}; differing rows:\n"
                        f"{merged[merged._merge != 'both'].head(10)}")


def test_the_reference_sees_the_windows_and_joins_it_should(data: Path) -> None:
    # Guards the comparison itself: enough closed windows and joined rows to mean something.
    tables = R.read_tables(data, ("person", "auction", "bid"))
    cut = R.cutoff_ms(data)
    closed = {q: len(R._windows_closed(q, Q.final(q, Q.reference(q, tables).assign(batch=0)), cut)) for q in Q.WINDOWED}
    assert closed["q7"] >= 15 and closed["q5"] >= 75 and closed["q11"] > 1000 and closed["q8"] > 50
    assert len(Q.reference("q3", tables)) > 100 and len(Q.reference("q20", tables)) > 1000


@pytest.mark.parametrize("query", ["q5", "q8", "q9", "q18", "q19", "q20"])
def test_a_live_rescale_2_4_2_changes_no_output(data: Path, tmp_path: Path, query: str, keyscale_output: Callable[[str], Path]) -> None:
    rescaled = R.run_keyscale(query, data, tmp_path / "b", 2, output=tmp_path / "b-out", plan={1: 4, 3: 2}, drain=True)
    # (batch, operator, from, to): every stateful operator went 2 -> 4 at batch 2 and 4 -> 2 at batch 4.
    assert sorted({(r[0], r[2], r[3]) for r in rescaled["rescales"]}) == [(2, 2, 4), (4, 4, 2)]
    a = Q.canonical(R.result_of(query, keyscale_output(query)))
    b = Q.canonical(R.result_of(query, tmp_path / "b-out"))
    assert len(a) > 0
    assert a.equals(b)


def test_the_floor_reads_what_sparks_own_query_scans(spark: Any, data: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``READS`` (the columns run.py's floor reads) is what Spark's optimised plan of each
    native query scans: a floor reading more would look slower than it is, one reading less
    faster. Checked on the same queries read as batch DataFrames (same plans, no stream)."""
    import re

    def read_batch(spark: Any, data: Any, stream: str) -> Any:
        return spark.read.schema(Q.SCHEMAS[stream]).parquet(str(Path(data) / stream))

    monkeypatch.setattr(Q, "_read", read_batch)
    assert set(Q.READS) == set(Q.SPARK_QUERIES)
    spark.conf.set("spark.sql.maxMetadataStringLength", 10_000)  # the scans' folders in full
    try:
        for query in Q.SPARK_QUERIES:
            df, _, post = Q.spark_query(spark, query, data)
            plan = (post(df) if post else df)._jdf.queryExecution().executedPlan().toString()
            scans: dict[str, set[str]] = {}
            for stream, schema in re.findall(r"Location: InMemoryFileIndex[^\n]*?/(person|auction|bid)\][^\n]*?ReadSchema: struct<([^>]*)>", plan):
                scans.setdefault(stream, set()).update(f.split(":")[0] for f in schema.split(","))
            assert scans == {s: set(c) for s, c in Q.READS[query].items()}, (query, plan)
    finally:
        spark.conf.unset("spark.sql.maxMetadataStringLength")
