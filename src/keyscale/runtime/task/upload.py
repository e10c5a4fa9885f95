"""A state file's upload from a task, and handing a batch's freed memory back to the system.

The task starts the upload of the state file it wrote (:class:`Upload`) and either waits for
it before it reports or, with asynchronous checkpoints, leaves it running past its end
(docs/design.md, "Asynchronous checkpoints: a commit one batch behind"). Called by
:mod:`keyscale.runtime.task.keyed` and :mod:`keyscale.runtime.task.spark`.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pyarrow as pa

from keyscale._faults import fault_point
from keyscale.checkpoint.encode import put_state_file
from keyscale.checkpoint.uploads import heartbeat, record_upload_failure
from keyscale.runtime.task.spec import StageTask
from keyscale.storage.scratch import remove_scratch


def _libc() -> Any:
    try:
        lib = ctypes.CDLL(None)
        return lib if hasattr(lib, "malloc_trim") else None  # glibc only
    except OSError:
        return None


_LIBC = _libc()


def release_free_memory() -> None:
    """Hand the memory a batch's temporaries freed back to the system. glibc keeps freed
    heap pages and Arrow's pool its freed segments for reuse; in a worker that idles
    between batches they only inflate its RSS (measured, 1M keys of a running count:
    ~90 bytes per key of state, more than the state itself; docs/benchmarks.md)."""
    pa.default_memory_pool().release_unused()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


class Upload:
    """The upload of a task's state files (a delta, a snapshot, or a snapshot and the delta
    beside it), one after the other in a thread of the task (obstore and file writes
    release the GIL).

    The task either waits for it (:meth:`wait`: the task reports once the files are stored) or,
    with asynchronous checkpoints (``spec.detach_upload``), leaves it running (:meth:`detach`):
    the worker process outlives the task, and the driver commits the batch's manifest once
    the files exist."""

    def __init__(self, spec: StageTask, files: list[tuple[str, bytes | Path]]):
        self._error: BaseException | None = None
        self._task_over = threading.Event()

        def put() -> None:
            stored = 0
            # Detached, the waiters are the driver's commit and the next batch's tasks: a
            # slow upload beats, so that they can tell it from one whose worker is gone.
            beating = heartbeat(spec.store, [rel for rel, _ in files]) if spec.detach_upload else nullcontext()
            try:
                with beating:
                    self._test_fault(spec)
                    for rel_path, data in files:
                        put_state_file(spec.store, rel_path, data)
                        stored += 1
            except BaseException as e:  # handed to wait(), in the task's own thread
                self._error = e
            finally:
                for _, data in files:
                    if isinstance(data, Path):  # a spilled file: its folder goes with it
                        remove_scratch(data.parent)
                if spec.detach_upload:
                    release_free_memory()
                error = self._error
                if spec.detach_upload and error is not None:
                    # The task may be over, and the driver's commit and the next batch's tasks
                    # wait for its files: a failure record beside each one not stored ends
                    # their wait at once with this error; the batch is replayed at the next start.
                    for rel_path, _ in files[stored:]:
                        recorded = record_upload_failure(spec.store, rel_path, error)
                        print(f"keyscale: uploading state file {rel_path} failed: {error}"
                              f"{'' if recorded else ' (and so did writing its failure record: the waiters time out)'}",
                              file=sys.stderr, flush=True)

        self._thread = threading.Thread(target=put, name="keyscale-upload", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        self._thread.join()
        # The output has streamed on by now (its buffers and the file's bytes are free):
        # from this thread, the one that freed them (Arrow's pool returns a thread's pages
        # only when that thread asks).
        release_free_memory()
        if self._error is not None:
            raise self._error

    def detach(self) -> None:
        """The task ends; the upload goes on (asynchronous checkpoints). An upload that has
        already failed fails the task instead."""
        self._task_over.set()
        if not self._thread.is_alive() and self._error is not None:
            raise self._error

    def _test_fault(self, spec: StageTask) -> None:
        """Test-only faults (``--fault``, keyscale/_faults.py) in an upload."""
        if spec.fault == "mid-upload" and spec.driver_pid:
            if spec.detach_upload:  # the task has ended: the driver is on to the next batch
                time.sleep(3)
            fault_point("mid-upload", spec.driver_pid)
        if spec.fault in ("worker-dies-mid-upload", "slow-upload", "fail-upload") and spec.detach_upload:
            self._task_over.wait()  # its report on its way to the driver
            time.sleep(2)
            if spec.fault == "worker-dies-mid-upload":
                fault_point("worker-dies-mid-upload")  # this Python worker, its task over
            if spec.fault == "slow-upload":
                fault_point("slow-upload")
            if spec.fault == "fail-upload":
                fault_point("fail-upload")
