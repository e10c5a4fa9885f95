"""The lookup structure of the in-memory state table: key -> row, in about 4-10 bytes per key.

:class:`KeyIndex` is an open-addressing hash table (double hashing over a power-of-two
number of slots) whose slots hold row numbers of the state table, nothing else: the keys
stay in the table's own columns, and a probe compares the key at a candidate row with
the key looked up. So a hash collision costs a longer probe, never a wrong row, and the
index needs no copy of the keys (a :class:`pandas.Index` keeps its values plus a hash table
of 16 bytes per bucket: about 27-34 bytes per key at 1M-10M keys, measured).

Everything is vectorized with numpy: one round per probe step, over the keys still
unresolved (a round costs a few numpy calls; at the load kept here a lookup needs about 2
rounds on average, a miss about 5).

:func:`key_hash` hashes key columns by value: numeric ones from numpy (integers widened to
int64, floats to float64 with -0.0 as 0.0), string-like and fixed-width ones from their
Arrow buffers without making a Python object per key.

>>> import numpy as np
>>> keys = np.array([10, 20, 30], dtype=np.int64)
>>> ix = KeyIndex()
>>> ix.rebuild(key_hash([keys]))
>>> probe = np.array([30, 5], dtype=np.int64)
>>> ix.find(key_hash([probe]), lambda rows, at: keys[rows] == probe[at]).tolist()
[2, -1]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

EMPTY = -1  # a slot never used: a probe ends here
GONE = -2  # a slot whose row was dropped: a probe goes on past it, an insert may reuse it
MAX_LOAD = 0.8  # used + gone slots at most this share: a miss then takes ~5 probes on average
MIN_SLOTS = 8

_K1 = np.uint64(0xFF51AFD7ED558CCD)
_K2 = np.uint64(0xC4CEB9FE1A85EC53)
_K3 = np.uint64(0x9E3779B97F4A7C15)
_S33 = np.uint64(33)


def _mix(x: np.ndarray) -> np.ndarray:
    """MurmurHash3's 64-bit finalizer, in place (uint64 arithmetic wraps)."""
    x ^= x >> _S33
    x *= _K1
    x ^= x >> _S33
    x *= _K2
    x ^= x >> _S33
    return x


def _numeric_words(col: np.ndarray) -> np.ndarray:
    """Each value as 64 bits, equal for equal values whatever the width (a copy)."""
    if col.dtype.kind == "f":
        return (col.astype(np.float64) + 0.0).view(np.uint64)  # + 0.0: -0.0 == 0.0, one hash
    return col.astype(np.int64).view(np.uint64)


def _byte_layout(arr: pa.Array[Any]) -> tuple[np.ndarray, np.ndarray] | None:
    """(offsets, data bytes) of a string-like or fixed-width Arrow array; None for others."""
    t = arr.type
    n = len(arr)
    bufs = arr.buffers()
    if pa.types.is_string(t) or pa.types.is_binary(t) or pa.types.is_large_string(t) or pa.types.is_large_binary(t):
        wide = pa.types.is_large_string(t) or pa.types.is_large_binary(t)
        assert bufs[1] is not None
        offsets = np.frombuffer(memoryview(bufs[1]), dtype=np.int64 if wide else np.int32, count=arr.offset + n + 1)[arr.offset :].astype(np.int64)
        data = bufs[2]
    elif len(bufs) == 2 and not pa.types.is_boolean(t) and getattr(t, "bit_width", 0) % 8 == 0 and t.bit_width > 0:
        width = t.bit_width // 8  # dates, timestamps, decimals, fixed-size binary: their bytes
        offsets = (np.arange(n + 1, dtype=np.int64) + arr.offset) * width
        data = bufs[1]
    else:
        return None
    raw = np.frombuffer(memoryview(data), dtype=np.uint8) if data is not None and data.size else np.empty(0, dtype=np.uint8)
    return offsets, raw


