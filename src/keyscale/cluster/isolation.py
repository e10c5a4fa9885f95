"""Workers that share no disk with the driver: another Unix user, its own dirs, the driver's home hidden.

``start_cluster(folder, isolated=True)`` (``keyscale cluster start --isolated``) runs every
worker JVM, and so its executors and their Python workers, as the system user
``keyscale-worker`` (or ``worker_user=NAME``), created with ``useradd --system`` the first
time (home ``/var/lib/keyscale-worker``). Like an executor on another machine, such a
task cannot read what the driver keeps on its local disk: job directories in a private
folder (pytest's ``/tmp/pytest-of-root/...`` is mode 0700) raise ``PermissionError``, so a
path that leaks past keyscale's storage layer fails instead of working by accident.

What a worker gets:

* **Its own dirs**, owned by the worker user, under its home:
  ``HOME/clusters/<cluster id>/<worker-N>/`` with ``work/`` (the worker's work dir:
  executor logs, ``app-*/N/stderr``), ``local/`` (``SPARK_LOCAL_DIRS``: shuffle and
  block files), ``tmp/`` (``TMPDIR`` and ``java.io.tmpdir``) and ``conf/`` (an empty
  ``SPARK_CONF_DIR``). The cluster id is a hash of the cluster folder, which may itself
  be private to the driver. When the worker is stopped its ``work/`` is copied to the
  cluster folder's ``work/worker-N/`` (where a plain cluster keeps it) and the rest is
  deleted.
* **The Python and Java it needs.** Executors run the driver's ``PYSPARK_PYTHON``; the
  worker user must be able to execute it and read its install, its venv, ``sys.path``
  (``PYTHONPATH`` included: that is how a source tree's keyscale reaches the workers) and
  Spark and Java. When one of those lies under a folder the worker user cannot enter
  (pyenv's Pythons live in ``/root/.pyenv``, and ``/root`` is 0700), the worker is
  started in its own mount namespace (``unshare --mount``, which needs root's
  ``CAP_SYS_ADMIN``) where that folder is covered by an empty tmpfs and only the needed
  paths are bind-mounted back at the same place: the worker sees the interpreter, not
  the rest of the driver's home. Nothing on the host changes mode. A needed path that
  is itself unreadable to the worker user (a venv of mode 0700) is a
  :class:`~keyscale.errors.ClusterError` naming it.
* **The driver's environment** (so ``PYTHONPATH``, S3 endpoints and credentials given as
  environment variables reach executors as on a plain cluster), with ``HOME``, ``USER``
  and ``TMPDIR`` the worker's.

Before the first worker starts, the worker user runs ``python -c "import pyspark, keyscale"``
the same way; a failure is a :class:`~keyscale.errors.ClusterError` with Python's message.
Only root can start isolated workers (``setpriv`` to another user).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pwd
import shlex
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from keyscale.errors import ClusterError

__all__ = [
    "DEFAULT_WORKER_USER",
    "WorkerUser",
    "blocked_at",
    "ensure_worker_user",
    "hidden_folders",
    "isolated_command",
    "worker_dirs",
]

DEFAULT_WORKER_USER = "keyscale-worker"
_HOME_BASE = Path("/var/lib")


@dataclass(frozen=True)
class WorkerUser:
    """The Unix user isolated workers run as."""

    name: str
    uid: int
    gid: int
    home: Path


def _lookup(name: str) -> WorkerUser | None:
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        return None
    return WorkerUser(name, pw.pw_uid, pw.pw_gid, Path(pw.pw_dir))


def ensure_worker_user(name: str = DEFAULT_WORKER_USER) -> WorkerUser:
    """The user ``name``, created as a system user (home ``/var/lib/NAME``) if absent; needs root.

    Its home is created (mode 0700, owned by it) if missing: isolated workers keep their
    dirs there.
    """
    if os.geteuid() != 0:
        raise ClusterError(
            f"isolated workers run as the user {name!r}, and only root can start processes as another user "
            f"(this is uid {os.geteuid()}); run 'keyscale cluster start --isolated' as root, or drop --isolated"
        )
    user = _lookup(name)
    if user is None:
        useradd = shutil.which("useradd")
        if useradd is None:
            raise ClusterError(f"there is no user {name!r} and no useradd to create it; create it by hand")
        cmd = [useradd, "--system", "--user-group", "--home-dir", str(_HOME_BASE / name), "--create-home",
               "--shell", "/usr/sbin/nologin", "--comment", "keyscale isolated Spark workers", name]  # fmt: skip
        r = subprocess.run(cmd, capture_output=True, text=True, check=False)
        user = _lookup(name)
        if user is None:
            raise ClusterError(f"could not create the user {name!r}: {r.stderr.strip() or f'useradd exited with {r.returncode}'}")
    if user.uid == 0:
        raise ClusterError(f"the worker user {name!r} is root: isolated workers need an unprivileged user")
    if user.home == Path("/") or not str(user.home).startswith("/"):
        raise ClusterError(f"the worker user {name!r} has no usable home ({user.home}); give it one, e.g. /var/lib/{name}")
    if not user.home.is_dir():
        user.home.mkdir(parents=True, mode=0o700)
        os.chown(user.home, user.uid, user.gid)
    return user


def _may(st: os.stat_result, user: WorkerUser, bits: int) -> bool:
    """Whether ``user`` (primary group only; ACLs not consulted) has ``bits`` (rwx as 4/2/1) on a file."""
    if st.st_uid == user.uid:
        mode = (st.st_mode >> 6) & 7
    elif st.st_gid == user.gid:
        mode = (st.st_mode >> 3) & 7
    else:
        mode = st.st_mode & 7
    return mode & bits == bits


def blocked_at(path: Path, user: WorkerUser) -> Path | None:
    """The first folder on the way to ``path`` (``path`` itself included) that ``user`` cannot enter.

    ``None`` when ``user`` can reach and read ``path``.

    >>> blocked_at(Path("/"), WorkerUser("nobody", 65534, 65534, Path("/nonexistent"))) is None
    True
    """
    parts = path.parts
    for i in range(1, len(parts) + 1):
        d = Path(*parts[:i])
        try:
            st = d.stat()
        except OSError:
            return None  # missing: nothing to expose
        if stat.S_ISDIR(st.st_mode):
            if not _may(st, user, 1) or (d == path and not _may(st, user, 4)):
                return d
        elif not _may(st, user, 4):
            return d
    return None


def _python_paths(python: str, env: dict[str, str]) -> list[Path]:
    """What ``python`` reads to start and import: its install, its venv and its ``sys.path``."""
    code = (
        "import json, os, sys; print(json.dumps([os.path.realpath(sys.executable), sys.prefix, sys.base_prefix,"
        " *[p for p in sys.path if os.path.isabs(p)]]))"
    )
    try:
        r = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env, cwd="/", timeout=60, check=False)
        found = json.loads(r.stdout) if r.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError):
        found = None
    if not isinstance(found, list):
        raise ClusterError(f"cannot run the Python executors would use ({python}) to see what it needs")
    exe = Path(found[0])
    return [exe.parent, *(Path(p) for p in found[1:])]


def _java_home() -> Path | None:
    if os.environ.get("JAVA_HOME"):
        return Path(os.environ["JAVA_HOME"])
    java = shutil.which("java")
    return Path(os.path.realpath(java)).parents[1] if java else None


def needed_paths(python: str, env: dict[str, str], spark_home: Path) -> list[Path]:
    """Paths an isolated worker must read: the executors' Python and what it imports, Spark, Java."""
    paths = [Path(os.path.realpath(python)), *_python_paths(python, env), spark_home]
    java = _java_home()
    if java is not None:
        paths.append(java)
    out: list[Path] = []
    for p in paths:
        rp = Path(os.path.realpath(p))
        if rp.exists() and rp not in out:
            out.append(rp)
    return out


