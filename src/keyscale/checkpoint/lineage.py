"""Job lineages: whose output a sink's batch folder is, and what a new write may do with it.

A lineage starts whenever a job's state starts anew: a new job directory, a restore from a
savepoint, or a job directory that starts over with no committed checkpoint. It is carried
forward in every manifest (``extra["lineage"]``) and so in savepoints. A lineage knows its
ancestors as ``lineage id -> fork batch``: a savepoint restore descends from the savepoint's
lineage at the savepoint's batch (the new run recomputes every batch after it); a job
directory that starts over descends from the lineages it had before at batch -1 (it
recomputes everything).

Each batch's output is marked with the lineage that wrote it. Before writing batch ``b``, a
sink decides with :func:`decide` what to do with a folder already there (pure, so it is
property-tested):

- no folder: write;
- same lineage: a replay after a crash: keep it (identical by determinism);
- an ancestor's, after its fork batch: superseded by this run: move it aside, write anew;
- an ancestor's at or before its fork batch: shared history, never rewritten (keep);
- another lineage's (a second job on the same output, a deployment restored with NONE):
  refuse, naming both; output is never dropped silently.

Folders without a marker were written by a keyscale before lineages (or by another tool):
kept if the job already committed that batch (its own history), refused otherwise.
"""

from __future__ import annotations

import enum
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from keyscale.checkpoint.manifest import Manifest
from keyscale.errors import KeyscaleError

if TYPE_CHECKING:
    from keyscale.checkpoint.jobdir import JobDir


@dataclass(frozen=True)
class Lineage:
    """One lineage: its id and its ancestors (lineage id -> the last batch shared with it)."""

    id: str
    ancestors: Mapping[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "ancestors": {k: int(v) for k, v in sorted(self.ancestors.items())}}

    @staticmethod
    def from_json(d: Any) -> Lineage | None:
        """The lineage in a manifest's ``extra`` (None if absent: written before lineages)."""
        if not isinstance(d, dict) or not isinstance(d.get("id"), str):
            return None
        anc = d.get("ancestors") or {}
        return Lineage(d["id"], {str(k): int(v) for k, v in anc.items()})


def new_lineage_id() -> str:
    return uuid.uuid4().hex


def descend(parents: Mapping[str, Lineage | None], fork: Mapping[str, int], new_id: str | None = None) -> Lineage:
    """A new lineage forked from each ``parents[p]`` at batch ``fork[p]``.

    The parents' own ancestors are inherited at the earlier of the two fork batches: what
    the new lineage shares with a grandparent is at most what its parent shared with it.

    >>> a = Lineage("a")
    >>> b = descend({"a": a}, {"a": 5}, "b")
    >>> dict(descend({"b": b}, {"b": 3}, "c").ancestors)
    {'b': 3, 'a': 3}
    """
    ancestors: dict[str, int] = {}

    def add(lid: str, batch: int) -> None:
        ancestors[lid] = min(batch, ancestors.get(lid, batch))

    for pid, parent in parents.items():
        f = int(fork[pid])
        add(pid, f)
        if parent is not None:
            for aid, af in parent.ancestors.items():
                add(aid, min(af, f))
    nid = new_id or new_lineage_id()
    ancestors.pop(nid, None)
    return Lineage(nid, ancestors)


class Action(enum.Enum):
    WRITE = "write"  # no folder yet
    KEEP = "keep"  # leave the folder as it is (a replay of this lineage, or shared history)
    SUPERSEDE = "supersede"  # move the folder aside and write this lineage's batch
    REFUSE = "refuse"  # another lineage's output: an error, never overwritten nor dropped


