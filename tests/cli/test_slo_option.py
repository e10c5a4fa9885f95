"""``keyscale run --slo``: an SLO keyscale cannot serve is one line naming it, a non-zero exit,
before Spark starts and before the job directory exists."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import RUNNING_COUNT


@pytest.mark.parametrize(("flags", "error"), [
    (["--scaling", "auto", "--slo", "latency=soon"], "keyscale: error: --slo 'latency=soon': 'soon' is not a duration"),
    (["--scaling", "auto", "--slo", "p99=5s"], "keyscale: error: --slo 'p99=5s': 'p99' is not an SLO keyscale measures"),
    (["--slo", "lag=30s"], "keyscale: error: --slo lag=30s: only the autoscaler sizes for an SLO; add --scaling auto"),
    (["--scaling", "auto", "--autoscaler", "off", "--slo", "lag=30s"], "keyscale: error: --slo lag=30s: only the autoscaler"),
    (["--scaling", "auto", "--trigger-interval", "10 seconds", "--slo", "latency=5s"],
     "keyscale: error: --slo latency=5s: the trigger interval is 10 seconds, and a record can wait that long"),
])
def test_an_slo_keyscale_cannot_serve_stops_the_start(tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], error: str) -> None:
    from keyscale.cli.main import main

    code = main(["run", str(RUNNING_COUNT), "--job-dir", str(tmp_path / "job"), *flags])
    err = capsys.readouterr().err
    assert code != 0 and err.splitlines()[-1].startswith(error), err
    assert "Traceback" not in err
    assert not (tmp_path / "job").exists()
