"""Executor side: what runs inside a Spark task of a batch.

A keyed stage's subtask (:mod:`.keyed`, with the vectorized path in :mod:`.vectorized`) and
its state backends behind one interface (:mod:`.backend`: the worker's memory in
:mod:`.memory`, RocksDB in :mod:`.rocks`), a non-keyed subtask (:mod:`.nonkeyed`), both
wrapped as Spark tasks by :mod:`.spark`; a log source's reader (:mod:`.reader`); what a task
is given (:mod:`.spec`: ``StageTask``), gives back (:mod:`.report`: ``TaskReport``) and
uploads (:mod:`.upload`); the pure rules they share with the driver: grouping by key
(:mod:`.grouping`), arrival order (:mod:`.arrival`) and counters (:mod:`.counters`).
Nothing here imports the driver, the batch protocol or the control plane.
"""
