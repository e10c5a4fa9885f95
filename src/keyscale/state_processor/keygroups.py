"""Key groups as Spark computes them (``pmod(hash(key columns), M)``), vectorized in numpy.

The rule and its numpy form live in :mod:`keyscale.state.spark_hash`; this module keeps the
State Processor's name for it.

>>> import pyarrow as pa
>>> key_groups(pa.table({"k": ["a", "bcdef"]}), ["k"], ["string"], 128).tolist() == [key_group_of(["a"], ["string"], 128), key_group_of(["bcdef"], ["string"], 128)]
True
"""

from __future__ import annotations

from keyscale.state.spark_hash import key_group_of, key_groups

__all__ = ["key_group_of", "key_groups"]
