"""Bad input is named for what it is: a key column the input lacks, and malformed JSON/CSV
records (Spark's corrupt-record column, or FAILFAST), handled by the job's on_error and never
turned into null keys (keyscale.runtime.batch.malformed, issue 33 item 5)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import read_output, run_job
from keyscale.checkpoint.jobdir import JobDir
from keyscale.errors import InputDataError, JobDefinitionError, KeyColumnMissingError, RecordError

pytestmark = pytest.mark.spark

JOB = '''
import keyscale as ks

def build(ctx):
    reader = ctx.spark.readStream.schema(ctx.arg("schema"))
    for name, value in ctx.args.items():
        if name.startswith("opt_"):
            reader = reader.option(name[4:], value)
    events = reader.format(ctx.arg("format")).load(ctx.arg("input"))
    dead = ks.sinks.ParquetSink(ctx.arg("dead")) if ctx.arg("on_error", "fail") == "dead_letter" else None
    return (ks.stream(events).key_by("user").aggregate(uid="counts", n=ks.aggregates.count(), total=ks.aggregates.sum("v"))
            .sink(ks.sinks.ParquetSink(ctx.arg("output")), on_error=ctx.arg("on_error", "fail"), dead_letter=dead))
'''
JSON_LINES = '{"user": "ann", "v": 1}\n{"user": "bob", "v": 2\n{"user": "ann", "v": 4}\n'  # line 2 lacks its brace
CSV_LINES = "user,v\nann,1\nbob,two\nann,4\n"  # "two" is not a long


def _run(tmp_path: Path, fmt: str, text: str, schema: str, **args: str) -> Any:
    (tmp_path / "in").mkdir(exist_ok=True)
    if text:
        (tmp_path / "in" / f"part-0.{fmt}").write_text(text)
    job = tmp_path / "job.py"
    job.write_text(JOB)
    opts = {"opt_header": "true"} if fmt == "csv" else {}
    return run_job(job, tmp_path / "job", 1, {"input": str(tmp_path / "in"), "output": str(tmp_path / "out"), "dead": str(tmp_path / "dead"),
                                               "format": fmt, "schema": schema, **opts, **args})


def _committed_nothing(tmp_path: Path) -> None:
    assert JobDir(tmp_path / "job").manifest_batches() == []
    assert read_output(tmp_path / "out").empty


def test_a_key_column_the_files_lack_is_named_with_the_columns_they_have(spark: Any, tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"userId": ["ann", "bob"], "v": [1, 2]}), tmp_path / "in" / "part-0.parquet")
    with pytest.raises(KeyColumnMissingError) as err:
        _run(tmp_path, "parquet", "", "user string, v long")
    assert str(err.value) == (f"key column 'user' of operator 'counts' is null in every record of batch 0: the parquet source reading "
                              f"{tmp_path / 'in'} has no column 'user' (its files have: userId, v); fix the name in key_by() or in the source's schema")
    _committed_nothing(tmp_path)


def test_a_subtask_that_gets_only_null_keys_is_no_missing_column(spark: Any, tmp_path: Path) -> None:
    """At parallelism 2 the null key's subtask (key group 42 of 128: subtask 0) gets nothing else,
    while "a" and "b" go to subtask 1: the batch has keys, so the null key is the record's own."""
    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"user": ["a", "b", None], "v": [1, 2, 3]}), tmp_path / "in" / "part-0.parquet")
    job = tmp_path / "job.py"
    job.write_text(JOB)
    with pytest.raises(InputDataError) as err:
        run_job(job, tmp_path / "job", 2, {"input": str(tmp_path / "in"), "output": str(tmp_path / "out"), "format": "parquet",
                                           "schema": "user string, v long"})
    assert str(err.value).startswith("null key in column 'user' of operator 'counts' (batch 0, 1 records)")


def test_a_json_source_in_spark_default_mode_without_the_corrupt_record_column_is_refused(spark: Any, tmp_path: Path) -> None:
    with pytest.raises(JobDefinitionError, match=r"the json source reading .* uses Spark's default mode PERMISSIVE.*add '_corrupt_record string'"):
        _run(tmp_path, "json", JSON_LINES, "user string, v long")


@pytest.mark.parametrize("fmt,text,raw", [("json", JSON_LINES, '{"user": "bob", "v": 2'), ("csv", CSV_LINES, "bob,two")])
def test_a_malformed_record_fails_the_batch_naming_file_and_record(spark: Any, tmp_path: Path, fmt: str, text: str, raw: str) -> None:
    with pytest.raises(RecordError) as err:
        _run(tmp_path, fmt, text, "user string, v long, _corrupt_record string")
    first = str(err.value).splitlines()[0]
    assert first == f"the {fmt} source reading {tmp_path / 'in'}: malformed record in file {tmp_path / 'in' / f'part-0.{fmt}'} (batch 0)"
    assert f"record: {raw!r}" in str(err.value)
    _committed_nothing(tmp_path)


def test_skipped_malformed_records_are_counted_and_the_others_processed(spark: Any, tmp_path: Path) -> None:
    _run(tmp_path, "json", JSON_LINES, "user string, v long, _corrupt_record string", on_error="skip")
    out = read_output(tmp_path / "out")
    assert out[["user", "n", "total"]].values.tolist() == [["ann", 2, 5]]  # no null key, no "bob"
    counted = JobDir(tmp_path / "job").latest_manifest().extra["counters"]  # type: ignore[union-attr]
    assert counted == {"input": {"malformed_skipped": 1}}


def test_dead_lettered_malformed_records_name_their_file(spark: Any, tmp_path: Path) -> None:
    _run(tmp_path, "json", JSON_LINES, "user string, v long, bad string", on_error="dead_letter", opt_columnNameOfCorruptRecord="bad")
    dead = read_output(tmp_path / "dead")
    assert len(dead) == 1
    row = dead.iloc[0]
    assert (row["operator"], row["batch_id"]) == ("input", 0)
    assert json.loads(row["record"]) == {"bad": '{"user": "bob", "v": 2'}
    assert row["error"] == f"malformed record in file {tmp_path / 'in' / 'part-0.json'}"
    assert read_output(tmp_path / "out")[["user", "n"]].values.tolist() == [["ann", 2]]
    assert JobDir(tmp_path / "job").latest_manifest().extra["counters"] == {"input": {"malformed_dead_lettered": 1}}  # type: ignore[union-attr]


def test_failfast_set_by_the_user_is_kept_and_names_the_file(spark: Any, tmp_path: Path) -> None:
    with pytest.raises(InputDataError, match="cannot read input file "
                       rf"{tmp_path / 'in' / 'part-0.json'}: malformed record \(the json source has mode=FAILFAST\): '{{\"user\": \"bob\", \"v\": 2'$"):
        _run(tmp_path, "json", JSON_LINES, "user string, v long", opt_mode="FAILFAST")
    _committed_nothing(tmp_path)


def test_dropmalformed_set_by_the_user_is_kept_with_a_warning(spark: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, "keyscale"):
        _run(tmp_path, "json", JSON_LINES, "user string, v long", opt_mode="DROPMALFORMED")
    assert read_output(tmp_path / "out")[["user", "n"]].values.tolist() == [["ann", 2]]
    assert any("mode=DROPMALFORMED (your setting)" in r.getMessage() for r in caplog.records)
