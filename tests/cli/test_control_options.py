"""``keyscale run``'s control API options (issue 33, item 3): a setting it cannot serve is one
clear line naming it, a non-zero exit, before Spark starts and before the job directory exists."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import RUNNING_COUNT, cli


@pytest.mark.parametrize(("flags", "env", "error"), [
    (["--metrics-token-file", "/nonexistent/metrics-token"], {},
     "keyscale: error: the metrics token file /nonexistent/metrics-token (metrics_token_file (--metrics-token-file)) does not exist"),
    ([], {"KEYSCALE_METRICS_TOKEN": ""}, "keyscale: error: KEYSCALE_METRICS_TOKEN is set but empty: give the token, or unset it"),
    (["--metrics-unauthenticated"], {"KEYSCALE_METRICS_TOKEN": "t"}, "keyscale: error: /metrics cannot both need a token (KEYSCALE_METRICS_TOKEN)"),
    ([], {"KEYSCALE_CONTROL_PORT": "metrics"}, "keyscale: error: KEYSCALE_CONTROL_PORT must be a port number (0 for any free port), not 'metrics'"),
])
def test_a_control_setting_keyscale_cannot_serve_stops_the_start(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                                                 flags: list[str], env: dict[str, str], error: str) -> None:
    from keyscale.cli.main import main

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code = main(["run", str(RUNNING_COUNT), "--job-dir", str(tmp_path / "job"), *flags])
    err = capsys.readouterr().err
    assert code != 0 and err.splitlines()[-1].startswith(error), err
    assert "Traceback" not in err
    assert not (tmp_path / "job").exists()


def test_an_empty_token_file_in_a_fresh_process(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("\n")  # a Secret created with an empty value
    proc = cli("run", str(RUNNING_COUNT), "--job-dir", str(tmp_path / "job"), "--metrics-token-file", str(tmp_path / "token"), timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == (
        f"keyscale: error: the metrics token file {tmp_path / 'token'} (metrics_token_file (--metrics-token-file)) is empty")