def _bytes_hash(offsets: np.ndarray, raw: np.ndarray) -> np.ndarray:
    """A 64-bit hash of each byte string ``raw[offsets[i]:offsets[i+1]]``, 8 bytes per round."""
    first, last = int(offsets[0]), int(offsets[-1])
    total = last - first
    padded = np.zeros(total + 8, dtype=np.uint8)  # so that the last word of the last string can be read whole
    padded[:total] = raw[first:last]
    words = np.ndarray(shape=(total + 1,), dtype="<u8", buffer=padded, strides=(1,))  # a word at every byte
    start = offsets[:-1] - first
    left = offsets[1:] - offsets[:-1]
    h = _mix(left.astype(np.uint64) * _K3)
    at = np.arange(len(left))
    while len(at):
        w = words[start]
        short = left < 8
        if short.any():  # keep the string's own bytes of its last word (little-endian: the low ones)
            w[short] &= (np.uint64(1) << (left[short] * 8).astype(np.uint64)) - np.uint64(1)
        h[at] = _mix(h[at] ^ w)
        more = left > 8
        at, start, left = at[more], start[more] + 8, left[more] - 8
    return h


def _object_column(values: list[Any]) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):  # element by element: lists must stay objects, not a 2-D array
        out[i] = v
    return out


def column_hash(col: np.ndarray | pa.Array[Any]) -> np.ndarray:
    """A 64-bit hash of each value of one key column (numpy numeric, or Arrow)."""
    if isinstance(col, np.ndarray):
        if col.dtype == object:
            return np.asarray(pd.util.hash_array(col, categorize=False), dtype=np.uint64)
        return _mix(_numeric_words(col))
    layout = _byte_layout(col)
    if layout is not None:
        return _bytes_hash(*layout)
    # Nested types (structs, lists): by their Python values; slow, and no such key is common.
    return np.asarray(pd.util.hash_array(_object_column(col.to_pylist()), categorize=False), dtype=np.uint64)


def key_hash(columns: Sequence[np.ndarray | pa.Array[Any]]) -> np.ndarray:
    """A 64-bit hash of each key from its columns (equal keys, equal hashes)."""
    h = column_hash(columns[0])
    for col in columns[1:]:
        h = _mix(h * _K3 ^ column_hash(col))
    return h


def slots_for(n: int) -> int:
    """The number of slots for ``n`` keys: a power of two at most ``MAX_LOAD`` full."""
    need = max(MIN_SLOTS, int(np.ceil(n / MAX_LOAD)))
    return 1 << (need - 1).bit_length()


