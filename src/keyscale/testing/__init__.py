"""Test your stages in milliseconds, without Spark: feed batches, move the clocks, read
what a stage emitted and its state, snapshot it and restore it at another parallelism.

A harness runs a stage's subtasks as a job does (the same task code, records routed to
subtasks as Spark routes them, state files in a temporary job directory), one batch per
``process`` call, so what holds here holds in the job: output that does not depend on
the parallelism, state that survives a restore.

- :class:`KeyedHarness`: a keyed stage (``KeyedProcessFunction``, ``VectorizedKeyedFunction``,
  ``aggregate``, ``window``).
- :class:`OperatorHarness`: a non-keyed ``ProcessFunction`` with its list state
  (split/merge or union on restore).
- :func:`run_job_file`: a whole job file (PySpark steps and all) on in-memory batches, with
  local Spark, each batch's output back.

>>> import keyscale as ks
>>> from keyscale.testing import KeyedHarness
>>> h = KeyedHarness.aggregate(key_by=["user"], input_schema="user string, clicks long", parallelism=2,
...                            n=ks.aggregates.count(), total=ks.aggregates.sum("clicks"))
>>> h.process([{"user": "ann", "clicks": 2}, {"user": "bob", "clicks": 1}, {"user": "ann", "clicks": 3}])
[{'user': 'ann', 'n': 2, 'total': 5}, {'user': 'bob', 'n': 1, 'total': 1}]
>>> h.state("ann")
{'n': 2, 'total': 5}
>>> h2 = h.snapshot().restore(parallelism=3)   # through the state files, at another parallelism
>>> h2.process([{"user": "ann", "clicks": 1}])
[{'user': 'ann', 'n': 3, 'total': 6}]
"""

from keyscale.testing.keyed import KeyedHarness, Snapshot
from keyscale.testing.nonkeyed import OperatorHarness, OperatorSnapshot
from keyscale.testing.pipeline import JobRun, run_job_file

__all__ = ["JobRun", "KeyedHarness", "OperatorHarness", "OperatorSnapshot", "Snapshot", "run_job_file"]
