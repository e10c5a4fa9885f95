"""The partitioned-log interface (keyscale.sources.partitioned): what every backend shares."""

from __future__ import annotations

import doctest

import pyarrow as pa
import pytest

import keyscale.sources.partitioned as partitioned_module
from keyscale.errors import InputDataError
from keyscale.sources import LocalLog, LogError, PartitionedLog, RedisLog
from keyscale.sources.partitioned import check_count, check_schema, first_line


def test_docstring_examples_run() -> None:
    result = doctest.testmod(partitioned_module)
    assert result.failed == 0 and result.attempted >= 1


def test_both_backends_implement_the_interface_and_the_package_exports_it() -> None:
    assert issubclass(LocalLog, PartitionedLog) and issubclass(RedisLog, PartitionedLog)
    assert LogError is partitioned_module.LogError


def test_the_shared_checks() -> None:
    assert check_schema("k string").names == ["k"]
    with pytest.raises((InputDataError, LogError)):
        check_count("the number of partitions", 0, 1)
    assert first_line(ValueError("one\ntwo")) == "one"
    assert first_line(ValueError("")) == "ValueError"
    assert check_schema(pa.schema([("a", pa.int64())])).names == ["a"]