class KeyIndex:
    """Row numbers of a table's keys in hash slots (see module doc). The owner passes the
    keys' hashes and compares keys; the index never sees a key."""

    def __init__(self) -> None:
        self.slots = np.empty(0, dtype=np.int32)
        self.used = 0  # slots holding a row
        self.gone = 0  # slots whose row was dropped

    @property
    def nbytes(self) -> int:
        return int(self.slots.nbytes)

    def _step(self, h: np.ndarray) -> np.ndarray:
        """The probe step of each hash: odd, so that it visits every slot of a power-of-two
        table. (int64, as slots are: numpy indexes with it as it is.)"""
        step = (h >> np.uint64(32)).astype(np.int64)
        step |= 1
        step &= len(self.slots) - 1
        return step

    def find(self, h: np.ndarray, same: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> np.ndarray:
        """Row of each hashed key (-1: none). ``same(rows, at)`` tells whether the table's
        key at each of ``rows`` equals the looked-up key at each of ``at``."""
        if not self.used or not len(h):
            return np.full(len(h), -1, dtype=np.intp)
        mask = len(self.slots) - 1
        slot = (h & np.uint64(mask)).astype(np.int64)
        # The first probe, of every key (most end here): no indirection through ``at``.
        rows = self.slots[slot].astype(np.intp)
        first = np.flatnonzero(rows >= 0)
        hit = np.zeros(len(h), dtype=bool)
        hit[first] = same(rows[first], first)
        out = np.where(hit, rows, -1)
        at = np.flatnonzero((rows != EMPTY) & ~hit)  # past another key's row, or a tombstone
        slot = slot[at]
        step = self._step(h[at])
        while len(at):
            slot += step
            slot &= mask
            rows = self.slots[slot].astype(np.intp)
            taken = rows >= 0
            hit = np.zeros(len(at), dtype=bool)
            hit[taken] = same(rows[taken], at[taken])
            out[at[hit]] = rows[hit]
            go_on = (rows != EMPTY) & ~hit
            at, slot, step = at[go_on], slot[go_on], step[go_on]
        return out

    def insert(self, rows: np.ndarray, h: np.ndarray, rehash: Callable[[], np.ndarray]) -> None:
        """Add ``rows`` (hashes ``h``), whose keys are distinct and not in the index yet.
        When the index must grow, ``rehash()`` gives the hashes of every row of the table
        (rows ``0..n-1``, ``rows`` included), and the index is rebuilt from them."""
        if not len(rows):
            return
        if (self.used + self.gone + len(rows)) > MAX_LOAD * len(self.slots):
            self.rebuild(rehash())
        else:
            self._place(rows, h)

    def rebuild(self, every: np.ndarray) -> None:
        """The index of rows ``0..len(every)-1`` with hashes ``every``, at the load it aims for."""
        self._reset(len(every))
        self._place(np.arange(len(every)), every)

    def _reset(self, n: int) -> None:
        self.slots = np.full(slots_for(n), EMPTY, dtype=np.int32 if n < 2**31 - 1 else np.int64)
        self.used = self.gone = 0

    def _place(self, rows: np.ndarray, h: np.ndarray) -> None:
        mask = len(self.slots) - 1
        slot = (h & np.uint64(mask)).astype(np.int64)
        rows = rows.astype(self.slots.dtype, copy=False)
        step: np.ndarray | None = None
        if self.used == 0 and self.gone == 0:  # every slot free: the first round needs no look
            self.slots[slot] = rows  # several rows may claim one slot: one of them gets it
            won = self.slots[slot] == rows
            self.used += int(won.sum())
            lost = np.flatnonzero(~won)
            rows, slot, step = rows[lost], slot[lost], self._step(h[lost])
            slot += step
            slot &= mask
        while len(rows):
            was = self.slots[slot]
            free = np.flatnonzero(was < 0)
            claim, mine = slot[free], rows[free]
            self.slots[claim] = mine
            won = self.slots[claim] == mine
            self.used += int(won.sum())
            self.gone -= int((was[free[won]] == GONE).sum())  # tombstones taken over
            go_on = np.ones(len(rows), dtype=bool)
            go_on[free[won]] = False
            if step is None:
                step = self._step(h)
            rows, slot, step = rows[go_on], slot[go_on], step[go_on]
            slot += step
            slot &= mask

    def renumber(self, new_row: np.ndarray, kept: int, rehash: Callable[[], np.ndarray]) -> None:
        """After the table kept some rows: ``new_row[r]`` is row r's new number (-1:
        dropped); ``kept`` rows remain. Dropped rows leave tombstones; when they (or free
        slots far beyond what ``kept`` rows need) would cost, the index is rebuilt."""
        if not kept:
            self.slots = np.empty(0, dtype=np.int32)
            self.used = self.gone = 0
            return
        if len(self.slots) > slots_for(kept):  # bigger than its keys need (under 40% full): rebuilt smaller
            self.rebuild(rehash())
            return
        # Tombstones do not lengthen probes beyond what the load already allows (they count
        # as used until the next rebuild, which growth triggers).
        taken = self.slots >= 0
        moved = new_row[self.slots[taken]]
        self.slots[taken] = np.where(moved >= 0, moved, GONE)
        self.gone += self.used - kept
        self.used = kept
