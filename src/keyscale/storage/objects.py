"""Objects on an object store: S3 and S3-compatible servers, Google Cloud Storage, Azure.

Served by ``obstore`` (Rust ``object_store``): it is the Python client that does a
conditional create (S3 ``If-None-Match: *``, GCS ``ifGenerationMatch=0``), which the commit
protocol needs, and it was the fastest of the clients measured (docs/design.md, "Storage").

Settings come as every S3 tool takes them: the standard environment variables
(``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``,
``AWS_REGION``/``AWS_DEFAULT_REGION``; ``GOOGLE_*``, ``AZURE_*`` for the others), plus
``--storage-option KEY=VALUE`` (obstore's config keys, e.g. ``endpoint``, ``region``,
``virtual_hosted_style_request``). The settings are read once, on the driver, and travel
with the store to the executors (tasks pickle it), as Spark's own ``spark.hadoop.fs.s3a.*``
settings do; where executors have their own credentials (instance profiles, workload
identity), set none and each process finds its own.

Two settings are keyscale's own, not obstore's: ``allow_http`` (a plain-http endpoint; an
``http://`` endpoint implies it) and ``upload_concurrency``, the parts of one multipart
upload (a state file over 64 MB) in flight at once, :data:`UPLOAD_CONCURRENCY` by default.
Why so few: on a server beside the job (SeaweedFS on this machine's two cores), a
snapshot's upload with obstore's 12 parts at once took as long as with 2 and made every
read of the server wait behind it (a point lookup's p99 3-6x as long, docs/benchmarks.md,
"State lookups on S3 beside a snapshot's upload"). A store far away, whose round trip a
part waits on, may want more: each upload's parts are 5 MB.
"""

from __future__ import annotations

import builtins
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from keyscale.errors import StorageError
from keyscale.storage.base import ObjectInfo, Store, check_key, join

SCHEMES = ("s3", "s3a", "gs", "az", "abfs", "abfss")

#: Parts of one multipart upload in flight at once, unless ``upload_concurrency`` says otherwise.
UPLOAD_CONCURRENCY = 2
# Files above this go up in parts (obstore's multipart upload, 5 MB a part).
_MULTIPART_ABOVE = 64 << 20
# Settings that are keyscale's, not obstore config keys.
_OWN = ("allow_http", "upload_concurrency")

# Environment variables read for each scheme, as obstore config keys.
_S3_ENV = {
    "AWS_ACCESS_KEY_ID": "access_key_id",
    "AWS_SECRET_ACCESS_KEY": "secret_access_key",
    "AWS_SESSION_TOKEN": "session_token",
    "AWS_DEFAULT_REGION": "region",
    "AWS_REGION": "region",  # after AWS_DEFAULT_REGION: the AWS CLI prefers AWS_REGION
    "AWS_ENDPOINT_URL": "endpoint",
    "AWS_ENDPOINT_URL_S3": "endpoint",
}


def settings_from_env(scheme: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """The store settings the environment gives for ``scheme`` (driver side).

    >>> settings_from_env("s3", {"AWS_ENDPOINT_URL": "http://127.0.0.1:9000", "AWS_REGION": "eu-west-1"})
    {'region': 'eu-west-1', 'endpoint': 'http://127.0.0.1:9000'}
    """
    env = dict(os.environ if env is None else env)
    out: dict[str, str] = {}
    if scheme in ("s3", "s3a"):
        for var, key in _S3_ENV.items():
            if env.get(var):
                out[key] = env[var]
    elif scheme == "gs":
        for var in ("GOOGLE_SERVICE_ACCOUNT", "GOOGLE_SERVICE_ACCOUNT_PATH", "GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_SERVICE_ACCOUNT_KEY"):
            if env.get(var):
                out[var.lower().removeprefix("google_")] = env[var]
    else:
        out.update({k.lower().removeprefix("azure_storage_").removeprefix("azure_"): v for k, v in env.items() if k.startswith("AZURE_") and v})
    return out


_READERS: ThreadPoolExecutor | None = None
_READERS_LOCK = threading.Lock()


def _reader_pool() -> ThreadPoolExecutor:
    """The threads of :meth:`ObjectStore.get_ranges`, one pool per process (a store is
    pickled to tasks and made often: a pool each would leave threads behind)."""
    global _READERS
    with _READERS_LOCK:
        if _READERS is None:
            _READERS = ThreadPoolExecutor(max_workers=16, thread_name_prefix="keyscale-ranged-read")
        return _READERS


def _upload_concurrency(value: str | None) -> int:
    """The ``upload_concurrency`` setting as a number of parts, 1 or more; anything else is a
    ValueError naming the setting.

    >>> _upload_concurrency(None), _upload_concurrency("8")
    (2, 8)
    >>> _upload_concurrency("0")
    Traceback (most recent call last):
    ...
    ValueError: storage option upload_concurrency='0': give the parts of an upload in flight at once, a whole number from 1
    """
    if value is None:
        return UPLOAD_CONCURRENCY
    text = str(value).strip()
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"storage option upload_concurrency={value!r}: give the parts of an upload in flight at once, a whole number from 1")
    return int(text)


