"""Replaying every batch after the checkpoint a restart fell back to (Spark sources).

After a fallback to checkpoint ``c`` Spark's offsets log may reach batch ``N > c + 1``. Spark
by itself would replay only ``N`` (see :mod:`keyscale.checkpoint.sparklog`), so the input of
``c+1 .. N-1`` would never be read again. Instead each of them is replayed alone: Spark's
offsets log is cut back to ``j`` and a query with a one-batch trigger runs, which replays
``j`` with its original input and batch id (keyscale's batch intent gives it its original
parallelism and time, so the sink's output for it is the same). Then the next one, and
finally the normal query replays ``N`` and goes on. An interruption leaves the later
offsets entries aside; the next start puts them back first.

Log sources need none of this: their input positions are in keyscale's own intents.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from keyscale.checkpoint import sparklog
from keyscale.checkpoint.jobdir import JobDir

log = logging.getLogger("keyscale")


def replay_spark_batches(jobdir: JobDir, after: int, run_once: Callable[[], None], stopping: Callable[[], bool]) -> list[int]:
    """Replay, one at a time, the batches Spark planned after checkpoint ``after`` except the
    newest (the normal start replays that one). ``run_once`` runs a query that executes one
    batch and returns; returns the batches replayed. Raises :class:`StateError` before
    anything runs when Spark no longer has the input of a batch to replay."""
    spark = jobdir.spark_checkpoint
    hidden = jobdir.spark_hidden
    sparklog.restore_hidden(spark, hidden)  # an interrupted replay: Spark's log whole again
    planned = sparklog.check_replayable(spark, after)
    todo = planned[:-1]
    if not todo:
        return []
    log.info(
        "replaying batches %d to %d one at a time (their checkpoints were lost), with their original input, then batch %d",
        todo[0], todo[-1], planned[-1],
    )
    done: list[int] = []
    try:
        for j in todo:
            if stopping():
                break
            sparklog.restore_hidden(spark, hidden, upto=j)  # j is Spark's newest batch ...
            sparklog.hide_offsets_after(spark, hidden, j)  # ... and the only one it may run
            run_once()
            if not jobdir.has_manifest(j):
                break  # stopped before the batch ran; the next start goes on from here
            done.append(j)
    finally:
        sparklog.restore_hidden(spark, hidden)
    return done
