"""Objects as files on a local (or locally mounted) file system.

``put`` writes a temporary file, fsyncs it and renames it over the target (then fsyncs the
folder), so a reader sees the old file or the whole new one. ``create`` hard-links a fully
written temporary file to the target name: ``link`` fails if the name exists, so of two
writers exactly one creates the object, and it never appears half written.
"""

from __future__ import annotations

import builtins
import fcntl
import json
import os
import shutil
import stat
import time
import uuid
from pathlib import Path

from keyscale.storage.base import ObjectInfo, Store, check_key

# How long a lock found held is tried again before it counts as held by another process.
LOCK_GRACE_SECONDS = 0.5


def fsync_path(path: Path) -> None:
    """Make a local file's written bytes (or a folder's entries) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)



def local_write_failure(path: str, e: OSError) -> str:
    """Why a task could not write ``path`` on local disk, for an error message: the
    executor's user and host (on a cluster, the driver's local folders are not the
    executors'), the system's reason, and what to do instead.

    >>> local_write_failure("/data/out/x", PermissionError(13, "Permission denied"))  # doctest: +ELLIPSIS
    "cannot write /data/out/x as user '...' on host '...': Permission denied (every executor must be able to write ..."
    """
    import errno
    import pwd
    import socket

    try:
        user = pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        user = str(os.geteuid())
    said = f"cannot write {path} as user '{user}' on host '{socket.gethostname()}': {e.strerror or e}"
    if e.errno not in (errno.EACCES, errno.EPERM, errno.ENOENT, errno.EROFS):
        return said  # a full disk, an I/O error: the system's reason says it all
    return (
        f"{said} (every executor must be able to write a local folder it is given; on a cluster "
        "whose executors do not share this disk, use an object store: s3://BUCKET/PATH)"
    )


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

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """Only those bytes of the file (one ``pread``), not the whole file."""
        self.requests["get_range"] += 1
        fd = os.open(self.path(key), os.O_RDONLY)
        try:
            return os.pread(fd, max(0, length), start)
        except IsADirectoryError:
            raise FileNotFoundError(self.url(key)) from None
        finally:
            os.close(fd)

    def _write_temp(self, target: Path, data: bytes | Path, durable: bool, private: bool = False) -> Path:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp-{uuid.uuid4().hex[:12]}")
        # O_EXCL | O_NOFOLLOW: never another user's file or a symlink planted under that name.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600 if private else 0o644)
        try:
            with open(fd, "wb") as f:
                if private:
                    os.fchmod(fd, 0o600)  # the umask can only narrow 0o600; this is belt and braces
                if isinstance(data, Path):
                    with open(data, "rb") as src:
                        shutil.copyfileobj(src, f, 8 << 20)
                else:
                    f.write(data)
                if durable:
                    f.flush()
                    os.fsync(f.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return tmp

    def put_file(self, key: str, source: Path) -> None:
        self._put(key, source, True, False)  # copied in chunks by _write_temp

    def put(self, key: str, data: bytes, durable: bool = True, private: bool = False) -> None:
        self._put(key, data, durable, private)

    def _put(self, key: str, data: bytes | Path, durable: bool, private: bool) -> None:
        self.requests["put"] += 1
        target = self.path(key)
        tmp = self._write_temp(target, data, durable, private)
        try:
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        if durable:
            fsync_path(target.parent)

    def set_modified(self, key: str, seconds: float) -> None:
        """Set a file's modification time: Spark's file source reads new files oldest
        first, and files written within one clock tick would come in any order."""
        os.utime(self.path(key), (seconds, seconds))

    def _create(self, key: str, data: bytes) -> bool:
        self.requests["create"] += 1
        target = self.path(key)
        tmp = self._write_temp(target, data, True)
        try:
            os.link(tmp, target)
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)
        fsync_path(target.parent)
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

    def list_names(self, prefix: str) -> builtins.list[str]:
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
    def append(self, key: str, data: bytes) -> None:
        """Append to a local file (an event log: object stores write one object per event)."""
        self.requests["append"] += 1
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "ab") as f:
            f.write(data)

    def try_lock(self, key: str) -> int | None:
        """An exclusive ``flock`` on ``key`` (created if absent): its fd, or None if held.
        Local only: it tells a second process on this machine that the job is running.

        ``is_locked`` probes by taking a shared lock for an instant, so a lock found held is
        tried again for up to ``LOCK_GRACE_SECONDS``: a status probe that happens to run at
        the moment a job or supervisor starts must not make it think another one runs."""
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + LOCK_GRACE_SECONDS
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    return None
                time.sleep(0.01)

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




def atomic_write_bytes(path: Path, data: bytes, durable: bool = True) -> None:
    """Write a local file so that readers see the old file or the whole new one (for
    local-only state: deployments, clusters)."""
    LocalStore(path.parent).put(path.name, data, durable)


def atomic_write_json(path: Path, obj: object, durable: bool = True) -> None:
    atomic_write_bytes(path, json.dumps(obj, indent=1, sort_keys=True).encode(), durable)


def is_locked(path: Path) -> bool:
    """True while some process holds an exclusive ``flock`` on the local file ``path``."""
    return LocalStore(path.parent).is_locked(path.name)

