"""Pure rules of poison records: Spark's input errors in one line, policies, re-planning a
failed batch's parallelism, the messages the driver logs."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from keyscale.checkpoint.intent import BatchIntent
from keyscale.errors import JobDefinitionError
from keyscale.operators.poison import (
    check_bound,
    check_on_error,
    input_error,
    null_key_mask,
)
from keyscale.runtime.batch.poison import replan_intent

# Excerpts of real Spark 4 error texts (the first line and the innermost cause of ~570 lines).
NANOS = """py4j.protocol.Py4JJavaError: An error occurred while calling o123.save.
: org.apache.spark.SparkException: [FAILED_READ_FILE.PARQUET_COLUMN_DATA_TYPE_MISMATCH] Encountered error while reading file file:///data/in/part-00002.parquet. Data type mismatches when reading Parquet column [ts]. Expected Spark type timestamp, actual Parquet type INT64. SQLSTATE: KD001
\tat org.apache.spark.sql.errors.QueryExecutionErrors$.failedToReadDataError(QueryExecutionErrors.scala:860)
Caused by: org.apache.spark.sql.execution.datasources.SchemaColumnConvertNotSupportedException: column: [ts], physicalType: INT64, logicalType: timestamp
"""
GARBAGE = """: org.apache.spark.SparkException: [FAILED_READ_FILE.NO_HINT] Encountered error while reading file file:///data/in/part-00000.parquet.  SQLSTATE: KD001
\tat org.apache.spark.sql.errors.QueryExecutionErrors$.cannotReadFilesError(QueryExecutionErrors.scala:890)
Caused by: java.lang.RuntimeException: outer
Caused by: java.lang.RuntimeException: footer is too large: 3366877235to be read
"""


def test_unreadable_file_is_one_line_naming_file_and_cause() -> None:
    assert input_error(NANOS) == (
        "cannot read input file /data/in/part-00002.parquet: Data type mismatches when reading Parquet column [ts]. "
        "Expected Spark type timestamp, actual Parquet type INT64."
    )
    assert input_error(GARBAGE) == "cannot read input file /data/in/part-00000.parquet: footer is too large: 3366877235to be read"
    assert input_error("java.lang.OutOfMemoryError: Java heap space") is None


def test_a_local_file_says_what_type_its_column_has(tmp_path: Path) -> None:
    f = tmp_path / "part-00002.parquet"
    pq.write_table(pa.table({"ts": pa.array([1], pa.timestamp("ns", tz="UTC"))}), f, version="2.6")
    msg = input_error(NANOS.replace("/data/in/part-00002.parquet", str(f)))
    assert msg is not None and msg.endswith("(the file has ts: timestamp[ns, tz=UTC])") and "\n" not in msg


def test_policies_are_checked_by_name() -> None:
    for ok in ("fail", "skip", "dead_letter", None):
        check_on_error(ok, "x")
    with pytest.raises(JobDefinitionError, match="operator 'a': on_error must be one of 'fail', 'skip', 'dead_letter', not 'ignore'"):
        check_on_error("ignore", "operator 'a'")
    check_bound(None)
    with pytest.raises(JobDefinitionError, match="max_errors_per_batch"):
        check_bound(-1)


def test_nan_and_null_keys_and_event_times() -> None:
    assert null_key_mask(pa.chunked_array([[1.0, None, float("nan")]])).tolist() == [False, True, True]
    assert null_key_mask(pa.chunked_array([["a", None]])).tolist() == [False, True]
    from keyscale.operators.eventtime import max_event_within

    assert max_event_within(np.array([5.0, np.nan, 7.0]), None) == (7, 0)  # a null event time never moves the watermark
    assert max_event_within(np.array([np.nan]), None) == (None, 0)
    assert max_event_within(np.array([], dtype=np.int64), None) == (None, 0)


def test_failed_batch_is_replanned_at_an_explicit_parallelism() -> None:
    intent = BatchIntent(batch_time_ms=5, watermark_ms=1, parallelism={"reader": 2, "totals": 2, "rules": 1},
                         source_plan=(((0, 0, 10),), ((1, 0, 10),)))
    new, changed = replan_intent(intent, 4, ["totals"])
    assert changed == {"totals": (2, 4)}
    assert new.parallelism == {"reader": 2, "totals": 4, "rules": 1}  # the readers follow the source plan
    assert new == replace(intent, parallelism=new.parallelism, replanned_from={"totals": 2})  # time, watermark, source plan stay
    assert replan_intent(intent, None, ["totals"]) == (intent, {})
    assert replan_intent(intent, 2, ["totals"]) == (intent, {})

