"""mkdocs hook (mkdocs.yml: hooks): fills each ``<!-- generated: NAME -->`` marker line in a
page with tools/docs_gen.py's NAME generator at build time, so the CLI, metrics and exit-code
references are always those of the code being built."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import docs_gen  # found through the line above: tools/ is not a package

MARKER = re.compile(r"^<!-- generated: ([a-z-]+) -->$", re.MULTILINE)


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    def fill(m: re.Match[str]) -> str:
        name = m.group(1)
        if name not in docs_gen.GENERATORS:
            raise ValueError(f"{page.file.src_path}: unknown generated section {name!r} (known: {', '.join(docs_gen.GENERATORS)})")
        return docs_gen.GENERATORS[name]()

    return MARKER.sub(fill, markdown)
