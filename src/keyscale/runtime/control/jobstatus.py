"""What a job directory says of its job, read without the job: ``keyscale status`` and
``keyscale list``, the folder page, deployments. (A running job's own answer is
:func:`keyscale.runtime.batch.status.status`.)"""

from __future__ import annotations

from typing import Any

from keyscale.errors import KeyscaleError

__all__ = ["find_jobs", "status_dict"]


def find_jobs(folder: str) -> list[str]:
    """The job directories under ``folder`` (local or an object store), by one listing."""
    from keyscale.checkpoint.jobdir import JOB_FILE
    from keyscale.storage import LocalStore, open_store

    root = open_store(folder, "folder")
    if isinstance(root, LocalStore) and not root.root.is_dir():
        raise KeyscaleError(f"{root.root} is not a folder")
    return sorted(
        root.url(o.key[: -len(JOB_FILE)].rstrip("/")) for o in root.list()
        if o.key.split("/")[-1] == JOB_FILE and "savepoints" not in o.key.split("/")
    )


def status_dict(job_dir: str) -> dict[str, Any]:
    from keyscale.checkpoint.jobdir import JobDir
    from keyscale.checkpoint.manifest import summarize_operator_state
    from keyscale.runtime.task import counters
    from keyscale.state.keygroups import key_group_ranges

    jd = JobDir(job_dir)
    ident = jd.identity()
    m = jd.latest_manifest()
    live = jd.read_status()
    running = jd.is_running()
    # Asynchronous checkpoints: the batch run whose checkpoint commits. The status file may be a
    # moment behind the manifests: a batch whose manifest is listed is no longer committing.
    committing = live.get("checkpoint_committing") if running else None
    if committing is not None and m is not None and committing <= m.batch:
        committing = None
    out: dict[str, Any] = {
        "job": ident.name,
        "job_dir": jd.uri,
        "running": running,
        # A job that is not running either stopped or failed (its last status says which, and why).
        "state": live.get("state", "running") if running else ("failed" if live.get("state") == "failed" else "stopped"),
        "last_error": live.get("last_error"),
        "pending_rescale": live.get("pending_rescale") if running else None,
        "pid": jd.lock_holder() if running else None,
        "max_parallelism": ident.max_parallelism,
        "last_checkpoint": m.batch if m else None,
        "checkpoints": jd.manifest_batches(),
        "checkpoint_committing": committing,
        "operators": {},
        "outputs": live.get("outputs", []),
    }
    if live.get("watermark") is not None:
        out["watermark"] = live["watermark"]
    # End-to-end latency of the last batch that measured any (keyscale.latency): the run's own figure.
    out["latency"] = live.get("latency")
    # With a latency target: the last batch's read limit, whose it is and why (runtime/batch/sizing.py).
    out["batch_size"] = live.get("batch_size") if running else None
    # The scaling mode, the autoscaler's last decision per operator with its reason, the SLO: the run's own.
    out["scaling"] = live.get("scaling")
    # Records late, too far ahead, dropped...: totals from the checkpoint (they survive restarts), the last batch's from the job.
    totals = counters.from_extra(m.extra) if m else {}
    last = live.get("counters", {}).get("last_batch", {}) if m is not None and live.get("last_checkpoint") == m.batch else {}
    out["counters"] = {"total": totals, "last_batch": last}
    for uid, op in (m.operators.items() if m else []):
        if not op.key_columns:  # operator state only: a source's offsets, list or broadcast state
            out["operators"][uid] = {"parallelism": op.parallelism, "operator_state": summarize_operator_state(op.operator_state),
                                     **({"lag": live["operators"][uid]["lag"]} if "lag" in live.get("operators", {}).get(uid, {}) else {})}
            continue
        ranges = key_group_ranges(op.max_parallelism, op.parallelism)
        per = []
        for i, (r, nbytes) in enumerate(zip(ranges, op.state_bytes_per_subtask(), strict=True)):
            sub = {"subtask": i, "key_groups": str(r), "state_bytes": nbytes}
            current = m is not None and live.get("last_checkpoint") == m.batch
            for s in live.get("operators", {}).get(uid, {}).get("subtasks", []) if current else []:
                if s.get("subtask") == i:
                    sub["state_keys"] = s.get("state_keys")
            per.append(sub)
        out["operators"][uid] = {
            "parallelism": op.parallelism,
            "state_files": len(op.files),
            "states": [s["name"] for s in op.states],
            "subtasks": per,
        }
    return out
