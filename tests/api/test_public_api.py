"""The public API (issue 34): a short top level, the rest in named modules, the old names
still working for one release with a DeprecationWarning naming the new spelling."""

from __future__ import annotations

import ast
import builtins
import importlib
import re
import subprocess
import sys
import warnings

import pytest

import keyscale
from conftest import ROOT

TOP_LEVEL = {
    "JobContext", "JobHandle", "KeyedCoProcessFunction", "KeyedProcessFunction", "KeyscaleError", "Pipeline",
    "ProcessFunction", "VectorizedKeyedCoProcessFunction", "VectorizedKeyedFunction", "main", "pipeline", "stream",
}
# The modules the API reference documents name by name.
MODULES = ("aggregates", "windows", "streams", "state", "sources", "sinks", "kafka")
# Where each name that left the top level is defined, as it was imported before (the
# deprecated spelling must give exactly this object).
DEFINED_IN = {
    **dict.fromkeys(["count", "first", "last", "max", "mean", "min", "sum"], "keyscale.operators.vectorized"),
    **dict.fromkeys(["reduce", "SessionWindows", "SlidingWindows", "TumblingWindows"], "keyscale.operators.windows"),
    **dict.fromkeys(["KeyedStream", "Stream", "WindowedStream"], "keyscale._pipeline"),
    **dict.fromkeys(["Context", "RuntimeContext", "TimerService", "OperatorContext"], "keyscale.state.contexts"),
    **dict.fromkeys(["ValueState", "ListState", "MapState", "OperatorListState"], "keyscale.state.handles"),
    **dict.fromkeys(["TIMER", "KeyedBatch", "KeyedCoBatch"], "keyscale.state.batches"),
    "BroadcastStream": "keyscale.operators.nonkeyed",
    **dict.fromkeys(["json_values", "kafka_decoder", "kafka_source"], "keyscale.kafka.source"),
    "KafkaSink": "keyscale.kafka.sink",
    **dict.fromkeys(["LogSource", "log_source", "broadcast"], "keyscale.sources.reader"),
    "ConsoleSink": "keyscale.sinks.console", "DeltaSink": "keyscale.sinks.delta", "IcebergSink": "keyscale.sinks.iceberg",
    "NoopSink": "keyscale.sinks.noop", "ParquetSink": "keyscale.sinks.parquet",
}
API_PAGE = (ROOT / "docs/reference/api.md").read_text()


def test_the_top_level_is_exactly_the_chosen_names() -> None:
    assert set(keyscale.__all__) == TOP_LEVEL
    assert len(keyscale.__all__) == len(TOP_LEVEL)
    assert all(hasattr(keyscale, name) for name in keyscale.__all__)
    assert set(dir(keyscale)) == TOP_LEVEL | {*MODULES, "testing", "state_processor", "__version__"}


def test_a_star_import_shadows_no_builtin() -> None:
    namespace: dict[str, object] = {}
    exec("from keyscale import *", namespace)
    given = set(namespace) - {"__builtins__"}
    assert given == TOP_LEVEL
    assert not given & set(dir(builtins))


def test_the_old_top_level_covers_every_name_that_left_it() -> None:
    """The 50 names of the release before: each is still at the top level or has moved."""
    assert set(keyscale._MOVED) == set(DEFINED_IN)
    assert len(TOP_LEVEL | set(keyscale._MOVED)) == 50


@pytest.mark.parametrize("name", sorted(DEFINED_IN))
def test_an_old_name_is_the_same_object_with_a_warning_naming_its_new_place(name: str) -> None:
    module = keyscale._MOVED[name]
    expected = getattr(importlib.import_module(DEFINED_IN[name]), name)
    message = f"keyscale.{name} is deprecated; use keyscale.{module}.{name}"
    with pytest.warns(DeprecationWarning, match=re.escape(message)) as caught:
        got = getattr(keyscale, name)
    assert got is expected
    assert getattr(importlib.import_module(f"keyscale.{module}"), name) is expected
    assert caught[0].filename == __file__  # the warning points at the caller's line
    namespace: dict[str, object] = {}
    with pytest.warns(DeprecationWarning, match=re.escape(message)):
        exec(f"from keyscale import {name}", namespace)
    assert namespace[name] is expected


