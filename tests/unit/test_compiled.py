"""Which path runs the per-message modules: compiled (mypyc) or pure Python (docs/compiled.md).

`make install` compiles asyncrpc._compiled.COMPILED_MODULES where it can; the header of a
pytest run says which path is active (tests/conftest.py).  ``ASYNCRPC_PURE_PYTHON=1``
forces the Python source, and ``ASYNCRPC_EXPECT_COMPILED=1`` makes a run fail unless
every module is compiled (for a job that must test the extension).
"""

from __future__ import annotations

import ast
import importlib.machinery
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from asyncrpc import _compiled


def _active_in_subprocess(**env: str) -> dict[str, bool]:
    code = "import json, asyncrpc._compiled as c; print(json.dumps(c.active()))"
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env={**os.environ, **env},
    )
    active: dict[str, bool] = json.loads(result.stdout)
    return active


def test_the_active_path_is_the_one_asked_for(record_property: pytest.RecordProperty) -> None:
    active = _compiled.active()
    record_property("compiled", json.dumps(active))
    assert set(active) == set(_compiled.COMPILED_MODULES)
    if _compiled.pure_python_requested():
        assert not any(active.values()), active
    if os.environ.get("ASYNCRPC_EXPECT_COMPILED", "") not in ("", "0"):
        assert all(active.values()), f"expected every module compiled: {active}"


def test_pure_python_env_loads_every_module_from_source() -> None:
    active = _active_in_subprocess(ASYNCRPC_PURE_PYTHON="1")
    assert active == dict.fromkeys(_compiled.COMPILED_MODULES, False)


def test_zero_means_no_override() -> None:
    forced = _active_in_subprocess(ASYNCRPC_PURE_PYTHON="1")
    default = _active_in_subprocess(ASYNCRPC_PURE_PYTHON="0")
    assert set(default) == set(forced)
    if not _compiled.pure_python_requested():
        assert default == _compiled.active()


def _awaits_in_finally(tree: ast.AST) -> list[int]:
    """Lines of ``finally`` blocks that await (or ``async with``/``async for``)."""
    found = []
    for node in ast.walk(tree):
        for block in getattr(node, "finalbody", []) if isinstance(node, ast.Try) else []:
            for inner in ast.walk(block):
                if isinstance(inner, (ast.Await, ast.AsyncWith, ast.AsyncFor)):
                    found.append(inner.lineno)
    return found


@pytest.mark.parametrize("module", _compiled.COMPILED_MODULES)
def test_no_compiled_module_awaits_in_a_finally_block(module: str) -> None:
    """Compiled by mypyc 2.4.1, a coroutine whose ``finally`` awaits raises the previous
    exception to pass through it again, in a later call that raised nothing (the
    agent's shutdown did, when it was compiled: docs/compiled.md)."""
    source = Path(_compiled._source_of(module))  # the file the finder would load
    assert _awaits_in_finally(ast.parse(source.read_text())) == []


def test_the_finally_check_finds_an_await() -> None:
    code = "async def f():\n    try:\n        pass\n    finally:\n        await g()\n"
    assert _awaits_in_finally(ast.parse(code)) == [5]


def _built_tree(root: Path) -> Path:
    """A fake source tree: every compiled module's source and extension, and a source
    they are built from that is not compiled; the extensions are the newest."""
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    for module in _compiled.COMPILED_MODULES:
        source = root.joinpath(*module.split(".")).with_suffix(".py")
        source.parent.mkdir(parents=True, exist_ok=True)
        source.write_text("")
        os.utime(source, (1000, 1000))
        extension = source.with_name(source.stem + suffix)
        extension.write_text("")
        os.utime(extension, (2000, 2000))
    (root / "asyncrpc" / "transport" / "shm.py").write_text("")
    os.utime(root / "asyncrpc" / "transport" / "shm.py", (1000, 1000))
    return root / "asyncrpc" / "transport" / "shm.py"


@pytest.mark.parametrize("edited", [None, "asyncrpc/transport/link.py", "built-from"])
def test_an_edit_to_any_source_they_are_built_from_sends_all_back_to_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, edited: str | None
) -> None:
    """A constant mypyc compiled in may come from a module that is only analysed, so an
    edit there makes the build stale too (all or nothing)."""
    read_only = _built_tree(tmp_path)
    if edited is not None:
        path = read_only if edited == "built-from" else tmp_path / edited
        os.utime(path, (3000, 3000))
    monkeypatch.setattr(_compiled, "_PACKAGE_PARENT", str(tmp_path))
    monkeypatch.setattr(_compiled, "_CHECKOUT", True)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert _compiled._any_stale.__wrapped__() is (edited is not None)
