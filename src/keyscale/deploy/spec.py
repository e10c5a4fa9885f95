"""Deployment files: what a deployment runs and how it may change (TOML).

A deployment file names a job file, its arguments and run settings, and the policies that
govern changes: the upgrade strategy (how a change of code or settings reaches a running
job), the restore strategy (which state a (re)started job begins from) and the restart
strategy (what happens when the job fails). ``docs/deployments.md`` documents every field.

>>> import tempfile
>>> from pathlib import Path
>>> d = Path(tempfile.mkdtemp())
>>> _ = (d / "job.py").write_text("def build(ctx): ...")
>>> spec = parse_deployment('''
... name = "counts"
... job = "job.py"
... parallelism = 2
... upgrade_strategy = "STATEFUL"
... [args]
... input = "in"
... [restart]
... attempts = 5
... ''', d / "deployment.toml")
>>> spec.name, spec.parallelism, spec.args, spec.upgrade_strategy, spec.restart.attempts
('counts', 2, {'input': 'in'}, <UpgradeStrategy.STATEFUL: 'STATEFUL'>, 5)
>>> spec.state_dir == d / ".keyscale" / "counts", spec.savepoint_dir == spec.state_dir / "savepoints"
(True, True)
>>> parse_deployment('name = "counts"\\njob = "job.py"\\nparallelism = 0', d / "deployment.toml")
Traceback (most recent call last):
...
keyscale.deploy.spec.DeploymentError: ...deployment.toml: parallelism: must be an integer >= 1, not 0
"""

from __future__ import annotations

import difflib
import hashlib
import os
import re
import tomllib
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, NoReturn

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
    "load_deployment",
    "parse_deployment",
    "state_dir_of",
]

DEFAULT_MASTER = "local[2]"
DEFAULT_TRIGGER_INTERVAL = "1 second"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_INTERVAL = re.compile(r"^\d+\s*(millisecond|second|minute|hour|day)s?$")


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


_TOP = (
    "name", "job", "args", "parallelism", "max_parallelism", "master", "trigger_interval", "retain",
    "compaction_chain", "state_dir", "savepoint_dir", "upgrade_strategy", "restore_strategy",
    "allow_non_restored_state", "restart", "spark_conf", "state_backend", "async_checkpoints", "latency_target", "scaling", "autoscaler", "slo",
)
_RESTART = ("attempts", "backoff_seconds", "backoff_factor", "max_backoff_seconds")


class _Fields:
    """Typed access to one TOML table, raising one-line errors naming the file and the field."""

    def __init__(self, where: Path, table: dict[str, Any], prefix: str, known: tuple[str, ...]):
        self.where, self.table, self.prefix = where, table, prefix
        for key in table:
            if key not in known:
                close = difflib.get_close_matches(key, known, n=1) or difflib.get_close_matches(_snake(key), known, n=1)
                hint = f" (did you mean '{close[0]}'?)" if close else f" (known: {', '.join(known)})"
                self.fail(key, f"unknown field{hint}")

    def fail(self, key: str, message: str) -> NoReturn:
        raise DeploymentError(f"{self.where}: {self.prefix}{key}: {message}")

    def get(self, key: str, default: Any = None) -> Any:
        return self.table.get(key, default)

    def string(self, key: str, default: str | None = None) -> str:
        v = self.table.get(key, default)
        if v is None:
            self.fail(key, "is required")
        if not isinstance(v, str) or not v.strip():
            self.fail(key, f"must be a non-empty string, not {v!r}")
        return str(v)

    def integer(self, key: str, default: int | None, minimum: int) -> int | None:
        v = self.table.get(key, default)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            self.fail(key, f"must be an integer >= {minimum}, not {v!r}")
        return int(v)

    def number(self, key: str, default: float, minimum: float) -> float:
        v = self.table.get(key, default)
        if isinstance(v, bool) or not isinstance(v, int | float) or v < minimum:
            self.fail(key, f"must be a number >= {minimum:g}, not {v!r}")
        return float(v)

    def boolean(self, key: str, default: bool) -> bool:
        v = self.table.get(key, default)
        if not isinstance(v, bool):
            self.fail(key, f"must be true or false, not {v!r}")
        return bool(v)

    def choice(self, key: str, enum: type[UpgradeStrategy] | type[RestoreStrategy], default: str) -> str:
        v = self.table.get(key, default)
        names = [e.value for e in enum]
        if not isinstance(v, str) or v.upper() not in names:
            self.fail(key, f"{v!r} is not one of {', '.join(names)}")
        return str(v).upper()


