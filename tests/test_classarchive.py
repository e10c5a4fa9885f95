"""A class archive for Spark's driver JVM (``keyscale class-archive``, ``KEYSCALE_CLASS_ARCHIVE``):
the archive a job's JVM maps, and the archives keyscale refuses."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from conftest import RUNNING_COUNT, cli, read_output, write_events
from keyscale.classarchive import (
    ARCHIVE_ENV,
    class_archive_conf,
    create_archive,
    current_stamp,
)
from keyscale.errors import KeyscaleError

OPTION = "spark.driver.defaultJavaOptions"


def _archive(folder: Path, **stamp: str) -> Path:
    """A stand-in archive with a stamp of this machine, or of ``stamp``'s differences."""
    path = folder / "spark.jsa"
    path.write_bytes(b"not read by these tests")
    made_for = dataclasses.replace(current_stamp(), **stamp)
    (folder / "spark.jsa.json").write_text(json.dumps(made_for.to_wire()))
    return path


def test_without_the_variable_the_settings_are_unchanged() -> None:
    conf = {"spark.driver.memory": "2g"}
    assert class_archive_conf(conf, env={}) == conf


def test_the_archive_goes_after_the_users_own_default_java_options(tmp_path: Path) -> None:
    path = _archive(tmp_path)
    conf = class_archive_conf({OPTION: "-Dmine=1", "spark.driver.memory": "2g"}, env={ARCHIVE_ENV: str(path)})
    assert conf == {OPTION: f"-Dmine=1 -XX:SharedArchiveFile={path}", "spark.driver.memory": "2g"}


@pytest.mark.parametrize("line", ["spark.driver.defaultJavaOptions   -Dadmin=1 -Dx=2", "spark.driver.defaultJavaOptions=-Dadmin=1 -Dx=2"])
def test_spark_defaults_conf_options_are_kept_not_replaced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, line: str) -> None:
    # A --conf of the same name would replace spark-defaults.conf's value: keyscale carries it over.
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "spark-defaults.conf").write_text(f"# the admin's\nspark.driver.memory 4g\n{line}\n")
    monkeypatch.setenv("SPARK_CONF_DIR", str(tmp_path / "conf"))
    path = _archive(tmp_path)
    conf = class_archive_conf({}, env={ARCHIVE_ENV: str(path)})
    assert conf == {OPTION: f"-Dadmin=1 -Dx=2 -XX:SharedArchiveFile={path}"}


def test_making_one_on_top_of_another_archive_is_refused_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPARK_SUBMIT_OPTS", f"-XX:SharedArchiveFile={tmp_path / 'old.jsa'}")
    with pytest.raises(KeyscaleError, match=r"^SPARK_SUBMIT_OPTS gives Spark's JVM a class archive already"):
        create_archive(str(tmp_path / "new.jsa"))
    assert list(tmp_path.iterdir()) == []


def test_a_missing_archive_is_an_error_that_says_how_to_make_it(tmp_path: Path) -> None:
    with pytest.raises(KeyscaleError) as e:
        class_archive_conf({}, env={ARCHIVE_ENV: str(tmp_path / "none.jsa")})
    assert f"{ARCHIVE_ENV}={tmp_path / 'none.jsa'}: no class archive there" in str(e.value)
    assert f"`keyscale class-archive {tmp_path / 'none.jsa'}`" in str(e.value)


@pytest.mark.parametrize(("stamp", "said"), [
    ({"jars": "0" * 16}, "other Spark jars in"),
    ({"spark_jars": "/elsewhere/pyspark/jars"}, "Spark's jars in"),
    ({"java": "/usr/lib/jvm/java-11/bin/java"}, "Java "),
    ({"jvm": "1-2"}, "another build of Java"),
    ({"conf_dir": "/elsewhere/conf"}, "Spark's conf folder"),
])  # fmt: skip
def test_an_archive_made_for_another_java_or_spark_is_refused_by_name(tmp_path: Path, stamp: dict[str, str], said: str) -> None:
    # The JVM itself would only warn and start without it: slower, and the user would not know why.
    path = _archive(tmp_path, **stamp)
    with pytest.raises(KeyscaleError) as e:
        class_archive_conf({}, env={ARCHIVE_ENV: str(path)})
    assert f"{ARCHIVE_ENV}={path} was made for another Java or Spark than this job's: this one has {said}" in str(e.value)
    assert f"`keyscale class-archive {path}`" in str(e.value)


