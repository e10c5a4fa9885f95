"""The executor helpers in local mode (the cluster case is in test_cluster.py)."""

from __future__ import annotations

from typing import Any

import pytest

from keyscale.cluster import executor_cores, executor_ids, request_executors
from keyscale.errors import ClusterError


def test_local_mode_has_its_threads_as_cores_and_takes_no_requests(spark: Any) -> None:
    assert spark.sparkContext.master == "local[2]"
    assert executor_cores(spark) == 2
    assert executor_ids(spark) == []
    assert request_executors(spark, 4) is False
    with pytest.raises(ClusterError, match="must be 0 or more, got -1"):
        request_executors(spark, -1)
