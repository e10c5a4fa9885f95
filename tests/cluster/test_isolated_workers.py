"""Isolated workers: executors run as another user and cannot read the driver's private files.

The storage tests rely on this: on such a cluster a path that leaks past keyscale's
storage layer (a job dir under pytest's 0700 tmp dir) fails in the task.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from keyscale.cluster import add_worker, read_cluster, start_cluster, stop_cluster
from keyscale.cluster.isolation import WorkerUser, hidden_folders, isolated_command
from keyscale.errors import ClusterError

APP = Path(__file__).with_name("isolated_app.py")
# A user with this process's uid: the test's tmp dirs are open to it, and a folder of mode
# 0077 is closed to it (owner bits apply), so no root is needed.
ME = WorkerUser("me", os.getuid(), -1, Path("/nonexistent"))

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or not (shutil.which("setpriv") and shutil.which("unshare")),
    reason="isolated workers need root, setpriv and unshare",
)


def _uid_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise AssertionError(f"no Uid in /proc/{pid}/status")


@needs_root
@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tasks_run_as_the_worker_user_and_cannot_read_the_drivers_files(tmp_path: Path) -> None:
    job_dir = tmp_path / "job"  # like a test's job dir: under pytest's private tmp dir
    job_dir.mkdir()
    secret = job_dir / "state.txt"
    secret.write_text("driver only")
    folder = tmp_path / "cluster"
    info = start_cluster(folder, workers=1, cores=1, isolated=True)
    try:
        assert info.worker_user == "keyscale-worker" and read_cluster(folder) == info
        (w,) = info.workers
        worker_uid = _uid_of(w.pid)
        assert worker_uid != os.getuid()
        # A worker added later is isolated the same way.
        w2 = add_worker(folder, cores=1)
        assert _uid_of(w2.pid) == worker_uid
        r = subprocess.run(
            [sys.executable, str(APP), info.master_url, str(secret)],
            capture_output=True, text=True, timeout=240, check=False,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr[-3000:]
        out = json.loads(r.stdout.strip().splitlines()[-1])
    finally:
        stop_cluster(folder)
    # A task that only computes works, as the worker user, with the worker's own temp dir.
    assert sorted(t["sum"] for t in out["compute"]) == [sum(range(50)), sum(range(50, 100))]
    for t in out["compute"]:
        assert t["uid"] == worker_uid != out["driver_uid"]
        assert t["user"] == "keyscale-worker"
        assert t["tmp"].startswith(t["home"]) and not t["tmp"].startswith(str(tmp_path))
    # A task that opens the driver's file fails.
    assert out["read"]["ok"] is False, out["read"]
    assert out["read"]["error"] in ("PermissionError", "FileNotFoundError"), out["read"]
    assert str(secret) in out["read"]["message"]
    # The workers had their own dirs in the worker user's home; once stopped, their
    # executor logs are in the cluster folder, as on a plain cluster, and the rest is gone.
    assert w.work_dir.is_relative_to(Path(pwd.getpwnam("keyscale-worker").pw_dir) / "clusters")
    assert any((folder / "work" / w.id).glob("app-*/*/stderr"))
    assert not w.work_dir.parent.exists() and not w2.work_dir.parent.exists()


def test_isolated_needs_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(ClusterError, match=r"only root can start processes as another user .*drop --isolated"):
        start_cluster(tmp_path / "c", isolated=True)
    assert read_cluster(tmp_path / "c") is None


def test_a_closed_folder_is_covered_and_the_needed_path_bound_back(tmp_path: Path) -> None:
    closed = tmp_path / "home"
    needed = closed / "py" / "3.11"
    needed.mkdir(parents=True)
    (needed / "lib").mkdir()
    os.chmod(closed, 0o077)
    try:
        hidden = hidden_folders([needed, needed / "lib", Path("/usr")], ME)
    finally:
        os.chmod(closed, 0o700)
    assert hidden == {closed: [needed]}
    cmd = isolated_command(["java"], ME, hidden, tmp_path / "stage")
    assert cmd[:5] == ["unshare", "--mount", "--propagation", "private", "--"]
    assert cmd[-6:] == ["setpriv", f"--reuid={os.getuid()}", "--regid=-1", "--clear-groups", "--", "java"]
    script = cmd[7]
    assert f"mount -t tmpfs -o mode=0755,size=1m keyscale-hidden {closed}" in script
    assert f"mount --rbind {tmp_path / 'stage' / '0' / 'py' / '3.11'} {needed}" in script


def test_a_needed_path_closed_to_the_worker_is_named(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    venv.mkdir()
    os.chmod(venv, 0o077)
    try:
        with pytest.raises(ClusterError, match=rf"'me' cannot read {venv} \(mode 0077, owner uid \d+\)"):
            hidden_folders([venv], ME)
    finally:
        os.chmod(venv, 0o700)


def test_cli_worker_user_implies_isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from keyscale.cli.main import main

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert main(["cluster", "start", "--dir", str(tmp_path / "c"), "--worker-user", "ks-test-worker"]) == 6
    assert "isolated workers run as the user 'ks-test-worker', and only root can" in capsys.readouterr().err
    assert main(["cluster", "start", "--dir", str(tmp_path / "c"), "--isolated"]) == 6
    assert "run as the user 'keyscale-worker'" in capsys.readouterr().err
