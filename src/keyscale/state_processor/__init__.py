"""The State Processor API: read, write and re-key keyed state outside a running job.

On Spark DataFrames, in the spirit of Flink's State Processor API:

- :func:`read_keyed_state` reads one operator's keyed state from a savepoint or from a
  job directory's checkpoint, as a DataFrame (list and map states flattened);
- :func:`write_savepoint_from_dataframes` bootstraps a savepoint from DataFrames (or
  pandas / Arrow tables), e.g. to start a job with state computed from a historical table;
- :func:`rekey_savepoint` rewrites a savepoint for another max parallelism (number of key
  groups), the one change Flink cannot make to existing state;
- :func:`inspect_savepoint` summarises a savepoint (``keyscale inspect SP``);
- :class:`StateLookup` answers what one key holds at a job directory's committed checkpoint,
  reading only its key group by byte range (``keyscale state get``, ``JobHandle.state``,
  the control API's ``GET /state/<uid>?key=...``);
- :func:`register` makes the ``keyscale`` Spark data source known to a session:
  ``spark.read.format("keyscale").option("uid", U).load(PATH)`` reads an operator's state
  in Spark's tasks, one key-group range each, key filters pruning key groups; with
  ``changes_from``/``changes_to`` it reads the change feed between two checkpoints;
- :func:`diff_savepoints` (``keyscale state diff``), :func:`diff_rows` and :func:`diff_state`
  compare one operator's state in two savepoints or checkpoints, at any parallelism and max
  parallelism: keys only in A, only in B, and changed;
- :func:`patch_state` (``keyscale state patch``) writes a new savepoint from an existing one
  with keys set, changed or deleted, checked against the operator's state types and
  recorded in the savepoint's metadata.

Savepoints and job directories are local paths, ``file://`` or object store URIs
(``s3://...``); every function reads and writes through :mod:`keyscale.storage`.

Key groups are Spark's ``pmod(hash(key columns), M)``. :func:`key_groups` computes them
for an Arrow table in numpy, bit for bit as Spark does (checked against Spark in the tests);
the rule and all its forms live in :mod:`keyscale.state.spark_hash`.

Modules: :mod:`.keygroups` (:func:`key_groups` under its State Processor name), :mod:`.read` (state as DataFrames),
:mod:`.bootstrap` (savepoints from tables), :mod:`.rekey` (re-keying and inspecting), :mod:`.lookup`
(point lookups), :mod:`.scan` (scans by key-group range), :mod:`.changes` (the change feed),
:mod:`.datasource` (the Spark data source), :mod:`.compare` and :mod:`.diff` (diffs),
:mod:`.patch` (validated edits).

>>> import tempfile, pyarrow as pa
>>> from pathlib import Path
>>> root = Path(tempfile.mkdtemp())
>>> table = pa.table({"user": ["ann", "bob"], "clicks": [3, 5]})
>>> sp = write_savepoint_from_dataframes(root / "sp", "clicks",
...                                      {"count": (table, ["user"], {"clicks": "long"})}, 128)
>>> print(inspect_savepoint(sp).splitlines()[2])
operator 'count': max parallelism 128 (bootstrapped)
>>> sp32 = rekey_savepoint(sp, root / "sp32", 32)
>>> import pyarrow.parquet as pq
>>> sorted(pq.read_table(Path(sp32) / "operators" / "count").to_pylist(), key=lambda r: r["user"])
[{'user': 'ann', 'key_group': 18, 'clicks': 3}, {'user': 'bob', 'key_group': 21, 'clicks': 5}]
"""

from keyscale.state_processor.bootstrap import BootstrapOperators, write_savepoint_from_dataframes
from keyscale.state_processor.datasource import register
from keyscale.state_processor.diff import StateDiff, diff_rows, diff_savepoints, diff_state
from keyscale.state_processor.keygroups import key_groups
from keyscale.state_processor.lookup import StateLookup
from keyscale.state_processor.patch import patch_state
from keyscale.state_processor.read import read_keyed_state
from keyscale.state_processor.rekey import inspect_savepoint, rekey_savepoint

__all__ = [
    "BootstrapOperators",
    "StateDiff",
    "StateLookup",
    "diff_rows",
    "diff_savepoints",
    "diff_state",
    "inspect_savepoint",
    "key_groups",
    "patch_state",
    "read_keyed_state",
    "register",
    "rekey_savepoint",
    "write_savepoint_from_dataframes",
]
