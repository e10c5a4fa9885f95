"""Where the control API listens and who may read ``/metrics``: run options first, then
environment variables, then the defaults.

- ``control_host`` (``--control-host``, ``KEYSCALE_CONTROL_HOST``): the address to listen
  on; default ``127.0.0.1``. ``0.0.0.0`` (or ``::``) for a probe or Prometheus in a pod.
- ``control_port`` (``--control-port``, ``KEYSCALE_CONTROL_PORT``): default 0, any free port.
- ``metrics_token_file`` (``--metrics-token-file``, ``KEYSCALE_METRICS_TOKEN_FILE``), or the
  token itself in ``KEYSCALE_METRICS_TOKEN`` (no flag: a command line is visible in ``ps``):
  ``/metrics`` also answers this stable token.
- ``metrics_unauthenticated`` (``--metrics-unauthenticated``,
  ``KEYSCALE_METRICS_UNAUTHENTICATED=1``): ``/metrics`` answers anyone.

Without either, ``/metrics`` needs the per-run secret, as every endpoint but ``/health``.

A setting keyscale cannot serve (a token file that is missing or empty, a port that is not
a number, a token and "unauthenticated" together) is a :class:`KeyscaleError` naming it when
the job starts: an operator who asked for a token must never get an open endpoint, or a
closed one, without being told.
"""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from keyscale.errors import KeyscaleError

if TYPE_CHECKING:
    from keyscale.runtime.batch.jobstate import RunOptions

log = logging.getLogger("keyscale")

HOST_ENV = "KEYSCALE_CONTROL_HOST"
PORT_ENV = "KEYSCALE_CONTROL_PORT"
TOKEN_FILE_ENV = "KEYSCALE_METRICS_TOKEN_FILE"
TOKEN_ENV = "KEYSCALE_METRICS_TOKEN"
UNAUTHENTICATED_ENV = "KEYSCALE_METRICS_UNAUTHENTICATED"


class BearerToken:
    """A token an operator gives a server (``/metrics``, ``keyscale state serve``), from a
    file or as is; ``kind`` names it in messages (``metrics``, ``state lookup``).

    A file is read again at each use (a scrape, a lookup): a Kubernetes Secret mounted as a
    volume is updated in place when it rotates, and Prometheus reads its ``credentials_file``
    at each scrape too, so both sides move to the new token without a restart. A file that becomes
    unreadable or empty later keeps the last token it had (logged): the job's metrics must
    not open up, nor a running job fail, because a mount hiccuped.
    """

    def __init__(self, value: str | None = None, file: str | None = None, origin: str = "", kind: str = "metrics"):
        self.file, self.origin, self.kind = file, origin, kind
        self._last = value if value is not None else _read_token_file(file or "", origin, kind)
        self._problem = ""  # logged once, not at every scrape

    def current(self) -> str:
        if self.file is None:
            return self._last
        try:
            self._last, self._problem = _read_token_file(self.file, self.origin, self.kind), ""
        except KeyscaleError as e:
            if str(e) != self._problem:
                self._problem = str(e)
                log.warning("%s; the previous token stays in force", e)
        return self._last


