"""A drained savepoint that restores with no batch lost, and event time that resumes.

A drain (``stop --drain``, ``--drain-at-end``) runs one last keyscale batch, ``d``, with no
input and the watermark at the end of time. Its id is the next after the committed one,
which Spark may already have planned with real input (a stop refuses a batch after Spark
wrote its offsets), or will plan when the job is restored. So the drain's manifest records
the last Spark batch the job consumed (``d - 1``), and a savepoint of it carries Spark's
log only up to that batch plus an *empty* batch ``d``: offsets equal to ``d - 1``'s and a
commit. Restored, Spark's next batch is ``d + 1`` and reads exactly the input after
``d - 1``: what the refused batch had planned, and anything newer.

Event time after a drained restore resumes at the watermark from before the drain (the
drain's end of time is not state, it is the act of ending). Windows and timers the drain
fired are gone from state: a record that is on time for such a window (behind the old
watermark it is late, as always) opens it again, and it fires again with only the records
that came after the restore, like a late firing. Windows after the drain's are the same as
in a run without the drain.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

from keyscale.checkpoint.manifest import Manifest

DRAIN_KEY = "drain"


def drain_extra(watermark_before: dict[str, Any], batch: int) -> dict[str, Any]:
    """What a drain's manifest records besides ``drained``: the watermark state the job had
    before the drain and the last Spark batch it consumed.

    >>> drain_extra({"watermark_ms": 5}, 3)
    {'drained': True, 'drain': {'spark_batch': 2, 'watermark': {'watermark_ms': 5}}}
    """
    return {"drained": True, DRAIN_KEY: {"spark_batch": batch - 1, "watermark": dict(watermark_before)}}


def spark_log_end(manifest: Manifest) -> int:
    """The last Spark batch whose input ``manifest``'s state includes."""
    info = manifest.extra.get(DRAIN_KEY) if manifest.extra.get("drained") else None
    if isinstance(info, dict) and "spark_batch" in info:
        return int(info["spark_batch"])
    return manifest.batch


def restored_event_time(checkpoint_extra: Mapping[str, Any]) -> tuple[dict[str, Any], int | None]:
    """The event-time entries of a restored manifest's ``extra`` and its watermark: a drained
    savepoint resumes at the watermark from before its drain and is not drained itself.

    >>> restored_event_time({"watermark": {"watermark_ms": 9}})
    ({'watermark': {'watermark_ms': 9}}, 9)
    >>> restored_event_time(drain_extra({"watermark_ms": 5, "inputs": {}}, 3) | {"watermark": {"watermark_ms": 99}})
    ({'watermark': {'watermark_ms': 5, 'inputs': {}}}, 5)
    """
    wm = checkpoint_extra.get("watermark")
    info = checkpoint_extra.get(DRAIN_KEY)
    if checkpoint_extra.get("drained"):
        wm = info.get("watermark") if isinstance(info, dict) else None
    out = {"watermark": wm} if wm else {}
    return out, (int(wm["watermark_ms"]) if wm else None)


def add_empty_batch(files: MutableMapping[str, bytes], consumed: int, batch: int) -> bool:
    """Make ``batch`` an empty, committed batch in a copy of Spark's checkpoint (as
    ``{relative path: bytes}``: a savepoint's copy) whose log ends at ``consumed``:
    ``offsets/<batch>`` and ``commits/<batch>`` are copies of ``consumed``'s (same source
    positions: the batch reads nothing). Returns False when there is nothing to copy (no
    batch consumed): the caller then leaves Spark's checkpoint out, and the restored job
    starts its input from the beginning.

    >>> files = {"offsets/2": b"o2", "commits/2": b"c2"}
    >>> add_empty_batch(files, 2, 3), sorted(files)
    (True, ['commits/2', 'commits/3', 'offsets/2', 'offsets/3'])
    """
    if batch <= consumed:
        return True
    off, com = files.get(f"offsets/{consumed}"), files.get(f"commits/{consumed}")
    if consumed < 0 or off is None or com is None:
        return False
    for n in range(consumed + 1, batch + 1):
        files[f"offsets/{n}"] = off
        files[f"commits/{n}"] = com
    return True
