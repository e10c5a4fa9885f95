"""griffe extension (mkdocs.yml, mkdocstrings' ``extensions``): keyscale's docstrings are
written for ``help()`` and doctest, in reStructuredText habits; this turns the three habits
that Markdown would garble into Markdown, without changing the source:

- ``:class:`x``` and the other Sphinx roles become code spans (`x`);
- doctest examples (``>>>`` lines and their output) become ``pycon`` code blocks (Markdown
  would read ``>>>`` as nested quotes);
- a paragraph ending in ``::`` (an rST literal block follows, indented) ends in ``:``.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|mod|data|exc|obj|const):`~?([^`]+)`")


def _fence_doctests(text: str) -> str:
    out: list[str] = []
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith(">>>") and not (out and out[-1].lstrip().startswith("```")):
            indent = line[: len(line) - len(line.lstrip())]
            block = []
            # A doctest runs until a blank line (its output included), as doctest reads it.
            while i < len(lines) and lines[i].strip():
                block.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i].lstrip())
                i += 1
            out += [f"{indent}```pycon", *(indent + b for b in block), f"{indent}```"]
            continue
        out.append(line)
        i += 1
    return "\n".join(out)


def rst_to_markdown(text: str) -> str:
    text = ROLE.sub(r"`\1`", text)
    text = re.sub(r"(\S)::$", r"\1:", text, flags=re.MULTILINE)
    return _fence_doctests(text)


class RstHabits(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **_: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rst_to_markdown(obj.docstring.value)
