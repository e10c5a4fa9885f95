"""The manifest: restore planning over state files (pure) and the manifest's JSON form.

The planning functions are checked against a model: each state file's content is a dict
``key group -> {key: value}`` (``None`` deletes a key), written by a random history of
batches in which every batch picks a parallelism and every subtask writes a delta, a
snapshot of its range (with or without a companion delta of the batch's changes), a snapshot
of part of its range with the delta of the whole range's changes beside it, or nothing.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keyscale.checkpoint.jobdir import JobDir
from keyscale.checkpoint.manifest import (
    FORMAT_VERSION,
    Manifest,
    OperatorCheckpoint,
    StateFile,
    catch_up,
    chain_length,
    deltas_since,
    files_overlapping,
    latest_snapshot_batches,
    live_files,
    restore_chain,
    restore_chains,
    restore_files,
)
from keyscale.errors import StateError
from keyscale.state.keygroups import KeyGroupRange, key_group_range

# -- a model of state files ------------------------------------------------------------------

State = dict[int, dict[int, int]]  # key group -> key -> value



def needs_full_reload(files: list[StateFile], key_group: int, held_version: int) -> bool:
    """The catch-up rule the task applies (manifest.chain_starts, through catch_up), per key
    group: a copy is rebuilt unless it is newer than every snapshot, or the latest snapshot
    keeps the deltas since a batch not after the copy."""
    snaps = [f for f in files if f.kind == "snapshot" and f.start <= key_group <= f.end]
    if held_version < 0 or not snaps:
        return held_version < 0
    latest = max(snaps, key=lambda f: f.batch)
    return latest.batch > held_version and (latest.deltas_since is None or latest.deltas_since > held_version)

@dataclass
class History:
    """Files written by a random run, their contents, and the true state after each batch."""

    max_parallelism: int
    files: list[StateFile] = field(default_factory=list)
    content: dict[str, dict[int, dict[int, int | None]]] = field(default_factory=dict)  # path -> kg -> key -> value
    truth: list[State] = field(default_factory=list)  # state after batch b

    @property
    def batches(self) -> int:
        return len(self.truth)


@st.composite
def histories(draw: st.DrawFn, max_m: int = 12, max_batches: int = 10) -> History:
    # Structure (parallelism, file kinds) is drawn by hypothesis so it shrinks; the keys and
    # values inside files come from a seeded generator (drawing them one by one is slow).
    m = draw(st.integers(1, max_m), label="max parallelism")
    n_batches = draw(st.integers(1, max_batches), label="batches")
    rnd = random.Random(draw(st.integers(0, 2**32 - 1), label="content seed"))
    h = History(m)
    state: State = {kg: {} for kg in range(m)}
    for b in range(n_batches):
        p = draw(st.integers(1, m), label=f"parallelism of batch {b}")
        actions = draw(st.lists(st.sampled_from(["delta", "delta", "snapshot", "snapshot+delta", "slice+delta", "none"]), min_size=p, max_size=p))
        for i, action in enumerate(actions):
            rng = key_group_range(i, m, p)
            if action == "none":
                continue
            # slice+delta: a snapshot of some of the range's key groups, the batch's changes of
            # the whole range beside it (a batch's part of a compaction in slices).
            part = rng
            if action == "slice+delta":
                lo = draw(st.integers(rng.start, rng.end), label="slice start")
                part = KeyGroupRange(lo, draw(st.integers(lo, rng.end), label="slice end"))
            content: dict[int, dict[int, int | None]] = {}
            companion: dict[int, dict[int, int | None]] = {}
            for kg in rng:
                # keys are small ints, values ints; None deletes the key
                changes = {rnd.randrange(4): rnd.choice([None, rnd.randrange(100)]) for _ in range(rnd.randrange(4))}
                for k, v in changes.items():
                    if v is None:
                        state[kg].pop(k, None)
                    else:
                        state[kg][k] = v
                if action == "delta":
                    content[kg] = dict(changes)
                elif kg in part:
                    content[kg] = dict(state[kg])
                if action in ("snapshot+delta", "slice+delta") and changes:
                    companion[kg] = dict(changes)
            kind = "delta" if action == "delta" else "snapshot"
            path = f"state/op/{b:012d}-s{i:05d}-{kind}.arrow"
            since = deltas_since(h.files, part) if action in ("snapshot+delta", "slice+delta") else None
            if since is not None and since >= b:  # nothing to keep: as a plain snapshot (the task's rule)
                since = None
                if part == rng:
                    companion = {}
            h.files.append(StateFile(path, b, kind, part.start, part.end, rows=0, bytes=0, crc32=0, deltas_since=since))
            h.content[path] = content
            if companion:  # the batch's changes beside its snapshot (none written when nothing changed)
                path = f"state/op/{b:012d}-s{i:05d}-delta.arrow"
                h.files.append(StateFile(path, b, "delta", rng.start, rng.end, rows=0, bytes=0, crc32=0))
                h.content[path] = companion
        h.truth.append({kg: dict(v) for kg, v in state.items()})
    return h


def apply(h: History, kg: int, chain: list[StateFile], base: dict[int, int] | None = None) -> dict[int, int]:
    """Apply a restore chain: a snapshot replaces the key group's state, a delta upserts."""
    out = dict(base or {})
    batches = [f.batch for f in chain]
    assert batches == sorted(batches), "restore chain is not in batch order"
    for f in chain:
        assert f.start <= kg <= f.end, f"restore chain of key group {kg} has a file not covering it"
        if f.kind == "snapshot":
            out = {}
        for k, v in h.content[f.path].get(kg, {}).items():
            if v is None:
                out.pop(k, None)
            else:
                out[k] = v
    return out


