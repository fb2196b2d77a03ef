"""Which modules ship compiled, and the switch back to their Python source.

``make install`` compiles the modules named in ``COMPILED_MODULES`` with mypyc (see
setup.py and docs/compiled.md): each becomes a C extension beside its ``.py`` file, one
source for both, and Python's import system prefers the extension.  Without a compiler,
or when the build fails, there is no extension and the ``.py`` files load as always.

``ASYNCRPC_PURE_PYTHON=1`` makes every compiled module load from its ``.py`` instead (all
or nothing: compiled modules call each other natively): CI's pure-Python job, mutation
testing and debugging use it.  In a source tree (an editable install), when any
extension is older than its source (the source edited since the last build) they are
all passed over, with a warning, so an edit is never hidden behind a stale build.

This module imports nothing but the standard library: the package root installs its
finder before anything else loads.
"""

from __future__ import annotations

import functools
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
    """Whether a compiled module's extension is older than its source: then every one
    loads from source (they call each other natively, so it is all or nothing)."""
    return _CHECKOUT and any(_stale(_source_of(module)) for module in COMPILED_MODULES)


def _stale(source: str) -> bool:
    stem = source.removesuffix(".py")
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        extension = stem + suffix
        if os.path.isfile(extension):
            if os.path.getmtime(extension) >= os.path.getmtime(source):
                return False
            warnings.warn(
                f"{extension} is older than {source}: loading every compiled module from "
                "its source (make install rebuilds them)",
                RuntimeWarning,
                stacklevel=2,
            )
            return True
    return False


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
