"""Public names re-exported from the module that defines them, imported on first use.

A package's ``__init__`` that names its public face this way imports nothing until a name
is asked for, so low-level code that imports one of the package's modules (``keyscale.state``
is imported by the operators that its public face re-exports) never meets a half-built module.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Mapping
from typing import Any


def load(package: str, exports: Mapping[str, str], name: str) -> Any:
    """``package``'s public attribute ``name``, from the module ``exports`` says defines it.

    The value is bound on the package, so a name is imported once; a name not in
    ``exports`` raises :class:`AttributeError` as any missing attribute does.
    """
    module = exports.get(name)
    if module is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    setattr(sys.modules[package], name, value)
    return value
