"""A local cluster's folder and its record: ``cluster.json`` (master URL, PIDs, ports and
cores of every daemon) read and written whole, the lock that serialises changes to one
folder's cluster across processes, and the checks that a cluster is recorded and its
master runs. The daemons are :mod:`keyscale.cluster.daemons`; what a caller does with a
cluster (start, add a worker, stop, status) is :mod:`keyscale.cluster.local`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from pathlib import Path

from keyscale.cluster.processes import alive
from keyscale.cluster.records import ClusterInfo
from keyscale.errors import ClusterError

__all__ = ["STATE_FILE", "cluster_folder", "locked", "read_cluster", "require", "require_running", "write_state"]

STATE_FILE = "cluster.json"


def cluster_folder(folder: str | os.PathLike[str]) -> Path:
    return Path(folder).expanduser().resolve()


@contextlib.contextmanager
def locked(folder: Path) -> Iterator[None]:
    """Serialise changes to one folder's cluster (start, add, stop) across processes."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".cluster.lock", "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def read_cluster(folder: str | os.PathLike[str]) -> ClusterInfo | None:
    """The cluster recorded in ``folder``, or ``None`` if none was started there (or it was stopped).

    >>> import tempfile
    >>> read_cluster(tempfile.mkdtemp()) is None
    True
    """
    path = cluster_folder(folder)
    try:
        text = (path / STATE_FILE).read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ClusterError(f"cannot read {path / STATE_FILE}: {e.strerror or e}") from None
    try:
        return ClusterInfo.from_dict(path, json.loads(text))
    except (ValueError, KeyError, TypeError) as e:
        raise ClusterError(f"{path / STATE_FILE} is damaged ({e}); stop its processes by hand and delete it") from None


def write_state(info: ClusterInfo) -> None:
    """Record ``info`` in its folder's ``cluster.json`` (a whole new file, renamed in)."""
    path = info.folder / STATE_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(info.to_dict(), indent=1) + "\n")
    os.replace(tmp, path)


def require(folder: Path) -> ClusterInfo:
    info = read_cluster(folder)
    if info is None:
        raise ClusterError(f"no cluster in {folder}; start one with: keyscale cluster start --dir {folder}")
    return info


def require_running(folder: Path) -> ClusterInfo:
    info = require(folder)
    if not alive(info.master_pid, info.master_started):
        raise ClusterError(
            f"the Spark master of the cluster in {folder} is not running (see {info.master_log}); "
            f"stop the cluster and start it again"
        )
    return info
