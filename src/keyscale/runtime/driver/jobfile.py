"""Loading a job file: a Python file with a ``build(ctx)`` function."""

from __future__ import annotations

import importlib.util
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from keyscale.errors import JobDefinitionError
from keyscale.runtime.driver.shipping import import_paths, is_user_module

# The user's modules that loading job files imported from their folders (see load_job);
# never a module something else imported first (a test module, keyscale itself).
_loaded: set[str] = set()


def _under(name: str, folders: list[Path]) -> bool:
    """Whether module ``name`` is the user's code in one of ``folders`` (or below)."""
    module = sys.modules.get(name)
    if not is_user_module(name, module):
        return False
    resolved = Path(str(getattr(module, "__file__", ""))).resolve()
    return any(resolved.is_relative_to(f) for f in folders)


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
    # by value once the pipeline is built (keyscale.runtime.driver.shipping), not through the path.
    paths, package_name = import_paths(p)
    for folder in reversed(paths):
        if str(folder) not in sys.path:
            sys.path.insert(0, str(folder))
    # Loaded again in this process (keyscale upgrade, rescale --restart): the modules an
    # earlier load brought in from these folders are imported afresh, so that new code in a
    # sibling module is new code on the driver and the workers, not the first version's.
    for name in [n for n in _loaded if _under(n, paths)]:
        sys.modules.pop(name, None)
        _loaded.discard(name)
    mod_name = package_name or f"keyscale_job_{p.stem}"
    spec = importlib.util.spec_from_file_location(mod_name, p)
    if spec is None or spec.loader is None:
        raise JobDefinitionError(f"job file {p} cannot be loaded")
    module = importlib.util.module_from_spec(spec)
    before = set(sys.modules) - {mod_name}  # what this load imports, the job file included, is the job's
    sys.modules[mod_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        raise JobDefinitionError(f"job file {p} failed to load: {type(e).__name__}: {e}") from e
    _loaded.update(n for n in set(sys.modules) - before if _under(n, paths))
    build = getattr(module, "build", None)
    if not callable(build):
        raise JobDefinitionError(f"job file {p} has no build(ctx) function")
    name = str(getattr(module, "NAME", p.stem))
    return name, build, module
