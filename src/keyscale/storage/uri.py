"""Locations as users write them: a local path, ``file://``, or an object store URI."""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import unquote, urlparse

from keyscale.errors import StorageError
from keyscale.storage.base import Store

# A scheme as RFC 3986 spells it, then "://". One letter before ":" is a Windows drive, not
# a scheme, and a path like "out:2024" has no "//": both stay paths.
_URI = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+)://")

# Options given with --storage-option (or storage_options=): they apply to every object
# store location the process opens, after the environment's settings.
_OPTIONS: dict[str, str] = {}


def set_storage_options(options: dict[str, str]) -> None:
    """Settings for object stores (obstore config keys), as ``--storage-option K=V`` gives them."""
    _OPTIONS.clear()
    _OPTIONS.update(options)


def parse_storage_options(items: list[str]) -> dict[str, str]:
    """``["endpoint=http://h:9000", ...]`` as a dict; a malformed item is an error naming it.

    >>> parse_storage_options(["region=eu-west-1", "endpoint=http://h:9000/x=y"])
    {'region': 'eu-west-1', 'endpoint': 'http://h:9000/x=y'}
    """
    out = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise StorageError(f"--storage-option {item!r}: write KEY=VALUE (e.g. endpoint=http://127.0.0.1:9000)")
        out[key.strip()] = value
    return out


def scheme_of(location: str | os.PathLike[str]) -> str | None:
    """The URI scheme of ``location`` (lower case), None for a plain path."""
    if isinstance(location, Path):
        return None
    found = _URI.match(os.fspath(location))
    return found.group(1).lower() if found else None


def local_path(location: str | os.PathLike[str], what: str) -> Path:
    """The absolute local path of ``location``; ``what`` names it in errors ("job directory").
    For things that only live on local disk (a Spark checkpoint, a log folder).

    >>> str(local_path("/tmp/jobs/a", "job directory"))
    '/tmp/jobs/a'
    >>> str(local_path("file:///tmp/jobs/a%20b", "job directory"))
    '/tmp/jobs/a b'
    >>> local_path("s3://bucket/jobs/rc", "log folder")
    Traceback (most recent call last):
    ...
    keyscale.errors.StorageError: log folder s3://bucket/jobs/rc: must be a local path or a file:// URI, not an s3:// location
    """
    if isinstance(location, Path):
        return location.absolute()
    text = os.fspath(location)
    scheme = scheme_of(text)
    if scheme is None:
        return Path(text).absolute()
    if scheme == "file":
        parsed = urlparse(text)
        if parsed.netloc not in ("", "localhost"):
            raise StorageError(f"{what} {text}: a file:// URI names a host ({parsed.netloc}); write file:///absolute/path")
        return Path(unquote(parsed.path)).absolute()
    raise StorageError(f"{what} {text}: must be a local path or a file:// URI, not an {scheme}:// location")


def open_store(location: str | os.PathLike[str] | Store, what: str, options: dict[str, str] | None = None) -> Store:
    """The store of ``location``; ``what`` names it in errors ("job directory").

    A local path or ``file://`` URI is a :class:`~keyscale.storage.local.LocalStore`;
    ``s3://`` (any S3-compatible endpoint), ``gs://`` and ``az://`` are object stores;
    any other scheme is an error, never a local folder named after it.

    >>> open_store("/tmp/jobs/a", "job directory").uri
    'file:///tmp/jobs/a'
    >>> open_store("s3://bucket/jobs/rc", "job directory").uri
    's3://bucket/jobs/rc'
    >>> open_store("hdfs://nn/jobs/rc", "job directory")
    Traceback (most recent call last):
    ...
    keyscale.errors.StorageError: job directory hdfs://nn/jobs/rc: keyscale cannot store in hdfs:// locations (it serves local paths, file://, s3://, gs:// and az://); HDFS needs the Hadoop native client (libhdfs), which this installation lacks: mount HDFS locally (NFS gateway, FUSE) and give the path
    """
    from keyscale.storage.local import LocalStore
    from keyscale.storage.objects import SCHEMES, ObjectStore, settings_from_env

    if isinstance(location, Store):
        return location
    scheme = scheme_of(location)
    if scheme is None or scheme == "file":
        return LocalStore(local_path(location, what))
    if scheme in SCHEMES:
        try:
            return ObjectStore(os.fspath(location), {**settings_from_env(scheme), **_OPTIONS, **(options or {})})
        except StorageError as e:
            raise StorageError(f"{what} {e}") from None
    why = ""
    if scheme in ("hdfs", "viewfs", "webhdfs"):
        why = "; HDFS needs the Hadoop native client (libhdfs), which this installation lacks: mount HDFS locally (NFS gateway, FUSE) and give the path"
    raise StorageError(
        f"{what} {os.fspath(location)}: keyscale cannot store in {scheme}:// locations (it serves local paths, file://, s3://, gs:// and az://){why}"
    )