PROPS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPS
@given(histories())
def test_restore_chain_rebuilds_every_key_group(h: History) -> None:
    final = h.truth[-1]
    for kg in range(h.max_parallelism):
        chain = restore_chain(h.files, kg)
        assert apply(h, kg, chain) == final[kg]
        snaps = [f for f in chain if f.kind == "snapshot"]
        # at most one snapshot, and only at the start
        assert len(snaps) <= 1 and (not snaps or chain[0] is snaps[0])


@PROPS
@given(histories())
def test_restore_chain_equals_applying_every_file_in_batch_order(h: History) -> None:
    for kg in range(h.max_parallelism):
        everything = sorted((f for f in h.files if f.start <= kg <= f.end), key=lambda f: f.batch)
        assert apply(h, kg, restore_chain(h.files, kg)) == apply(h, kg, everything)


@PROPS
@given(histories(), st.data())
def test_restore_chains_of_a_range_are_each_key_groups_restore_chain(h: History, data: st.DataObject) -> None:
    lo = data.draw(st.integers(0, h.max_parallelism - 1))
    hi = data.draw(st.integers(lo, h.max_parallelism - 1))
    after = data.draw(st.none() | st.integers(-1, h.batches))
    chains = restore_chains(h.files, KeyGroupRange(lo, hi), after)
    assert chains == [restore_chain(h.files, kg, after) for kg in range(lo, hi + 1)]


@PROPS
@given(histories())
def test_live_files_keep_every_file_a_restore_needs(h: History) -> None:
    live = live_files(h.files, h.max_parallelism)
    assert set(f.path for f in live) <= set(f.path for f in h.files)
    assert live == [f for f in h.files if f in live], "live_files reorders files"
    for kg in range(h.max_parallelism):
        assert restore_chain(live, kg) == restore_chain(h.files, kg)
        assert apply(h, kg, restore_chain(live, kg)) == h.truth[-1][kg]
    # idempotent, and a dropped file is one no key group needs, from nothing or after a copy
    assert live_files(live, h.max_parallelism) == live
    restores = {f.path for kg in range(h.max_parallelism) for f in restore_chain(h.files, kg)}
    assert {f.path for f in restore_files(h.files, h.max_parallelism)} == restores
    assert restore_files(live, h.max_parallelism) == [f for f in live if f.path in restores]
    catch_ups = {f.path for kg in range(h.max_parallelism) for held in range(h.batches)
                 if not needs_full_reload(h.files, kg, held) for f in restore_chain(h.files, kg, after=held)}
    assert {f.path for f in live} == restores | catch_ups


@PROPS
@given(histories(), st.data())
def test_live_files_incrementally_equal_live_files_of_everything(h: History, data: st.DataObject) -> None:
    # The driver keeps only live files and adds each batch's new ones: same result as from all.
    live: list[StateFile] = []
    for b in range(h.batches):
        live = live_files([*live, *(f for f in h.files if f.batch == b)], h.max_parallelism)
        upto = [f for f in h.files if f.batch <= b]
        assert live == live_files(upto, h.max_parallelism)
        for kg in range(h.max_parallelism):
            assert apply(h, kg, restore_chain(live, kg)) == h.truth[b][kg]