def _read_token_file(path: str, origin: str, kind: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except FileNotFoundError:
        raise KeyscaleError(f"the {kind} token file {path} ({origin}) does not exist") from None
    except OSError as e:
        raise KeyscaleError(f"cannot read the {kind} token file {path} ({origin}): {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise KeyscaleError(f"the {kind} token file {path} ({origin}) is not text") from None
    if not token:
        raise KeyscaleError(f"the {kind} token file {path} ({origin}) is empty")
    if any(c.isspace() for c in token):
        # Prometheus sends the file's content, trimmed, as one header value: a token with a
        # space or a second line would never match what it sends.
        raise KeyscaleError(f"the {kind} token in {path} ({origin}) contains white space: write the token alone")
    return token


@dataclass(frozen=True)
class ControlSettings:
    """The control API's address and ``/metrics`` access, resolved and checked."""

    host: str = "127.0.0.1"
    port: int = 0
    # /metrics also accepts this token (the per-run secret always works); or, unauthenticated, anyone may read it.
    metrics_token: BearerToken | None = None
    metrics_unauthenticated: bool = False

    def describe_metrics(self) -> str:
        if self.metrics_unauthenticated:
            return "/metrics without authentication"
        if self.metrics_token is not None:
            return f"/metrics with the token of {self.metrics_token.origin}"
        return "/metrics with the control secret"


def _flag(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("", "0", "false", "no", "off"):
        return False
    raise KeyscaleError(f"{name} must be true or false (1/0, yes/no), not {raw!r}")


def _port(raw: str | int, origin: str) -> int:
    try:
        port = int(raw)
    except (TypeError, ValueError):
        raise KeyscaleError(f"{origin} must be a port number (0 for any free port), not {raw!r}") from None
    if not 0 <= port <= 65535:
        raise KeyscaleError(f"{origin} must be a port number from 0 to 65535 (0 for any free port), not {port}")
    return port


def control_settings(opts: RunOptions, environ: dict[str, str] | None = None) -> ControlSettings:
    """The settings of a run from its options and the environment; a :class:`KeyscaleError`
    naming the setting that cannot be served.

    >>> from keyscale.runtime.batch.jobstate import RunOptions
    >>> s = control_settings(RunOptions("j.py", "d"), {"KEYSCALE_CONTROL_HOST": "0.0.0.0", "KEYSCALE_CONTROL_PORT": "9464"})
    >>> s.host, s.port, s.describe_metrics()
    ('0.0.0.0', 9464, '/metrics with the control secret')
    """
    env = dict(os.environ) if environ is None else environ

    if opts.control_host is not None:
        host, host_origin = opts.control_host, "control_host (--control-host)"
    else:
        host, host_origin = env.get(HOST_ENV, "127.0.0.1"), HOST_ENV
    if not host.strip() or host != host.strip():
        raise KeyscaleError(f"{host_origin} must be an address to listen on (e.g. 127.0.0.1, 0.0.0.0, ::), not {host!r}")
    if opts.control_port is not None:
        port = _port(opts.control_port, "control_port (--control-port)")
    else:
        port = _port(env.get(PORT_ENV, "0"), PORT_ENV)

    if opts.metrics_unauthenticated is not None:
        unauthenticated = opts.metrics_unauthenticated
    else:
        unauthenticated = _flag(UNAUTHENTICATED_ENV, env.get(UNAUTHENTICATED_ENV, ""))
    sources: list[tuple[str, str | None, str | None]] = []  # (origin, file, value)
    if opts.metrics_token_file is not None:
        sources.append(("metrics_token_file (--metrics-token-file)", os.fspath(opts.metrics_token_file), None))  # a Path from Python too
    elif TOKEN_FILE_ENV in env:
        sources.append((TOKEN_FILE_ENV, env[TOKEN_FILE_ENV], None))
    if TOKEN_ENV in env:
        sources.append((TOKEN_ENV, None, env[TOKEN_ENV]))
    if len(sources) > 1:
        raise KeyscaleError(f"the /metrics token is given twice ({' and '.join(s[0] for s in sources)}): give one")
    if sources and unauthenticated:
        raise KeyscaleError(f"/metrics cannot both need a token ({sources[0][0]}) and be unauthenticated "
                            f"(metrics_unauthenticated, --metrics-unauthenticated or {UNAUTHENTICATED_ENV}): choose one")
    token = None
    if sources:
        origin, file, value = sources[0]
        if file is not None:
            if not file.strip():
                raise KeyscaleError(f"{origin} is set but names no file")
            token = BearerToken(file=file, origin=origin)
        else:
            assert value is not None
            if not value.strip():
                raise KeyscaleError(f"{origin} is set but empty: give the token, or unset it")
            if any(c.isspace() for c in value.strip()):
                raise KeyscaleError(f"{origin} contains white space: give the token alone")
            token = BearerToken(value=value.strip(), origin=origin)
    return ControlSettings(host=host, port=port, metrics_token=token, metrics_unauthenticated=unauthenticated)


def add_control_arguments(p: argparse.ArgumentParser) -> None:
    """The control API's flags, for ``keyscale run`` and a job file's ``ks.main`` (spark-submit)."""
    g = p.add_argument_group(f"control API (also {HOST_ENV}, {PORT_ENV}, {TOKEN_FILE_ENV}, {TOKEN_ENV}, {UNAUTHENTICATED_ENV}; "
                             "a flag wins over its variable)")
    g.add_argument("--control-host", metavar="ADDRESS",
                   help="address the control API listens on (default 127.0.0.1; 0.0.0.0 for probes and Prometheus in Kubernetes); "
                        "every endpoint but /health and /metrics still needs the per-run secret")
    g.add_argument("--control-port", type=int, metavar="PORT", help="its port (default: any free port, see JOB_DIR/control/http.json)")
    g.add_argument("--metrics-token-file", metavar="FILE",
                   help="/metrics also accepts 'Authorization: Bearer <the file's content>' (e.g. a mounted Kubernetes Secret; "
                        "read again at each scrape)")
    g.add_argument("--metrics-unauthenticated", action="store_true", default=None,
                   help="/metrics answers without any credential (the operator's explicit choice)")


def control_options(a: argparse.Namespace) -> dict[str, Any]:
    """The :class:`RunOptions` fields of :func:`add_control_arguments`' flags."""
    return {"control_host": a.control_host, "control_port": a.control_port, "metrics_token_file": a.metrics_token_file,
            "metrics_unauthenticated": a.metrics_unauthenticated}
