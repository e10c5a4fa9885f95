"""The docs cannot drift from the code: every KEYSCALE_ variable, export, metric and Spark
default is documented, and every relative link in README.md and docs/ leads somewhere.

`make docs` (which `make test` runs) builds the site with `mkdocs build --strict`, which
checks links and anchors between the pages of docs/ and renders the generated references;
these tests cover what it cannot see: README.md (outside docs/), and what the pages must list.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import docs_gen  # found through the line above: tools/ is not a package

DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))

# Strings shaped like variables that are not environment variables: the Redis log's Lua
# script answers errors with these names (keyscale/sources/redis_log.py).
NOT_VARIABLES = {"KEYSCALE_NOLOG", "KEYSCALE_NOPARTITION"}


def _variables_in_source() -> set[str]:
    found: set[str] = set()
    for path in (ROOT / "src").rglob("*.py"):
        found |= set(re.findall(r"\bKEYSCALE_[A-Z0-9_]+\b", path.read_text()))
    return found - NOT_VARIABLES


def test_every_keyscale_variable_the_code_reads_is_documented() -> None:
    page = (DOCS / "reference/environment.md").read_text()
    listed = set(re.findall(r"^\| `(KEYSCALE_[A-Z0-9_]+)` \|", page, re.MULTILINE))
    in_source = _variables_in_source()
    assert in_source, "found no KEYSCALE_ variable in src/: the scan is broken"
    assert not in_source - listed, f"add these to docs/reference/environment.md: {sorted(in_source - listed)}"
    assert not listed - in_source, f"docs/reference/environment.md lists variables src/ no longer reads: {sorted(listed - in_source)}"


def test_api_reference_has_every_export() -> None:
    import importlib

    import keyscale

    page = (DOCS / "reference/api.md").read_text()
    documented = set(re.findall(r"^::: (keyscale(?:\.\w+)*)$", page, re.MULTILINE))
    exports = {f"keyscale.{name}" for name in keyscale.__all__}
    for module in ("aggregates", "windows", "streams", "state", "sources", "sinks"):
        exports |= {f"keyscale.{module}.{name}" for name in importlib.import_module(f"keyscale.{module}").__all__}
    missing = exports - documented
    assert not missing, f"add `::: NAME` blocks to docs/reference/api.md for: {sorted(missing)}"


def test_metrics_reference_has_every_family_the_endpoint_serves() -> None:
    from keyscale.runtime.batch.jobstate import RunSummary
    from keyscale.runtime.control.metrics import families

    listed = {name for name, *_ in docs_gen.metric_families()}
    status = {"job": "j", "state": "running", "watermark_ms": 0, "pending_rescale": {"parallelism": {"*": 2}},
              "operators": {"totals": {"parallelism": 2}}}
    served = {f.name + ("_total" if f.type == "counter" else "") for f in families(status, None, RunSummary("j", "d"), 0)}
    assert served and served <= listed, f"metrics the generator does not find in metrics.py: {sorted(served - listed)}"


def test_cli_reference_covers_every_command() -> None:
    import argparse

    from keyscale.cli.main import build_parser

    def commands(parser: argparse.ArgumentParser, prefix: str) -> list[str]:
        out = [prefix]
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    out += commands(sub, f"{prefix} {name}")
        return out

    text = docs_gen.cli_markdown()
    missing = [c for c in commands(build_parser(), "keyscale") if f"`{c}`" not in text]
    assert not missing, missing


def test_spark_settings_page_lists_keyscale_defaults() -> None:
    from keyscale.runtime.driver.session import session_conf

    page = (DOCS / "reference/spark-settings.md").read_text()
    for master in ("local[2]", "spark://127.0.0.1:7077"):
        missing = [k for k in session_conf(master, {}) if f"`{k}`" not in page]
        assert not missing, f"docs/reference/spark-settings.md does not list keyscale's default {missing} (master {master})"


def test_python_examples_in_the_docs_parse() -> None:
    import ast

    broken = []
    for page in [ROOT / "README.md", *PAGES]:
        for block in re.findall(r"^```python\n(.*?)^```", page.read_text(), re.MULTILINE | re.DOTALL):
            try:
                ast.parse(block)
            except SyntaxError as e:
                broken.append(f"{page.relative_to(ROOT)}: {e.msg} in:\n{block}")
    assert not broken, "\n".join(broken)


# -- links ---------------------------------------------------------------------------------

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)


def _slug(heading: str) -> str:
    """An anchor as mkdocs' toc extension makes it (Python-Markdown's default slugify)."""
    text = re.sub(r"<[^>]+>", "", heading).replace("`", "")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _anchors(page: Path) -> set[str] | None:
    """The page's heading anchors, or None when part of it is generated at build time (the
    API and CLI references: mkdocs --strict checks links into those)."""
    text = FENCE.sub("", page.read_text())
    if re.search(r"^::: |^<!-- generated:", text, re.MULTILINE):
        return None
    return {_slug(h) for h in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.MULTILINE)}


@pytest.mark.parametrize("source", [ROOT / "README.md", *PAGES], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_lead_to_a_file_and_heading(source: Path) -> None:
    broken = []
    for target in LINK.findall(FENCE.sub("", source.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("//"):
            continue  # http(s), mailto: not checked offline
        path, _, anchor = target.partition("#")
        dest = (source.parent / path).resolve() if path else source
        if not dest.exists():
            broken.append(f"{target}: no such file")
            continue
        if anchor and dest.suffix == ".md":
            anchors = _anchors(dest)
            if anchors is not None and anchor not in anchors:
                broken.append(f"{target}: no heading with anchor #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{source.relative_to(ROOT)}: " + "; ".join(broken)
