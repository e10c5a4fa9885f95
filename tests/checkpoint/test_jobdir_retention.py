"""JobDir.retain on real files: the kept checkpoints (checkpoint.retention), their files and
intents stay; other attempts' files and everything no kept checkpoint needs go."""

from __future__ import annotations

from pathlib import Path

from keyscale.checkpoint.intent import BatchIntent
from keyscale.checkpoint.jobdir import JobDir
from keyscale.checkpoint.manifest import Manifest, OperatorCheckpoint, StateFile


def _file(jd: JobDir, batch: int, kind: str, attempt: str) -> StateFile:
    rel = f"state/op/{batch:012d}-s00000-{kind}-{attempt}.arrow"
    (jd.path / rel).parent.mkdir(parents=True, exist_ok=True)
    (jd.path / rel).write_bytes(b"x")
    return StateFile(rel, batch, kind, 0, 7, 1, 1, 0)  # type: ignore[arg-type]


def test_retain_keeps_a_fallback_without_shared_files_and_removes_other_attempts_files(tmp_path: Path) -> None:
    jd = JobDir(tmp_path / "job")
    jd.claim("j", 8, 8)
    live: list[StateFile] = []
    losers = []
    for b in range(8):
        kind = "snapshot" if b in (0, 4) else "delta"
        f = _file(jd, b, kind, "win")
        losers.append(_file(jd, b, kind, "lose"))  # a speculative attempt's file no report named
        live = [f] if kind == "snapshot" else [*live, f]
        jd.write_intent(b, BatchIntent(batch_time_ms=b))
        jd.commit(Manifest("j", b, b, {"op": OperatorCheckpoint("op", 8, 1, (), (), tuple(live))}))
        jd.retain(1)
    # Checkpoint 7 uses the files of batches 4..7; 3 shares none of them; 4 is the next anchor.
    assert jd.manifest_batches() == [3, 4, 7]
    on_disk = sorted(p.name for p in (jd.path / "state" / "op").iterdir())
    needed = sorted(Path(f.path).name for b in (3, 4, 7) for f in jd.read_manifest(b).operators["op"].files)
    assert on_disk == sorted({*needed, *(Path(f.path).name for f in losers if f.batch >= 3)})
    assert all(jd.read_intent(b) is not None for b in range(3, 8))  # a fallback to 3 replays 4..7 from them
    assert jd.read_intent(2) is None
