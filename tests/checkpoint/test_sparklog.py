"""Surgery on Spark's streaming checkpoint (keyscale.checkpoint.sparklog), on plain files."""

from __future__ import annotations

from pathlib import Path

import pytest

from keyscale.checkpoint import sparklog
from keyscale.errors import StateError


def spark_log(root: Path, offsets: range, commits: range) -> Path:
    for kind, batches in (("offsets", offsets), ("commits", commits)):
        (root / kind).mkdir(parents=True, exist_ok=True)
        for b in batches:
            (root / kind / str(b)).write_text(f"v1\n{kind} {b}\n")
            (root / kind / f".{b}.crc").write_text(f"crc {kind} {b}")
    return root


def test_hide_and_restore_offsets_move_each_file_with_its_checksum(tmp_path: Path) -> None:
    root = spark_log(tmp_path / "spark", range(0, 6), range(0, 6))
    hidden = tmp_path / "hidden"
    assert sparklog.remove_commits_after(root, 2) == [3, 4, 5]
    assert sparklog.commit_batches(root) == [0, 1, 2] and not (root / "commits" / ".3.crc").exists()
    assert sparklog.hide_offsets_after(root, hidden, 3) == [4, 5]
    assert sparklog.offset_batches(root) == [0, 1, 2, 3]
    assert (hidden / ".5.crc").read_text() == "crc offsets 5"
    (root / "offsets" / "4").write_text("planned anew by Spark")  # replaced by the original
    assert sparklog.restore_hidden(root, hidden, upto=4) == [4]
    assert (root / "offsets" / "4").read_text() == "v1\noffsets 4\n"
    assert sparklog.restore_hidden(root, hidden) == [5]
    assert sparklog.offset_batches(root) == [0, 1, 2, 3, 4, 5] and not hidden.exists()


def test_check_replayable_refuses_when_spark_no_longer_has_a_batch_input(tmp_path: Path) -> None:
    root = spark_log(tmp_path / "spark", range(0, 8), range(0, 4))
    assert sparklog.check_replayable(root, 3) == [4, 5, 6, 7]
    assert sparklog.check_replayable(root, 7) == []
    for b in (0, 1, 2):  # Spark purged them (spark.sql.streaming.minBatchesToRetain)
        (root / "offsets" / str(b)).unlink()
    assert sparklog.check_replayable(root, 3) == [4, 5, 6, 7]
    with pytest.raises(StateError, match=r"no longer has the input positions \(offsets\) of batch 2.*minBatchesToRetain"):
        sparklog.check_replayable(root, 2)


def test_set_aside_renames_spark_checkpoint(tmp_path: Path) -> None:
    root = spark_log(tmp_path / "spark", range(0, 2), range(0, 2))
    aside = sparklog.set_aside(root)
    assert aside is not None and aside.name.startswith("spark.set-aside-") and (aside / "offsets" / "1").exists()
    assert not root.exists() and sparklog.set_aside(root) is None
