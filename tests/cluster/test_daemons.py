"""The Spark daemons of a local cluster (keyscale.cluster.daemons): the parts that need no JVM.
Starting and stopping real daemons is tested through keyscale.cluster.local (test_local.py)."""

from __future__ import annotations

from keyscale.cluster.daemons import alive_worker_ports, master_json
from keyscale.cluster.processes import free_ports


def test_only_alive_workers_count_as_registered() -> None:
    data = {"workers": [{"port": 1, "state": "ALIVE"}, {"port": 2, "state": "DEAD"}, {"state": "ALIVE"}]}
    assert alive_worker_ports(data) == {1, -1}
    assert alive_worker_ports({}) == set()


def test_a_master_that_does_not_answer_is_none() -> None:
    (port,) = free_ports(1)
    assert master_json(port, timeout=0.5) is None
