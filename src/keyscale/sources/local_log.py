"""The local backend of a partitioned log: a folder with ``log.json`` (schema, partitions)
and, per partition, immutable Arrow segment files named by their first offset and count.

Appends write a whole segment under a temporary name and rename it in, under the
partition's lock, so readers see whole segments only; see :mod:`keyscale.sources.partitioned`
for the interface and :mod:`keyscale.sources.log` for ``open_log``/``create_log``::

    >>> import tempfile, pyarrow as pa
    >>> from keyscale.sources.local_log import LocalLog
    >>> log = LocalLog.create(tempfile.mkdtemp() + "/events", "key string", partitions=2)
    >>> log.append(1, pa.table({"key": ["a"]}))
    (0, 1)
    >>> log.end_offsets()
    [0, 1]
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import re
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from keyscale.errors import StateError
from keyscale.sources.partitioned import (
    FORMAT,
    AppendTimes,
    LogError,
    PartitionedLog,
    check_count,
    check_schema,
    ddl,
    first_line,
    schema_from_bytes,
    schema_to_bytes,
)

META_FILE = "log.json"
SEGMENT_CLOCK = "log segment write"  # a record's append time: its segment's modification time
_SEGMENT = re.compile(r"^(\d{20})-(\d{10})\.arrow$")


def _segment_problem(segs: list[tuple[int, int]]) -> str | None:
    """None when sorted (base, count) segments cover offsets 0.. without a gap or overlap.

    >>> _segment_problem([(0, 5), (5, 2)]), _segment_problem([(0, 5), (7, 1)]), _segment_problem([(0, 5), (4, 1)])
    (None, 'offsets [5, 7) are missing', 'segments overlap at offset 4')
    """
    expect = 0
    for base, count in segs:
        if base != expect:
            return f"offsets [{expect}, {base}) are missing" if base > expect else f"segments overlap at offset {base}"
        expect = base + count
    return None


def _segment_name(base: int, count: int) -> str:
    return f"{base:020d}-{count:010d}.arrow"


@contextmanager
def _flocked(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class LocalLog(PartitionedLog):
    """A log in a local (or shared) folder, no server needed.

    Layout::

        LOG/log.json                         format, id, partition count, schema (Arrow IPC, base64)
        LOG/p-00000/<base>-<count>.arrow     segments: one Arrow IPC file per append
        LOG/p-00000/.lock                    serialises appends to the partition

    A segment's name holds its first offset and its number of records, so end offsets come
    from listing folders, not reading files. Segments and ``log.json`` are written to a
    hidden temporary file and renamed into place, so a reader never sees part of one.
    Appends to a partition take a file lock (several writer processes are safe);
    ``add_partitions`` creates the folders before it renames the new ``log.json``.

    >>> import tempfile, pyarrow as pa
    >>> log = LocalLog.create(tempfile.mkdtemp() + "/l", pa.schema([("n", pa.int64())]), partitions=1)
    >>> log.append(0, pa.table({"n": [1, 2]})), log.append(0, pa.table({"n": [3]}))
    ((0, 2), (2, 3))
    >>> log.read(0, 1, 3).column("n").to_pylist()
    [2, 3]
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._path = Path(path).absolute()
        self._schema: pa.Schema | None = None
        self._partitions = 0
        self._segments: dict[int, list[tuple[int, int]]] = {}
        self._read_meta()

    # -- pickling: the path and the schema, nothing else ------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        return {"path": str(self._path), "schema": schema_to_bytes(self.schema), "partitions": self._partitions}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._path = Path(state["path"])
        self._schema = schema_from_bytes(state["schema"])
        self._partitions = int(state["partitions"])
        self._segments = {}

    # -- creation and metadata ---------------------------------------------------------------------

    @classmethod
    def create(cls, path: str | os.PathLike[str], schema: str | pa.Schema, partitions: int) -> LocalLog:
        """Create the log folder ``path`` (it must not exist, or be empty).

        >>> import tempfile
        >>> LocalLog.create(tempfile.mkdtemp() + "/l", "k string", 2).num_partitions()
        2
        """
        s = check_schema(schema)
        check_count("the number of partitions", partitions, 1)
        p = Path(path).absolute()
        if (p / META_FILE).exists():
            raise LogError(f"{p} is already a log; open it with open_log, or pick another folder")
        if p.exists() and (not p.is_dir() or any(p.iterdir())):
            raise LogError(f"{p} exists and is not an empty folder; a new log needs a new or empty folder")
        try:
            p.mkdir(parents=True, exist_ok=True)
            for i in range(partitions):
                (p / _partition_dir(i)).mkdir(exist_ok=True)
            _write_atomic(p / META_FILE, _meta_bytes(s, partitions))
        except OSError as e:
            raise LogError(f"cannot create log folder {p}: {e.strerror or e}") from None
        return cls(p)

    def _read_meta(self) -> dict[str, Any]:
        meta_path = self._path / META_FILE
        try:
            raw = meta_path.read_bytes()
        except FileNotFoundError:
            if not self._path.exists():
                raise LogError(f"log folder {self._path} does not exist (create it with `keyscale log create`)") from None
            raise LogError(f"{self._path} is not a keyscale log (it has no {META_FILE})") from None
        except OSError as e:
            raise LogError(f"cannot read log folder {self._path}: {e.strerror or e}") from None
        try:
            meta = json.loads(raw)
            if meta.get("format") != FORMAT:
                raise ValueError("format")
            partitions = int(meta["partitions"])
            if self._schema is None:
                self._schema = schema_from_bytes(base64.b64decode(meta["schema"]))
        except (ValueError, KeyError, TypeError, pa.ArrowInvalid):
            raise LogError(f"{meta_path} is not a keyscale log's metadata file") from None
        self._partitions = max(self._partitions, partitions)
        return dict(meta)

    @property
    def path(self) -> Path:
        """The log's folder."""
        return self._path

    @property
    def schema(self) -> pa.Schema:
        if self._schema is None:
            self._read_meta()
        assert self._schema is not None
        return self._schema

    @property
    def uri(self) -> str:
        return str(self._path)

    def num_partitions(self) -> int:
        self._read_meta()
        return self._partitions

    def identity(self) -> str | None:
        log_id = self._read_meta().get("log_id")
        return None if log_id is None else str(log_id)

    def _known_partition(self, partition: int) -> None:
        """Check ``partition`` exists, reading the metadata again only if it is beyond what we knew."""
        if isinstance(partition, int | np.integer) and not isinstance(partition, bool) and 0 <= partition < self._partitions:
            return
        self._check_partition(partition)

    # -- segments ------------------------------------------------------------------------------------

    def _pdir(self, partition: int) -> Path:
        return self._path / _partition_dir(partition)

    def _list_segments(self, partition: int, attempts: int = 3) -> list[tuple[int, int]]:
        """The partition's segments as (base, count), in offset order; checked to be contiguous from 0.

        A directory listing is not a snapshot: while a writer appends, it can miss a
        segment created during the scan and return the next one, which looks like a gap.
        A gap is therefore damage only when it is still there in a new listing.
        """
        for attempt in range(attempts):
            segs: list[tuple[int, int]] = []
            try:
                with os.scandir(self._pdir(partition)) as it:
                    for entry in it:
                        m = _SEGMENT.match(entry.name)
                        if m:
                            segs.append((int(m.group(1)), int(m.group(2))))
            except FileNotFoundError:
                pass  # a partition folder add_partitions has not created yet: empty
            segs.sort()
            problem = _segment_problem(segs)
            if problem is None:
                self._segments[partition] = segs
                return segs
            if attempt + 1 < attempts:
                time.sleep(0.01 * (attempt + 1))
        raise StateError(f"partition {partition} of log {self._path} is damaged: {problem}")

    def _end(self, partition: int) -> int:
        segs = self._list_segments(partition)
        return segs[-1][0] + segs[-1][1] if segs else 0

    def end_offsets(self) -> list[int]:
        return [self._end(p) for p in range(self.num_partitions())]

    def read(self, partition: int, start: int, end: int) -> pa.Table:
        return self._read(partition, start, end, None)

    def read_timed(self, partition: int, start: int, end: int) -> tuple[pa.Table, AppendTimes | None]:
        """The records with their append times: each segment's modification time (an append
        writes one segment, renamed into place when complete), per record of it."""
        times: list[np.ndarray[Any, Any]] = []
        table = self._read(partition, start, end, times)
        return table, AppendTimes(np.concatenate(times) if times else np.empty(0), SEGMENT_CLOCK)

    def _read(self, partition: int, start: int, end: int, times: list[np.ndarray[Any, Any]] | None) -> pa.Table:
        self._known_partition(partition)
        self._check_range(partition, start, end)
        if start == end:
            return self.schema.empty_table()
        segs = self._segments.get(partition, [])
        if not segs or segs[-1][0] + segs[-1][1] < end:
            segs = self._list_segments(partition)
        have = segs[-1][0] + segs[-1][1] if segs else 0
        if end > have:
            raise self._range_error(partition, start, end, have)
        tables = []
        bases = [b for b, _ in segs]
        i = max(0, int(np.searchsorted(bases, start, side="right")) - 1)
        while i < len(segs) and segs[i][0] < end:
            base, count = segs[i]
            i += 1
            if base + count <= start:
                continue
            t = self._read_segment(partition, base, count)
            lo, hi = max(start, base) - base, min(end, base + count) - base
            tables.append(t.slice(lo, hi - lo))
            if times is not None:
                times.append(np.full(hi - lo, self._segment_time(partition, base, count)))
        out = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
        return out.combine_chunks() if out.column(0).num_chunks > 1 else out

    def _segment_time(self, partition: int, base: int, count: int) -> float:
        """When a segment was appended (its modification time, Unix seconds; NaN if gone)."""
        try:
            return os.stat(self._pdir(partition) / _segment_name(base, count)).st_mtime_ns / 1e9
        except OSError:
            return float("nan")

    def _read_segment(self, partition: int, base: int, count: int) -> pa.Table:
        path = self._pdir(partition) / _segment_name(base, count)
        try:
            with pa.memory_map(str(path)) as src:
                t = pa.ipc.open_file(src).read_all()
        except FileNotFoundError:
            raise StateError(f"partition {partition} of log {self._path} is damaged: segment {path.name} disappeared") from None
        except pa.ArrowInvalid as e:
            raise StateError(f"segment {path} of log {self._path} is damaged: {first_line(e)}") from None
        if t.num_rows != count or not t.schema.equals(self.schema):
            raise StateError(f"segment {path} of log {self._path} does not hold the {count} records its name says")
        return t

    def append(self, partition: int, table: pa.Table) -> tuple[int, int]:
        self._known_partition(partition)
        t = self._conform(table)
        pdir = self._pdir(partition)
        pdir.mkdir(exist_ok=True)
        with _flocked(pdir / ".lock"):
            start = self._end(partition)
            if t.num_rows == 0:
                return start, start
            tmp = pdir / f".{uuid.uuid4().hex}.tmp"
            try:
                with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, self.schema) as w:
                    w.write_table(t)
                os.replace(tmp, pdir / _segment_name(start, t.num_rows))
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
        return start, start + t.num_rows

    def add_partitions(self, n: int) -> int:
        check_count("the number of partitions to add", n, 0)
        with _flocked(self._path / ".lock"):
            meta = self._read_meta()
            old = int(meta["partitions"])
            new = old + n
            if n:
                for i in range(old, new):
                    self._pdir(i).mkdir(exist_ok=True)
                meta["partitions"] = new
                _write_atomic(self._path / META_FILE, json.dumps(meta, indent=1).encode())
                self._partitions = new
        return new

    def describe(self) -> str:
        ends = self.end_offsets()
        segs = sum(len(self._segments.get(p, [])) for p in range(len(ends)))
        lines = [
            f"log {self._path} (local folder): {len(ends)} partitions, {sum(ends):,} records in {segs:,} segments",
            f"  schema: {ddl(self.schema)}",
        ]
        lines += [f"  partition {p}: end offset {e:,}" for p, e in enumerate(ends)]
        return "\n".join(lines)


def _partition_dir(partition: int) -> str:
    return f"p-{partition:05d}"


def _meta_bytes(schema: pa.Schema, partitions: int) -> bytes:
    meta = {
        "format": FORMAT,
        "version": 1,
        "log_id": uuid.uuid4().hex,  # a log created again at the same place is another log
        "partitions": partitions,
        "schema": base64.b64encode(schema_to_bytes(schema)).decode(),
        "schema_text": ddl(schema),
    }
    return json.dumps(meta, indent=1).encode()
