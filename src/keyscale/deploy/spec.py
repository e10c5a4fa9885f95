"""A deployment as data: what it runs and how it may change (:class:`DeploymentSpec`).

A deployment names a job file, its arguments and run settings, and the policies that
govern changes: the upgrade strategy (how a change of code or settings reaches a running
job), the restore strategy (which state a (re)started job begins from) and the restart
strategy (what happens when the job fails). :mod:`keyscale.deploy.file` reads one from its
TOML file; ``docs/deployments.md`` documents every field.

>>> RestartStrategy().attempts >= 0, "slo" in RUN_FIELDS
(True, True)
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from keyscale.errors import KeyscaleError

__all__ = [
    "DEFAULT_MASTER",
    "DEFAULT_TRIGGER_INTERVAL",
    "RUN_FIELDS",
    "DeploymentError",
    "DeploymentSpec",
    "RestartStrategy",
    "RestoreStrategy",
    "UpgradeStrategy",
    "file_sha256",
]

DEFAULT_MASTER = "local[2]"
DEFAULT_TRIGGER_INTERVAL = "1 second"


class DeploymentError(KeyscaleError):
    """A deployment file is invalid, or a deployment refused or failed a change."""


class UpgradeStrategy(StrEnum):
    """How a change of the job's code, arguments or run settings reaches a running job.

    >>> UpgradeStrategy("STATELESS")
    <UpgradeStrategy.STATELESS: 'STATELESS'>
    """

    STATEFUL = "STATEFUL"  # stop with a savepoint, start the new spec from it
    STATELESS = "STATELESS"  # stop without a savepoint, start per the restore strategy
    NONE = "NONE"  # refuse: the running job is left as it is


class RestoreStrategy(StrEnum):
    """Which state a job starts from when the deployment (re)starts it.

    >>> [s.value for s in RestoreStrategy]
    ['LATEST_STATE', 'LATEST_SAVEPOINT', 'NONE']
    """

    LATEST_STATE = "LATEST_STATE"  # newest of the current job's checkpoint and the savepoints
    LATEST_SAVEPOINT = "LATEST_SAVEPOINT"  # the newest savepoint
    NONE = "NONE"  # empty state


@dataclass(frozen=True)
class RestartStrategy:
    """Restarts of a failed job: up to ``attempts`` in a row, waiting longer each time.

    >>> r = RestartStrategy(attempts=4, backoff_seconds=2, backoff_factor=2, max_backoff_seconds=10)
    >>> [r.delay(n) for n in (1, 2, 3, 4)]
    [2.0, 4.0, 8.0, 10.0]
    """

    attempts: int = 3
    backoff_seconds: float = 2.0
    backoff_factor: float = 1.0
    max_backoff_seconds: float = 60.0

    def delay(self, failure: int) -> float:
        """Seconds to wait before restarting after the ``failure``-th failure in a row (1-based)."""
        return float(min(self.max_backoff_seconds, self.backoff_seconds * self.backoff_factor ** max(0, failure - 1)))

    def to_json(self) -> dict[str, Any]:
        return {
            "attempts": self.attempts,
            "backoff_seconds": self.backoff_seconds,
            "backoff_factor": self.backoff_factor,
            "max_backoff_seconds": self.max_backoff_seconds,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RestartStrategy:
        return cls(int(d["attempts"]), float(d["backoff_seconds"]), float(d["backoff_factor"]), float(d["max_backoff_seconds"]))


#: Fields whose change needs a new job process (the upgrade strategy applies).
RUN_FIELDS = ("job", "args", "master", "trigger_interval", "retain", "compaction_chain", "max_parallelism", "spark_conf", "state_backend",
              "async_checkpoints", "latency_target", "scaling", "autoscaler", "slo")


@dataclass(frozen=True)
class DeploymentSpec:
    """One deployment file, validated, with paths made absolute and the job file hashed.

    >>> a = DeploymentSpec("c", Path("/d/c.toml"), Path("/d/job.py"), "a" * 64, {"input": "in"}, parallelism=2)
    >>> b = DeploymentSpec("c", Path("/d/c.toml"), Path("/d/job.py"), "b" * 64, {"input": "in2"}, parallelism=2)
    >>> a.changes(b)
    ['job', 'args']
    >>> a.describe_changes(b)
    'job: job.py@aaaaaaaaaaaa -> job.py@bbbbbbbbbbbb; args: input: in -> in2'
    """

    name: str
    source: Path  # the deployment file
    job_file: Path
    job_sha256: str
    args: dict[str, str] = field(default_factory=dict)
    parallelism: int = 1
    max_parallelism: int | None = None
    master: str = DEFAULT_MASTER
    trigger_interval: str = DEFAULT_TRIGGER_INTERVAL
    retain: int = 3
    compaction_chain: int = 8
    state_dir: Path = Path(".")
    savepoint_dir: Path = Path(".")
    upgrade_strategy: UpgradeStrategy = UpgradeStrategy.STATEFUL
    restore_strategy: RestoreStrategy = RestoreStrategy.LATEST_STATE
    allow_non_restored_state: bool = False
    restart: RestartStrategy = field(default_factory=RestartStrategy)
    spark_conf: dict[str, str] = field(default_factory=dict)  # keyscale run --conf
    state_backend: str = "memory"  # keyscale run --state-backend: the keyed stages' default
    async_checkpoints: bool = False  # keyscale run --async-checkpoints
    latency_target: str | None = None  # keyscale run --latency-target
    scaling: str = "fixed"  # keyscale run --scaling: fixed, reactive or auto
    autoscaler: str = "recommend"  # keyscale run --autoscaler (with scaling auto): recommend or active
    slo: str | None = None  # keyscale run --slo (with scaling auto): "latency=5s", "lag=30s"

    @property
    def base_dir(self) -> Path:
        """The deployment file's folder: relative paths start here, and the job runs here."""
        return self.source.parent

    @property
    def artifact(self) -> Path:
        """Where ``keyscale apply`` keeps the applied copy of the job file (runs use it)."""
        return self.state_dir / "artifacts" / self.job_sha256[:16] / self.job_file.name

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "source": str(self.source),
            "job_file": str(self.job_file),
            "job_sha256": self.job_sha256,
            "args": dict(self.args),
            "parallelism": self.parallelism,
            "max_parallelism": self.max_parallelism,
            "master": self.master,
            "trigger_interval": self.trigger_interval,
            "retain": self.retain,
            "compaction_chain": self.compaction_chain,
            "state_dir": str(self.state_dir),
            "savepoint_dir": str(self.savepoint_dir),
            "upgrade_strategy": self.upgrade_strategy.value,
            "restore_strategy": self.restore_strategy.value,
            "allow_non_restored_state": self.allow_non_restored_state,
            "restart": self.restart.to_json(),
            "spark_conf": dict(self.spark_conf),
            "state_backend": self.state_backend,
            "async_checkpoints": self.async_checkpoints,
            "latency_target": self.latency_target,
            "scaling": self.scaling,
            "autoscaler": self.autoscaler,
            "slo": self.slo,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> DeploymentSpec:
        return cls(
            name=str(d["name"]), source=Path(d["source"]), job_file=Path(d["job_file"]), job_sha256=str(d["job_sha256"]),
            args={str(k): str(v) for k, v in d["args"].items()}, parallelism=int(d["parallelism"]),
            max_parallelism=None if d.get("max_parallelism") is None else int(d["max_parallelism"]),
            master=str(d["master"]), trigger_interval=str(d["trigger_interval"]), retain=int(d["retain"]),
            compaction_chain=int(d["compaction_chain"]), state_dir=Path(d["state_dir"]), savepoint_dir=Path(d["savepoint_dir"]),
            upgrade_strategy=UpgradeStrategy(d["upgrade_strategy"]), restore_strategy=RestoreStrategy(d["restore_strategy"]),
            allow_non_restored_state=bool(d["allow_non_restored_state"]), restart=RestartStrategy.from_json(d["restart"]),
            spark_conf={str(k): str(v) for k, v in d.get("spark_conf", {}).items()},  # absent in specs stored before it
            state_backend=str(d.get("state_backend", "memory")),  # likewise
            async_checkpoints=bool(d.get("async_checkpoints", False)),  # likewise
            latency_target=None if d.get("latency_target") is None else str(d["latency_target"]),  # likewise
            scaling=str(d.get("scaling", "fixed")), autoscaler=str(d.get("autoscaler", "recommend")), slo=d.get("slo"),  # likewise
        )

    def settings(self) -> dict[str, Any]:
        """The comparable settings: the job is its file name and content, not where it lives."""
        d = {"job": f"{self.job_file.name}@{self.job_sha256[:12]}", **self.to_json()}
        for k in ("job_file", "job_sha256", "source", "name", "state_dir"):
            d.pop(k)
        return d

    def changes(self, other: DeploymentSpec) -> list[str]:
        """Names of the settings that differ between ``self`` and ``other``, in a fixed order."""
        a, b = self.settings(), other.settings()
        return [k for k in a if a[k] != b[k]]

    def describe_changes(self, other: DeploymentSpec) -> str:
        """``field: old -> new`` for each changed setting (one line)."""
        a, b = self.settings(), other.settings()
        return "; ".join(f"{k}: {_diff(a[k], b[k])}" for k in self.changes(other)) or "no change"

    def command(self, job_dir: Path | str, from_savepoint: Path | str | None = None, python: str = "python") -> list[str]:
        """The ``keyscale run`` command line that runs this spec's job in ``job_dir``.

        >>> spec = DeploymentSpec("c", Path("/d/c.toml"), Path("/d/job.py"), "ab" * 32, {"input": "in"},
        ...                       parallelism=2, state_dir=Path("/s"))
        >>> " ".join(spec.command("/s/jobs/1", python="py"))  # doctest: +NORMALIZE_WHITESPACE
        'py -m keyscale.cli.main run /s/artifacts/abababababababab/job.py --job-dir /s/jobs/1 -p 2
         --master local[2] --trigger-interval 1 second --retain 3 --compaction-chain 8 --no-stored-args --set input=in'
        """
        argv = [
            python, "-m", "keyscale.cli.main", "run", str(self.artifact), "--job-dir", str(job_dir),
            "-p", str(self.parallelism), "--master", self.master, "--trigger-interval", self.trigger_interval,
            "--retain", str(self.retain), "--compaction-chain", str(self.compaction_chain),
            # The file lists every argument: one removed from it must not live on as one the job directory kept.
            "--no-stored-args",
        ]
        if self.max_parallelism is not None:
            argv += ["--max-parallelism", str(self.max_parallelism)]
        if self.state_backend != "memory":
            argv += ["--state-backend", self.state_backend]
        if self.async_checkpoints:
            argv += ["--async-checkpoints"]
        if self.latency_target is not None:
            argv += ["--latency-target", self.latency_target]
        if self.scaling != "fixed":
            argv += ["--scaling", self.scaling] + (["--autoscaler", self.autoscaler] if self.scaling == "auto" else [])
        if self.slo is not None:
            argv += ["--slo", self.slo]
        for k, v in self.args.items():
            argv += ["--set", f"{k}={v}"]
        for k, v in self.spark_conf.items():
            argv += ["--conf", f"{k}={v}"]
        if from_savepoint is not None:
            argv += ["--from-savepoint", str(from_savepoint)]
            if self.allow_non_restored_state:
                argv.append("--allow-non-restored-state")
        return argv


