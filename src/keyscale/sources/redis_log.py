"""The Redis backend of :class:`~keyscale.sources.partitioned.PartitionedLog`: one Redis stream per partition.

URI: ``redis://[[user]:password@]host[:port][/db]?name=NAME`` (``rediss://`` for TLS); other
query parameters go to the client as in ``redis.Redis.from_url`` (``socket_timeout=5``...).
``NAME`` may hold letters, digits and ``_.-``.

Keys (the ``{NAME}`` hash tag keeps them in one slot of a Redis Cluster):

- ``keyscale:{NAME}:meta``: a hash with ``format``, ``log_id`` (random, set at creation),
  ``schema`` (Arrow IPC bytes), ``schema_text`` and ``partitions``;
- ``keyscale:{NAME}:P``: the stream of partition ``P``. The record at offset ``o`` is the
  entry with id ``<o+1>-0`` (Redis refuses id ``0-0``), so ``read(p, s, e)`` is
  ``XRANGE key <s+1>-0 <e>-0``. Appends run as one Lua script that finds the last id and
  adds the records after it, so they are atomic and offsets stay contiguous with any
  number of writers.

A record is an entry whose fields are its non-null columns (a null is a missing field; an
entry whose columns are all null has the single field ``""``). Values are text in the
column type's integer or decimal form (timestamps, dates, times and durations as their
integer count of the type's unit, booleans as ``1``/``0``, floats in shortest round-trip
form), strings and binaries as their bytes, and nested types as a one-row Arrow IPC
stream, so every Arrow type round-trips exactly.

>>> log = RedisLog.create("redis://localhost:6379/0?name=clicks", "user string, ts timestamp", 4)  # doctest: +SKIP
>>> log.append(0, pa.table({"user": ["ann"], "ts": [dt.datetime.now(dt.UTC)]}))  # doctest: +SKIP
(0, 1)
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import pyarrow as pa
import redis
import redis.exceptions

from keyscale.errors import StateError
from keyscale.sources.partitioned import (
    FORMAT,
    LogError,
    PartitionedLog,
    check_count,
    check_schema,
    ddl,
    schema_from_bytes,
    schema_to_bytes,
)

__all__ = ["RedisLog", "decode_records", "encode_records"]

_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
_ALL_NULL = b""
_PAGE = 10_000

# KEYS[1] meta hash, KEYS[2] stream. ARGV[1] partition, ARGV[2] record count, then per
# record its number of fields and the field/value pairs.
_APPEND = """
local parts = redis.call('HGET', KEYS[1], 'partitions')
if not parts then return redis.error_reply('KEYSCALE_NOLOG') end
if tonumber(ARGV[1]) >= tonumber(parts) then return redis.error_reply('KEYSCALE_NOPARTITION ' .. parts) end
local nxt = 1
local last = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)
if #last > 0 then nxt = tonumber(string.match(last[1][1], '^(%d+)')) + 1 end
local first = nxt
local i = 3
for r = 1, tonumber(ARGV[2]) do
  local nf = tonumber(ARGV[i])
  i = i + 1
  local args = {}
  for j = 1, 2 * nf do args[j] = ARGV[i + j - 1] end
  i = i + 2 * nf
  redis.call('XADD', KEYS[2], string.format('%.0f-0', nxt), unpack(args))
  nxt = nxt + 1
end
return first - 1
"""

# KEYS[1] meta hash; ARGV: field/value pairs. Creates the log unless it exists.
_CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1
"""


def _parse_uri(uri: str) -> tuple[str, str]:
    """(client URL without the name, log name)."""
    parts = urlsplit(uri)
    query = parse_qsl(parts.query, keep_blank_values=True)
    names = [v for k, v in query if k == "name"]
    if not names or not names[0]:
        raise LogError(f"Redis log URI {_safe(uri)!r} has no log name: add ?name=NAME")
    name = names[0]
    if not _NAME.match(name):
        raise LogError(f"Redis log name {name!r} may only hold letters, digits and _.-")
    rest = urlencode([(k, v) for k, v in query if k != "name"])
    return urlunsplit((parts.scheme, parts.netloc, parts.path, rest, "")), name


def _safe(uri: str) -> str:
    """The URI without its password."""
    parts = urlsplit(uri)
    if parts.password is None:
        return uri
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit((parts.scheme, f"{user}:***@{netloc}", parts.path, parts.query, parts.fragment))