@PROPS
@given(histories(), st.data())
def test_restore_chain_after_a_held_version_catches_up(h: History, data: st.DataObject) -> None:
    held = data.draw(st.integers(-1, h.batches - 1), label="held version")
    for files in (h.files, live_files(h.files, h.max_parallelism)):
        for kg in range(h.max_parallelism):
            base = h.truth[held][kg] if held >= 0 else {}
            chain = restore_chain(files, kg, after=held)
            assert apply(h, kg, chain, base) == h.truth[-1][kg]
            if not needs_full_reload(files, kg, held):
                # catching up needs only deltas newer than the held version, applied as upserts
                assert all(f.kind == "delta" and f.batch > held for f in chain)
            elif held >= 0:
                assert chain and chain[0].kind == "snapshot" and chain[0].batch > held


@PROPS
@given(histories(), st.data())
def test_catch_up_reads_each_key_groups_restore_chain(h: History, data: st.DataObject) -> None:
    """One rule: the task's catch-up reads, per key group, exactly its restore_chain (from
    nothing where the copy is unusable: none, or ahead of the checkpoint)."""
    m = h.max_parallelism
    start = data.draw(st.integers(0, m - 1), label="range start")
    rng = KeyGroupRange(start, data.draw(st.integers(start, m - 1), label="range end"))
    committed = h.batches - 1
    held = np.array(data.draw(st.lists(st.integers(-1, h.batches + 1), min_size=len(rng), max_size=len(rng)), label="held"))
    for files in (h.files, live_files(h.files, m)):
        full, reads, stats = catch_up(files, rng, held, committed, m)
        for i, kg in enumerate(rng):
            usable = 0 <= held[i] <= committed
            want = restore_chain(files, kg, after=int(held[i]) if usable else None)
            assert [f for f, r in reads if kg in r] == want
            assert bool(full[i]) == (not usable or needs_full_reload(files, kg, int(held[i])))
        assert stats["files_read"] == len({f.path for f, _ in reads})
        batches = [f.batch for f, _ in reads]
        assert batches == sorted(batches)


@PROPS
@given(histories(), st.data())
def test_needs_full_reload_semantics(h: History, data: st.DataObject) -> None:
    held = data.draw(st.integers(-1, h.batches - 1), label="held version")
    for kg in range(h.max_parallelism):
        newer = [f for f in h.files if f.kind == "snapshot" and f.batch > held and f.start <= kg <= f.end]
        # one snapshot since the copy, which keeps the deltas since a batch the copy has
        crossable = len(newer) == 1 and newer[0].deltas_since is not None and newer[0].deltas_since <= held
        assert needs_full_reload(h.files, kg, held) == (held < 0 or (bool(newer) and not crossable))


@PROPS
@given(histories(), st.data())
def test_chain_length_is_the_longest_restore_chain(h: History, data: st.DataObject) -> None:
    m = h.max_parallelism
    start = data.draw(st.integers(0, m - 1))
    end = data.draw(st.integers(start, m - 1))
    rng = KeyGroupRange(start, end)
    for files in (h.files, live_files(h.files, m)):
        assert chain_length(files, rng, m) == max(len(restore_chain(files, kg)) for kg in rng)


@PROPS
@given(histories())
def test_latest_snapshot_batches_and_overlap(h: History) -> None:
    m = h.max_parallelism
    snap = latest_snapshot_batches(h.files, m)
    for kg in range(m):
        want = max((f.batch for f in h.files if f.kind == "snapshot" and f.start <= kg <= f.end), default=-1)
        assert snap[kg] == want
    rng = KeyGroupRange(0, m - 1)
    assert files_overlapping(h.files, rng) == h.files