def test_a_job_started_with_the_archive_loads_sparks_classes_from_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The archive is the suite's own (tests/jvm_archive.py), made by the same create_archive
    # as `keyscale class-archive` (making one takes a JVM about a minute): here it reaches
    # the job through KEYSCALE_CLASS_ARCHIVE, as a user's does, not through SPARK_SUBMIT_OPTS.
    from jvm_archive import ensure

    options = ensure()
    assert options is not None, "the suite's class archive could not be made (tests/jvm_archive.py said why on stderr)"
    archive = Path(options.split()[0].removeprefix("-XX:SharedArchiveFile="))
    assert json.loads(archive.with_name(archive.name + ".json").read_text())["v"] == 1
    monkeypatch.setenv("SPARK_SUBMIT_OPTS", "-XX:TieredStopAtLevel=1")

    write_events(tmp_path / "in", files=2, rows=400, keys=20)
    monkeypatch.setenv(ARCHIVE_ENV, str(archive))
    loads = tmp_path / "class-load.log"
    run = cli("run", str(RUNNING_COUNT), "--job-dir", str(tmp_path / "job"), "-p", "2", "--until-idle",
              "--set", f"input={tmp_path / 'in'}", "--set", f"output={tmp_path / 'out'}",
              "--conf", f"spark.driver.extraJavaOptions=-Xlog:class+load=info:file={loads}", check=True)
    assert "processed 2 batches (800 records)" in run.stdout
    assert "Unable to use shared archive" not in run.stdout + run.stderr
    # The JVM logs each class with where it came from; the dynamic archive is the "top" layer.
    from_archive = [line for line in loads.read_text().splitlines() if "source: shared objects file (top)" in line]
    assert any(" org.apache.spark.sql.SparkSession " in line for line in from_archive), from_archive[:5]
    assert len(from_archive) > 5000
    totals = read_output(tmp_path / "out").groupby("key")["count"].max()
    assert totals.sum() == 800 and len(totals) == 20


def _fake_workload(logs: list[str]) -> Any:
    """subprocess.run for the archive's small job: it writes the archive file and the JVM's
    ``logs`` (one file each) where the job's JVM would."""
    import subprocess

    def workload(argv: list[str], **_: object) -> subprocess.CompletedProcess[str]:
        work, archive = Path(argv[3]), Path(argv[4])
        archive.write_bytes(b"a file, whole or not")
        for i, text in enumerate(logs):
            (work / f"cds-{i}.log").write_text(text + "\n")
        return subprocess.CompletedProcess(argv, 0, "", "")

    return workload


def test_the_command_moves_the_archive_and_its_stamp_into_place_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    import subprocess

    from keyscale.cli.main import main

    monkeypatch.setattr(subprocess, "run", _fake_workload(["[info][cds,dynamic] Written dynamic archive 0x8 - 0x9"]))
    monkeypatch.delenv("SPARK_SUBMIT_OPTS", raising=False)  # the tests' own JVMs map an archive
    archive = tmp_path / "cache" / "spark.jsa"
    assert main(["class-archive", str(archive)]) == 0
    out = capsys.readouterr().out
    assert "class archive written" in out and f"{ARCHIVE_ENV}={archive}" in out
    assert archive.read_bytes() == b"a file, whole or not"
    assert json.loads((tmp_path / "cache" / "spark.jsa.json").read_text()) == current_stamp().to_wire()
    assert sorted(p.name for p in archive.parent.iterdir()) == ["spark.jsa", "spark.jsa.json"]  # no work folder left


@pytest.mark.parametrize(("logs", "said"), [
    ([], "written whole 0 times"),  # the JVM was killed while it wrote: no line
    (["[info][cds,dynamic] Written dynamic archive 0x8 - 0x9"] * 2, "written whole 2 times"),  # two JVMs wrote it in turn
])
def test_an_archive_its_jvm_did_not_say_it_wrote_whole_once_is_not_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, logs: list[str], said: str,
) -> None:
    import subprocess

    monkeypatch.setattr(subprocess, "run", _fake_workload(logs))
    monkeypatch.delenv("SPARK_SUBMIT_OPTS", raising=False)  # the tests' own JVMs map an archive
    target = tmp_path / "spark.jsa"
    with pytest.raises(KeyscaleError, match=f"the class archive's job failed \\(exit 0\\) \\(the JVM's log says the archive was {said}"):
        create_archive(str(target), progress=lambda _: None)
    assert not target.exists() and not (tmp_path / "spark.jsa.json").exists()
