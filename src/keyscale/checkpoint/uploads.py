"""Detached uploads of state files (asynchronous checkpoints): how long one may take, the
record a failed one leaves, and the wait for them that the driver's commit and the next
batch's tasks share.

Apart from :mod:`keyscale.checkpoint.files` (the format and a state file's write) because
these rules are about *when* a file is in the store, read by processes other than the one
uploading it, not about its bytes.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress

from keyscale._env import env_number
from keyscale.checkpoint.manifest import StateFile
from keyscale.errors import StateError
from keyscale.storage import Store

__all__ = [
    "BEAT_SECONDS",
    "SILENCE_SECONDS",
    "UPLOADING",
    "UPLOAD_FAILED",
    "heartbeat",
    "record_upload_failure",
    "upload_failure",
    "upload_timeout",
    "wait_stored",
]


def upload_timeout() -> float:
    """Seconds a state file of a batch whose task has ended may take to appear in the store
    (asynchronous checkpoints): ``KEYSCALE_UPLOAD_TIMEOUT``, 600 by default."""
    return env_number("KEYSCALE_UPLOAD_TIMEOUT", 600, "seconds", above=0)


# Beside a state file whose detached upload failed: ``<file>.failed``, the upload's error.
UPLOAD_FAILED = ".failed"


def record_upload_failure(store: Store, rel_path: str, error: BaseException) -> bool:
    """Leave a record that the upload of state file ``rel_path`` failed with ``error``, so
    that whoever waits for the file (:func:`wait_stored`) fails at once instead of after
    ``KEYSCALE_UPLOAD_TIMEOUT``. Returns False if the record could not be written either (the
    store refusing every write): the waiters then time out, as without it.

    Why a record in the store rather than a message to the driver: the waiters are the
    driver's commit thread and the next batch's tasks, on other machines, and the store is
    the one thing they all read, on local disk and on S3 alike. The state file's name is
    its attempt's own (:func:`keyscale.runtime.task.spec.state_file_name`) and that attempt
    never uploads it again, so a record means the file will not come. Retention's sweep
    deletes it with the batch's other unnamed files (its name starts with the batch)."""
    record = {"error": f"{type(error).__name__}: {error}", "pid": os.getpid(), "time_ms": int(time.time() * 1000)}
    try:
        store.put(rel_path + UPLOAD_FAILED, json.dumps(record).encode(), durable=False)
    except Exception:  # the store refuses this write too: the waiters' timeout is left
        return False
    return True


def upload_failure(store: Store, rel_path: str) -> str | None:
    """The error of a failed upload of ``rel_path`` (see :func:`record_upload_failure`), else None."""
    data = store.get_or_none(rel_path + UPLOAD_FAILED)
    if data is None:
        return None
    try:
        return str(json.loads(data)["error"])
    except (ValueError, KeyError, TypeError):
        return "(its failure record is unreadable)"


# Beside a state file whose detached upload is taking long: ``<file>.uploading``, a count
# its uploader moves on every BEAT_SECONDS (from BEAT_SECONDS after the upload began), so
# that the waiters can tell a slow upload from one whose worker is gone.
UPLOADING = ".uploading"
BEAT_SECONDS = 5.0
# A waiter that has seen neither the file nor a new beat for this long takes the upload as
# lost: its Python worker died, or its executor was lost or killed (a spot node going away),
# and no failure record will come. Four beats: a worker starved of CPU for seconds is not dead.
SILENCE_SECONDS = 20.0


@contextmanager
def heartbeat(store: Store, rel_paths: list[str], every: float = BEAT_SECONDS) -> Iterator[None]:
    """While the block uploads ``rel_paths``: from ``every`` seconds on, a beat beside each
    one every ``every`` seconds (:data:`UPLOADING`), removed at the end. An upload done
    within ``every`` seconds, as most are, writes none. Best effort: a beat the store
    refuses is skipped (the waiters then take the upload as lost after
    :data:`SILENCE_SECONDS` and the batch is replayed, as for a failed upload)."""
    done = threading.Event()
    wrote: set[str] = set()

    def beat() -> None:
        n = 0
        while not done.wait(every):
            n += 1
            for rel in rel_paths:
                if not store.exists(rel):
                    try:
                        store.put(rel + UPLOADING, json.dumps({"beat": n, "pid": os.getpid()}).encode(), durable=False)
                        wrote.add(rel)
                    except Exception:  # the store refuses it: a missed beat
                        pass

    t = threading.Thread(target=beat, name="keyscale-upload-beat", daemon=True)
    t.start()
    try:
        yield
    finally:
        done.set()
        t.join()
        for rel in wrote:
            with suppress(Exception):  # retention's sweep removes it with the batch's other unnamed files
                store.delete(rel + UPLOADING)


def wait_stored(store: Store, files: Iterable[StateFile], timeout: float, what: str, silence: float = SILENCE_SECONDS) -> None:
    """Return once every file of ``files`` is in ``store``; raise :class:`StateError` naming
    the first one still missing after ``timeout`` seconds, at once naming one whose upload
    left a failure record (:func:`record_upload_failure`), or naming one whose upload has
    been silent for ``silence`` seconds: no file and no new beat of its uploader's
    :func:`heartbeat` (a worker or executor gone leaves no failure record).

    Silence is timed on the waiter's own clock from the beats it sees change, so the
    uploader's and the waiter's clocks need not agree.

    Used when a state file's upload outlives its task (asynchronous checkpoints): a store's
    put is atomic (a local file is renamed into place, an object appears whole), so a file
    that exists is complete. A file present wins over a failure record (an upload reported
    as failed may have landed): the record only makes a wait end sooner, never makes a
    commit name a file that is not there. ``what`` says who waits, for the error."""
    missing = list(files)
    began = time.monotonic()
    deadline = began + timeout
    beats: dict[str, tuple[bytes | None, float]] = {}  # per file: its last beat seen, and since when
    looked = began
    pause = 0.01
    while missing:
        missing = [f for f in missing if not store.exists(f.path)]
        if not missing:
            return
        for f in missing:
            error = upload_failure(store, f.path)
            if error is not None:
                raise StateError(
                    f"state file {store.url(f.path)} of batch {f.batch} was not stored: its upload failed ({error}) ({what}). "
                    "The batch is replayed from its intent at the next start")
        now = time.monotonic()
        if now - looked >= min(BEAT_SECONDS, silence) / 2:  # a beat at most every few seconds: no request each poll
            looked = now
            for f in missing:
                beat = store.get_or_none(f.path + UPLOADING)
                seen, since = beats.get(f.path, (None, began))
                if beat != seen:
                    beats[f.path] = (beat, now)
                elif now - since >= silence and not store.exists(f.path):
                    raise StateError(
                        f"state file {store.url(f.path)} of batch {f.batch} was not stored and its upload has been silent for "
                        f"{now - since:.0f} s ({what}): the Python worker uploading it is gone (it died, or its executor was "
                        "lost or released). The batch is replayed from its intent at the next start")
        if time.monotonic() >= deadline:
            f = missing[0]
            raise StateError(
                f"state file {store.url(f.path)} of batch {f.batch} was not stored within {timeout:g} s of its task's end "
                f"({what}); the worker uploading it may have died. The batch is replayed from its intent at the next start "
                "(KEYSCALE_UPLOAD_TIMEOUT sets the wait)")
        time.sleep(pause)
        pause = min(pause * 2, 0.5)
