"""A local cluster's record (keyscale.cluster.statefile): cluster.json and its folder's lock."""

from __future__ import annotations

from pathlib import Path

import pytest

from keyscale.cluster.records import ClusterInfo
from keyscale.cluster.statefile import (
    STATE_FILE,
    cluster_folder,
    locked,
    read_cluster,
    require,
    write_state,
)
from keyscale.errors import ClusterError


def _info(folder: Path) -> ClusterInfo:
    return ClusterInfo(folder, "spark://127.0.0.1:1", "http://127.0.0.1:2", 4_194_304 + 1, 1, 2,
                       folder / "logs" / "master.log", 5, (), 1)  # fmt: skip


def test_the_record_is_written_whole_and_read_back(tmp_path: Path) -> None:
    folder = cluster_folder(tmp_path)
    assert read_cluster(folder) is None
    with pytest.raises(ClusterError, match="no cluster in"):
        require(folder)
    with locked(folder):
        write_state(_info(folder))
    assert read_cluster(folder) == require(folder) == _info(folder)
    assert not list(folder.glob("*.tmp"))


def test_a_damaged_record_is_an_error_that_says_what_to_do(tmp_path: Path) -> None:
    (tmp_path / STATE_FILE).write_text("{")
    with pytest.raises(ClusterError, match=r"is damaged .* stop its processes by hand"):
        read_cluster(tmp_path)
