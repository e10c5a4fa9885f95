"""Mistakes on the public entry points get one clear error naming the thing at fault: a
misspelt keyword says which one was meant, a pipeline without a sink says what to add."""

from __future__ import annotations

import doctest
from pathlib import Path
from typing import Any

import pytest

import keyscale as ks
import keyscale._keywords as keywords_module
from keyscale.errors import JobDefinitionError


@pytest.mark.spark
def test_a_misspelt_keyword_says_which_one_was_meant(spark: Any, tmp_path: Path) -> None:
    events = ks.stream(spark.readStream.schema("key string, value long, ts timestamp").parquet(str(tmp_path)))
    keyed = events.key_by("key")
    cases = [
        (lambda: events.key_by("key", null_key="drop"), "Stream.key_by() got an unknown keyword argument 'null_key' (did you mean 'null_keys'?)"),
        (lambda: events.with_watermark("ts", max_out_of_order="1 s"), "(did you mean 'max_out_of_orderness'?)"),
        (lambda: keyed.aggregate(uid="n", paralelism=2, n=ks.aggregates.count()), "aggregate() got an unknown keyword argument 'paralelism' (did you mean 'parallelism'?)"),
        (lambda: keyed.process(None, "k string", uid="p", paralelism=2), "KeyedStream.process() got an unknown keyword argument 'paralelism'"),  # type: ignore[arg-type]
        (lambda: keyed.aggregate(uid="n", n=3), "aggregate(): n=3 is not an aggregate"),
        (lambda: ks.sinks.ParquetSink(pth="x"), "ParquetSink() got an unknown keyword argument 'pth' (did you mean 'path'?)"),  # type: ignore[call-arg]
        (lambda: ks.windows.TumblingWindows(sise="1 minute"), "(did you mean 'size'?)"),  # type: ignore[call-arg]
        (lambda: ks.sources.log_source("x", paralelism=2), "log_source() got an unknown keyword argument 'paralelism' (did you mean 'parallelism'?)"),  # type: ignore[call-arg]
        (lambda: events.sink(ks.sinks.NoopSink(), on_eror="skip"), "(did you mean 'on_error'?)"),  # type: ignore[call-arg]
    ]
    for call, message in cases:
        with pytest.raises(JobDefinitionError) as e:
            call()
        assert message in str(e.value)
    pipeline = keyed.aggregate(uid="n", n=ks.aggregates.count()).sink(ks.sinks.NoopSink())
    with pytest.raises(JobDefinitionError, match=r"Pipeline.start\(\) got an unknown keyword argument 'paralelism' \(did you mean 'parallelism'\?\)"):
        pipeline.start(str(tmp_path / "job"), paralelism=2)
    assert not (tmp_path / "job").exists()


@pytest.mark.spark
def test_starting_without_a_sink_says_what_to_add(spark: Any, tmp_path: Path) -> None:
    events = ks.stream(spark.readStream.schema("key string, value long, ts timestamp").parquet(str(tmp_path)))
    with pytest.raises(JobDefinitionError, match=r"the stream after stage 'totals' has no sink, so it cannot start: end it with \.sink\("):
        events.key_by("key").aggregate(uid="totals", n=ks.aggregates.count()).start(str(tmp_path / "job"), 2)
    with pytest.raises(JobDefinitionError, match=r"the stream keyed by 'key' has no stage and no sink.*\.aggregate\(\.\.\.\) or \.process\(\.\.\.\)"):
        events.key_by("key").start(str(tmp_path / "job"))  # type: ignore[attr-defined]
    with pytest.raises(JobDefinitionError, match="the windowed stream has no aggregate and no sink"):
        events.with_watermark("ts").key_by("key").window(ks.windows.TumblingWindows("1 minute")).start(str(tmp_path / "job"))  # type: ignore[attr-defined]
    assert not (tmp_path / "job").exists()


def test_doctests() -> None:
    result = doctest.testmod(keywords_module)
    assert result.failed == 0 and result.attempted > 0
