"""Compiles the per-message path with mypyc (docs/compiled.md); the rest is pyproject.toml.

The modules compiled are ``COMPILED_MODULES`` in asyncrpc/_compiled.py, from their own
strictly typed ``.py`` files: there is no second source.  The build never fails for
want of a compiler: without mypyc, or when mypyc or the C compiler fails, it warns
and installs the pure-Python package, which behaves the same.  ``ASYNCRPC_PURE_PYTHON=1``
at build time skips the compilation too.
"""

from __future__ import annotations

import ast
import os
import warnings
from pathlib import Path
from typing import Any

from setuptools import setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
PURE_PYTHON_ENV = "ASYNCRPC_PURE_PYTHON"
SHARED_LIBRARY = "asyncrpc._native"
"""The compiled modules' shared code lives in ``asyncrpc/_native__mypyc*.so`` (inside the
package, so an editable install finds it); each module is a small extension over it."""


def from_compiled(name: str) -> list[str]:
    """The tuple ``name`` of asyncrpc/_compiled.py, read without importing it."""
    tree = ast.parse((HERE / "asyncrpc" / "_compiled.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == name:
            assert node.value is not None
            return list(ast.literal_eval(node.value))
    raise RuntimeError(f"asyncrpc/_compiled.py has no {name}")


def _fallback(why: str) -> None:
    warnings.warn(f"asyncrpc: {why}; installing the pure-Python modules", stacklevel=2)


def ext_modules() -> list[Any]:
    if os.environ.get(PURE_PYTHON_ENV, "") not in ("", "0"):
        return []
    try:
        from mypyc.build import mypycify  # noqa: PLC0415 (optional at build time)
    except ImportError:
        _fallback("mypyc (it comes with mypy) is not installed")
        return []
    sources = [name.replace(".", "/") + ".py" for name in from_compiled("COMPILED_MODULES")]
    # The layers they belong to are analysed, not compiled; every other import is
    # skipped, so the type check never reaches torch (minutes otherwise).
    analysed = sorted(
        str(path.relative_to(HERE))
        for layer in from_compiled("BUILT_FROM")
        for path in (HERE / "asyncrpc").glob(layer)
        if str(path.relative_to(HERE)) not in sources
    )
    try:
        return list(
            mypycify(
                ["--follow-imports=skip", *sources, *analysed],
                only_compile_paths=sources,
                opt_level="3",
                group_name=SHARED_LIBRARY,
            )
        )
    except (Exception, SystemExit) as exc:  # mypyc exits on a type error
        _fallback(f"mypyc failed ({exc!r})")
        return []


class OptionalBuildExt(build_ext):
    """build_ext that falls back to pure Python (all or nothing) when compiling fails."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # no compiler, missing headers, a compiler error
            for path in self._outputs():
                Path(path).unlink(missing_ok=True)
            _fallback(f"compiling the extensions failed ({exc})")
            return
        # Newer than their sources even when nothing needed recompiling (a source only
        # touched): asyncrpc._compiled passes over an extension older than its source.
        for path in self._outputs():
            if os.path.exists(path):
                os.utime(path)

    def _outputs(self) -> set[str]:
        """What is built, and where an in-place build (an editable install) copies it."""
        return {*self.get_outputs(), *self.get_output_mapping().values()}


setup(ext_modules=ext_modules(), cmdclass={"build_ext": OptionalBuildExt})
