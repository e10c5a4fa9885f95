"""Which checkpoints to keep, and when a subtask writes a snapshot: the pure rules.

A damaged state file takes with it every checkpoint that uses it. Deltas are shared: the
newest checkpoints all use the deltas since each key group's last snapshot, so keeping only
the newest ``--retain`` checkpoints, one flipped byte in an old delta can leave no intact
checkpoint at all. Two rules prevent that:

* Besides the newest ``keep`` checkpoints, keep the *anchor*: the newest checkpoint whose
  batch is older than every file the newest checkpoint uses. The two share no file, so one
  damaged file cannot take both. Also keep the *next anchor*: the oldest checkpoint not
  older than that oldest file. The oldest file of the newest checkpoint never gets older;
  once it is newer than the next anchor, that one is the anchor.
* A subtask writes a snapshot of its key groups not only when its restore chain is long but
  also when the oldest file of its chain is ``max_age`` batches old. So the newest
  checkpoint's files are less than ``max_age`` batches old, an anchor exists from batch
  ``max_age`` on, and it is less than ``2 * max_age`` batches behind the newest: the most
  batches a fallback to it replays. At most ``keep + 2`` checkpoints are kept.

>>> sorted(checkpoints_to_keep({5: [1, 4], 6: [1, 4, 6], 7: [6, 7]}, keep=1))
[5, 6, 7]
>>> should_snapshot(chain=2, oldest=3, batch=40, max_chain=8, max_age=32)
True
"""

from __future__ import annotations

from collections.abc import Collection, Mapping


def checkpoints_to_keep(file_batches: Mapping[int, Collection[int]], keep: int) -> set[int]:
    """The checkpoints to keep, given per checkpoint the batches of the state files it uses:
    the newest ``keep``; the *anchor*, the newest one older than every file of the newest
    checkpoint (they share no file); and the *next anchor*, the oldest one not older than
    that file (once the newest checkpoint's files have all moved past it, it is the anchor)."""
    batches = sorted(file_batches)
    if not batches:
        return set()
    kept = set(batches[-max(keep, 1):])
    newest_files = file_batches[batches[-1]]
    if not newest_files:
        return kept  # no state file can damage the newest checkpoint
    oldest_file = min(newest_files)
    older = [b for b in batches if b < oldest_file]
    if older:
        kept.add(older[-1])
    kept.add(min(b for b in batches if b >= oldest_file))  # the newest checkpoint is one
    return kept


def should_snapshot(chain: int, oldest: int | None, batch: int, max_chain: int, max_age: int) -> bool:
    """Whether a subtask writes a snapshot of its key groups in ``batch`` instead of a delta:
    its restore chain is ``max_chain`` files long, or its oldest file (batch ``oldest``) is
    ``max_age`` batches old."""
    return chain >= max_chain or (oldest is not None and batch - oldest >= max_age)
