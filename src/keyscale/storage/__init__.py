"""Where keyscale keeps what it persists: job directories, savepoints and sink output.

One seam: everything keyscale writes or reads back goes through a :class:`Store` opened
with :func:`open_store` (a local path, ``file://``, ``s3://``, ``gs://``, ``az://``). Nothing
outside this package opens, renames, lists, locks or deletes a path. A location keyscale
cannot serve is an error, never a local folder named after its scheme.

>>> from keyscale.storage import open_store
>>> import tempfile
>>> store = open_store(tempfile.mkdtemp(), "job directory")
>>> store.create("checkpoints/manifest-1.json", b'{"run": 1}'), store.create("checkpoints/manifest-1.json", b'{"run": 2}')
(True, False)
"""

from keyscale.storage.base import ObjectInfo, Store, join
from keyscale.storage.local import LocalStore
from keyscale.storage.objects import ObjectStore
from keyscale.storage.uri import (
    local_path,
    open_store,
    parse_storage_options,
    scheme_of,
    set_storage_options,
)

__all__ = [
    "LocalStore",
    "ObjectInfo",
    "ObjectStore",
    "Store",
    "join",
    "local_path",
    "open_store",
    "parse_storage_options",
    "scheme_of",
    "set_storage_options",
]
