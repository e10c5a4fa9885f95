"""Objects as files on a local (or locally mounted) file system.

``put`` writes a temporary file, fsyncs it and renames it over the target (then fsyncs the
folder), so a reader sees the old file or the whole new one. ``create`` hard-links a fully
written temporary file to the target name: ``link`` fails if the name exists, so of two
writers exactly one creates the object, and it never appears half written.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import stat
import uuid
from pathlib import Path

from keyscale.storage.base import ObjectInfo, Store, check_key, join


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStore(Store):
    """A folder; keys are paths below it.

    >>> import tempfile
    >>> s = LocalStore(tempfile.mkdtemp())
    >>> s.create("a/b.json", b"1"), s.create("a/b.json", b"2"), s.get("a/b.json")
    (True, False, b'1')
    >>> [o.key for o in s.list("a")]
    ['a/b.json']
    """

    def __init__(self, root: str | os.PathLike[str]):
        super().__init__()
        self.root = Path(root).absolute()
        self.uri = self.root.as_uri()

    def __getstate__(self) -> dict[str, object]:
        return {"root": self.root}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__init__(state["root"])  # type: ignore[misc, arg-type]

    def url(self, key: str = "") -> str:
        return str(self.root / key) if key else str(self.root)

    def sub(self, key: str) -> LocalStore:
        return LocalStore(self.root / check_key(key))

    @property
    def local_root(self) -> Path:
        return self.root

    def path(self, key: str) -> Path:
        """The file of ``key`` (for memory-mapping and for Spark, which reads local paths)."""
        return self.root / check_key(key) if key else self.root

    # -- objects -------------------------------------------------------------------------
    def get(self, key: str) -> bytes:
        self.requests["get"] += 1
        try:
            return self.path(key).read_bytes()
        except IsADirectoryError:
            raise FileNotFoundError(self.url(key)) from None

    def _write_temp(self, target: Path, data: bytes, durable: bool) -> Path:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp-{uuid.uuid4().hex[:12]}")
        with open(tmp, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        return tmp

    def put(self, key: str, data: bytes, durable: bool = True) -> None:
        self.requests["put"] += 1
        target = self.path(key)
        tmp = self._write_temp(target, data, durable)
        try:
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        if durable:
            _fsync_dir(target.parent)

    def create(self, key: str, data: bytes) -> bool:
        self.requests["create"] += 1
        target = self.path(key)
        tmp = self._write_temp(target, data, True)
        try:
            os.link(tmp, target)
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)
        _fsync_dir(target.parent)
        return True

    def size(self, key: str) -> int | None:
        self.requests["head"] += 1
        try:
            st = self.path(key).stat()
        except (FileNotFoundError, NotADirectoryError):
            return None
        return None if stat.S_ISDIR(st.st_mode) else st.st_size

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        self.requests["list"] += 1
        base = self.path(prefix)
        if base.is_file():
            return [ObjectInfo(check_key(prefix), base.stat().st_size)]
        out = []
        for folder, _, files in os.walk(base):
            for name in files:
                if name.startswith(".") and ".tmp-" in name:
                    continue  # a write in progress (or left by a crash): not an object
                p = Path(folder) / name
                try:
                    out.append(ObjectInfo(p.relative_to(self.root).as_posix(), p.stat().st_size))
                except FileNotFoundError:
                    continue  # deleted while listing
        return sorted(out, key=lambda o: o.key)

    def list_names(self, prefix: str) -> list[str]:
        self.requests["list"] += 1
        try:
            return sorted(n for n in os.listdir(self.path(prefix)) if not (n.startswith(".") and ".tmp-" in n))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def delete(self, key: str) -> None:
        self.requests["delete"] += 1
        self.path(key).unlink(missing_ok=True)

    def delete_prefix(self, prefix: str) -> int:
        base = self.path(prefix)
        n = len(self.list(prefix))
        if base.is_dir():
            shutil.rmtree(base, ignore_errors=True)
        elif base.exists():
            base.unlink()
        return n

    def copy(self, src: str, dst: str) -> None:
        self.requests["copy"] += 1
        self.put(dst, self.get(src))

    # -- local only ----------------------------------------------------------------------
    def try_lock(self, key: str) -> int | None:
        """An exclusive ``flock`` on ``key`` (created if absent): its fd, or None if held.
        Local only: it tells a second process on this machine that the job is running."""
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return fd

    @staticmethod
    def unlock(fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)

    def is_locked(self, key: str) -> bool:
        """True while some process holds the ``flock`` on ``key`` (it dies with its holder)."""
        path = self.path(key)
        if not path.exists():
            return False
        fd = os.open(path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)
            return False
        finally:
            os.close(fd)


__all__ = ["LocalStore", "join"]
