"""Job lineages: the pure decision of what a sink does with a batch folder already there."""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from keyscale.checkpoint.jobdir import JobDir
from keyscale.checkpoint.lineage import (
    Action,
    Lineage,
    Marker,
    decide,
    descend,
    known_lineages,
    restored_lineage,
    start_lineage,
)
from keyscale.checkpoint.manifest import Manifest

ids = st.sampled_from(["a", "b", "c", "d", "e"])
batches = st.integers(-1, 30)


@st.composite
def lineages(draw: st.DrawFn) -> Lineage:
    own = draw(ids)
    anc = draw(st.dictionaries(ids.filter(lambda x: x != own), batches, max_size=3))
    return Lineage(own, anc)


@given(lineages(), batches, batches, st.one_of(st.none(), ids))
def test_no_folder_is_written_and_a_folder_is_never_overwritten_blindly(me: Lineage, batch: int, committed: int, lid: str | None) -> None:
    assert decide(False, None, batch, me, committed) is Action.WRITE
    assert decide(True, Marker(lid), batch, me, committed) is not Action.WRITE


@given(lineages(), batches, batches)
def test_own_folder_is_a_replay_and_kept(me: Lineage, batch: int, committed: int) -> None:
    assert decide(True, Marker(me.id), batch, me, committed) is Action.KEEP


@given(lineages(), ids, batches, batches)
def test_ancestor_output_after_the_fork_is_superseded_before_kept(me: Lineage, lid: str, batch: int, committed: int) -> None:
    action = decide(True, Marker(lid), batch, me, committed)
    if lid == me.id:
        assert action is Action.KEEP
    elif lid in me.ancestors:
        assert action is (Action.SUPERSEDE if batch > me.ancestors[lid] else Action.KEEP)
    else:
        assert action is Action.REFUSE  # another lineage's output is never dropped nor replaced


@given(lineages(), batches, batches)
def test_unmarked_output_is_kept_only_as_own_committed_history(me: Lineage, batch: int, committed: int) -> None:
    assert decide(True, None, batch, me, committed) is (Action.KEEP if batch <= committed else Action.REFUSE)
    assert decide(True, Marker(None), batch, me, committed) is (Action.KEEP if batch <= committed else Action.REFUSE)


@given(st.lists(st.tuples(st.integers(0, 4), st.integers(1, 6)), min_size=1, max_size=6))
def test_a_chain_of_restores_leaves_exactly_the_latest_runs_history(steps: list[tuple[int, int]]) -> None:
    """A model of an output path: a job runs, then each step restores a savepoint of the
    current run at some batch and runs further. Whatever the chain, after each run the
    output is, batch by batch, that of the run that computed it last, nothing refused."""
    out: dict[int, str] = {}  # batch -> lineage of its folder
    cur = Lineage("L0")
    owner: dict[int, str] = {}
    end = 3
    for b in range(end + 1):
        out[b] = owner[b] = cur.id
    for n, (back, extra) in enumerate(steps, start=1):
        fork = max(-1, end - back)
        new = descend({cur.id: cur}, {cur.id: fork}, f"L{n}")
        # the sink at start: one decision per folder
        for b in sorted(out):
            action = decide(True, Marker(out[b]), b, new, fork)
            assert action is not Action.REFUSE
            if action is Action.SUPERSEDE:
                del out[b]
        end = fork + extra
        for b in range(fork + 1, end + 1):
            assert decide(b in out, Marker(out.get(b)), b, new, b - 1) is Action.WRITE
            out[b] = new.id
        for b in range(fork + 1, end + 1):
            owner[b] = new.id
        owner = {b: o for b, o in owner.items() if b <= end}
        cur = new
        assert out == owner


def test_a_sibling_restore_is_refused() -> None:
    """Two restores of one savepoint are siblings: neither may replace the other's output."""
    a = Lineage("a")
    b = descend({"a": a}, {"a": 3}, "b")
    c = descend({"a": a}, {"a": 3}, "c")
    assert decide(True, Marker("b"), 4, c, 3) is Action.REFUSE
    assert decide(True, Marker("a"), 4, c, 3) is Action.SUPERSEDE
    assert decide(True, Marker("a"), 3, b, 3) is Action.KEEP


def test_markers_and_lineages_round_trip() -> None:
    lin = Lineage("x", {"y": 4})
    assert Lineage.from_json(json.loads(json.dumps(lin.to_json()))) == lin
    assert Lineage.from_json(None) is None and Lineage.from_json({"ancestors": {}}) is None
    m = Marker("x", "job", "/jd", "run", 7)
    assert Marker.from_json(json.loads(json.dumps(m.to_json()))) == m
    assert Marker.from_json("junk") == Marker(None)


def _job_dir(tmp_path: Path) -> JobDir:
    jd = JobDir(tmp_path)
    jd.claim("j", 8, 8)
    return jd


def _manifest(batch: int, extra: dict[str, object]) -> Manifest:
    return Manifest(job="j", batch=batch, batch_time_ms=0, operators={}, extra=extra)


def test_a_job_dir_keeps_its_lineage_and_a_start_over_descends_from_all_before(tmp_path: Path) -> None:
    jd = _job_dir(tmp_path)
    first = start_lineage(jd, None)
    assert [x.id for x in known_lineages(jd)] == [first.id]
    # Resumed from a checkpoint of that lineage: the same lineage.
    assert start_lineage(jd, _manifest(4, {"lineage": first.to_json()})) == first
    # Started over with no checkpoint (an empty restart): a new lineage that supersedes everything.
    again = start_lineage(jd, None)
    assert again.id != first.id and dict(again.ancestors) == {first.id: -1}
    third = start_lineage(jd, None)
    assert dict(third.ancestors) == {first.id: -1, again.id: -1}
    # A checkpoint written before lineages: a new lineage sharing history up to its batch.
    legacy = start_lineage(jd, _manifest(5, {}))
    # (the earlier lineages were superseded from batch -1 on by the later ones already)
    assert dict(legacy.ancestors) == {first.id: -1, again.id: -1, third.id: 5}


def test_a_restore_descends_from_the_savepoints_lineage_at_its_batch() -> None:
    parent = Lineage("p", {"g": 2})
    child = restored_lineage({"lineage": parent.to_json()}, 5)
    assert dict(child.ancestors) == {"p": 5, "g": 2} and child.id not in ("p", "g")
    assert dict(restored_lineage({}, 5).ancestors) == {}
