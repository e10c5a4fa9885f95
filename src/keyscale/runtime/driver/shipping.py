"""The job's own code, to Spark's Python workers.

A job's functions and classes run on the workers, which unpickle them. Spark pickles a
function by reference (``module.name``) unless its module is registered to be pickled by
value, and the workers then import that module by name: a job file's sibling module
(``from myjob import pipeline``) or package is found on the driver but on no worker (a
cluster's workers run in their own folders), so the batch fails there with
``No module named 'myjob'``.

One rule, for every way a job starts (``keyscale run``, ``Pipeline.start``, ``ks.main``):
when the job starts, every module the process has loaded from outside the Python
installation -- the job file, the modules and packages next to it, a project on
``PYTHONPATH`` or installed in editable mode -- is pickled by value
(:func:`ship_user_code`). Installed packages (``site-packages``), the standard library,
keyscale and Spark are pickled by reference: the workers must have them installed.

What this cannot cover is an ``import`` the workers run themselves (inside a function);
:func:`unimportable_module` turns the workers' ``No module named ...`` into one line that
says which case it is and what to do.
"""

from __future__ import annotations

import importlib.util
import os
import re
import site
import sys
import sysconfig
import types
from functools import cache
from pathlib import Path

__all__ = ["import_paths", "is_user_code", "is_user_module", "ship_user_code", "unimportable_module", "user_modules"]

# Pickled by reference even where they are not installed (an editable keyscale, Spark's own
# python/ folder on PYTHONPATH under spark-submit): every worker must have them anyway.
_NEVER_SHIPPED = frozenset({"__main__", "keyscale", "pyspark", "py4j"})


@cache
def _installation_dirs() -> tuple[str, ...]:
    dirs = {sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    dirs.update(site.getsitepackages())
    dirs.add(site.getusersitepackages())
    return tuple(os.path.realpath(d) + os.sep for d in dirs if d)


def is_user_code(path: str | os.PathLike[str]) -> bool:
    """Whether a module file is the user's own code: a ``.py`` file outside the Python
    installation (its standard library and site-packages, this one's or another's)."""
    p = os.fspath(path)
    # The path as given first: most modules are ruled out without a system call.
    return _outside_installation(p) and _outside_installation(os.path.realpath(p)) and os.path.isfile(p)


def _outside_installation(p: str) -> bool:
    parts = p.split(os.sep)
    # Compiled extensions and zip imports (--py-files) cannot be shipped by value either.
    return p.endswith(".py") and "site-packages" not in parts and "dist-packages" not in parts and not p.startswith(_installation_dirs())


def is_user_module(name: str, module: types.ModuleType | None) -> bool:
    """Whether a loaded module is the user's own code (see the module's docstring)."""
    path = getattr(module, "__file__", None)
    return bool(path) and name.partition(".")[0] not in _NEVER_SHIPPED and is_user_code(str(path))


def user_modules() -> list[types.ModuleType]:
    """The modules loaded so far that are the user's own code."""
    return [m for name, m in list(sys.modules.items()) if m is not None and is_user_module(name, m)]


def ship_user_code() -> list[str]:
    """Have cloudpickle pickle the user's own modules by value (a package's covers the
    submodules it imports later); returns their names. Called once the pipeline is built,
    when the job's modules are loaded, before anything is sent to a worker."""
    from pyspark import cloudpickle

    modules = user_modules()
    for module in modules:
        cloudpickle.register_pickle_by_value(module)  # type: ignore[no-untyped-call]
    return sorted(m.__name__ for m in modules)


def import_paths(job_file: Path) -> tuple[list[Path], str | None]:
    """Where the job file's imports are found, as ``python JOB.py`` and ``python -m`` find
    them: its own folder, and when that folder is a package (it has ``__init__.py``) the
    folder above the outermost package too. Also the job's dotted module name in that
    package (None: not in a package), so that its relative imports work.

    >>> import tempfile
    >>> root = Path(tempfile.mkdtemp())
    >>> (root / "proj" / "jobs").mkdir(parents=True)
    >>> for f in ("proj/__init__.py", "proj/jobs/__init__.py", "proj/jobs/clicks.py"):
    ...     _ = (root / f).write_text("")
    >>> paths, name = import_paths(root / "proj" / "jobs" / "clicks.py")
    >>> [str(p.relative_to(root)) for p in paths], name
    (['proj/jobs', '.'], 'proj.jobs.clicks')
    >>> _ = (root / "plain.py").write_text("")
    >>> import_paths(root / "plain.py") == ([root.resolve()], None)
    True
    """
    folder = job_file.resolve().parent
    packages: list[str] = []
    top = folder
    while (top / "__init__.py").is_file():
        packages.insert(0, top.name)
        top = top.parent
    if not packages:
        return [folder], None
    return [folder, top], ".".join([*packages, job_file.stem])


_NO_MODULE = re.compile(r"No module named '([A-Za-z_][\w.]*)'")


def _driver_file(top: str) -> str | None:
    """The file this process imports the top-level module ``top`` from (None: it cannot)."""
    module = sys.modules.get(top)
    path = getattr(module, "__file__", None)
    if path:
        return str(path)
    try:
        spec = importlib.util.find_spec(top)  # a top-level name: finds it without running it
    except (ImportError, ValueError):
        return None
    return spec.origin if spec is not None and spec.origin not in (None, "built-in", "frozen") else None


def unimportable_module(error_text: str, python: str) -> str | None:
    """The one-line explanation of a task failure that is a module the workers cannot
    import (``No module named 'X'``), or None; keyscale itself has its own
    (:func:`keyscale.runtime.driver.session.missing_keyscale`).

    >>> unimportable_module("ModuleNotFoundError: No module named 'no_such_mod_42'", "python3")[:74]
    "Spark's Python workers (python3) cannot import module 'no_such_mod_42', an"
    >>> unimportable_module("ValueError: bad", "python3") is None
    True
    """
    found = _NO_MODULE.search(error_text)
    if found is None:
        return None
    name = found.group(1)
    top = name.partition(".")[0]
    if top == "keyscale":
        return None
    head = f"Spark's Python workers ({python}) cannot import module '{name}'"
    where = _driver_file(top)
    if where is None:
        return (f"{head}, and neither can the driver: install it in the workers' Python (the one spark.pyspark.python "
                "or PYSPARK_PYTHON names)")
    if is_user_code(where):
        return (f"{head} ({where}), which is the job's own code: keyscale ships the modules the job has imported when it "
                "starts, but an import inside a function runs on the worker, by name; import it at the top of the job file "
                "or of a module it imports")
    return (f"{head}, which the driver has installed ({where}) but the workers do not: install '{top}' in the workers' "
            "Python too (the one spark.pyspark.python or PYSPARK_PYTHON names)")
