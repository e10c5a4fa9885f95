"""Loading a job file: a Python file with a ``build(ctx)`` function."""

from __future__ import annotations

import importlib.util
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from keyscale.errors import JobDefinitionError
from keyscale.runtime.shipping import import_paths


def load_job(path: str | Path) -> tuple[str, Callable[[Any], Any], types.ModuleType]:
    """(job name, build function, module) of a job file.

    The job's name is the module's ``NAME`` if it sets one, else the file's stem; a job
    directory remembers it so that another job cannot take it over.
    """
    p = Path(path)
    if not p.is_file():
        raise JobDefinitionError(f"job file {p} does not exist")
    if p.suffix != ".py":
        raise JobDefinitionError(f"job file {p} is not a Python file (.py)")
    # Its imports resolve as under `python JOB.py` (its folder first on the path) or, in a
    # package, `python -m pkg.job` (relative imports too), whatever the working directory:
    # `from myjob import pipeline` finds the sibling module. The workers get these modules
    # by value once the pipeline is built (keyscale.runtime.shipping), not through the path.
    paths, package_name = import_paths(p)
    for folder in reversed(paths):
        if str(folder) not in sys.path:
            sys.path.insert(0, str(folder))
    mod_name = package_name or f"keyscale_job_{p.stem}"
    spec = importlib.util.spec_from_file_location(mod_name, p)
    if spec is None or spec.loader is None:
        raise JobDefinitionError(f"job file {p} cannot be loaded")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        raise JobDefinitionError(f"job file {p} failed to load: {type(e).__name__}: {e}") from e
    build = getattr(module, "build", None)
    if not callable(build):
        raise JobDefinitionError(f"job file {p} has no build(ctx) function")
    name = str(getattr(module, "NAME", p.stem))
    return name, build, module
