"""A stage's subtask as a Spark task (``mapInArrow``): partition ``i`` is subtask ``i``;
errors leave it named (operator, batch, subtask) in one line; the state file's upload
overlaps the output's streaming, and the task reports only once the file is stored (with
asynchronous checkpoints, it reports at once and the upload goes on after the task)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from keyscale.errors import KeyscaleError, decode_error, encode_error
from keyscale.operators.poison import FAIL, ErrorCollector
from keyscale.runtime.task import report as reports
from keyscale.runtime.task.keyed import SEQ, StageTask, run_subtask_deferred
from keyscale.runtime.task.profiling import profiled
from keyscale.runtime.task.report import TaskReport
from keyscale.runtime.task.spec import check_shipped
from keyscale.runtime.task.upload import Upload


def as_spark_task(
    run: Callable[[Any, Iterator[pa.RecordBatch], int], tuple[pa.Table, TaskReport, Upload | None]], spec: Any,
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """A ``mapInArrow`` function: partition ``i`` of the stage's input is subtask ``i``.

    The subtask's state file uploads while its output streams on to the sink; the task
    reports (and so ends) only once the upload is done: a batch's manifest never names a
    file that is not durable."""

    def stage(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        tc = TaskContext.get()
        subtask = tc.partitionId() if tc is not None else 0
        with _named_errors(spec, subtask):
            check_shipped(spec)
        with _named_errors(spec, subtask), profiled(f"task-{spec.uid}"):
            out, report, upload = run(spec, batches, subtask)
        yield from out.to_batches()
        if upload is not None:
            with _named_errors(spec, subtask):
                if spec.detach_upload:
                    upload.detach()  # asynchronous checkpoints: the driver commits once the file exists
                else:
                    upload.wait()
                    report = replace(report, store_requests=dict(spec.store.requests))  # with the upload's
        reports.send(spec.report_to, spec.uid, spec.batch_id, subtask, report)

    return stage


@contextmanager
def _named_errors(spec: Any, subtask: int) -> Iterator[None]:
    """Never a raw numpy/pandas/user exception: name the operator and batch, in one
    recognisable line that survives Spark's wrapping of the Python traceback."""
    try:
        try:
            yield
        except KeyscaleError:
            raise
        except Exception as e:
            if isinstance(e, RuntimeError) and decode_error(str(e)) is not None:
                raise  # named where it happened: the log's reader, chained before the stage (runtime/task/reader.py)
            ErrorCollector(FAIL, spec.uid, spec.batch_id, subtask).fail_batch(e)
            raise
    except KeyscaleError as e:
        raise RuntimeError(encode_error(e)) from None


def make_stage_function(spec: StageTask) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """The function given to ``DataFrame.mapInArrow`` for this keyed stage and batch."""

    def run(spec: StageTask, batches: Iterator[pa.RecordBatch], subtask: int) -> tuple[pa.Table, TaskReport, Upload | None]:
        return run_subtask_deferred(spec, _without_markers(batches), subtask)

    return as_spark_task(run, spec)


def _without_markers(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """The stage's input rows without the marker row each subtask gets (runtime/batch/stages.py)."""
    for b in batches:
        keep = pc.greater_equal(b.column(SEQ), pa.scalar(0, pa.int64()))
        yield b if pc.all(keep).as_py() else b.filter(keep)


# How long a start_worker task holds its worker (start_worker: why).
WORKER_HOLD_SECONDS = 0.3


def start_worker(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """A ``mapInArrow`` function that starts the Python worker it runs in, as a stage task
    would (this module's imports: pyarrow, pandas, keyscale's task side), and holds it for
    ``WORKER_HOLD_SECONDS``, so that the tasks of one such job run in as many workers at once
    as there are free cores (``runtime/batch/parallelism.py`` ``start_workers``: why)."""
    import time

    for _ in batches:
        pass
    time.sleep(WORKER_HOLD_SECONDS)
    yield from ()

