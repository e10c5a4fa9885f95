"""The job directory: one job's identity, epochs, checkpoints, state files and control inbox.

Layout (keys of the job directory's store: a local folder or an object store prefix)::

    job.json                  identity: job name, max parallelism (fixed for life), lineages
    epochs/<n>.json           run n's claim (created only if absent): a commit of run n checks
                              that no run n+1 exists, so an old driver never commits after a new one
    lock                      local disk only: held (flock) by the one process running the job
    status.json               written by the running job (its heartbeat on an object store)
    run.json                  how the job was started (for `keyscale rescale --restart`)
    args.json                 the --set arguments of the last successful start, which `keyscale run` reuses
    control/rescale.json      live rescale requests, read at the next batch
    control/secret            the running job's control API secret (new each run)
    checkpoints/manifest-<batch>.json   one per committed batch (the commit point; created only if absent)
    checkpoints/intent-<batch>.json     parallelism, time and input fixed for a batch before it runs (BatchIntent)
    spark/bundle-<batch>.json           Spark's own checkpoint, mirrored when the job dir is not local
    state/<uid>/...           state files written by tasks (immutable, uniquely named)
    events.jsonl | events/    what the job decided (autoscaler, rescales), with reasons

Every object is written whole; nothing is renamed or locked on an object store (see
docs/design.md, "Commit protocol").

:class:`JobDir` is the one interface to the files above, each method one file's protocol
under the same epoch fence and store rules. This module holds the checkpoint half (manifests
and the commit point, recovery at a start, batch intents, retention);
:class:`~keyscale.checkpoint.jobfiles.JobFiles`, which it extends, holds the run half
(layout, identity, the single-writer lock and epochs, status, events, rescale requests).
What is pure lives apart (:mod:`~keyscale.checkpoint.manifest`,
:mod:`~keyscale.checkpoint.fence`, :mod:`~keyscale.checkpoint.retention`,
:mod:`~keyscale.checkpoint.lineage`).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass, replace

from keyscale.checkpoint import sparklog
from keyscale.checkpoint.fence import EPOCHS, resumed_key, superseded
from keyscale.checkpoint.files import state_size_problem, verify_state_file
from keyscale.checkpoint.intent import BatchIntent
from keyscale.checkpoint.jobfiles import (
    JOB_FILE,
    JobFiles,
    JobIdentity,
    batch_of,
    json_bytes,
    spark_cache_dir,
)
from keyscale.checkpoint.manifest import Manifest, restore_files
from keyscale.checkpoint.retention import checkpoints_to_keep
from keyscale.errors import StateError, StorageError
from keyscale.storage import Store

# Names of the run half that callers import from here, where they were defined first.
__all__ = ["JOB_FILE", "JobDir", "JobIdentity", "Recovery", "spark_cache_dir"]

log = logging.getLogger("keyscale")

CHECKPOINTS = "checkpoints"
DAMAGE_REPORT = "damage.json"  # a run found a damaged state file: the next start checks in full
# Files no manifest took (other attempts', a crashed batch's) are found by listing the
# state folder: at start and every so many batches, never once per file.
SWEEP_EVERY = 32


@dataclass(frozen=True)
class Recovery:
    """What :meth:`JobDir.recover` found: the checkpoint to resume from, and what it skipped."""

    manifest: Manifest | None
    discarded: tuple[str, ...]  # one sentence per damaged checkpoint set aside
    empty_restart: bool = False  # no intact checkpoint: state starts empty, input is read again
    spark_set_aside: str | None = None  # where Spark's checkpoint went on an empty restart


class JobDir(JobFiles):
    """One job directory on a store (local path, ``file://``, ``s3://``, ...)."""

    def __init__(self, location: str | os.PathLike[str] | Store):
        super().__init__(location)
        self.resumed_from: int | None = None  # the checkpoint this run resumed from (-1: none), once recovered
        self._batches: list[int] | None = None  # manifest batches, listed once, then kept up to date
        self._manifests: dict[int, Manifest] = {}
        self._intents: set[int] | None = None  # intent batches, listed once by retention, then kept
        self._inherited: set[int] = set()  # intents older runs left when this run took over (adoptable)
        self._since_sweep = SWEEP_EVERY

    def manifest_key(self, batch: int) -> str:
        return f"{CHECKPOINTS}/manifest-{batch:012d}.json"

    def intent_key(self, batch: int) -> str:
        return f"{CHECKPOINTS}/intent-{batch:012d}.json"

    def lock(self) -> None:
        """:meth:`JobFiles.lock`, then note the intents older runs left (this run's replays follow them)."""
        super().lock()
        # After the claim, before anything else: the intents older runs left. An older run's
        # intent that appears later is a paused run's late write (read_intent ignores it).
        self._inherited = {i for n in self.store.list_names(CHECKPOINTS) if (i := batch_of(n, "intent-")) is not None}

    # -- checkpoints ---------------------------------------------------------------------
    def manifest_batches(self) -> list[int]:
        if self._batches is None or self.epoch == 0:  # tools list every time; the writer keeps its own
            found = [b for n in self.store.list_names(CHECKPOINTS) if (b := batch_of(n, "manifest-")) is not None]
            self._batches = sorted(found)  # batch -1: a savepoint without source positions
        return list(self._batches)

    def read_manifest(self, batch: int) -> Manifest:
        if self.epoch and batch in self._manifests:  # the writer's own (tools always read)
            return self._manifests[batch]
        key = self.manifest_key(batch)
        try:
            text = self.store.get_text(key)
        except StorageError:
            raise StateError(f"checkpoint {batch} ({key}) is damaged (not UTF-8 text)") from None
        if text is None:
            raise StateError(f"checkpoint {batch} does not exist ({self.store.url(key)})")
        m = Manifest.loads(text, where=f"checkpoint {batch} ({key.rsplit('/', 1)[-1]})")
        self._manifests[batch] = m
        return m

    def has_manifest(self, batch: int) -> bool:
        if self.epoch and self._batches is not None:
            return batch in self._batches  # the one writer knows what it and its predecessors committed
        return self.store.exists(self.manifest_key(batch))

    def commit(self, manifest: Manifest) -> Manifest:
        """The commit point of a batch: after this the batch has happened. Returns the
        manifest as committed.

        The manifest, stamped with this run's epoch and the checkpoint it resumed from, is
        created only if absent; then the fence is checked. A run that a newer one took over
        may have passed an earlier check and paused before its create (the create lands
        late, perhaps re-creating a checkpoint retention deleted): it learns here that it
        is fenced and stops before any effect that follows a commit. Its late manifest is
        never deleted (the newer run may have listed and resumed from it); the next
        :meth:`recover` sets it aside if a newer run resumed from an earlier checkpoint
        (:func:`keyscale.checkpoint.fence.superseded`)."""
        stamped = replace(manifest, extra={**manifest.extra, "epoch": self.epoch, "resumed_from": self.resumed_from}) if self.epoch else manifest
        created = self.store.create(self.manifest_key(manifest.batch), stamped.dumps().encode())
        self.check_epoch(f"committing batch {manifest.batch}" if not created else f"anything after its late commit of batch {manifest.batch}")
        if not created:
            raise StateError(
                f"batch {manifest.batch} of {self.uri} was committed by another run while this one ran it; "
                "this run stops (restart the job: it resumes from that checkpoint)"
            )
        self._manifests[manifest.batch] = stamped
        if self._batches is not None:
            self._batches = sorted({*self._batches, manifest.batch})
        return stamped

    def latest_manifest(self) -> Manifest | None:
        batches = self.manifest_batches()
        return self.read_manifest(batches[-1]) if batches else None

    def check_manifest(self, batch: int, sizes: dict[str, int] | None = None) -> tuple[Manifest | None, str | None]:
        """The manifest and None if it and all its files are intact, else (None, why).
        ``sizes`` (key -> size from one listing): on an object store, where objects are
        written whole and checksummed by the store, a file is intact when its size matches."""
        try:
            m = self.read_manifest(batch)
        except StateError as e:
            return None, str(e)
        for op in m.operators.values():
            # The files a restore reads: a delta kept only for running workers' copies
            # (manifest.live_files) is never read by a new run, whose workers hold none.
            for f in restore_files(op.files, op.max_parallelism):
                problem = state_size_problem(f, sizes.get(f.path)) if sizes is not None else verify_state_file(self.store, f)
                if problem:
                    return None, f"checkpoint {batch}: {problem}"
        return m, None

    def _set_aside(self, key: str, dest: str) -> None:
        self.store.copy(key, dest)
        self.store.delete(key)

    def recover(self, allow_empty_restart: bool = False) -> Recovery:
        """Find the newest intact checkpoint; set damaged newer ones aside.

        Spark's commit log is rolled back to the checkpoint found; the runtime then replays
        every batch after it (:mod:`keyscale.runtime.driver.recovery`). When no intact checkpoint is
        left but the job has committed batches, starting would lose its state: refused with a
        :class:`StateError` naming the damage, unless ``allow_empty_restart``: then the state
        starts empty and the input is read again from its beginning (Spark's checkpoint and
        the batch intents are set aside, not deleted).
        """
        self._batches = None
        self._manifests.clear()
        damaged: list[tuple[int, str]] = []
        found: Manifest | None = None
        reported = None if self.is_local else self.store.get_text(DAMAGE_REPORT)
        # Sizes only on an object store, unless a run found a damaged file (then in full, as on local disk).
        sizes = None if self.is_local or reported is not None else {o.key: o.size for o in self.store.list("state")}
        stale = self._set_aside_superseded()
        for batch in reversed(self.manifest_batches()):
            if batch in stale:
                continue
            m, problem = self.check_manifest(batch, sizes)
            if m is not None:
                found = m
                break
            damaged.append((batch, problem or f"checkpoint {batch} is damaged"))
        discarded = tuple(why for _, why in damaged)
        committed_by_spark = sparklog.commit_batches(self.spark_checkpoint)
        empty = found is None and bool(damaged or committed_by_spark)
        if empty and not allow_empty_restart:
            damage = "; ".join(discarded) if damaged else (
                f"there is no checkpoint, yet Spark's log says batches up to {committed_by_spark[-1]} were committed"
            )
            raise StateError(
                f"no intact checkpoint is left in {self.store.url(CHECKPOINTS)}: {damage}. Starting would lose the job's state; "
                "to start again with empty state, reading the input again from its beginning, run with --allow-empty-restart"
            )
        for batch, _ in damaged:
            key = self.manifest_key(batch)
            self._set_aside(key, key + ".damaged")
            self._manifests.pop(batch, None)
        self._batches = [b for b in self.manifest_batches() if b not in dict(damaged) and b not in stale]
        self._resumed(found)
        if empty:
            sparklog.restore_hidden(self.spark_checkpoint, self.spark_hidden)  # set aside whole
            aside = sparklog.set_aside(self.spark_checkpoint)
            folder = f"{CHECKPOINTS}/intents.set-aside-{int(time.time() * 1000)}"
            for name in self.store.list_names(CHECKPOINTS):
                if batch_of(name, "intent-") is not None:
                    self._set_aside(f"{CHECKPOINTS}/{name}", f"{folder}/{name}")
            if reported is not None:
                self.store.delete(DAMAGE_REPORT)
            self._resumed(None)
            return Recovery(None, discarded, empty_restart=True, spark_set_aside=str(aside) if aside else None)
        self.rollback_spark_commits(after=found.batch if found else -1)
        if reported is not None:
            self.store.delete(DAMAGE_REPORT)  # checked in full: what is damaged is set aside
        return Recovery(found, discarded)

    def _set_aside_superseded(self) -> set[int]:
        """Set aside (``.superseded``) every checkpoint a fenced run created after a newer
        run had resumed from an earlier one; returns their batches. Reads each manifest
        once (retention keeps a few) and the resumed-from records of the runs since the
        oldest of them; a damaged manifest is left to the damage check."""
        epochs: dict[int, int] = {}
        for batch in self.manifest_batches():
            try:
                epochs[batch] = int(self.read_manifest(batch).extra.get("epoch") or 0)
            except StateError:
                continue
        if not epochs:
            return set()
        resumed: dict[int, tuple[int, int]] = {}
        for e in (b for n in self.store.list_names(EPOCHS) if (b := batch_of(n, "")) is not None):
            record = self.read_json(resumed_key(e)) if e > min(epochs.values()) and e != self.epoch else {}
            if isinstance(record.get("batch"), int):
                resumed[e] = (int(record["batch"]), int(record.get("epoch") or 0))
        stale = set(superseded(epochs, resumed))
        for batch in sorted(stale):
            key = self.manifest_key(batch)
            self._set_aside(key, key + ".superseded")
            self._manifests.pop(batch, None)
            log.warning(
                "checkpoint %d was created by run %d after a newer run had resumed from an earlier checkpoint (the late commit "
                "of a paused or cut-off driver): it is not the job's history; set aside as %s",
                batch, epochs[batch], self.store.url(key + ".superseded"))
        return stale

    def _resumed(self, found: Manifest | None) -> None:
        """Note (for a run: beside its epoch claim) the checkpoint this run resumes from: an
        older run's checkpoint after it that appears later is a late commit (:meth:`recover`)."""
        self.resumed_from = found.batch if found is not None else -1
        if self.epoch:
            epoch = int(found.extra.get("epoch") or 0) if found is not None else 0
            self.store.put(resumed_key(self.epoch), json_bytes({"batch": self.resumed_from, "epoch": epoch}))

    def report_damage(self, why: str) -> None:
        """Ask the next start to check every state file of the checkpoints in full.

        On an object store :meth:`recover` checks state files by size only (reading every
        state file at each start would cost a job of terabytes its restart), so a file damaged
        in place is found when a task reads it. The run that finds it calls this before it
        exits; the next :meth:`recover` then checks sizes and checksums, as on local disk: it
        falls back to the newest intact checkpoint, or refuses when none is left (unless
        ``allow_empty_restart``). The request stays until a recovery succeeds. A run that a
        newer one took over writes nothing (:class:`FencedError`): the newer run reads the
        file itself."""
        self.check_epoch("recording the damage for the next start")
        self.store.put(DAMAGE_REPORT, json_bytes({"why": why, "pid": os.getpid(), "host": socket.gethostname(), "time_ms": int(time.time() * 1000)}))

    def rollback_spark_commits(self, after: int) -> list[int]:
        """Make Spark re-run every batch newer than ``after`` (its offsets are kept)."""
        return sparklog.remove_commits_after(self.spark_checkpoint, after)

    # -- batch intents -------------------------------------------------------------------
    def read_intent(self, batch: int) -> BatchIntent | None:
        """Batch ``batch``'s intent in force: this run's, or one an older run left before this
        run took over (its replay follows it). For a run (not a tool), an older run's intent
        written after the takeover is None: a paused run's late write, which this run must
        not follow (docs/design.md, "Exactly-once, effect by effect"). An intent of a later
        version than this keyscale reads is an error naming the file."""
        key = self.intent_key(batch)
        found = self.read_json(key) or None  # an intent is never empty
        if found is None:
            return None
        intent = BatchIntent.from_wire(found, f"the intent of batch {batch} ({self.uri}: {key})")
        if self.epoch and intent.epoch < self.epoch and batch not in self._inherited:
            log.warning("batch %d: ignoring the intent run %s wrote after this run took over (a paused or cut-off driver)",
                        batch, intent.epoch or "?")
            return None
        return intent

    def write_intent(self, batch: int, intent: BatchIntent, replace: bool = False) -> None:
        """Fix batch ``batch``'s intent, stamped with this run's epoch. Created only if absent,
        so that a paused older run that wakes cannot replace it (it finds this one and is
        fenced); ``replace``: this run re-plans the batch (a retry at a new ``-p``, an
        interrupted drain, an intent :meth:`read_intent` ignored)."""
        doing = f"planning batch {batch}"
        self.check_epoch(doing)
        data = json_bytes((intent.stamped(self.epoch) if self.epoch else intent).to_wire())
        if replace:
            self.store.put(self.intent_key(batch), data)
        elif not self.store.create(self.intent_key(batch), data):
            self.check_epoch(doing)
            # An older run's late write since this run read none: not followed, replaced.
            log.warning("batch %d: replacing the intent an older run wrote after this run took over", batch)
            self.store.put(self.intent_key(batch), data)
        if self._intents is not None:
            self._intents.add(batch)

    # -- retention -----------------------------------------------------------------------
    def retain(self, keep: int) -> int:
        """Keep the checkpoints :func:`checkpoints_to_keep` names (the newest ``keep`` and one
        that shares no state file with the newest); delete files no kept checkpoint needs.
        The intents of every batch after the oldest kept checkpoint stay: a fallback to it
        replays those batches as they first ran.

        Works from what this run knows (the manifests it read and wrote) without listing;
        files no manifest ever took are found by one listing (every ``SWEEP_EVERY`` calls
        on an object store, where a listing is a billed request; every call on local disk)."""
        batches = self.manifest_batches()
        if len(batches) <= keep:
            return 0
        manifests: dict[int, Manifest] = {}
        for b in batches:
            try:
                manifests[b] = self.read_manifest(b)
            except StateError:
                continue  # a damaged one is never a fallback; it goes once it is old
        kept_batches = checkpoints_to_keep(
            {b: [f.batch for op in m.operators.values() for f in restore_files(op.files, op.max_parallelism)] for b, m in manifests.items()}, keep)
        kept_batches.update(batches[-keep:])
        needed = {f.path for b in kept_batches if b in manifests for op in manifests[b].operators.values() for f in op.files}
        oldest = min(kept_batches)
        gone = [b for b in batches if b not in kept_batches]
        doomed = {f.path for b in gone if b in manifests for op in manifests[b].operators.values() for f in op.files} - needed
        self._since_sweep += 1
        if self._since_sweep >= SWEEP_EVERY or self.is_local:  # listing a local folder costs nothing
            self._since_sweep = 0
            for o in self.store.list("state"):
                name = o.key.rsplit("/", 1)[-1]
                if name[:1].isdigit() and o.key not in needed and int(name.split("-")[0].split(".")[0]) < oldest:
                    doomed.add(o.key)  # also other attempts' files and old reports
        self.store.delete_many(sorted(doomed))
        self.store.delete_many([self.manifest_key(b) for b in gone])
        if self._intents is None:
            self._intents = {i for n in self.store.list_names(CHECKPOINTS) if (i := batch_of(n, "intent-")) is not None}
        old = sorted(b for b in self._intents if b < oldest)
        self.store.delete_many([self.intent_key(b) for b in old])
        self._intents.difference_update(old)
        for b in gone:
            self._manifests.pop(b, None)
        if self._batches is not None:
            self._batches = [b for b in self._batches if b in kept_batches]
        return sum(1 for p in doomed if p.endswith(".arrow"))

    def remove(self) -> None:
        self.store.delete_prefix("")