class RedisLog(PartitionedLog):
    """A log kept in Redis streams (see the module doc for the URI and the keys).

    ``RedisLog(uri)`` opens an existing log (connecting to check it exists); pickled copies
    carry only the URI and schema and connect on first use.

    >>> log = RedisLog("redis://localhost:6379/0?name=clicks")  # doctest: +SKIP
    >>> log.end_offsets()  # doctest: +SKIP
    [120, 97, 143, 110]
    """

    def __init__(self, uri: str) -> None:
        self._uri = uri
        self._url, self._name = _parse_uri(uri)
        self._client: redis.Redis | None = None
        self._scripts: dict[str, Any] = {}
        self._schema: pa.Schema | None = None
        self._partitions = 0
        self._read_meta()

    def __getstate__(self) -> dict[str, Any]:
        return {"uri": self._uri, "schema": schema_to_bytes(self.schema), "partitions": self._partitions}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._uri = state["uri"]
        self._url, self._name = _parse_uri(self._uri)
        self._client = None
        self._scripts = {}
        self._schema = schema_from_bytes(state["schema"])
        self._partitions = int(state["partitions"])

    @classmethod
    def create(cls, uri: str, schema: str | pa.Schema, partitions: int) -> RedisLog:
        """Create the log named in ``uri``; a :class:`LogError` if one of that name exists."""
        s = check_schema(schema)
        check_count("the number of partitions", partitions, 1)
        url, name = _parse_uri(uri)
        meta = {"format": FORMAT, "version": "1", "log_id": uuid.uuid4().hex, "partitions": str(partitions), "schema": schema_to_bytes(s), "schema_text": ddl(s)}
        args: list[Any] = [x for kv in meta.items() for x in kv]
        client = _connect(url)
        with _errors(uri):
            created = client.register_script(_CREATE)(keys=[_meta_key(name)], args=args)
        client.close()
        if not created:
            raise LogError(f"Redis log {_safe(uri)!r} already exists; open it with open_log, or pick another name")
        return cls(uri)

    # -- connection --------------------------------------------------------------------------------

    def _redis(self) -> redis.Redis:
        if self._client is None:
            self._client = _connect(self._url)
        return self._client

    def _script(self, name: str, text: str) -> Any:
        if name not in self._scripts:
            self._scripts[name] = self._redis().register_script(text)
        return self._scripts[name]

    def _stream(self, partition: int) -> str:
        return f"keyscale:{{{self._name}}}:{partition}"

    def _read_meta(self) -> None:
        with _errors(self._uri):
            meta: dict[bytes, bytes] = self._redis().hgetall(_meta_key(self._name))  # type: ignore[assignment]
        if not meta:
            raise LogError(f"there is no Redis log {_safe(self._uri)!r} (create it with `keyscale log create`)")
        try:
            if meta[b"format"].decode() != FORMAT:
                raise ValueError("format")
            if self._schema is None:
                self._schema = schema_from_bytes(meta[b"schema"])
            self._partitions = max(self._partitions, int(meta[b"partitions"]))
        except (KeyError, ValueError, pa.ArrowInvalid):
            raise LogError(f"Redis key {_meta_key(self._name)!r} ({_safe(self._uri)}) is not a keyscale log's metadata") from None

    # -- the interface -----------------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The log's name (``?name=`` in its URI)."""
        return self._name

    @property
    def schema(self) -> pa.Schema:
        if self._schema is None:
            self._read_meta()
        assert self._schema is not None
        return self._schema

    @property
    def uri(self) -> str:
        return _safe(self._uri)

    def num_partitions(self) -> int:
        with _errors(self._uri):
            n = self._redis().hget(_meta_key(self._name), "partitions")
        if n is None:
            raise LogError(f"Redis log {self.uri!r} no longer exists")
        self._partitions = max(self._partitions, int(n))
        return self._partitions

    def identity(self) -> str | None:
        with _errors(self._uri):
            found: Any = self._redis().hmget(_meta_key(self._name), ["format", "log_id"])
        if found[0] is None:
            raise LogError(f"Redis log {self.uri!r} no longer exists")
        return None if found[1] is None else bytes(found[1]).decode()

    def end_offsets(self) -> list[int]:
        n = self.num_partitions()
        with _errors(self._uri):
            pipe = self._redis().pipeline(transaction=False)
            for p in range(n):
                pipe.xrevrange(self._stream(p), count=1)
            lasts = pipe.execute()
        return [_offset_of(last[0][0]) + 1 if last else 0 for last in lasts]

    def read(self, partition: int, start: int, end: int) -> pa.Table:
        if not (isinstance(partition, int) and 0 <= partition < self._partitions):
            self._check_partition(partition)
        self._check_range(partition, start, end)
        if start == end:
            return self.schema.empty_table()
        entries: list[dict[bytes, bytes]] = []
        key = self._stream(partition)
        nxt = start
        with _errors(self._uri):
            while nxt < end:
                got: Any = self._redis().xrange(key, f"{nxt + 1}-0", f"{end}-0", count=min(_PAGE, end - nxt))
                page: list[tuple[bytes, dict[bytes, bytes]]] = got
                if not page:
                    break
                for entry_id, fields in page:
                    if _offset_of(entry_id) != nxt:
                        raise StateError(f"partition {partition} of Redis log {self.uri!r} is damaged: expected offset {nxt}, found entry {entry_id!r}")
                    entries.append(fields)
                    nxt += 1
        if nxt < end:
            raise self._range_error(partition, start, end, nxt)
        return decode_records(self.schema, entries)

    def append(self, partition: int, table: pa.Table) -> tuple[int, int]:
        if not (isinstance(partition, int) and 0 <= partition < self._partitions):
            self._check_partition(partition)
        t = self._conform(table)
        records = encode_records(t)
        args: list[Any] = [partition, len(records)]
        for fields in records:
            args.append(len(fields))
            for k, v in fields.items():
                args += (k, v)
        try:
            with _errors(self._uri):
                first = int(self._script("append", _APPEND)(keys=[_meta_key(self._name), self._stream(partition)], args=args))
        except redis.exceptions.ResponseError as e:
            msg = str(e)
            if "KEYSCALE_NOPARTITION" in msg:
                raise LogError(f"Redis log {self.uri!r} has no partition {partition} (it has {msg.split()[-1]})") from None
            if "KEYSCALE_NOLOG" in msg:
                raise LogError(f"Redis log {self.uri!r} no longer exists") from None
            raise LogError(f"appending to partition {partition} of Redis log {self.uri!r} failed: {msg}") from None
        return first, first + len(records)

    def add_partitions(self, n: int) -> int:
        check_count("the number of partitions to add", n, 0)
        self.num_partitions()  # the log exists
        with _errors(self._uri):
            new = int(self._redis().hincrby(_meta_key(self._name), "partitions", n))
        self._partitions = max(self._partitions, new)
        return new

    def describe(self) -> str:
        ends = self.end_offsets()
        lines = [
            f"log {self._name} at {self.uri} (Redis streams keyscale:{{{self._name}}}:P): {len(ends)} partitions, {sum(ends):,} records",
            f"  schema: {ddl(self.schema)}",
        ]
        lines += [f"  partition {p}: end offset {e:,}" for p, e in enumerate(ends)]
        return "\n".join(lines)

    def delete(self) -> None:
        """Remove the log and all its records from Redis."""
        n = self.num_partitions()
        with _errors(self._uri):
            self._redis().delete(_meta_key(self._name), *[self._stream(p) for p in range(n)])


