"""`keyscale run JOB.py` ships the job's own modules to Spark's Python workers, as
`Pipeline.start` does; a module the workers cannot import is one line naming it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest
from tests.cli.job_project import expected_totals, final_totals, write_project

from conftest import cli, read_output, write_events


def _one_line_error(proc: subprocess.CompletedProcess[str], *needles: str) -> str:
    assert proc.returncode != 0, proc.stderr[-2000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("keyscale: error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for n in needles:
        assert n in errors[0], errors[0]
    return errors[0]


@pytest.mark.spark
@pytest.mark.slow
def test_a_job_file_importing_a_sibling_module_and_package_runs_through_keyscale_run(tmp_path: Path) -> None:
    # The CLI runs in the repository's folder, not the project's: neither the driver nor the
    # workers find the project's modules on their own (before: "No module named 'myjob'").
    job = write_project(tmp_path / "project")
    write_events(tmp_path / "in", files=2, rows=100, keys=8)
    cli("run", str(job), "--job-dir", str(tmp_path / "job"), "-p", "2", "--until-idle",
        "--set", f"input={tmp_path / 'in'}", "--set", f"output={tmp_path / 'out'}", check=True)
    events = pd.concat(pq.read_table(f).to_pandas() for f in sorted((tmp_path / "in").glob("*.parquet")))
    assert final_totals(read_output(tmp_path / "out")) == expected_totals(events)


@pytest.mark.spark
@pytest.mark.slow
def test_a_module_the_workers_cannot_import_is_one_line_naming_it(tmp_path: Path) -> None:
    # An import inside a function runs on the worker, by name: the job's folder is not on
    # the workers' path, so that is the one import shipping cannot cover.
    project = tmp_path / "project"
    project.mkdir()
    (project / "lazy_helpers.py").write_text("def scale(v):\n    return v\n")
    job = project / "lazy.py"
    job.write_text(
        "import keyscale as ks\n"
        "class Lazy(ks.KeyedProcessFunction):\n"
        "    def process_element(self, row, ctx):\n"
        "        import lazy_helpers\n"
        "        yield (ctx.key, lazy_helpers.scale(row.value))\n"
        "def build(ctx):\n"
        "    df = ctx.spark.readStream.schema('key string, value long, ts timestamp').parquet(ctx.arg('input'))\n"
        "    return ks.stream(df).key_by('key').process(Lazy(), 'key string, v long', uid='lazy')"
        ".sink(ks.sinks.ParquetSink(ctx.arg('output')), on_error='skip')\n"
    )
    write_events(tmp_path / "in", files=1, rows=50, keys=5)
    proc = cli("run", str(job), "--job-dir", str(tmp_path / "job"), "--until-idle",
               "--set", f"input={tmp_path / 'in'}", "--set", f"output={tmp_path / 'out'}")
    # Not a poison record (on_error='skip' would have dropped every record): the job stops.
    line = _one_line_error(proc, "'lazy_helpers'", str(project / "lazy_helpers.py"), "top of")
    assert "on_error" not in line
    assert read_output(tmp_path / "out").empty
