"""Spark's own streaming checkpoint, mirrored into a job directory that is not on local disk.

Spark writes its checkpoint (source positions, its batch log) only to local or Hadoop
paths, and this Spark has no object-store Hadoop connector. So while a job whose job
directory is on an object store runs, Spark's checkpoint lives in a local folder, and
keyscale copies it into the job directory: before each batch's intent, one object
``spark/bundle-<batch>-e<epoch>.json`` with the files Spark wrote or deleted since the last one
(every ``FULL_EVERY`` batches, and at a run's first batch, all of them). At start, the
newest full bundle and the deltas after it rebuild the folder, on whichever host the
driver runs. Spark's files of batch ``b`` (its offsets) are in the bundle of ``b``, written
before anything of ``b`` is; its commit of ``b`` comes with the bundle of ``b + 1``, and
a commit that is missing only makes Spark offer ``b`` again, which keyscale skips (it is
committed). Hadoop's ``.crc`` side files are not copied (Spark reads the files without them).

Bundles are named per run (its epoch): a run that a newer one took over checks its fence
before it writes one, and if it wakes between the check and the write, its bundle lands
beside the newer run's, not over it; the rebuild ignores it (:func:`live_bundles`).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
from pathlib import Path
from typing import Any

from keyscale.checkpoint.fence import Fence
from keyscale.storage import Store

FOLDER = "spark"
FULL_EVERY = 20


def _bundle_key(batch: int, epoch: int = 0) -> str:
    """A bundle's key: per batch and per run (epoch), so that a paused run that wakes after a
    newer one took over can never replace the newer run's bundle of a batch."""
    return f"{FOLDER}/bundle-{batch:012d}" + (f"-e{epoch:010d}" if epoch else "") + ".json"


def _parse(name: str) -> tuple[int, int] | None:
    """(batch, epoch) of a bundle's name; epoch 0 for names without one (tools, older keyscale).

    >>> _parse("bundle-000000000004-e0000000002.json"), _parse("bundle-000000000004.json"), _parse("x.json")
    ((4, 2), (4, 0), None)
    """
    if not (name.startswith("bundle-") and name.endswith(".json")):
        return None
    batch, _, epoch = name[len("bundle-"):-len(".json")].partition("-e")
    try:
        return int(batch), int(epoch or 0)
    except ValueError:
        return None


def live_bundles(found: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Of the bundles ``found`` ((batch, epoch)), those of the job's history, by batch: a
    bundle of run ``e`` at a batch where a newer run had already written one (at that batch
    or before) was written by ``e`` after the takeover (a zombie's) and is not history.

    >>> live_bundles([(3, 1), (4, 1), (4, 2), (5, 2), (6, 1)])
    [(3, 1), (4, 2), (5, 2)]
    """
    first: dict[int, int] = {}
    for batch, epoch in found:
        first[epoch] = min(batch, first.get(epoch, batch))
    return sorted((b, e) for b, e in found if not any(e2 > e and f <= b for e2, f in first.items()))


def _encode(data: bytes) -> dict[str, str]:
    try:
        return {"text": data.decode()}
    except UnicodeDecodeError:
        return {"b64": base64.b64encode(data).decode()}


def _decode(d: dict[str, str]) -> bytes:
    return d["text"].encode() if "text" in d else base64.b64decode(d["b64"])


class SparkMirror:
    """The local folder ``local`` kept in ``store`` (the job directory) as bundles."""

    def __init__(self, store: Store, local: Path, fence: Fence | None = None):
        self.store, self.local, self.fence = store, local, fence
        self._pushed: dict[str, tuple[int, int]] = {}  # relative path -> (size, mtime_ns) as last sent
        self._since_full = FULL_EVERY  # a run's first bundle is full

    def _scan(self) -> dict[str, tuple[int, int]]:
        out = {}
        for folder, _, files in os.walk(self.local):
            for name in files:
                if name.endswith(".crc"):
                    continue
                p = Path(folder) / name
                st = p.stat()
                out[p.relative_to(self.local).as_posix()] = (st.st_size, st.st_mtime_ns)
        return out

    def _listed(self) -> list[tuple[int, int]]:
        """(batch, epoch) of every bundle in the job directory (one listing)."""
        return [x for n in self.store.list_names(FOLDER) if (x := _parse(n)) is not None]

    def pull(self) -> int:
        """Rebuild the local folder from the job directory; returns the files written."""
        chain: list[dict[str, Any]] = []
        for b, e in reversed(live_bundles(self._listed())):  # back to the newest full bundle
            bundle = json.loads(self.store.get(_bundle_key(b, e)))
            chain.append(bundle)
            if bundle.get("full"):
                break
        shutil.rmtree(self.local, ignore_errors=True)
        self.local.mkdir(parents=True, exist_ok=True)
        files: dict[str, bytes] = {}
        for bundle in reversed(chain):
            if bundle.get("full"):
                files.clear()
            for rel in bundle.get("deleted", []):
                files.pop(rel, None)
            files.update({rel: _decode(d) for rel, d in bundle["files"].items()})
        for rel, data in files.items():
            target = self.local / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        self._pushed = {}
        self._since_full = FULL_EVERY
        return len(files)

    def push(self, batch: int) -> None:
        """One object with what Spark changed since the last push (all files, now and then)."""
        now = self._scan() if self.local.exists() else {}
        full = self._since_full >= FULL_EVERY
        changed = [rel for rel, sig in now.items() if full or self._pushed.get(rel) != sig]
        bundle = {
            "batch": batch, "full": full,
            "files": {rel: _encode((self.local / rel).read_bytes()) for rel in sorted(changed)},
            "deleted": [] if full else sorted(set(self._pushed) - set(now)),
        }
        # A run that a newer one took over writes no bundle: its batch is not the job's.
        if self.fence is not None:
            self.fence.check(f"mirroring Spark's checkpoint of batch {batch}")
        epoch = self.fence.epoch if self.fence is not None else 0
        self.store.put(_bundle_key(batch, epoch), json.dumps(bundle, sort_keys=True).encode())
        self._pushed = now
        self._since_full = 1 if full else self._since_full + 1
        if full:  # older bundles are no longer needed to rebuild the folder; never a newer run's
            if self.fence is not None:
                self.fence.check(f"pruning Spark's mirrored checkpoint before batch {batch}")
            self.store.delete_many([_bundle_key(b, e) for b, e in self._listed() if b < batch and e <= epoch])
