"""The storage seam: what keyscale asks of any place it persists to.

Everything keyscale keeps (job directories, intents, manifests, state files, savepoints,
control requests, sink output) is an *object* named by a key relative to a root
location. The rules are those of object stores, so that one commit protocol is correct on
local disk and on S3 alike:

* objects are written whole (``put``): a reader sees the old object or the new one;
* ``create`` writes an object only if no object of that name exists, atomically: the
  commit point of a batch (its manifest) and a writer's epoch claim rely on it;
* nothing relies on renaming, on directory fsync or on file locks; a ``list`` is used
  at start-up and by tools, never once per file on the hot path.

Implementations: :class:`keyscale.storage.local.LocalStore` (POSIX files; ``create`` is a
hard link of a fully written temporary file) and :class:`keyscale.storage.objects.ObjectStore`
(S3 and S3-compatible servers, GCS, Azure through ``obstore``; ``create`` is a conditional
PUT). Stores are picklable: tasks on executors receive them and read and write through
them, so no executor needs the driver's disk.
"""

from __future__ import annotations

import builtins
import posixpath
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from keyscale.errors import StorageError


@dataclass(frozen=True)
class ObjectInfo:
    key: str  # relative to the store's root, "/"-separated
    size: int


def join(*parts: str) -> str:
    """Keys joined with "/" (empty parts skipped).

    >>> join("checkpoints", "manifest-1.json"), join("", "a", "b/")
    ('checkpoints/manifest-1.json', 'a/b')
    """
    return posixpath.join(*[p.strip("/") for p in parts if p and p.strip("/")]) if any(p.strip("/") for p in parts) else ""


def check_key(key: str) -> str:
    """A key must stay under its root: no absolute keys, no ``..``."""
    parts = key.split("/")
    if key.startswith("/") or ".." in parts:
        raise StorageError(f"invalid object key {key!r} (keys are relative and never leave their root)")
    return key.strip("/")


class Store(ABC):
    """A root location and the objects under it. Keys are relative, "/"-separated."""

    #: The location as a URI (``file:///...``, ``s3://bucket/prefix``), for messages and pickling.
    uri: str

    def __init__(self) -> None:
        self.requests: Counter[str] = Counter()  # per operation: what this process asked of the store

    # -- naming --------------------------------------------------------------------------
    def url(self, key: str = "") -> str:
        """The full location of ``key`` as a user would write it (for messages)."""
        return self.uri.rstrip("/") + ("/" + key if key else "")

    @abstractmethod
    def sub(self, key: str) -> Store:
        """A store rooted at ``key`` of this one (a savepoint inside a job directory)."""

    @property
    def is_local(self) -> bool:
        return self.local_root is not None

    @property
    def local_root(self) -> Path | None:
        """The root as a local path, when it is one (Spark's own readers and writers need it)."""
        return None

    # -- objects -------------------------------------------------------------------------
    @abstractmethod
    def get(self, key: str) -> bytes:
        """The object's bytes; :class:`FileNotFoundError` if there is none."""

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """``length`` bytes of the object from ``start`` (fewer at its end)."""
        return self.get(key)[start : start + length]

    def get_ranges(self, reads: Sequence[tuple[str, int, int]]) -> builtins.list[bytes]:
        """``get_range(key, start, length)`` of each of ``reads``, in their order: all at once
        where the store can (an object store: one round trip for them all, not one each)."""
        return [self.get_range(key, start, length) for key, start, length in reads]

    def get_or_none(self, key: str) -> bytes | None:
        try:
            return self.get(key)
        except FileNotFoundError:
            return None

    def get_text(self, key: str) -> str | None:
        """The object as UTF-8 text, None if absent; damaged text is a :class:`StorageError`."""
        data = self.get_or_none(key)
        if data is None:
            return None
        try:
            return data.decode()
        except UnicodeDecodeError:
            raise StorageError(f"{self.url(key)} is damaged (not UTF-8 text)") from None

    @abstractmethod
    def put(self, key: str, data: bytes, durable: bool = True, private: bool = False) -> None:
        """Write the whole object (replacing any); readers never see a part of it.
        ``durable=False`` for objects that may be lost in a crash (status, addresses);
        ``private``: readable by the writing user only, where the store has file modes."""

    def put_file(self, key: str, source: Path) -> None:
        """``put`` (durable) of the bytes of local file ``source``, without holding them in
        memory where the store can stream them (a state file of a large range)."""
        self.put(key, source.read_bytes())

    def create(self, key: str, data: bytes) -> bool:
        """Write the object only if none of that name exists: True if this call created it,
        False if one was there. Atomic: of two concurrent callers exactly one creates it.

        An object store client retries a request whose answer it did not get (a timeout, a
        5xx sent after the write landed); the retry then finds the object its own first try
        created and is told "exists". That answer is resolved by reading the object back,
        never by deleting anything: the same bytes are this call's. So every caller writes
        content no other writer would write (an epoch claim's run id, a manifest's epoch and
        time, an output marker's write id); docs/design.md, "Ambiguous creates"."""
        if self._create(key, data):
            return True
        return self.get_or_none(key) == data

    @abstractmethod
    def _create(self, key: str, data: bytes) -> bool:
        """The store's conditional create: True if the write happened in this request."""

    @abstractmethod
    def size(self, key: str) -> int | None:
        """The object's size, None if absent."""

    def exists(self, key: str) -> bool:
        return self.size(key) is not None

    @abstractmethod
    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Every object under ``prefix`` (recursive), sorted by key."""

    def list_names(self, prefix: str) -> builtins.list[str]:
        """The names (last key part) of the objects directly under folder ``prefix``, sorted."""
        base = prefix.strip("/") + "/"
        return sorted({o.key[len(base):].split("/")[0] for o in self.list(prefix) if o.key.startswith(base)})

    @abstractmethod
    def delete(self, key: str) -> None:
        """Delete the object if it exists."""

    def delete_many(self, keys: builtins.list[str]) -> None:
        for k in keys:
            self.delete(k)

    def delete_prefix(self, prefix: str) -> int:
        """Delete every object under ``prefix``; returns how many."""
        found = [o.key for o in self.list(prefix)]
        self.delete_many(found)
        return len(found)

    @abstractmethod
    def copy(self, src: str, dst: str) -> None:
        """Copy an object inside this store (server-side where the store can)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"
