"""Where keyscale keeps what it persists: job directories, savepoints and sink output.

Today every location is a local (or locally mounted) path. A location written as a URI
is accepted only when keyscale can serve it (``file://``); any other scheme (``s3://``,
``gs://``, ``hdfs://``, ...) is an error, never a local folder named after the scheme.
"""

from keyscale.storage.uri import local_path

__all__ = ["local_path"]