def test_restore_chain_examples() -> None:
    d0 = StateFile("a", 0, "delta", 0, 7, 1, 1, 1)
    s1 = StateFile("b", 1, "snapshot", 0, 3, 1, 1, 1)
    d2 = StateFile("c", 2, "delta", 0, 7, 1, 1, 1)
    files = [d2, s1, d0]  # any order in, batch order out
    assert restore_chain(files, 2) == [s1, d2]
    assert restore_chain(files, 5) == [d0, d2]
    assert restore_chain(files, 2, after=1) == [d2]  # snapshot at the held version: catch up
    assert restore_chain(files, 2, after=0) == [s1, d2]  # newer snapshot: from it
    assert restore_chain(files, 5, after=0) == [d2]
    assert restore_chain(files, 5, after=2) == []
    assert restore_chain([], 0) == []
    assert needs_full_reload(files, 2, 0) and not needs_full_reload(files, 2, 1)
    assert needs_full_reload(files, 5, -1) and not needs_full_reload(files, 5, 0)
    assert chain_length(files, KeyGroupRange(0, 7), 8) == 2
    assert chain_length([], KeyGroupRange(0, 7), 8) == 0
    assert live_files(files, 8) == files  # d0 still needed by key groups 4-7
    s3 = StateFile("d", 3, "snapshot", 4, 7, 1, 1, 1)
    assert live_files([*files, s3], 8) == [d2, s1, s3]


def test_a_snapshot_with_its_changes_beside_it_examples() -> None:
    d0 = StateFile("a", 0, "delta", 0, 7, 1, 1, 1)
    d1 = StateFile("b", 1, "delta", 0, 7, 1, 1, 1)
    s2 = StateFile("c", 2, "snapshot", 0, 7, 1, 1, 1, deltas_since=0)  # no snapshot before it: copies of 0 on
    c2 = StateFile("d", 2, "delta", 0, 7, 1, 1, 1)  # its companion
    d3 = StateFile("e", 3, "delta", 0, 7, 1, 1, 1)
    files = [d0, d1, s2, c2, d3]
    assert restore_chain(files, 5) == [s2, d3]  # a restore skips the companion
    assert restore_chain(files, 5, after=0) == [d1, c2, d3]  # a copy of 0 crosses the snapshot
    assert restore_chain(files, 5, after=2) == [d3]
    assert live_files(files, 8) == [d1, s2, c2, d3]  # d0: no copy (of batch 0 or later) needs it
    assert restore_files(files, 8) == [s2, d3]
    assert deltas_since(files, KeyGroupRange(0, 7)) == 2
    s4 = StateFile("f", 4, "snapshot", 0, 7, 1, 1, 1, deltas_since=2)
    c4 = StateFile("g", 4, "delta", 0, 7, 1, 1, 1)
    files = live_files([*files, s4, c4], 8)
    assert files == [d3, s4, c4]  # one snapshot interval of deltas, never more
    assert restore_chain(files, 5, after=1)[0] == s4  # two snapshots since the copy: reloads
    assert restore_chain(files, 5, after=2) == [d3, c4]


# -- the manifest's JSON form ----------------------------------------------------------------


def _manifest() -> Manifest:
    files = (
        StateFile("state/counts/000000000004-s00000-snapshot.arrow", 4, "snapshot", 0, 63, 120, 4096, 123456),
        StateFile("state/counts/000000000007-s00001-delta.arrow", 7, "delta", 64, 127, 3, 900, 4_000_000_000),
    )
    op = OperatorCheckpoint(
        uid="counts", max_parallelism=128, parallelism=2,
        key_columns=(("key", "string"), ("n", "int64")),
        states=({"name": "count", "kind": "value", "type": "int64"},),
        files=files, operator_state={"offsets": [[0, 5], [1, 9]]},
    )
    op2 = OperatorCheckpoint("alerts", 128, 4, (("key", "string"),), (), ())
    return Manifest(job="wc", batch=7, batch_time_ms=1_700_000_000_123, operators={"counts": op, "alerts": op2},
                    watermark_ms=None, created_ms=1_700_000_000_999, extra={"note": "ünïcode"})


def test_manifest_round_trip() -> None:
    m = _manifest()
    text = m.dumps()
    back = Manifest.loads(text)
    assert back == m
    assert back.dumps() == text
    assert json.loads(text)["format_version"] == FORMAT_VERSION
    assert back.operators["counts"].files[0].range == KeyGroupRange(0, 63)
    m2 = m.with_operator(OperatorCheckpoint("new", 128, 1, (("k", "int64"),), ()))
    assert set(m2.operators) == {"counts", "alerts", "new"} and set(m.operators) == {"counts", "alerts"}
    assert Manifest.loads(m2.dumps()) == m2