def _meta_key(name: str) -> str:
    return f"keyscale:{{{name}}}:meta"


def _offset_of(entry_id: bytes | str) -> int:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, _seq = text.partition("-")
    return int(ms) - 1


def _connect(url: str) -> redis.Redis:
    kwargs: dict[str, Any] = {}
    if "socket_connect_timeout" not in url:
        kwargs["socket_connect_timeout"] = 5
    try:
        return redis.Redis.from_url(url, **kwargs)
    except (ValueError, TypeError) as e:
        raise LogError(f"bad Redis URL {_safe(url)!r}: {e}") from None


@contextmanager
def _errors(uri: str) -> Iterator[None]:
    try:
        yield
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as e:
        parts = urlsplit(uri)
        where = f"{parts.hostname or 'localhost'}:{parts.port or 6379}"
        raise LogError(f"cannot reach Redis at {where} for log {_safe(uri)!r}: {e}") from None
    except redis.exceptions.AuthenticationError as e:
        raise LogError(f"Redis refused the credentials for log {_safe(uri)!r}: {e}") from None


# -- the record codec (pure) --------------------------------------------------------------------


def _kind(t: pa.DataType) -> str:
    """How a type is encoded: int, temporal64, temporal32, float, bool, text, bytes, decimal or ipc."""
    if pa.types.is_integer(t):
        return "int"
    if pa.types.is_timestamp(t) or pa.types.is_duration(t) or pa.types.is_time64(t) or pa.types.is_date64(t):
        return "temporal64"
    if pa.types.is_date32(t) or pa.types.is_time32(t):
        return "temporal32"
    if pa.types.is_float32(t) or pa.types.is_float64(t):
        return "float"
    if pa.types.is_boolean(t):
        return "bool"
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "text"
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        return "bytes"
    if pa.types.is_decimal(t):
        return "decimal"
    return "ipc"


