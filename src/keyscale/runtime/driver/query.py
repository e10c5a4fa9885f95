"""The Spark query that runs a job with a Spark source (driver process): its
``foreachBatch`` writer, its trigger, and how long its batches took.

Each batch Spark plans is handed to ``on_batch`` (``JobRunner._on_batch``), which commits
it through keyscale's protocol (``batch/commit.py``); Spark's own checkpoint location holds
only its offsets log, which ``checkpoint/sparklog.py`` keeps in step with keyscale's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from keyscale.runtime.batch import malformed
from keyscale.runtime.batch.jobstate import JobState
from keyscale.runtime.batch.malformed import check_malformed_modes
from keyscale.runtime.task.arrival import with_file_order
from keyscale.sources.reader import LogSource

if TYPE_CHECKING:
    from pyspark.sql import DataFrame
    from pyspark.sql.streaming.query import StreamingQuery

log = logging.getLogger("keyscale")


def spark_writer(job: JobState, on_batch: Callable[[DataFrame, int], None], once: bool = False) -> Any:
    """The job's streaming writer, not started: each batch to ``on_batch``; with ``once``, a
    query that runs the one batch Spark's offsets log ends with (a replay), else the run's
    trigger."""
    assert job.pipeline is not None
    source = job.pipeline.source
    assert not isinstance(source, LogSource)
    # A file source's rows carry their file and split (arrival.py): a batch's order is
    # then the files' whatever Spark's split, so a replay elsewhere sees it again.
    job.malformed = check_malformed_modes(source, warn=False)
    query, ordered = with_file_order(source, malformed.PATH if job.malformed else None)
    if not ordered and not once:
        log.info("the Spark source's rows have no file metadata (not a file source, or one behind an aggregate, a union or "
                 "mapInPandas): within a batch, keyed stages get their records in Spark's order, by partition (docs/guides/job.md, \"Arrival order\")")
    writer = (
        query.writeStream.foreachBatch(on_batch)
        .option("checkpointLocation", str(job.jobdir.spark_checkpoint))
        .queryName(f"keyscale_{job.name}_{job.run_id[:6]}")
    )
    if once:
        return writer.trigger(once=True)
    if job.opts.until_idle and job.pipeline.side_log is None:
        return writer.trigger(availableNow=True)
    # With a log beside the Spark source, "available now" would end before the log is
    # read: batches run every trigger interval, and the job ends on its first idle one.
    return writer.trigger(processingTime=job.opts.trigger_interval)


def trigger_seconds(query: StreamingQuery) -> list[float]:
    """How long each of the query's recent batches that read records took, by Spark's clock."""
    progress = sorted(query.recentProgress, key=lambda p: p.batchId)
    return [p.durationMs.get("triggerExecution", 0) / 1000 for p in progress if p.numInputRows > 0]
