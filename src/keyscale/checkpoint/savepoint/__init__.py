"""Savepoints: self-contained, relocatable, parallelism-independent copies of a job's state.

A savepoint is a folder or an object store prefix (the format is documented in
``docs/savepoint-format.md``)::

    SAVEPOINT/
      _metadata.json                        job, batch, operators, states, files, sha256s
      operators/<uid>/kg-<start>-<end>.parquet   keys, key_group, one column per state
      source/spark/                         Spark's checkpoint up to the savepoint's batch

Every path inside is relative, so it can be copied or moved anywhere (local disk, S3, and
back). Data files hold the state *per key group*, not per subtask, so a savepoint restores
at any parallelism ``1..M`` (``M`` = max parallelism). They are plain Parquet, sorted by
key group then key, with deleted keys left out: any Parquet reader can read them. A
savepoint is complete exactly when its ``_metadata.json`` exists: it is written last, and
only if absent.

This package is the library behind ``keyscale savepoint``, ``keyscale run
--from-savepoint`` and ``keyscale inspect``; its modules:

- :mod:`.schema`: Arrow type strings, Spark SQL type names, schema evolution rules;
- :mod:`.format`: the metadata (:class:`SavepointInfo`), :func:`read_savepoint` (parse
  and verify), data file names and order;
- :mod:`.write`: the writing protocol and :func:`write_savepoint` (a savepoint of a
  committed checkpoint of a job directory);
- :mod:`.restore`: :func:`restore_savepoint` (a new job directory from a savepoint);
- :mod:`.progress`: :func:`text_progress`, the progress bar the CLI passes as ``progress``.

Locations are local paths, ``file://`` or object store URIs (``s3://...``), or Stores; the
job directory and the savepoint may be on different ones.

>>> import tempfile, pyarrow as pa
>>> from pathlib import Path
>>> from keyscale.checkpoint.jobdir import JobDir
>>> from keyscale.checkpoint.manifest import Manifest, OperatorCheckpoint
>>> from keyscale.checkpoint.encode import write_state_file
>>> from keyscale.state.keygroups import KeyGroupRange
>>> from keyscale.state.types import StateDescriptor
>>> root = Path(tempfile.mkdtemp())
>>> jd = JobDir(root / "job"); _ = jd.claim("counts", 8, 8)
>>> rows = pa.table({"key": ["a", "b"], "__kg": pa.array([1, 5], pa.int32()), "n": [3, 4]})
>>> f = write_state_file(jd.store, "state/count/000000000000-s00000-snapshot.arrow", rows,
...                      "snapshot", 0, KeyGroupRange(0, 7))
>>> n = StateDescriptor("n", "value", pa.int64())
>>> op = OperatorCheckpoint("count", 8, 1, (("key", "string"),), (n.to_json(),), (f,))
>>> m = jd.commit(Manifest("counts", 0, 0, {"count": op}))
>>> sp = write_savepoint(jd, m, root / "sp")
>>> info = read_savepoint(sp)
>>> info.batch, info.operators["count"].rows, info.source
(0, 2, None)
>>> new = JobDir(root / "job2"); _ = new.claim("counts", 8, 8)
>>> spec = OperatorSpec((("key", pa.string()),), (n,))
>>> restored = restore_savepoint(sp, new, "counts", {"count": spec})
>>> restored.batch, [x.rows for x in restored.operators["count"].files]
(-1, [2])
"""

from keyscale.checkpoint.savepoint.format import (
    DEFAULT_ROWS_PER_FILE,
    FORMAT,
    FORMAT_VERSION,
    KEY_GROUP_COLUMN,
    METADATA_FILE,
    SOURCE_DIR,
    Location,
    SavepointFile,
    SavepointInfo,
    SavepointOperator,
    canonical_order,
    chunk_ranges,
    data_file_name,
    read_data_file,
    read_savepoint,
)
from keyscale.checkpoint.savepoint.progress import Progress, text_progress
from keyscale.checkpoint.savepoint.restore import OperatorSpec, restore_savepoint
from keyscale.checkpoint.savepoint.schema import (
    evolution_problem,
    parse_arrow_type,
    spark_type_name,
)
from keyscale.checkpoint.savepoint.write import (
    begin_savepoint,
    checkpoint_rows_per_key_group,
    checkpoint_types,
    finish_savepoint,
    new_savepoint,
    restore_key_groups,
    write_data_file,
    write_savepoint,
)

__all__ = [
    "DEFAULT_ROWS_PER_FILE",
    "FORMAT",
    "FORMAT_VERSION",
    "KEY_GROUP_COLUMN",
    "METADATA_FILE",
    "SOURCE_DIR",
    "Location",
    "OperatorSpec",
    "Progress",
    "SavepointFile",
    "SavepointInfo",
    "SavepointOperator",
    "begin_savepoint",
    "canonical_order",
    "checkpoint_rows_per_key_group",
    "checkpoint_types",
    "chunk_ranges",
    "data_file_name",
    "evolution_problem",
    "finish_savepoint",
    "new_savepoint",
    "parse_arrow_type",
    "read_data_file",
    "read_savepoint",
    "restore_key_groups",
    "restore_savepoint",
    "spark_type_name",
    "text_progress",
    "write_data_file",
    "write_savepoint",
]
