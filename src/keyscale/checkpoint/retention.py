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
* A key group is snapshotted not only when its restore chain is long but also when the
  oldest file of its chain is ``max_age`` batches old. So the newest checkpoint's files are
  less than ``max_age`` batches old, an anchor exists from batch ``max_age`` on, and it is
  less than ``2 * max_age`` batches behind the newest: the most batches a fallback to it
  replays. At most ``keep + 2`` checkpoints are kept.

A subtask with a large state does not snapshot its whole range at once
(:func:`snapshot_range`): its batches take turns at slices of it, so each does a small part
of the compaction, where a whole range every ``max_chain`` batches made those batches
several times as long as the others.

>>> sorted(checkpoints_to_keep({5: [1, 4], 6: [1, 4, 6], 7: [6, 7]}, keep=1))
[5, 6, 7]
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping

from keyscale.checkpoint.manifest import Chains
from keyscale.errors import KeyscaleError
from keyscale.state.keygroups import KeyGroupRange


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


#: The rows a slice of a snapshot aims at: a subtask holding fewer snapshots its whole range
#: at once (one file, as small states always did), a larger one in up to ``max_chain``
#: slices. A slice of 625,000 string keys added ~0.35 s to a batch, ~0.25 s since its
#: write passes once (docs/benchmarks.md, "Compaction in slices", "A slice's snapshot
#: written once"), so one of 250,000 about 0.1 s.
SLICE_ROWS = 250_000


def snapshot_range(rng: KeyGroupRange, batch: int, chains: Chains, max_chain: int, max_age: int) -> KeyGroupRange | None:
    """The key groups of a subtask's range ``rng`` it snapshots in ``batch`` (None: none),
    given each one's restore chain (``manifest.chains``).

    ``rng`` is cut into slices of consecutive key groups: one per ``SLICE_ROWS`` rows its
    chains hold, at most ``max_chain`` (and at most one a key group). Over every
    ``max_chain`` batches each slice has a turn, the turns spread evenly over them. A slice
    is due on its turn unless each of its chains is empty or a snapshot of its own last turn
    alone (nothing changed since, nothing to shorten), and in any batch when one of its
    chains is ``max_chain`` files long or has a file ``max_age`` batches old (slices that
    moved in a rescale or as the state grew, or a ``max_age`` below ``max_chain``). The
    snapshot covers the due slices and any between them: a state file holds consecutive key
    groups. So no chain grows past ``max_chain`` files, a key group whose chain holds a
    delta is snapshotted on its turn, once every ``max_chain`` batches, and at a steady
    parallelism a batch snapshots one slice, of about ``SLICE_ROWS`` rows where the state
    is large.

    >>> import numpy as np
    >>> rng, big = KeyGroupRange(0, 15), Chains(np.full(16, 3), np.full(16, 2), np.full(16, 37), np.full(16, 2e5))
    >>> snapshot_range(rng, 40, big, max_chain=8, max_age=32), snapshot_range(rng, 43, big, max_chain=8, max_age=32)
    (KeyGroupRange(start=0, end=1), KeyGroupRange(start=6, end=7))
    >>> small = big._replace(rows=np.full(16, 10.0))  # one slice: the whole range on its turn, batch 40
    >>> snapshot_range(rng, 40, small, max_chain=8, max_age=32), snapshot_range(rng, 43, small, max_chain=8, max_age=32)
    (KeyGroupRange(start=0, end=15), None)
    >>> long = big._replace(length=np.array([3] * 15 + [8]))
    >>> snapshot_range(rng, 43, long, max_chain=8, max_age=32)  # slice 3's turn, slice 7 too long
    KeyGroupRange(start=6, end=15)
    >>> print(snapshot_range(rng, 43, Chains(np.ones(16), np.zeros(16), np.full(16, 35), np.full(16, 2e5)), max_chain=8, max_age=32))
    None

    (The last: every slice was snapshotted on its turn 8 batches ago and nothing changed since.)
    """
    n = len(rng)
    slices = min(max_chain, n, max(1, math.ceil(float(chains.rows.sum()) / SLICE_ROWS)))
    due: list[int] = []
    for j in range(slices):
        a, b = j * n // slices, (j + 1) * n // slices
        # A chain that is a snapshot alone is left on its turn, unless the snapshot was
        # written out of turn (forced, or before the slices moved): else it would be forced
        # again one batch before each of its turns, and stay out of turn.
        alone = (chains.deltas[a:b] == 0) & ((chains.length[a:b] == 0) | ((batch - chains.oldest[a:b]) % max_chain == 0))
        on_turn = batch % max_chain == j * max_chain // slices and not bool(alone.all())
        too_long = int(chains.length[a:b].max()) >= max_chain or bool((batch - chains.oldest[a:b] >= max_age).any())
        if on_turn or too_long:
            due += [a, b - 1]
    return KeyGroupRange(rng.start + min(due), rng.start + max(due)) if due else None


def check_compaction(max_chain: int, max_age: int) -> None:
    """Refuse compaction settings the rule cannot follow, by the option's name.

    >>> check_compaction(0, 32)
    Traceback (most recent call last):
    ...
    keyscale.errors.KeyscaleError: --compaction-chain 0: give the most files a key group's restore may read, 1 or more
    """
    if max_chain < 1:
        raise KeyscaleError(f"--compaction-chain {max_chain}: give the most files a key group's restore may read, 1 or more")
    if max_age < 1:
        raise KeyscaleError(f"--max-file-age {max_age}: give the age in batches at which state files are rewritten, 1 or more")