WHERE = "checkpoint 7 (manifest-000000000007.json)"


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_manifest_with_a_flipped_byte_is_rejected(data: st.DataObject) -> None:
    text = _manifest().dumps()
    i = data.draw(st.integers(0, len(text) - 1), label="position")
    if not text[i].isascii():
        return
    bad = text[:i] + chr(ord(text[i]) ^ 1) + text[i + 1 :]
    with pytest.raises(StateError, match="checkpoint 7"):
        Manifest.loads(bad, where=WHERE)


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_truncated_manifest_is_rejected(data: st.DataObject) -> None:
    text = _manifest().dumps()
    n = data.draw(st.integers(0, len(text) - 1), label="length")
    with pytest.raises(StateError, match="checkpoint 7"):
        Manifest.loads(text[:n], where=WHERE)


def test_wrong_checksum_is_rejected() -> None:
    d = json.loads(_manifest().dumps())
    d["checksum"] = "0" * 64
    with pytest.raises(StateError, match=r"checkpoint 7.*checksum"):
        Manifest.loads(json.dumps(d), where=WHERE)
    d = json.loads(_manifest().dumps())
    del d["checksum"]
    with pytest.raises(StateError, match=r"checkpoint 7.*no checksum"):
        Manifest.loads(json.dumps(d), where=WHERE)
    # an edited value with the old checksum
    d = json.loads(_manifest().dumps())
    d["operators"]["counts"]["parallelism"] = 3
    with pytest.raises(StateError, match="checksum mismatch"):
        Manifest.loads(json.dumps(d), where=WHERE)


def _resigned(mutate: object) -> str:
    from keyscale.checkpoint.manifest import _checksum

    d = json.loads(_manifest().dumps())
    del d["checksum"]
    mutate(d)  # type: ignore[operator]
    d["checksum"] = _checksum(d)
    return json.dumps(d)


def test_other_format_version_and_missing_fields_are_rejected() -> None:
    with pytest.raises(StateError, match=r"checkpoint 7 .*format version 99"):
        Manifest.loads(_resigned(lambda d: d.update(format_version=99)), where=WHERE)
    with pytest.raises(StateError, match=r"checkpoint 7 .*missing or has a bad field"):
        Manifest.loads(_resigned(lambda d: d.pop("batch")), where=WHERE)
    with pytest.raises(StateError, match=r"checkpoint 7 .*missing or has a bad field"):
        Manifest.loads(_resigned(lambda d: d["operators"]["counts"]["files"][0].pop("crc32")), where=WHERE)
    for text in ("[]", "null", "42", ""):
        with pytest.raises(StateError, match="checkpoint 7"):
            Manifest.loads(text, where=WHERE)


def _committed_jobdir(tmp_path: object) -> tuple[JobDir, bytes]:
    jd = JobDir(tmp_path)  # type: ignore[arg-type]
    jd.claim("wc", 128, 128)
    jd.commit(_manifest())
    path = (jd.path / jd.manifest_key(7))
    return jd, path.read_bytes()


def test_jobdir_reads_its_committed_manifest(tmp_path: object) -> None:
    jd, _ = _committed_jobdir(tmp_path)
    assert jd.read_manifest(7) == _manifest()
    with pytest.raises(StateError, match="checkpoint 8 does not exist"):
        jd.read_manifest(8)


@pytest.mark.parametrize("bit", [0x01, 0x20])
def test_jobdir_manifest_with_a_flipped_ascii_bit_names_the_checkpoint(tmp_path: object, bit: int) -> None:
    jd, raw = _committed_jobdir(tmp_path)
    i = raw.index(b'"parallelism"') + 1
    (jd.path / jd.manifest_key(7)).write_bytes(raw[:i] + bytes([raw[i] ^ bit]) + raw[i + 1 :])
    with pytest.raises(StateError, match=r"checkpoint 7 \(manifest-000000000007.json\)"):
        jd.read_manifest(7)


def test_jobdir_manifest_with_a_flipped_high_bit_names_the_checkpoint(tmp_path: object) -> None:
    jd, raw = _committed_jobdir(tmp_path)
    i = raw.index(b'"parallelism"') + 1
    (jd.path / jd.manifest_key(7)).write_bytes(raw[:i] + bytes([raw[i] ^ 0x80]) + raw[i + 1 :])
    with pytest.raises(StateError, match="checkpoint 7"):
        jd.read_manifest(7)
