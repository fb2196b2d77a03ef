"""Which modules ship compiled, and the switch back to their Python source.

``make install`` compiles the modules named in ``COMPILED_MODULES`` with mypyc (see
setup.py and docs/compiled.md): each becomes a C extension beside its ``.py`` file, one
source for both, and Python's import system prefers the extension.  Without a compiler,
or when the build fails, there is no extension and the ``.py`` files load as always.

``ASYNCRPC_PURE_PYTHON=1`` makes every compiled module load from its ``.py`` instead (all
or nothing: compiled modules call each other natively): CI's pure-Python job, mutation
testing and debugging use it.  In a source tree (an editable install), when a source
they were built from (``BUILT_FROM``) is newer than an extension (edited since the last
build), they are all passed over, with a warning, so an edit is never hidden behind a
stale build.

This module imports nothing but the standard library: the package root installs its
finder before anything else loads.
"""

from __future__ import annotations

import functools
import glob
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType
from typing import Final

COMPILED_MODULES: Final = (
    "asyncrpc.wire.codec",
    "asyncrpc.transport.flow",
    "asyncrpc.transport.link",
)
"""Modules setup.py compiles, by their import names (it reads this tuple)."""
BUILT_FROM: Final = ("errors.py", "wire/*.py", "transport/*.py")
"""The sources mypyc reads to build them, as globs under the package (setup.py reads
this tuple too): a constant declared ``Final`` in one of them is compiled in."""
PURE_PYTHON_ENV: Final = "ASYNCRPC_PURE_PYTHON"


def pure_python_requested() -> bool:
    """True when ``ASYNCRPC_PURE_PYTHON`` is set to anything but empty or ``0``."""
    return os.environ.get(PURE_PYTHON_ENV, "") not in ("", "0")


class _SourceFinder(importlib.abc.MetaPathFinder):
    """Finds a compiled module's ``.py`` when it must not load as an extension."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in COMPILED_MODULES or path is None:
            return None
        source = _source_of(fullname)
        if pure_python_requested() or _any_stale():
            return importlib.util.spec_from_file_location(fullname, source)
        return None  # the usual finders load the extension


_PACKAGE_PARENT: Final = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CHECKOUT: Final = os.path.isfile(os.path.join(_PACKAGE_PARENT, "setup.py"))
"""Whether the package runs from its source tree (an editable install), where sources
are edited after a build.  An installed wheel writes its files in any order, so there
the times say nothing."""


def _source_of(module: str) -> str:
    return os.path.join(_PACKAGE_PARENT, *module.split(".")) + ".py"


@functools.cache
def _any_stale() -> bool:
    """Whether a source the extensions were built from is newer than one of them: then
    every compiled module loads from source (they call each other natively, so it is
    all or nothing)."""
    if not _CHECKOUT:
        return False
    built = [_extension_time(_source_of(module)) for module in COMPILED_MODULES]
    if not any(built):
        return False  # nothing was compiled
    oldest = min(t for t in built if t)
    package = os.path.join(_PACKAGE_PARENT, "asyncrpc")
    for pattern in BUILT_FROM:
        for source in sorted(glob.glob(os.path.join(package, pattern))):
            if os.path.getmtime(source) > oldest:
                warnings.warn(
                    f"{source} changed since the compiled modules were built: loading "
                    "every one from its source (make install rebuilds them)",
                    RuntimeWarning,
                    stacklevel=2,
                )
                return True
    return False


def _extension_time(source: str) -> float:
    """When the extension beside ``source`` was built; 0 if there is none."""
    stem = source.removesuffix(".py")
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        if os.path.isfile(stem + suffix):
            return os.path.getmtime(stem + suffix)
    return 0.0


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once)."""
    if not any(isinstance(finder, _SourceFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _SourceFinder())


def is_compiled(module: ModuleType) -> bool:
    """Whether ``module`` was loaded from an extension rather than from Python source."""
    return not (module.__file__ or "").endswith(".py")


def active() -> dict[str, bool]:
    """Each module of ``COMPILED_MODULES`` (imported here) and whether it runs compiled."""
    return {name: is_compiled(importlib.import_module(name)) for name in COMPILED_MODULES}