def _encode_column(arr: pa.Array[Any]) -> list[bytes | None]:
    kind = _kind(arr.type)
    if kind == "temporal64":
        arr = arr.cast(pa.int64())
    elif kind == "temporal32":
        arr = arr.cast(pa.int32())
    elif kind == "bool":
        arr = arr.cast(pa.int8())
    if kind in ("int", "temporal64", "temporal32", "bool", "float", "decimal"):
        return arr.cast(pa.string()).cast(pa.binary()).to_pylist()  # type: ignore[no-any-return]
    if kind == "text":
        return arr.cast(pa.large_string()).cast(pa.large_binary()).to_pylist()  # type: ignore[no-any-return]
    if kind == "bytes":
        return arr.to_pylist()  # type: ignore[no-any-return]
    out: list[bytes | None] = []
    for i in range(len(arr)):
        if arr[i].is_valid:
            sink = pa.BufferOutputStream()
            one = pa.record_batch([arr.slice(i, 1)], names=["v"])
            with pa.ipc.new_stream(sink, one.schema) as w:
                w.write_batch(one)
            out.append(sink.getvalue().to_pybytes())
        else:
            out.append(None)
    return out


def _decode_column(values: Sequence[bytes | None], t: pa.DataType) -> pa.Array[Any]:
    kind = _kind(t)
    if kind == "ipc":
        pieces = []
        for v in values:
            if v is None:
                pieces.append(pa.nulls(1, t))  # type: ignore[call-overload]
            else:
                pieces.append(pa.ipc.open_stream(pa.py_buffer(v)).read_all().column(0).combine_chunks())
        return pa.concat_arrays(pieces) if pieces else pa.array([], t)
    raw = pa.array(values, pa.large_binary())
    if kind == "bytes":
        return raw.cast(t)
    text = raw.cast(pa.large_string())
    if kind == "text":
        return text.cast(t)
    if kind == "temporal64":
        return text.cast(pa.int64()).cast(t)
    if kind == "temporal32":
        return text.cast(pa.int32()).cast(t)
    if kind == "bool":
        return text.cast(pa.int8()).cast(t)
    return text.cast(t)


def encode_records(table: pa.Table) -> list[dict[bytes, bytes]]:
    """Each row of ``table`` as the fields of a stream entry (see the module doc).

    >>> import pyarrow as pa
    >>> encode_records(pa.table({"k": ["a", None], "n": [1, None]}))
    [{b'k': b'a', b'n': b'1'}, {b'': b''}]
    """
    names = [n.encode() for n in table.column_names]
    cols = [_encode_column(table.column(i).combine_chunks()) for i in range(table.num_columns)]
    out: list[dict[bytes, bytes]] = []
    for row in zip(*cols, strict=True):
        fields = {n: v for n, v in zip(names, row, strict=True) if v is not None}
        out.append(fields or {_ALL_NULL: b""})
    if not cols:
        out = [{_ALL_NULL: b""} for _ in range(table.num_rows)]
    return out


def decode_records(schema: pa.Schema, entries: Sequence[dict[bytes, bytes]]) -> pa.Table:
    """The table whose rows :func:`encode_records` made ``entries`` of.

    >>> import pyarrow as pa
    >>> s = pa.schema([("k", pa.string()), ("n", pa.int64())])
    >>> decode_records(s, [{b"k": b"a", b"n": b"1"}, {b"": b""}]).to_pylist()
    [{'k': 'a', 'n': 1}, {'k': None, 'n': None}]
    """
    arrays = []
    for field in schema:
        key = field.name.encode()
        arrays.append(_decode_column([e.get(key) for e in entries], field.type))
    return pa.Table.from_arrays(arrays, schema=schema)
