"""The deployment file: TOML in, a :class:`~keyscale.deploy.spec.DeploymentSpec` out, every
mistake a one-line :class:`~keyscale.deploy.spec.DeploymentError` naming the file and the field.

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
import os
import re
import tomllib
from pathlib import Path
from typing import Any, NoReturn

from keyscale.deploy.spec import (
    DEFAULT_MASTER,
    DEFAULT_TRIGGER_INTERVAL,
    DeploymentError,
    DeploymentSpec,
    RestartStrategy,
    RestoreStrategy,
    UpgradeStrategy,
    file_sha256,
)
from keyscale.errors import KeyscaleError

__all__ = ["load_deployment", "parse_deployment", "state_dir_of"]

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_INTERVAL = re.compile(r"^\d+\s*(millisecond|second|minute|hour|day)s?$")

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
