"""Locations as users write them: a local path, a ``file://`` URI, or a URI keyscale refuses."""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import unquote, urlparse

from keyscale.errors import StorageError

# A scheme as RFC 3986 spells it, then "://". One letter before ":" is a Windows drive, not
# a scheme, and a path like "out:2024" has no "//": both stay paths.
_URI = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+)://")


def local_path(location: str | os.PathLike[str], what: str) -> Path:
    """The absolute local path of ``location``; ``what`` names it in errors ("job directory").

    >>> str(local_path("/tmp/jobs/a", "job directory"))
    '/tmp/jobs/a'
    >>> str(local_path("file:///tmp/jobs/a%20b", "job directory"))
    '/tmp/jobs/a b'
    >>> local_path("s3://bucket/jobs/rc", "job directory")
    Traceback (most recent call last):
    ...
    keyscale.errors.StorageError: job directory s3://bucket/jobs/rc: keyscale cannot store in s3:// locations yet (only local paths and file:// URIs); use a local or mounted path
    """
    if isinstance(location, Path):
        return location.absolute()
    text = os.fspath(location)
    found = _URI.match(text)
    if found is None:
        return Path(text).absolute()
    scheme = found.group(1).lower()
    if scheme == "file":
        parsed = urlparse(text)
        if parsed.netloc not in ("", "localhost"):
            raise StorageError(f"{what} {text}: a file:// URI names a host ({parsed.netloc}); write file:///absolute/path")
        return Path(unquote(parsed.path)).absolute()
    raise StorageError(
        f"{what} {text}: keyscale cannot store in {scheme}:// locations yet (only local paths and file:// URIs); use a local or mounted path"
    )