def hidden_folders(paths: list[Path], user: WorkerUser) -> dict[Path, list[Path]]:
    """Folders to cover with an empty tmpfs, each with the needed paths under it to bind back.

    Every needed path the worker user cannot reach is reachable after that, unless the path
    itself is closed to it: a :class:`ClusterError` naming it.

    >>> nobody = WorkerUser("nobody", 65534, 65534, Path("/nonexistent"))
    >>> hidden_folders([Path("/usr/bin")], nobody)
    {}
    """
    out: dict[Path, list[Path]] = {}
    for p in paths:
        where = blocked_at(p, user)
        if where is None:
            continue
        if where == p or not _reachable_under(where, p, user):
            st = where.stat()
            raise ClusterError(
                f"the worker user {user.name!r} cannot read {where} (mode {stat.S_IMODE(st.st_mode):04o}, owner uid "
                f"{st.st_uid}), which isolated workers need for {p}; make it readable by others, or drop --isolated"
            )
        out.setdefault(where, []).append(p)
    # A path inside another one bound back under the same folder comes along with it.
    for where, ps in out.items():
        out[where] = [p for p in ps if not any(q != p and p.is_relative_to(q) for q in ps)]
    return out


def _reachable_under(where: Path, path: Path, user: WorkerUser) -> bool:
    """Once ``where`` is a fresh tmpfs holding ``path`` bound back, can ``user`` read ``path``'s tree root?"""
    try:
        st = path.stat()
    except OSError:
        return False
    return _may(st, user, 5 if stat.S_ISDIR(st.st_mode) else 4)


def cluster_id(folder: Path) -> str:
    """A short name for the cluster in ``folder`` (its folder may be private to the driver)."""
    return hashlib.sha256(str(folder).encode()).hexdigest()[:12]