def _split(uri: str) -> tuple[str, str, str]:
    parsed = urlparse(uri)
    scheme = parsed.scheme.lower()
    if not parsed.netloc:
        raise StorageError(f"{uri}: an object store location names its bucket ({scheme}://BUCKET/PREFIX)")
    return scheme, parsed.netloc, parsed.path.strip("/")


class ObjectStore(Store):
    """A bucket and a prefix of an object store.

    >>> s = ObjectStore("s3://bucket/jobs/a", {"endpoint": "http://127.0.0.1:1", "region": "us-east-1"})
    >>> s.url("checkpoints/manifest-1.json"), s.sub("savepoints/x").uri
    ('s3://bucket/jobs/a/checkpoints/manifest-1.json', 's3://bucket/jobs/a/savepoints/x')
    """

    def __init__(self, uri: str, settings: dict[str, str] | None = None):
        super().__init__()
        scheme, bucket, prefix = _split(uri)
        if scheme not in SCHEMES:
            raise StorageError(f"{uri}: keyscale cannot store in {scheme}:// locations")
        self.scheme, self.bucket, self.prefix = scheme, bucket, prefix
        self.uri = f"{scheme}://{bucket}" + (f"/{prefix}" if prefix else "")
        self.settings = dict(settings or {})
        try:
            self.upload_concurrency = _upload_concurrency(self.settings.get("upload_concurrency"))
        except ValueError as e:
            raise StorageError(f"{self.uri}: {e}") from None
        self._client: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {"uri": self.uri, "settings": self.settings}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["uri"], state["settings"])  # type: ignore[misc]

    def sub(self, key: str) -> ObjectStore:
        return ObjectStore(self.url(check_key(key)), self.settings)

    @property
    def client(self) -> Any:
        if self._client is None:
            from obstore.store import AzureStore, GCSStore, S3Store

            config = {k: v for k, v in self.settings.items() if k not in _OWN}
            # A plain-http endpoint (a local S3 server) is what the user configured: allow it.
            http = self.settings.get("allow_http", "").lower() in ("1", "true") or str(config.get("endpoint", "")).startswith("http://")
            options = {"allow_http": True} if http else None
            try:
                if self.scheme in ("s3", "s3a"):
                    config.setdefault("region", "us-east-1")
                    self._client = S3Store(self.bucket, config=config, client_options=options)  # type: ignore[arg-type]
                elif self.scheme == "gs":
                    self._client = GCSStore(self.bucket, config=config, client_options=options)  # type: ignore[arg-type]
                else:
                    self._client = AzureStore(self.bucket, config=config, client_options=options)  # type: ignore[arg-type]
            except Exception as e:  # obstore's own errors for unknown keys, bad values
                raise StorageError(f"{self.uri}: cannot configure the object store ({e})") from None
        return self._client

    def _key(self, key: str) -> str:
        return join(self.prefix, check_key(key))

    def _fail(self, what: str, key: str, e: Exception) -> StorageError:
        text = str(e).split("\n")[0]
        if "169.254.169.254" in text or "credential" in text.lower():  # no keys, so obstore asked the cloud metadata service
            return StorageError(
                f"{self.url(key)}: {what} failed: no credentials for {self.scheme}:// (set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, and AWS_ENDPOINT_URL for a server other than AWS, or give --storage-option)"
            )
        if "error sending request" in text.lower() or "connection refused" in text.lower():
            where = self.settings.get("endpoint", "the default endpoint")
            return StorageError(f"{self.url(key)}: {what} failed: cannot reach {where} ({text[:200]})")
        return StorageError(f"{self.url(key)}: {what} failed ({type(e).__name__}: {text[:300]})")

    # -- objects -------------------------------------------------------------------------
    def get(self, key: str) -> bytes:
        import obstore
        from obstore.exceptions import NotFoundError

        self.requests["get"] += 1
        try:
            return bytes(obstore.get(self.client, self._key(key)).bytes())
        except (NotFoundError, FileNotFoundError):
            raise FileNotFoundError(self.url(key)) from None
        except StorageError:
            raise
        except Exception as e:
            raise self._fail("read", key, e) from None

    def get_range(self, key: str, start: int, length: int) -> bytes:
        import obstore
        from obstore.exceptions import NotFoundError

        self.requests["get_range"] += 1
        try:
            return bytes(obstore.get_range(self.client, self._key(key), start=start, length=length))
        except (NotFoundError, FileNotFoundError):
            raise FileNotFoundError(self.url(key)) from None
        except Exception as e:
            raise self._fail("ranged read", key, e) from None

    def get_ranges(self, reads: Sequence[tuple[str, int, int]]) -> builtins.list[bytes]:
        """The ranged reads at once, on this process's reader threads (obstore's calls wait
        outside the GIL): a point lookup's reads of its chain's files in one round trip."""
        if len(reads) <= 1:
            return [self.get_range(*r) for r in reads]
        return list(_reader_pool().map(lambda r: self.get_range(*r), reads))

    def put(self, key: str, data: bytes, durable: bool = True, private: bool = False) -> None:
        self._put(key, data, len(data))

    def put_file(self, key: str, source: Path) -> None:
        self._put(key, source, source.stat().st_size)  # obstore reads the file in parts

    def _put(self, key: str, data: bytes | Path, size: int) -> None:
        import obstore

        self.requests["put"] += 1
        try:
            obstore.put(self.client, self._key(key), data, use_multipart=size > _MULTIPART_ABOVE, max_concurrency=self.upload_concurrency)
        except StorageError:
            raise
        except Exception as e:
            raise self._fail("write", key, e) from None

    def _create(self, key: str, data: bytes) -> bool:
        import obstore
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        self.requests["create"] += 1
        try:
            obstore.put(self.client, self._key(key), data, mode="create", use_multipart=False)
        except (AlreadyExistsError, PreconditionError):
            return False
        except StorageError:
            raise
        except Exception as e:
            raise self._fail("conditional create", key, e) from None
        return True

    def size(self, key: str) -> int | None:
        import obstore
        from obstore.exceptions import NotFoundError

        self.requests["head"] += 1
        try:
            return int(obstore.head(self.client, self._key(key))["size"])
        except (NotFoundError, FileNotFoundError):
            return None
        except StorageError:
            raise
        except Exception as e:
            raise self._fail("head", key, e) from None

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        import obstore

        self.requests["list"] += 1
        base = self._key(prefix)
        strip = len(self.prefix) + 1 if self.prefix else 0
        try:
            out = [
                ObjectInfo(meta["path"][strip:], int(meta["size"]))
                for chunk in obstore.list(self.client, base + "/" if base else None)
                for meta in chunk
            ]
        except StorageError:
            raise
        except Exception as e:
            raise self._fail("list", prefix, e) from None
        return sorted(out, key=lambda o: o.key)

    def list_names(self, prefix: str) -> builtins.list[str]:
        import obstore

        self.requests["list"] += 1
        base = self._key(prefix)
        try:
            res = obstore.list_with_delimiter(self.client, base + "/" if base else None)
        except Exception as e:
            raise self._fail("list", prefix, e) from None
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in res["common_prefixes"]]
        names += [m["path"].rsplit("/", 1)[-1] for m in res["objects"]]
        return sorted(set(names))

    def delete(self, key: str) -> None:
        self.delete_many([key])

    def delete_many(self, keys: builtins.list[str]) -> None:
        import obstore
        from obstore.exceptions import NotFoundError

        if not keys:
            return
        self.requests["delete"] += 1  # one bulk request per 1000 keys where the store has one
        try:
            obstore.delete(self.client, [self._key(k) for k in keys])
        except (NotFoundError, FileNotFoundError):
            pass
        except Exception as e:
            raise self._fail("delete", keys[0], e) from None

    def copy(self, src: str, dst: str) -> None:
        import obstore

        self.requests["copy"] += 1
        try:
            obstore.copy(self.client, self._key(src), self._key(dst))
        except Exception as e:
            raise self._fail(f"copy to {dst}", src, e) from None