def _snake(key: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", key).lower()


def _path(base: Path, text: str) -> Path:
    p = Path(text).expanduser()
    return Path(os.path.normpath((p if p.is_absolute() else base / p).absolute()))


def _text_table(top: _Fields, key: str) -> dict[str, str]:
    """A table of NAME = string, number or boolean (``[args]``, ``[spark_conf]``), as text."""
    raw = top.get(key, {})
    if not isinstance(raw, dict):
        top.fail(key, f"must be a table of NAME = value, not {raw!r}")
    out: dict[str, str] = {}
    for k, v in raw.items():
        if isinstance(v, bool):
            out[k] = "true" if v else "false"
        elif isinstance(v, str | int | float):
            out[k] = str(v)
        else:
            top.fail(f"{key}.{k}", f"must be a string, number or boolean, not {type(v).__name__}")
    return out


def _scaling(top: _Fields) -> tuple[str, str, str | None]:
    """``scaling``, ``autoscaler`` and ``slo``: what ``keyscale run`` would refuse is refused here."""
    from keyscale.scaling.slo import parse_slo

    scaling = top.string("scaling", "fixed")
    if scaling not in ("fixed", "reactive", "auto"):
        top.fail("scaling", f"must be 'fixed', 'reactive' or 'auto', not {scaling!r}")
    autoscaler = top.string("autoscaler", "recommend")
    if autoscaler not in ("recommend", "active"):
        top.fail("autoscaler", f"must be 'recommend' or 'active', not {autoscaler!r}")
    if "slo" not in top.table:
        return scaling, autoscaler, None
    if scaling != "auto":
        top.fail("slo", "only the autoscaler sizes for an SLO: set scaling = \"auto\"")
    try:
        return scaling, autoscaler, str(parse_slo(top.string("slo")))
    except KeyscaleError as e:
        top.fail("slo", str(e).removeprefix("--slo "))


def parse_deployment(text: str, path: str | Path) -> DeploymentSpec:
    """Parse and validate the text of deployment file ``path`` (relative paths start at its folder).

    Every problem is a :class:`DeploymentError` whose message is one line naming the file
    and the field.
    """
    where = Path(path).absolute()
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise DeploymentError(f"{where}: not valid TOML: {e}") from None
    top = _Fields(where, doc, "", _TOP)
    base = where.parent
    name = top.string("name")
    if not _NAME.match(name):
        top.fail("name", f"{name!r} must be letters, digits, '_', '-' or '.', starting with a letter or digit")
    job_file = _path(base, top.string("job"))
    if job_file.suffix != ".py":
        top.fail("job", f"{job_file} is not a Python file (.py)")
    if not job_file.is_file():
        top.fail("job", f"job file {job_file} does not exist")
    args = _text_table(top, "args")
    spark_conf = _text_table(top, "spark_conf")
    parallelism = top.integer("parallelism", 1, 1)
    assert parallelism is not None
    max_parallelism = top.integer("max_parallelism", None, 1)
    if max_parallelism is not None:
        if max_parallelism > 32768:
            top.fail("max_parallelism", f"must be at most 32768, not {max_parallelism}")
        if parallelism > max_parallelism:
            top.fail("parallelism", f"{parallelism} is larger than max_parallelism {max_parallelism}")
    master = top.string("master", DEFAULT_MASTER)
    interval = top.string("trigger_interval", DEFAULT_TRIGGER_INTERVAL).strip()
    if not _INTERVAL.match(interval):
        top.fail("trigger_interval", f"{interval!r} must look like '500 milliseconds', '1 second' or '2 minutes'")
    retain = top.integer("retain", 3, 1)
    chain = top.integer("compaction_chain", 8, 2)
    backend = top.string("state_backend", "memory")
    if backend not in ("memory", "rocksdb"):
        top.fail("state_backend", f"must be 'memory' or 'rocksdb', not {backend!r}")
    async_checkpoints = top.boolean("async_checkpoints", False)
    latency_target = top.string("latency_target").strip() if "latency_target" in doc else None
    if latency_target is not None:
        # The rule keyscale run applies to it.
        from keyscale.runtime.batch.sizing import target_seconds

        try:
            target_seconds(latency_target)
        except KeyscaleError as e:
            top.fail("latency_target", str(e).removeprefix("latency_target "))
    scaling, autoscaler, slo = _scaling(top)
    state_dir = _path(base, top.string("state_dir", f".keyscale/{name}"))
    savepoint_dir = _path(base, top.string("savepoint_dir")) if "savepoint_dir" in doc else state_dir / "savepoints"
    upgrade = UpgradeStrategy(top.choice("upgrade_strategy", UpgradeStrategy, "STATEFUL"))
    restore = RestoreStrategy(top.choice("restore_strategy", RestoreStrategy, "LATEST_STATE"))
    allow = top.boolean("allow_non_restored_state", False)
    raw_restart = top.get("restart", {})
    if not isinstance(raw_restart, dict):
        top.fail("restart", f"must be a table ([restart] attempts = 3, backoff_seconds = 2), not {raw_restart!r}")
    r = _Fields(where, raw_restart, "restart.", _RESTART)
    attempts = r.integer("attempts", 3, 0)
    assert attempts is not None and retain is not None and chain is not None
    restart = RestartStrategy(
        attempts=attempts,
        backoff_seconds=r.number("backoff_seconds", 2.0, 0.0),
        backoff_factor=r.number("backoff_factor", 1.0, 1.0),
        max_backoff_seconds=r.number("max_backoff_seconds", 60.0, 0.0),
    )
    return DeploymentSpec(
        name=name, source=where, job_file=job_file, job_sha256=file_sha256(job_file), args=args,
        parallelism=parallelism, max_parallelism=max_parallelism, master=master, trigger_interval=interval,
        retain=retain, compaction_chain=chain, state_dir=state_dir, savepoint_dir=savepoint_dir,
        upgrade_strategy=upgrade, restore_strategy=restore, allow_non_restored_state=allow, restart=restart,
        spark_conf=spark_conf, state_backend=backend, async_checkpoints=async_checkpoints, latency_target=latency_target,
        scaling=scaling, autoscaler=autoscaler, slo=slo,
    )


def load_deployment(path: str | Path) -> DeploymentSpec:
    """Read and validate a deployment file (see :func:`parse_deployment`).

    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp()); _ = (d / "job.py").write_text("def build(ctx): ...")
    >>> _ = (d / "d.toml").write_text('name = "counts"\\njob = "job.py"\\nrestore_strategy = "NONE"\\n')
    >>> load_deployment(d / "d.toml").restore_strategy
    <RestoreStrategy.NONE: 'NONE'>
    >>> load_deployment(d / "missing.toml")
    Traceback (most recent call last):
    ...
    keyscale.deploy.spec.DeploymentError: deployment file .../missing.toml does not exist
    """
    where = Path(path).absolute()
    try:
        text = where.read_text()
    except FileNotFoundError:
        raise DeploymentError(f"deployment file {where} does not exist") from None
    except (IsADirectoryError, UnicodeDecodeError, PermissionError) as e:
        raise DeploymentError(f"deployment file {where} cannot be read ({type(e).__name__})") from None
    return parse_deployment(text, where)


def state_dir_of(target: str | Path) -> Path:
    """The state folder of a deployment given its file or its state folder.

    Only ``name`` and ``state_dir`` of a file are read, so a deployment whose file has
    since become invalid can still be inspected and stopped.

    >>> state_dir_of("/nonexistent/deployment.toml")
    Traceback (most recent call last):
    ...
    keyscale.deploy.spec.DeploymentError: /nonexistent/deployment.toml is neither a deployment file nor a deployment's state folder
    """
    p = Path(target).absolute()
    if p.is_dir():
        return p
    if p.is_file():
        try:
            doc = tomllib.loads(p.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise DeploymentError(f"{p}: not valid TOML: {e}") from None
        top = _Fields(p, {k: v for k, v in doc.items() if k in ("name", "state_dir")}, "", _TOP)
        name = top.string("name")
        return _path(p.parent, top.string("state_dir", f".keyscale/{name}"))
    raise DeploymentError(f"{p} is neither a deployment file nor a deployment's state folder")