def worker_dirs(user: WorkerUser, folder: Path, worker_id: str) -> Path:
    """``HOME/clusters/<id>/<worker_id>`` with ``work``, ``local``, ``tmp``, ``conf``, all the worker user's."""
    base = user.home / "clusters" / cluster_id(folder) / worker_id
    for d in (user.home / "clusters", base.parent, base, *(base / s for s in ("work", "local", "tmp", "conf", ".mnt"))):
        d.mkdir(exist_ok=True, mode=0o700)
        os.chown(d, user.uid, user.gid)
    return base


def retire_worker_dirs(base: Path, keep_work_in: Path) -> None:
    """After a worker stopped: copy its ``work`` (executor logs) to ``keep_work_in``, delete the rest.

    So the logs stay with the cluster folder, as for a cluster that is not isolated, and
    nothing piles up in the worker user's home.
    """
    if (base / "work").is_dir():
        with contextlib.suppress(OSError, shutil.Error):
            shutil.copytree(base / "work", keep_work_in, dirs_exist_ok=True, symlinks=True)
    shutil.rmtree(base, ignore_errors=True)
    with contextlib.suppress(OSError):
        base.parent.rmdir()  # the cluster's folder in the home, once its last worker is gone


def isolated_env(env: dict[str, str], user: WorkerUser, base: Path) -> dict[str, str]:
    """The driver's environment for a worker running as ``user`` with its dirs in ``base``."""
    out = dict(env)
    tmp = str(base / "tmp")
    out.update(
        HOME=str(user.home), USER=user.name, LOGNAME=user.name, TMPDIR=tmp,
        SPARK_LOCAL_DIRS=str(base / "local"), SPARK_WORKER_DIR=str(base / "work"),
        SPARK_CONF_DIR=str(base / "conf"), SPARK_LOG_DIR=str(base / "work"),
    )  # fmt: skip
    out["SPARK_WORKER_OPTS"] = f"{env.get('SPARK_WORKER_OPTS', '')} -Djava.io.tmpdir={tmp}".strip()
    return out


def isolated_command(argv: list[str], user: WorkerUser, hidden: dict[Path, list[Path]], stage: Path) -> list[str]:
    """``argv`` run as ``user``; in a new mount namespace that hides ``hidden``'s folders if there are any.

    ``stage`` is an empty folder used as a mount point inside the namespace only.

    >>> u = WorkerUser("w", 990, 990, Path("/var/lib/w"))
    >>> isolated_command(["java"], u, {}, Path("/s"))
    ['setpriv', '--reuid=990', '--regid=990', '--clear-groups', '--', 'java']
    """
    become = ["setpriv", f"--reuid={user.uid}", f"--regid={user.gid}", "--clear-groups", "--", *argv]
    if not hidden:
        return become
    q = shlex.quote
    lines = ["set -e", f"mount -t tmpfs -o mode=0700,size=1m keyscale-stage {q(str(stage))}"]
    for i, where in enumerate(hidden):
        # Keep a handle on the folder's content, cover the folder, bring back what is needed.
        lines += [f"mkdir {q(str(stage / str(i)))}", f"mount --rbind {q(str(where))} {q(str(stage / str(i)))}"]
    for i, (where, paths) in enumerate(hidden.items()):
        lines.append(f"mount -t tmpfs -o mode=0755,size=1m keyscale-hidden {q(str(where))}")
        for p in paths:
            rel = p.relative_to(where)
            inside = stage / str(i) / rel
            lines.append(
                f"if [ -d {q(str(inside))} ]; then mkdir -p {q(str(p))}; "
                f"else mkdir -p {q(str(p.parent))}; : > {q(str(p))}; fi"
            )
            lines.append(f"mount --rbind {q(str(inside))} {q(str(p))}")
    lines += [f"umount -l {q(str(stage))}", 'exec "$@"']
    return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", "\n".join(lines), "keyscale-worker", *become]


def check_worker_python(user: WorkerUser, hidden: dict[Path, list[Path]], stage: Path, env: dict[str, str], python: str) -> None:
    """Run ``python -c "import pyspark, keyscale"`` as an isolated worker would; ClusterError if it fails."""
    cmd = isolated_command([python, "-c", "import pyspark, keyscale"], user, hidden, stage)
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=stage.parent, timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ClusterError(f"cannot start a process as the worker user {user.name!r}: {e}") from None
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or [f"exit code {r.returncode}"])[-1]
        raise ClusterError(
            f"the worker user {user.name!r} cannot run {python} and import pyspark and keyscale "
            f"({last}); make them readable by others, or drop --isolated"
        )


def executors_python() -> str:
    """The Python executors will run: the driver's ``PYSPARK_PYTHON``, else this interpreter."""
    return os.environ.get("PYSPARK_PYTHON") or sys.executable

