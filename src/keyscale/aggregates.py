"""Aggregates: what ``aggregate(...)`` computes per key, running or per window.

Each call names a column (``count()`` needs none) and returns an aggregate to pass as a
keyword of ``KeyedStream.aggregate`` (a running aggregate, one output row per key and
batch) or ``WindowedStream.aggregate`` (one row per key and window); the keyword is the
output column. ``reduce(column, fn)`` is a custom reduction and works in windows only.

Read them through the module, ``ks.aggregates.sum("value")``: the names ``sum``, ``min``,
``max`` and ``reduce`` are Python's own builtins (and functools') at the call site.

>>> import keyscale as ks
>>> from keyscale.testing import KeyedHarness
>>> h = KeyedHarness.aggregate(key_by=["user"], input_schema="user string, clicks long",
...                            n=ks.aggregates.count(), total=ks.aggregates.sum("clicks"),
...                            most=ks.aggregates.max("clicks"))
>>> h.process([{"user": "ann", "clicks": 2}, {"user": "ann", "clicks": 5}, {"user": "bob", "clicks": 1}])
[{'user': 'ann', 'n': 2, 'total': 7, 'most': 5}, {'user': 'bob', 'n': 1, 'total': 1, 'most': 1}]
"""

from keyscale.operators.vectorized import count, first, last, max, mean, min, sum
from keyscale.operators.windows import reduce

__all__ = ["count", "first", "last", "max", "mean", "min", "reduce", "sum"]
