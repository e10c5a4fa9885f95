"""What your functions are given: their contexts, state handles and batches.

Contexts, one per role (a function's methods are called with them; you never make one):

- :class:`RuntimeContext`: given to ``open`` of a keyed function; declares keyed state
  (``value_state``, ``list_state``, ``map_state``) and says where this instance runs;
- :class:`Context`: given to ``process`` and ``on_timer`` of a keyed function: the current
  key, the batch, its times, the :class:`TimerService` and any broadcast state;
- :class:`OperatorContext`: given to ``open`` and ``process`` of a non-keyed
  ``ProcessFunction``; declares operator state (:class:`OperatorListState`).

Keyed state, per key and moved with it on rescale: :class:`ValueState`,
:class:`ListState`, :class:`MapState`. A ``VectorizedKeyedFunction`` is given a
:class:`KeyedBatch` (a ``VectorizedKeyedCoProcessFunction`` a :class:`KeyedCoBatch`);
:data:`TIMER` is the column of its returned state that sets each key's timer.

They are defined in this package: the contexts in :mod:`~keyscale.state.contexts`, the handles in
:mod:`~keyscale.state.handles`, the batches in :mod:`~keyscale.state.batches`. (Its other
modules lay keyed state out in key groups; they are not API.)

>>> import keyscale as ks
>>> from keyscale.testing import KeyedHarness
>>> class Total(ks.KeyedProcessFunction):
...     def open(self, ctx: ks.state.RuntimeContext) -> None:
...         self.total = ctx.value_state("total", "long")
...     def process(self, key, rows, ctx: ks.state.Context):
...         self.total.update((self.total.value() or 0) + sum(r.clicks for r in rows))
...         return [(key, self.total.value())]
>>> h = KeyedHarness.of(Total(), key_by=["user"], input_schema="user string, clicks long",
...                     output_schema="user string, total long")
>>> h.process([{"user": "ann", "clicks": 2}, {"user": "ann", "clicks": 3}])
[{'user': 'ann', 'total': 5}]
>>> h.state("ann")
{'total': 5}
"""

from __future__ import annotations

from keyscale.state.batches import TIMER, KeyedBatch, KeyedCoBatch
from keyscale.state.contexts import Context, OperatorContext, RuntimeContext, TimerService
from keyscale.state.handles import ListState, MapState, OperatorListState, ValueState

__all__ = [
    "TIMER",
    "Context",
    "KeyedBatch",
    "KeyedCoBatch",
    "ListState",
    "MapState",
    "OperatorContext",
    "OperatorListState",
    "RuntimeContext",
    "TimerService",
    "ValueState",
]