def _diff(a: Any, b: Any) -> str:
    """``old -> new``; for tables only what changed (``+added=1, -removed, changed: 1 -> 2``).

    >>> _diff({"a": "1", "b": "2"}, {"a": "1", "b": "3", "c": "4"})
    'b: 2 -> 3, +c=4'
    """
    if isinstance(a, dict) and isinstance(b, dict):
        parts = []
        for k in [*a, *(k for k in b if k not in a)]:
            if k not in b:
                parts.append(f"-{k}")
            elif k not in a:
                parts.append(f"+{k}={_short(b[k])}")
            elif a[k] != b[k]:
                parts.append(f"{k}: {_diff(a[k], b[k])}")
        return ", ".join(parts)
    return f"{_short(a)} -> {_short(b)}"


def _short(v: Any) -> str:
    text = repr(v) if not isinstance(v, str) else v
    return text if len(text) <= 80 else text[:77] + "..."


def file_sha256(path: Path) -> str:
    """The sha256 of a file's content, hex.

    >>> import tempfile
    >>> p = Path(tempfile.mkdtemp()) / "job.py"; _ = p.write_text("")
    >>> file_sha256(p)[:16]
    'e3b0c44298fc1c14'
    """
    return hashlib.sha256(path.read_bytes()).hexdigest()