@dataclass(frozen=True)
class Marker:
    """What a batch folder says about who wrote it (``_keyscale.json``)."""

    lineage: str | None
    job: str = ""
    job_dir: str = ""
    attempt: str = ""
    batch: int = -1

    def to_json(self) -> dict[str, Any]:
        return {"lineage": self.lineage, "job": self.job, "job_dir": self.job_dir, "attempt": self.attempt, "batch": self.batch}

    @staticmethod
    def from_json(d: Any) -> Marker:
        if not isinstance(d, dict):
            return Marker(None)
        lid = d.get("lineage")
        return Marker(
            lid if isinstance(lid, str) else None, str(d.get("job", "")), str(d.get("job_dir", "")),
            str(d.get("attempt", "")), int(d.get("batch", -1)),
        )


def decide(exists: bool, marker: Marker | None, batch: int, mine: Lineage, committed: int) -> Action:
    """What to do with the output folder of ``batch`` before (or instead of) writing it.

    ``marker`` is the folder's marker (None: no marker or an unreadable one); ``committed``
    is the last batch this lineage committed (-1 if none).

    >>> me = Lineage("b", {"a": 5})
    >>> [decide(True, Marker(l), n, me, 5).value for l, n in [("b", 6), ("a", 6), ("a", 5), ("x", 9)]]
    ['keep', 'supersede', 'keep', 'refuse']
    >>> decide(False, None, 7, me, 5).value, decide(True, None, 3, me, 5).value, decide(True, None, 6, me, 5).value
    ('write', 'keep', 'refuse')
    """
    if not exists:
        return Action.WRITE
    lid = marker.lineage if marker is not None else None
    if lid is None:
        return Action.KEEP if batch <= committed else Action.REFUSE
    if lid == mine.id:
        return Action.KEEP
    if lid in mine.ancestors:
        return Action.KEEP if batch <= mine.ancestors[lid] else Action.SUPERSEDE
    return Action.REFUSE


# -- the job directory's lineages (job.json) ------------------------------------------------


def known_lineages(job_dir: JobDir) -> list[Lineage]:
    """Every lineage that ever wrote from ``job_dir`` (recorded in its ``job.json``)."""
    try:
        d = job_dir.read_job_file()
    except KeyscaleError:
        return []
    found = [Lineage.from_json(x) for x in d.get("lineages") or []]
    return [x for x in found if x is not None]


def record_lineage(job_dir: JobDir, lineage: Lineage) -> None:
    """Remember ``lineage`` in ``job.json`` before it writes any output: a job directory
    that starts over later descends from it (and supersedes what it wrote)."""
    d = job_dir.read_job_file()
    entries = [x for x in d.get("lineages") or [] if isinstance(x, dict) and x.get("id") != lineage.id]
    d["lineages"] = [*entries, lineage.to_json()]
    job_dir.write_job_file(d)


def start_lineage(job_dir: JobDir, committed: Manifest | None, anew: bool = False) -> Lineage:
    """The lineage a job runs as: its checkpoint's, else a new one.

    A checkpoint without a lineage (a job directory that starts over with no checkpoint, or
    one written before lineages) starts a new lineage that descends from every lineage the
    job directory had, at its committed batch (-1 without one): what they wrote after it
    is superseded by this run, which recomputes it. With ``anew`` the checkpoint's lineage
    forks at the committed batch too: the next batch will not be what was written for it
    before (an interrupted drain's output is no replay of the input batch that takes its id).
    """
    own = Lineage.from_json(committed.extra.get("lineage")) if committed is not None else None
    if own is not None and anew and committed is not None:
        own = descend({own.id: own}, {own.id: committed.batch})
    if own is None:
        known = {x.id: x for x in known_lineages(job_dir)}
        fork = committed.batch if committed is not None else -1
        own = descend(dict(known), dict.fromkeys(known, fork))
    record_lineage(job_dir, own)
    return own


def restored_lineage(savepoint_checkpoint_extra: Mapping[str, Any], batch: int) -> Lineage:
    """The lineage of a job restored from a savepoint: it descends from the savepoint's
    lineage (if it has one) at the restored ``batch``."""
    parent = Lineage.from_json(savepoint_checkpoint_extra.get("lineage"))
    if parent is None:
        return Lineage(new_lineage_id())
    return descend({parent.id: parent}, {parent.id: batch})
