"""A keyed stage and the sink that writes its output run in one Python worker per task
(``keyscale._spark_map``'s chaining): one Arrow hand-off and one worker fewer on every
batch's path (issue 35)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from conftest import run_job, write_events

HERE = Path(__file__).parent


def test_a_keyed_stages_sink_writes_in_the_stages_python_worker(spark: Any, tmp_path: Path) -> None:
    write_events(tmp_path / "in", files=2, rows=300, keys=40, seed=5)
    (tmp_path / "notes").mkdir()
    run_job(HERE / "chain_probe_job.py", tmp_path / "job", 2, {"input": str(tmp_path / "in"), "notes": str(tmp_path / "notes")})
    notes = sorted((tmp_path / "notes").iterdir())
    assert len(notes) == 2 * 2, [n.name for n in notes]  # a note per batch and subtask
    for note in notes:
        sink_pid = int(note.name.split("-")[1])
        assert note.read_text().split() == [str(sink_pid)], f"{note.name}: the stage's rows came from workers {note.read_text()}"
