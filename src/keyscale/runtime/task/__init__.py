"""Executor side: what runs inside a Spark task of a batch.

A keyed stage's subtask (:mod:`.keyed`, with the RocksDB backend in :mod:`.rocks` and the
vectorized path in :mod:`.vectorized`), a non-keyed one (:mod:`.nonkeyed`), both wrapped as
Spark tasks by :mod:`.spark`; a log source's reader (:mod:`.reader`); what a task is given
(:mod:`.spec`: ``StageTask``) and gives back (:mod:`.report`: ``TaskReport``); the pure rules they share with the driver: grouping by key
(:mod:`.grouping`), arrival order (:mod:`.arrival`) and counters (:mod:`.counters`).
Nothing here imports the driver, the batch protocol or the control plane.
"""
