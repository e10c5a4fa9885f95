"""Validated edits of keyed state: a new savepoint from an existing one, with keys of one
operator set, changed or deleted (``keyscale state patch``, :func:`patch_state`).

- **Checked first, written after.** Every key is parsed as the operator's key type
  (:func:`keyscale.state_processor.keys.parse_key`) and every value against its state's
  type: a value of the wrong type is an :class:`~keyscale.errors.InputDataError` naming the
  key, the state and the field, and nothing is written. A value is JSON data as
  ``keyscale state get`` shows it: a list state an array, a map state an object, a struct an
  object, a date or timestamp ISO 8601 text (a timestamp also microseconds since the epoch),
  binary base64 text.
- **Set** replaces the states it names and keeps the key's others (``null`` clears one); a
  key the savepoint lacks is created with only those. A key left with no state at all does
  not exist. Setting a state with a time-to-live restarts its clock at the patch's time.
  Timers and TTL clocks (states named ``__...``) cannot be set. **Delete** removes a key with
  all its state, timers included; deleting a key the savepoint does not hold is an error.
- **A new savepoint, never an edit in place.** The destination must be new (absent or
  empty) and must not be inside a job directory, except under its ``savepoints/`` folder:
  a patch never writes into a job's checkpoints. Data files without an edited key are
  copied as they are; the savepoint's batch, source positions and other operators too.
- **Recorded.** The metadata's ``extra.patches`` lists every patch the savepoint went
  through (those of its source first): who (user and host), when, from which savepoint,
  the operator, the counts, the keys (up to 100) and a sha256 digest of the edits.
  ``origin`` is ``"patch"``. A job restores from it as from any savepoint.

>>> import tempfile, pyarrow as pa
>>> from pathlib import Path
>>> from keyscale.state_processor import write_savepoint_from_dataframes
>>> from keyscale.checkpoint.savepoint import read_savepoint
>>> root = Path(tempfile.mkdtemp())
>>> table = pa.table({"user": ["ann", "bob"], "n": [3, 5]})
>>> sp = write_savepoint_from_dataframes(root / "sp", "clicks", {"count": (table, ["user"], {"n": "long"})}, 16)
>>> new = patch_state(sp, root / "fixed", "count", updates={"ann": {"n": 4}, "cy": {"n": 1}}, deletes=["bob"])
>>> info = read_savepoint(new)
>>> info.origin, info.extra["patches"][0]["set"], info.extra["patches"][0]["deleted"], info.operators["count"].rows
('patch', 2, 1, 2)
>>> patch_state(sp, root / "bad", "count", updates={"ann": {"n": "four"}})
Traceback (most recent call last):
...
keyscale.errors.InputDataError: operator 'count', key {'user': 'ann'}, state 'n': 'four' is not a long
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import decimal
import getpass
import hashlib
import json
import socket
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from keyscale.checkpoint.jobdir import JOB_FILE
from keyscale.checkpoint.savepoint import (
    KEY_GROUP_COLUMN,
    METADATA_FILE,
    SOURCE_DIR,
    Location,
    SavepointFile,
    SavepointInfo,
    SavepointOperator,
    canonical_order,
    finish_savepoint,
    new_savepoint,
    read_data_file,
    read_savepoint,
    spark_type_name,
    write_data_file,
)
from keyscale.errors import InputDataError, StateError
from keyscale.state.handles import ttl_column
from keyscale.state.keygroups import KeyGroupRange
from keyscale.state.spark_hash import key_group_of
from keyscale.state_processor.keys import parse_key
from keyscale.state_processor.lookup import jsonable
from keyscale.state_processor.read import _operator
from keyscale.storage import Store, open_store

__all__ = ["RECORDED_KEYS", "Edit", "parse_edit_lines", "parse_set", "patch_state"]

_PC: Any = pc

#: Keys a patch's record lists by name; beyond, only their count and digest.
RECORDED_KEYS = 100


@dataclass(frozen=True)
class Edit:
    """One edit of a key: ``values`` (state name -> JSON value) to set, or None to delete it."""

    key: Any
    values: dict[str, Any] | None


def parse_set(arg: str) -> Edit:
    """``KEY={"state": value, ...}`` (``--set``): the key as ``keyscale state get`` takes it,
    then ``=`` and a JSON object.

    >>> parse_set('ann={"total": 5}')
    Edit(key='ann', values={'total': 5})
    >>> parse_set('["ann", 3]={"total": null}')
    Edit(key='["ann", 3]', values={'total': None})
    """
    at = arg.find("={")
    if at <= 0:
        raise InputDataError(f"--set {arg!r}: write KEY={{\"state\": value, ...}} (a JSON object of the states to set)")
    try:
        values = json.loads(arg[at + 1:])
    except ValueError as e:
        raise InputDataError(f"--set {arg!r}: the value is not JSON ({e})") from None
    if not isinstance(values, dict):
        raise InputDataError(f"--set {arg!r}: the value must be a JSON object of states")
    return Edit(arg[:at], values)


def parse_edit_lines(lines: Iterable[str], where: str) -> list[Edit]:
    """Edits from JSON lines (``--from-file``): ``{"key": K, "set": {"state": value}}`` or
    ``{"key": K, "delete": true}``, K a JSON value (an array for a key of several columns).

    >>> parse_edit_lines(['{"key": "ann", "set": {"n": 1}}', '', '{"key": ["bob", 2], "delete": true}'], "p.jsonl")
    [Edit(key='ann', values={'n': 1}), Edit(key=['bob', 2], values=None)]
    """
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except ValueError as e:
            raise InputDataError(f"{where}, line {n}: not JSON ({e})") from None
        ok = isinstance(d, dict) and "key" in d and (isinstance(d.get("set"), dict) != (d.get("delete") is True))
        if not ok:
            raise InputDataError(f"{where}, line {n}: write {{\"key\": K, \"set\": {{\"state\": value}}}} or {{\"key\": K, \"delete\": true}}")
        out.append(Edit(d["key"], None if d.get("delete") is True else dict(d["set"])))
    return out


# -- values against the state's type ------------------------------------------------------------


def _scalar(value: Any, t: pa.DataType) -> Any:
    if pa.types.is_boolean(t):
        if isinstance(value, bool):
            return value
    elif pa.types.is_integer(t):
        if isinstance(value, int) and not isinstance(value, bool):
            lo, hi = (-(2 ** (t.bit_width - 1)), 2 ** (t.bit_width - 1) - 1) if pa.types.is_signed_integer(t) else (0, 2**t.bit_width - 1)
            if lo <= value <= hi:
                return value
    elif pa.types.is_floating(t):
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if value in ("NaN", "Infinity", "-Infinity", "nan", "inf", "-inf"):  # as jsonable writes non-finite floats
            return float(value.replace("Infinity", "inf"))
    elif pa.types.is_string(t) or pa.types.is_large_string(t):
        if isinstance(value, str):
            return value
    elif pa.types.is_binary(t) or pa.types.is_large_binary(t):
        if isinstance(value, bytes):
            return value
        if isinstance(value, str):
            return base64.b64decode(value, validate=True)
    elif pa.types.is_decimal(t):
        if isinstance(value, int | str) and not isinstance(value, bool):
            return decimal.Decimal(value)
    elif pa.types.is_date(t):
        if isinstance(value, str):
            return dt.date.fromisoformat(value)
    elif pa.types.is_timestamp(t):
        if isinstance(value, int) and not isinstance(value, bool):
            return dt.datetime(1970, 1, 1, tzinfo=dt.UTC) + dt.timedelta(microseconds=value)
        if isinstance(value, str):
            stamp = dt.datetime.fromisoformat(value)
            return stamp if stamp.utcoffset() is not None else stamp.replace(tzinfo=dt.UTC)
    raise ValueError


def _convert(value: Any, t: pa.DataType, where: str) -> Any:
    """``value`` (JSON data) as a Python value of Arrow type ``t``; an error names ``where``."""
    if value is None:
        return None
    nested: Any = t
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        if not isinstance(value, list):
            raise InputDataError(f"{where}: {value!r} is not an array ({spark_type_name(t)})")
        return [_convert(v, nested.value_type, f"{where}[{i}]") for i, v in enumerate(value)]
    if pa.types.is_map(t):
        items = value.items() if isinstance(value, dict) else value if isinstance(value, list) else None
        if items is None:
            raise InputDataError(f"{where}: {value!r} is not an object ({spark_type_name(t)})")
        out = []
        for entry in items:
            if not isinstance(entry, tuple | list) or len(entry) != 2:
                raise InputDataError(f"{where}: map entry {entry!r} is not a [key, value] pair")
            k, v = entry
            if isinstance(k, str) and not (pa.types.is_string(nested.key_type) or pa.types.is_large_string(nested.key_type)):
                with contextlib.suppress(ValueError):  # an object's keys are text: a map of numbers is written {"3": ...}
                    k = json.loads(k) if not (pa.types.is_date(nested.key_type) or pa.types.is_timestamp(nested.key_type)) else k
            out.append((_convert(k, nested.key_type, f"{where}, map key"), _convert(v, nested.item_type, f"{where}[{k!r}]")))
        return out
    if pa.types.is_struct(t):
        if not isinstance(value, dict):
            raise InputDataError(f"{where}: {value!r} is not an object ({spark_type_name(t)})")
        names = [f.name for f in nested]
        extra = [k for k in value if k not in names]
        if extra:
            raise InputDataError(f"{where}: no field '{extra[0]}' (fields: {', '.join(names)})")
        return {f.name: _convert(value.get(f.name), f.type, f"{where}, field '{f.name}'") for f in nested}
    try:
        converted = _scalar(value, t)
        pa.array([converted], t)  # what Arrow refuses (a date out of range, ...) is refused here, not half-way
        return converted
    except (ValueError, TypeError, OverflowError, decimal.InvalidOperation, pa.ArrowInvalid, pa.ArrowTypeError):
        raise InputDataError(f"{where}: {value!r} is not a {spark_type_name(t)}") from None


# -- planning -----------------------------------------------------------------------------------


@dataclass
class _Planned:
    values: tuple[Any, ...]  # the key, typed
    key_group: int
    states: dict[str, Any] | None  # typed values to set; None: delete


def _plan(op: SavepointOperator, edits: Sequence[Edit]) -> dict[tuple[Any, ...], _Planned]:
    settable = {s.name: s for s in op.states if not s.name.startswith("__")}
    types = [spark_type_name(t) for _, t in op.key_columns]
    out: dict[tuple[Any, ...], _Planned] = {}
    for e in edits:
        values = parse_key(e.key, op.key_columns, op.uid)
        shown = {k: jsonable(v, t) for (k, t), v in zip(op.key_columns, values, strict=True)}
        where = f"operator '{op.uid}', key {shown}"
        if values in out:
            raise InputDataError(f"{where} is edited twice in one patch")
        states = None
        if e.values is not None:
            if not e.values:
                raise InputDataError(f"{where}: no state to set (states: {', '.join(settable)})")
            states = {}
            for name, v in e.values.items():
                if name not in settable:
                    raise InputDataError(f"{where}: operator '{op.uid}' has no state '{name}' to set (states: {', '.join(settable) or 'none'})")
                states[name] = _convert(v, settable[name].column_type, f"{where}, state '{name}'")
        out[values] = _Planned(values, key_group_of(list(values), types, op.max_parallelism), states)
    return out


def _digest(plan: Mapping[tuple[Any, ...], _Planned], op: SavepointOperator) -> str:
    items = sorted(json.dumps([jsonable(list(p.values)), None if p.states is None else
                               {k: jsonable(v) for k, v in sorted(p.states.items())}], sort_keys=True, default=str) for p in plan.values())
    return hashlib.sha256("\n".join(items).encode()).hexdigest()


# -- applying -----------------------------------------------------------------------------------


def _apply(table: pa.Table, op: SavepointOperator, edits: Sequence[_Planned], now_ms: int, where: str) -> pa.Table:
    """``table`` (canonical rows of one data file, or empty) with ``edits`` applied."""
    names = op.key_names
    # Only rows whose first key column holds an edited value can be edited: a file holds up
    # to a million keys, of which a patch usually touches a few.
    wanted = pa.array([e.values[0] for e in edits], table.schema.field(names[0]).type)
    cand = np.flatnonzero(np.asarray(_PC.is_in(table.column(names[0]), value_set=wanted).to_numpy(zero_copy_only=False), dtype=bool))
    index = {tuple(r[k] for k in names): int(i) for i, r in zip(cand, table.take(cand).select(names).to_pylist(), strict=True)}
    drop = np.zeros(table.num_rows, dtype=bool)
    rows = []
    ttl = {s.name: ttl_column(s.name) for s in op.states if s.ttl_seconds is not None}
    have = {s.name for s in op.states}
    for e in edits:
        i = index.get(e.values)
        if e.states is None:
            if i is None:
                raise StateError(f"{where}: key {dict(zip(names, e.values, strict=True))} cannot be deleted: the savepoint does not hold it")
            drop[i] = True
            continue
        row = table.slice(i, 1).to_pylist()[0] if i is not None else {**dict(zip(names, e.values, strict=True)), KEY_GROUP_COLUMN: e.key_group}
        if i is not None:
            drop[i] = True
        row.update(e.states)
        for name in e.states:
            if name in ttl and ttl[name] in have:
                row[ttl[name]] = now_ms
        if any(row.get(s.name) is not None for s in op.states if not s.name.startswith("__")):
            rows.append(row)
    schema = op.schema()
    kept = table.filter(pa.array(~drop)) if drop.any() else table
    if rows:
        kept = pa.concat_tables([kept.cast(schema), pa.Table.from_pylist(rows, schema=schema)])
    return canonical_order(kept, names)


# -- where a patch may write --------------------------------------------------------------------


def _ancestors(store: Store) -> list[tuple[str, str]]:
    """``(location, path of the store under it)`` of every folder above the store."""
    root = store.local_root
    if root is not None:
        return [(str(p), root.relative_to(p).as_posix()) for p in root.parents]
    url = store.url().rstrip("/")
    head, _, rest = url.partition("://")
    bucket, _, key = rest.partition("/")
    parts = [p for p in key.split("/") if p]
    return [(f"{head}://{bucket}/{'/'.join(parts[:i])}", "/".join(parts[i:])) for i in range(len(parts) - 1, -1, -1)]


def _check_destination(dest: Location) -> None:
    store = open_store(dest, "patched savepoint destination")
    where = store.url()
    if (store.is_local and store.size("") is not None) or store.list_names(""):
        raise StateError(f"patched savepoint destination {where} exists; a patch writes only a new savepoint: choose a new location")
    for location, below in _ancestors(store):
        if open_store(location, "folder").exists(JOB_FILE) and not below.startswith("savepoints/"):
            raise StateError(f"patched savepoint destination {where} is inside job directory {location}: a patch never writes "
                             f"into a job's checkpoints (write it elsewhere, or under {location.rstrip('/')}/savepoints/)")


def _who() -> dict[str, str]:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a container)
        user = "unknown"
    return {"user": user, "host": socket.gethostname()}


def patch_state(
    src: Location,
    dest: Location,
    uid: str,
    updates: Mapping[Any, Mapping[str, Any]] | None = None,
    deletes: Sequence[Any] = (),
    *,
    edits: Sequence[Edit] = (),
    note: str | None = None,
) -> str:
    """Write savepoint ``src`` again at ``dest`` (new) with operator ``uid``'s keys edited;
    returns the new savepoint's location. ``updates`` maps a key (as :func:`parse_key`
    takes it: a value, a tuple for a key of several columns, or text) to the states to set
    (state name -> JSON value); ``deletes`` lists keys to delete; ``edits`` gives both in
    one list (the CLI's ``--set``, ``--delete`` and ``--from-file``). ``note`` is kept in
    the patch's record. See the module for the rules."""
    source = open_store(src, "savepoint")
    if not source.exists(METADATA_FILE) and source.exists(JOB_FILE):
        raise StateError(f"{source.url()} is a job directory, not a savepoint: take a savepoint of it first "
                         f"(keyscale savepoint {source.url()}), then patch that")
    info = read_savepoint(source)
    op = _operator(info.operators, uid, f"savepoint {info.path}")
    all_edits = [*(Edit(k, dict(v)) for k, v in (updates or {}).items()), *(Edit(k, None) for k in deletes), *edits]
    if not all_edits:
        raise InputDataError(f"patch of operator '{uid}': no key to set or delete")
    plan = _plan(op, all_edits)
    _check_destination(dest)
    now_ms = int(time.time() * 1000)
    by_file: dict[int, list[_Planned]] = {}
    new_kgs: dict[int, list[_Planned]] = {}
    for p in plan.values():
        i = next((j for j, f in enumerate(op.files) if f.start <= p.key_group <= f.end), None)
        if i is None and p.states is None:
            shown = dict(zip(op.key_names, p.values, strict=True))
            raise StateError(f"savepoint {info.path}, operator '{uid}': key {shown} cannot be deleted: the savepoint does not hold it")
        (by_file.setdefault(i, []) if i is not None else new_kgs.setdefault(p.key_group, [])).append(p)
    with new_savepoint(dest) as store:
        ops = {}
        for other, o in info.operators.items():
            if other != uid:
                for f in o.files:
                    store.put(f.path, info.store.get(f.path))
                ops[other] = o
        files: list[SavepointFile] = []
        for i, f in enumerate(op.files):
            if i not in by_file:
                store.put(f.path, info.store.get(f.path))
                files.append(f)
                continue
            table = _apply(read_data_file(info, f, uid).select(op.schema().names).cast(op.schema()), op, by_file[i], now_ms, f"savepoint {info.path}")
            if table.num_rows:
                files.append(write_data_file(store, uid, f.range, table))
        for kg, planned in sorted(new_kgs.items()):
            table = _apply(op.schema().empty_table(), op, planned, now_ms, f"savepoint {info.path}")
            if table.num_rows:
                files.append(write_data_file(store, uid, KeyGroupRange(kg, kg), table))
        ops[uid] = SavepointOperator(uid, op.max_parallelism, op.parallelism, op.key_columns, op.states,
                                     tuple(sorted(files, key=lambda f: f.start)), dict(op.operator_state))
        if info.source is not None:
            prefix = info.source.rstrip("/") + "/"
            for obj in info.store.list(info.source):
                store.put(f"{SOURCE_DIR}/{obj.key[len(prefix):]}", info.store.get(obj.key))
        record = _record(info, op, plan, now_ms, note)
        new = SavepointInfo(
            path=store.url(), job=info.job, batch=info.batch, batch_time_ms=info.batch_time_ms, watermark_ms=info.watermark_ms,
            created_ms=now_ms, origin="patch", source=SOURCE_DIR if info.source is not None else None, operators=ops, store=store,
            extra={**info.extra, "patches": [*info.extra.get("patches", []), record]},
        )
        return finish_savepoint(store, new)


def _record(info: SavepointInfo, op: SavepointOperator, plan: Mapping[tuple[Any, ...], _Planned], now_ms: int, note: str | None) -> dict[str, Any]:
    def key(p: _Planned) -> Any:
        return {k: jsonable(v, t) for (k, t), v in zip(op.key_columns, p.values, strict=True)}

    sets = [p for p in plan.values() if p.states is not None]
    dels = [p for p in plan.values() if p.states is None]
    out: dict[str, Any] = {
        "who": _who(), "when_ms": now_ms, "operator": op.uid,
        "from": {"path": info.path, "origin": info.origin, "created_ms": info.created_ms},
        "set": len(sets), "deleted": len(dels), "digest": _digest(plan, op),
    }
    if len(plan) <= RECORDED_KEYS:
        out["keys_set"] = [key(p) for p in sets]
        out["keys_deleted"] = [key(p) for p in dels]
    if note:
        out["note"] = note
    return out

