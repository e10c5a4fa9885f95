"""Deployment files: defaults, paths, and one-line errors naming the file and the field (no Spark)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from keyscale.deploy.file import load_deployment, parse_deployment, state_dir_of
from keyscale.deploy.spec import (
    RUN_FIELDS,
    DeploymentError,
    DeploymentSpec,
    RestartStrategy,
    RestoreStrategy,
    UpgradeStrategy,
)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "job.py").write_text("def build(ctx):\n    raise NotImplementedError\n")
    (tmp_path / "notes.txt").write_text("not a job")
    return tmp_path


def _parse(folder: Path, text: str) -> DeploymentSpec:
    return parse_deployment(text, folder / "deployment.toml")


MINIMAL = 'name = "counts"\njob = "job.py"\n'


def test_minimal_file_gets_the_documented_defaults(folder: Path) -> None:
    spec = _parse(folder, MINIMAL)
    assert spec.name == "counts"
    assert spec.job_file == folder / "job.py"
    assert spec.parallelism == 1 and spec.max_parallelism is None
    assert spec.master == "local[2]" and spec.trigger_interval == "1 second"
    assert spec.retain == 3 and spec.compaction_chain == 8
    assert spec.upgrade_strategy is UpgradeStrategy.STATEFUL
    assert spec.restore_strategy is RestoreStrategy.LATEST_STATE
    assert spec.restart == RestartStrategy(attempts=3, backoff_seconds=2.0, backoff_factor=1.0, max_backoff_seconds=60.0)
    assert spec.state_dir == folder / ".keyscale" / "counts"
    assert spec.savepoint_dir == spec.state_dir / "savepoints"
    assert spec.allow_non_restored_state is False and spec.args == {}


def test_full_file(folder: Path) -> None:
    spec = _parse(folder, '''
name = "counts-v2"
job = "./job.py"
parallelism = 4
max_parallelism = 64
master = "local[4]"
trigger_interval = "500 milliseconds"
retain = 5
compaction_chain = 4
state_dir = "/tmp/somewhere/state"
savepoint_dir = "sps"
upgrade_strategy = "stateless"      # case-insensitive
restore_strategy = "LATEST_SAVEPOINT"
allow_non_restored_state = true

[args]
input = "data/in"
files_per_batch = 2
verbose = true
ratio = 0.5

[restart]
attempts = 0
backoff_seconds = 1
backoff_factor = 3
max_backoff_seconds = 30
''')
    assert spec.parallelism == 4 and spec.max_parallelism == 64 and spec.master == "local[4]"
    assert spec.trigger_interval == "500 milliseconds" and spec.retain == 5 and spec.compaction_chain == 4
    assert spec.state_dir == Path("/tmp/somewhere/state") and spec.savepoint_dir == folder / "sps"
    assert spec.upgrade_strategy is UpgradeStrategy.STATELESS and spec.restore_strategy is RestoreStrategy.LATEST_SAVEPOINT
    assert spec.allow_non_restored_state
    assert spec.args == {"input": "data/in", "files_per_batch": "2", "verbose": "true", "ratio": "0.5"}
    assert spec.restart == RestartStrategy(0, 1.0, 3.0, 30.0)


def test_relative_paths_start_at_the_file_not_the_working_directory(folder: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path_factory.mktemp("elsewhere"))
    (folder / "deployment.toml").write_text(MINIMAL + 'state_dir = "st"\n')
    spec = load_deployment(folder / "deployment.toml")
    assert spec.job_file == folder / "job.py" and spec.state_dir == folder / "st"
    assert spec.base_dir == folder and spec.source == folder / "deployment.toml"
    assert state_dir_of(folder / "deployment.toml") == folder / "st"
    assert state_dir_of(folder) == folder  # a folder is taken as the state folder


@pytest.mark.parametrize(
    ("text", "field", "message"),
    [
        ('name = "counts"\njob = ', "", r"not valid TOML: Invalid value"),
        ('name = "counts"\njob "job.py"\n', "", r"not valid TOML: .*line 2"),
        ('job = "job.py"\n', "name", "is required"),
        ('name = "counts"\n', "job", "is required"),
        ('name = "bad name!"\njob = "job.py"\n', "name", "must be letters, digits"),
        ('name = 3\njob = "job.py"\n', "name", "must be a non-empty string, not 3"),
        ('name = "counts"\njob = "notes.txt"\n', "job", r"notes\.txt is not a Python file"),
        ('name = "counts"\njob = "missing.py"\n', "job", r"job file .*missing\.py does not exist"),
        (MINIMAL + "parallelism = 0\n", "parallelism", "must be an integer >= 1, not 0"),
        (MINIMAL + 'parallelism = "2"\n', "parallelism", "must be an integer >= 1, not '2'"),
        (MINIMAL + "parallelism = true\n", "parallelism", "must be an integer >= 1, not True"),
        (MINIMAL + "parallelism = 2.5\n", "parallelism", "must be an integer >= 1"),
        (MINIMAL + "max_parallelism = 40000\n", "max_parallelism", "must be at most 32768"),
        (MINIMAL + "parallelism = 10\nmax_parallelism = 8\n", "parallelism", "10 is larger than max_parallelism 8"),
        (MINIMAL + 'upgrade_strategy = "STATEFULL"\n', "upgrade_strategy", "'STATEFULL' is not one of STATEFUL, STATELESS, NONE"),
        (MINIMAL + "restore_strategy = 1\n", "restore_strategy", "1 is not one of LATEST_STATE, LATEST_SAVEPOINT, NONE"),
        (MINIMAL + 'upgradeStrategy = "NONE"\n', "upgradeStrategy", r"unknown field \(did you mean 'upgrade_strategy'\?\)"),
        (MINIMAL + 'parallelsm = 2\n', "parallelsm", r"unknown field \(did you mean 'parallelism'\?\)"),
        (MINIMAL + 'trigger_interval = "fast"\n', "trigger_interval", "must look like '500 milliseconds'"),
        (MINIMAL + 'trigger_interval = 5\n', "trigger_interval", "must be a non-empty string"),
        (MINIMAL + "retain = 0\n", "retain", "must be an integer >= 1"),
        (MINIMAL + 'master = ""\n', "master", "must be a non-empty string"),
        (MINIMAL + 'allow_non_restored_state = "yes"\n', "allow_non_restored_state", "must be true or false"),
        (MINIMAL + 'args = "input=x"\n', "args", "must be a table"),
        (MINIMAL + "[args]\nnested = { a = 1 }\n", "args.nested", "must be a string, number or boolean, not dict"),
        (MINIMAL + "[args]\nlist = [1, 2]\n", "args.list", "not list"),
        (MINIMAL + "restart = 3\n", "restart", "must be a table"),
        (MINIMAL + "[restart]\nattempts = -1\n", "restart.attempts", "must be an integer >= 0, not -1"),
        (MINIMAL + "[restart]\nbackoff_seconds = -1\n", "restart.backoff_seconds", "must be a number >= 0"),
        (MINIMAL + "[restart]\nbackoff_factor = 0.5\n", "restart.backoff_factor", "must be a number >= 1"),
        (MINIMAL + '[restart]\nbackoff_seconds = "2s"\n', "restart.backoff_seconds", "must be a number"),
        (MINIMAL + "[restart]\nretries = 3\n", "restart.retries", "unknown field"),
    ],
)
def test_errors_are_one_line_naming_file_and_field(folder: Path, text: str, field: str, message: str) -> None:
    with pytest.raises(DeploymentError) as info:
        _parse(folder, text)
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith(f"{folder / 'deployment.toml'}: {field + ': ' if field else ''}"), msg
    assert re.search(message, msg), msg


def test_missing_or_unreadable_file(folder: Path) -> None:
    with pytest.raises(DeploymentError, match=r"deployment file .*nope\.toml does not exist"):
        load_deployment(folder / "nope.toml")
    with pytest.raises(DeploymentError, match="cannot be read"):
        load_deployment(folder)
    with pytest.raises(DeploymentError, match="neither a deployment file nor"):
        state_dir_of(folder / "nope.toml")


def test_state_dir_of_reads_only_name_and_state_dir(folder: Path) -> None:
    # The rest of the file may have become invalid: status and stop still find the deployment.
    (folder / "d.toml").write_text('name = "counts"\njob = "gone.py"\nparallelism = -5\n')
    assert state_dir_of(folder / "d.toml") == folder / ".keyscale" / "counts"
    (folder / "e.toml").write_text('job = "job.py"\n')
    with pytest.raises(DeploymentError, match="name: is required"):
        state_dir_of(folder / "e.toml")


def test_json_round_trip_and_changes(folder: Path) -> None:
    spec = _parse(folder, MINIMAL + "parallelism = 2\n[args]\ninput = 'in'\n")
    assert DeploymentSpec.from_json(spec.to_json()) == spec
    assert spec.changes(spec) == [] and spec.describe_changes(spec) == "no change"

    other = _parse(folder, MINIMAL + "parallelism = 3\n[args]\ninput = 'in2'\nextra = 1\n")
    assert spec.changes(other) == ["args", "parallelism"]
    assert spec.describe_changes(other) == "args: input: in -> in2, +extra=1; parallelism: 2 -> 3"

    # The job is its file name and content: a changed file is a change, a moved copy is not.
    moved = folder / "moved"
    moved.mkdir()
    (moved / "job.py").write_bytes((folder / "job.py").read_bytes())
    same = parse_deployment(MINIMAL + "parallelism = 2\nstate_dir = '../.keyscale/counts'\n[args]\ninput = 'in'\n", moved / "d.toml")
    assert spec.changes(same) == []
    (folder / "job.py").write_text("def build(ctx):\n    return 1\n")
    edited = _parse(folder, MINIMAL + "parallelism = 2\n[args]\ninput = 'in'\n")
    assert spec.changes(edited) == ["job"]
    assert edited.job_sha256 != spec.job_sha256 and edited.artifact != spec.artifact


def test_command_line(folder: Path) -> None:
    spec = _parse(folder, MINIMAL + 'parallelism = 3\nmax_parallelism = 16\nallow_non_restored_state = true\nstate_dir = "/s"\n[args]\ninput = "a=b"\n')
    argv = spec.command("/s/jobs/2", python="py")
    assert argv[:5] == ["py", "-m", "keyscale.cli.main", "run", f"/s/artifacts/{spec.job_sha256[:16]}/job.py"]
    assert argv[argv.index("--job-dir") + 1] == "/s/jobs/2" and argv[argv.index("-p") + 1] == "3"
    assert argv[argv.index("--max-parallelism") + 1] == "16" and argv[argv.index("--set") + 1] == "input=a=b"
    assert "--from-savepoint" not in argv and "--allow-non-restored-state" not in argv
    argv = spec.command("/s/jobs/3", "/sp/x", python="py")
    assert argv[-3:] == ["--from-savepoint", "/sp/x", "--allow-non-restored-state"]


def test_restart_backoff() -> None:
    fixed = RestartStrategy(attempts=3, backoff_seconds=2)
    assert [fixed.delay(n) for n in (1, 2, 3)] == [2.0, 2.0, 2.0]
    exp = RestartStrategy(attempts=5, backoff_seconds=0.5, backoff_factor=2, max_backoff_seconds=3)
    assert [exp.delay(n) for n in (1, 2, 3, 4, 5)] == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_the_example_deployment_file_is_valid() -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "deployment.toml"
    spec = load_deployment(example)
    assert spec.name == "running-count" and spec.job_file == example.parent / "running_count.py"
    assert spec.restart.backoff_factor == 2.0 and spec.upgrade_strategy is UpgradeStrategy.STATEFUL


def test_spark_conf_reaches_the_command_line_and_is_a_run_setting(folder: Path) -> None:
    spec = _parse(folder, MINIMAL + '[spark_conf]\n"spark.executor.memory" = "1g"\n"spark.sql.shuffle.partitions" = 8\n')
    assert spec.spark_conf == {"spark.executor.memory": "1g", "spark.sql.shuffle.partitions": "8"}
    argv = spec.command("/s/jobs/1", python="py")
    confs = [argv[i + 1] for i, a in enumerate(argv) if a == "--conf"]
    assert confs == ["spark.executor.memory=1g", "spark.sql.shuffle.partitions=8"]
    assert DeploymentSpec.from_json(spec.to_json()) == spec
    # A spec stored before spark_conf existed reads as none.
    old = spec.to_json()
    del old["spark_conf"]
    assert DeploymentSpec.from_json(old).spark_conf == {}
    other = _parse(folder, MINIMAL + '[spark_conf]\n"spark.executor.memory" = "2g"\n')
    assert spec.changes(other) == ["spark_conf"] and "spark_conf" in RUN_FIELDS
    with pytest.raises(DeploymentError, match=r"spark_conf\.x: must be a string, number or boolean, not list"):
        _parse(folder, MINIMAL + "[spark_conf]\nx = [1]\n")


def test_the_state_backend_is_a_run_setting_passed_to_keyscale_run(folder: Path) -> None:
    default = _parse(folder, MINIMAL)
    assert default.state_backend == "memory" and "--state-backend" not in default.command("/j")
    rocks = _parse(folder, MINIMAL + 'state_backend = "rocksdb"\n')
    assert rocks.command("/j")[-2:] == ["--state-backend", "rocksdb"]
    assert default.changes(rocks) == ["state_backend"] and "state_backend" in RUN_FIELDS
    assert DeploymentSpec.from_json(rocks.to_json()) == rocks
    with pytest.raises(DeploymentError, match="state_backend"):
        _parse(folder, MINIMAL + 'state_backend = "disk"\n')


def test_async_checkpoints_is_a_run_setting_passed_to_keyscale_run(folder: Path) -> None:
    default = _parse(folder, MINIMAL)
    assert not default.async_checkpoints and "--async-checkpoints" not in default.command("/j")
    on = _parse(folder, MINIMAL + "async_checkpoints = true\n")
    assert on.command("/j")[-1] == "--async-checkpoints"
    assert default.changes(on) == ["async_checkpoints"] and "async_checkpoints" in RUN_FIELDS
    assert DeploymentSpec.from_json(on.to_json()) == on
    with pytest.raises(DeploymentError, match="async_checkpoints"):
        _parse(folder, MINIMAL + 'async_checkpoints = "yes"\n')


def test_a_latency_target_is_a_run_setting_passed_to_keyscale_run(folder: Path) -> None:
    default = _parse(folder, MINIMAL)
    assert default.latency_target is None and "--latency-target" not in default.command("/j")
    on = _parse(folder, MINIMAL + 'latency_target = "500 ms"\n')
    assert on.command("/j")[-2:] == ["--latency-target", "500 ms"]
    assert default.changes(on) == ["latency_target"] and "latency_target" in RUN_FIELDS
    assert DeploymentSpec.from_json(on.to_json()) == on
    with pytest.raises(DeploymentError, match=r"deployment.toml: latency_target: 'soon' is not a duration"):
        _parse(folder, MINIMAL + 'latency_target = "soon"\n')
    with pytest.raises(DeploymentError, match="latency_target: '0s' must be more than 0 ms"):
        _parse(folder, MINIMAL + 'latency_target = "0s"\n')


def test_scaling_and_an_slo_are_run_settings_passed_to_keyscale_run(folder: Path) -> None:
    default = _parse(folder, MINIMAL)
    assert (default.scaling, default.slo) == ("fixed", None) and "--scaling" not in default.command("/j")
    auto = _parse(folder, MINIMAL + 'scaling = "auto"\nautoscaler = "active"\nslo = "latency = 5 s"\n')
    assert auto.slo == "latency=5s"  # as keyscale run reads it
    assert auto.command("/j")[-6:] == ["--scaling", "auto", "--autoscaler", "active", "--slo", "latency=5s"]
    assert default.changes(auto) == ["scaling", "autoscaler", "slo"] and {"scaling", "autoscaler", "slo"} <= set(RUN_FIELDS)
    assert DeploymentSpec.from_json(auto.to_json()) == auto
    with pytest.raises(DeploymentError, match=r"deployment.toml: slo: 'latency=soon': 'soon' is not a duration"):
        _parse(folder, MINIMAL + 'scaling = "auto"\nslo = "latency=soon"\n')
    with pytest.raises(DeploymentError, match='slo: only the autoscaler sizes for an SLO: set scaling = "auto"'):
        _parse(folder, MINIMAL + 'slo = "lag=30s"\n')
    with pytest.raises(DeploymentError, match="scaling: must be 'fixed', 'reactive' or 'auto'"):
        _parse(folder, MINIMAL + 'scaling = "elastic"\n')