def test_from_keyscale_import_sum_still_works_with_a_warning() -> None:
    with pytest.warns(DeprecationWarning, match=r"keyscale\.sum is deprecated; use keyscale\.aggregates\.sum"):
        from keyscale import sum as ks_sum
    assert ks_sum("value") == keyscale.aggregates.sum("value")


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="has no attribute 'nonesuch'"):
        keyscale.nonesuch  # noqa: B018
    for module in MODULES:
        with pytest.raises(AttributeError):
            importlib.import_module(f"keyscale.{module}").nonesuch  # noqa: B018


def test_the_new_names_raise_no_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in keyscale.__all__:
            getattr(keyscale, name)
        for module in MODULES:
            mod = getattr(keyscale, module)
            for name in mod.__all__:
                getattr(mod, name)
        assert keyscale.testing.KeyedHarness and keyscale.state_processor


@pytest.mark.parametrize("module", MODULES)
def test_each_module_exports_what_the_api_reference_lists(module: str) -> None:
    mod = importlib.import_module(f"keyscale.{module}")
    documented = set(re.findall(rf"^::: keyscale\.{module}\.(\w+)$", API_PAGE, re.MULTILINE))
    assert documented == set(mod.__all__), (
        f"docs/reference/api.md lists {sorted(documented - set(mod.__all__))} that keyscale.{module} does not export, "
        f"and misses {sorted(set(mod.__all__) - documented)}")
    assert all(hasattr(mod, name) for name in mod.__all__)


def test_the_api_reference_lists_no_deprecated_spelling() -> None:
    old = set(re.findall(r"^::: keyscale\.(\w+)$", API_PAGE, re.MULTILINE)) & set(keyscale._MOVED)
    assert not old, old


def test_kafka_is_a_connector_of_its_own_that_sources_and_sinks_do_not_re_export() -> None:
    """sources/ and sinks/ sit below the Kafka connector (it implements their interfaces), so
    their public faces do not name it: one spelling, ks.kafka.X."""
    for name in ("json_values", "kafka_decoder", "kafka_source"):
        assert name not in keyscale.sources.__all__ and not hasattr(keyscale.sources, name)
    assert "KafkaSink" not in keyscale.sinks.__all__ and not hasattr(keyscale.sinks, "KafkaSink")
    assert keyscale.kafka.KafkaSink.__module__ == "keyscale.kafka.sink"


def _deprecated_uses(code: str) -> list[str]:
    """``ks.NAME``/``keyscale.NAME`` and ``from keyscale import NAME`` of a name that moved."""
    found = []
    for node in ast.walk(ast.parse(code)):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ("ks", "keyscale")
                and node.attr in keyscale._MOVED):
            found.append(f"{node.value.id}.{node.attr}")
        if isinstance(node, ast.ImportFrom) and node.module == "keyscale":
            found += [f"from keyscale import {a.name}" for a in node.names if a.name in keyscale._MOVED]
    return found


def test_the_readme_examples_use_no_deprecated_name() -> None:
    blocks = re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), re.MULTILINE | re.DOTALL)
    assert blocks, "found no python block in README.md: the scan is broken"
    assert sorted(_deprecated_uses("ks.sum('x')\nfrom keyscale import ParquetSink")) == ["from keyscale import ParquetSink", "ks.sum"]
    used = [use for block in blocks for use in _deprecated_uses(block)]
    assert not used, used


def test_the_docs_examples_and_job_files_use_no_deprecated_name() -> None:
    used = []
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    for page in pages:
        for block in re.findall(r"^```python\n(.*?)^```", page.read_text(), re.MULTILINE | re.DOTALL):
            used += [f"{page.relative_to(ROOT)}: {use}" for use in _deprecated_uses(block)]
    for folder in ("examples", "bench", "src/keyscale/testing"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            used += [f"{path.relative_to(ROOT)}: {use}" for use in _deprecated_uses(path.read_text())]
    assert not used, "\n".join(used)


def test_the_low_level_modules_import_first_in_a_fresh_interpreter() -> None:
    """No import circle: the operators import keyscale.state's modules, whose public face imports only its own."""
    for module in ("keyscale.state.keygroups", "keyscale.operators.keyed", "keyscale.kafka.source", "keyscale.sinks.parquet",
                   "keyscale.sources.reader", "keyscale.state"):
        code = f"import {module}; import keyscale; keyscale.state.Context; keyscale.kafka.kafka_source; keyscale.kafka.KafkaSink"
        proc = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c", code], capture_output=True, text=True,
                              timeout=120, env={"PYTHONPATH": str(ROOT / "src"), "PATH": ""})
        assert proc.returncode == 0, f"{module}: {proc.stderr[-2000:]}"
