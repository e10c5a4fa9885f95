"""Which state backend keeps an operator's keyed state: ``"memory"`` (default) or ``"rocksdb"``.

``memory`` keeps every key of a subtask's key groups in the Python worker, in a compact
columnar table (:mod:`keyscale.state.table`): fastest, bounded by the executors' memory.
``rocksdb`` keeps them in a RocksDB on the executor's local disk (:mod:`keyscale.state.rocksdb`,
:mod:`keyscale.runtime.task.rocks`): a batch reads and writes only its own keys, and the
memory it keeps is bounded by configuration and by the batch's working set, whatever the
state's size (100M keys: docs/benchmarks.md, "100M keys"). Both write the same checkpoint
files and savepoints, so a job can switch between them at a restart.

>>> check_state_backend("rocksdb", "operator 'counts'")
'rocksdb'
>>> check_state_backend("disk", "operator 'counts'")
Traceback (most recent call last):
...
keyscale.errors.JobDefinitionError: operator 'counts': state_backend must be 'memory' or 'rocksdb', not 'disk'
"""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa

from keyscale.errors import JobDefinitionError

STATE_BACKENDS = ("memory", "rocksdb")
DEFAULT_STATE_BACKEND = "memory"


def check_state_backend(value: object, where: str) -> str:
    """``value`` if it names a state backend this installation can run, else a clear error
    saying ``where`` (the operator, or the job's option)."""
    if value not in STATE_BACKENDS:
        raise JobDefinitionError(f"{where}: state_backend must be 'memory' or 'rocksdb', not {value!r}")
    if value == "rocksdb":
        try:
            import rocksdict  # noqa: F401
        except ImportError as e:
            raise JobDefinitionError(f"{where}: state_backend='rocksdb' needs the rocksdict package: pip install 'keyscale[rocksdb]'") from e
    return str(value)


def check_rocksdb_keys(uid: str, columns: Sequence[tuple[str, pa.DataType]]) -> None:
    """The RocksDB backend orders keys by their bytes: say which key column it cannot encode."""
    from keyscale.state.rockskeys import key_supported

    for name, t in columns:
        if not key_supported(t):
            raise JobDefinitionError(
                f"operator '{uid}': the rocksdb state backend cannot key by column '{name}' of type {t} "
                "(numbers, booleans, strings, binary, dates and timestamps only); use state_backend='memory' for it"
            )
