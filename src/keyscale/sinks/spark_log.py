"""The Parquet sink's commit log in Spark's format, so Spark's readers see committed batches only.

Spark's own file sink keeps ``PATH/_spark_metadata/``; ``spark.read.parquet(PATH)`` (and a
streaming read of ``PATH``) read exactly the files that log lists when it exists, and
ignore every other file of the folder. The format is Spark's ``FileStreamSinkLog``:

- one object per log batch, named by its id (``0``, ``1``...): a version line ``v1``, then
  one JSON object per file (``SinkFileStatus``: ``path`` a full URI, ``size``, ``isDir``,
  ``modificationTime``, ``blockReplication``, ``blockSize``, ``action`` ``"add"``);
- every 10th batch (``(id + 1) % 10 == 0``) is a compaction, ``<id>.compact``, listing the
  files of every batch up to it; a reader reads the newest compaction and the batches after
  it, so those must all be there (a missing one is an error to Spark's reader).

keyscale's log batch ``b`` is the sink's batch ``b``. Its object is created (create-only)
just after the batch's marker, under the same fence check, and lists the files the marker
lists: a batch enters the log only once complete, and an unfinished attempt's files never
do. A batch id the sink never wrote (an empty dead-letter batch, batches before a restore
into a new folder) gets the files its marked folder holds, or none. Batches of an
ancestor lineage that a new run recomputes leave the log (newest first, so what remains is
always a readable prefix) before their folders move to ``_superseded/``.

>>> entry_name(3), entry_name(9), is_compaction(19), is_compaction(20)
('3', '9.compact', True, False)
>>> parse_entry(render_entry([{"path": "file:/o/a.parquet", "size": 1}]))
[{'path': 'file:/o/a.parquet', 'size': 1}]
"""

from __future__ import annotations

import json
import re
from typing import Any

from keyscale.errors import StorageError
from keyscale.storage import Store, join

LOG = "_spark_metadata"
VERSION = "v1"
COMPACT_INTERVAL = 10  # Spark's default spark.sql.streaming.fileSink.log.compactInterval
_ENTRY = re.compile(r"^(\d+)(\.compact)?$")
_BLOCK_SIZE = 32 << 20  # what Hadoop's local file system reports; readers split by their own settings


def is_compaction(batch: int) -> bool:
    return (batch + 1) % COMPACT_INTERVAL == 0


def entry_name(batch: int) -> str:
    return f"{batch}.compact" if is_compaction(batch) else str(batch)


def render_entry(files: list[dict[str, Any]]) -> bytes:
    return "\n".join([VERSION, *(json.dumps(f, separators=(",", ":")) for f in files)]).encode()


def parse_entry(data: bytes) -> list[dict[str, Any]]:
    lines = data.decode().split("\n")
    if not lines or lines[0].strip() != VERSION:
        raise ValueError(f"not a version {VERSION} log entry")
    return [json.loads(ln) for ln in lines[1:] if ln.strip()]


def file_status(uri: str, size: int, modified_ms: int) -> dict[str, Any]:
    """One file as Spark's ``SinkFileStatus`` (field order as Spark writes it)."""
    return {"path": uri, "size": size, "isDir": False, "modificationTime": modified_ms, "blockReplication": 1,
            "blockSize": _BLOCK_SIZE, "action": "add"}


class SinkLog:
    """The log of one output folder (``store``): what the Parquet sink calls around its markers."""

    def __init__(self, store: Store):
        self.store = store
        self.latest = -1  # the newest log batch (read by ``load``), -1 when the log is empty

    def load(self) -> list[int]:
        """One LIST of the log: the ids it holds, ascending; sets :attr:`latest`."""
        ids = sorted({int(m.group(1)) for n in self.store.list_names(LOG) if (m := _ENTRY.match(n.rsplit("/", 1)[-1]))})
        self.latest = ids[-1] if ids else -1
        return ids

    def truncate(self, keep_up_to: int) -> None:
        """Drop the log batches after ``keep_up_to``, newest first: a reader meanwhile reads a
        shorter log, never one with a hole."""
        for batch in reversed([i for i in self.load() if i > keep_up_to]):
            self.store.delete(join(LOG, entry_name(batch)))
        self.latest = min(self.latest, keep_up_to)

    def _entries(self, batch: int) -> list[dict[str, Any]]:
        data = self.store.get_or_none(join(LOG, entry_name(batch)))
        if data is None:
            raise StorageError(f"{self.store.url(join(LOG, entry_name(batch)))} is missing: the log of the Parquet sink's output has a hole")
        return parse_entry(data)

    def add(self, batch: int, files: list[dict[str, Any]]) -> bool:
        """Create log batch ``batch`` with ``files`` (a compaction: with every earlier batch's
        files too). False if it exists (another attempt logged the batch: the same files)."""
        listed = files
        if is_compaction(batch):
            # The previous compaction and the batches since: at most COMPACT_INTERVAL reads, once per COMPACT_INTERVAL batches.
            start = batch - COMPACT_INTERVAL
            listed = [*(self._entries(start) if start >= 0 else []), *(f for i in range(max(start + 1, 0), batch) for f in self._entries(i)), *files]
        created = self.store.create(join(LOG, entry_name(batch)), render_entry(listed))
        self.latest = max(self.latest, batch)
        return created
