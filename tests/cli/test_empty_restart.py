"""`keyscale run` on a job directory with no intact checkpoint: refused before Spark starts,
with a non-zero exit naming the damaged file and the flag that accepts an empty restart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from conftest import RUNNING_COUNT
from keyscale.checkpoint.encode import write_state_file
from keyscale.checkpoint.jobdir import JobDir
from keyscale.checkpoint.manifest import Manifest, OperatorCheckpoint
from keyscale.cli.main import main as keyscale_main
from keyscale.state.keygroups import KeyGroupRange
from keyscale.state.table import KG_COLUMN


def _job_dir_with_one_damaged_checkpoint(path: Path) -> str:
    jd = JobDir(path)
    jd.claim("running_count", 8, 8)
    table = pa.table({KG_COLUMN: pa.array([0, 3], pa.int32()), "key": ["a", "b"], "count": [1, 2]})
    rel = "state/totals/000000000000-s00000-delta-aaaa.arrow"
    f = write_state_file(jd.path, rel, table, "delta", 0, KeyGroupRange(0, 7))
    op = OperatorCheckpoint("totals", 8, 1, (("key", "string"),), (), (f,))
    jd.commit(Manifest("running_count", 0, 0, {"totals": op}))
    data = bytearray((jd.path / rel).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (jd.path / rel).write_bytes(bytes(data))
    return rel


def test_run_refuses_with_a_clear_error_and_changes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rel = _job_dir_with_one_damaged_checkpoint(tmp_path / "job")
    argv = ["run", str(RUNNING_COUNT), "--job-dir", str(tmp_path / "job"), "--set", f"input={tmp_path}", "--set", f"output={tmp_path / 'out'}", "--until-idle"]
    code = keyscale_main(argv)
    err = capsys.readouterr().err
    assert code != 0
    last = err.strip().splitlines()[-1]
    assert last.startswith("keyscale: error: no intact checkpoint is left")
    assert rel in last and "--allow-empty-restart" in last
    assert JobDir(tmp_path / "job").manifest_batches() == [0]  # not set aside: the same answer next time
    assert not (tmp_path / "job" / "spark.set-aside").exists()


def test_the_flag_reaches_run_options(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import keyscale.runtime.driver.runner as driver

    seen = {}

    class Runner:
        def __init__(self, opts: driver.RunOptions, serve: Any = None) -> None:
            seen["opts"] = opts

        def run(self) -> None:
            raise driver.StateError("stop here")

        def stop(self) -> None: ...

    monkeypatch.setattr(driver, "JobRunner", Runner)
    argv = ["run", str(RUNNING_COUNT), "--job-dir", str(tmp_path / "job"), "--allow-empty-restart", "--max-file-age", "5"]
    assert keyscale_main(argv) != 0
    assert seen["opts"].allow_empty_restart and seen["opts"].max_file_age == 5
