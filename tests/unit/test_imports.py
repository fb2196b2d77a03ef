"""The package root is lazy: the sans-IO and transport layers load without torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

import asyncrpc


def _run(code: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("package", ["asyncrpc", "asyncrpc.wire", "asyncrpc.transport"])
def test_lower_layers_load_without_torch(package: str) -> None:
    _run(f"import {package}, sys; assert 'torch' not in sys.modules, {package!r}")


def test_every_public_name_resolves_on_first_use() -> None:
    _run(
        "import asyncrpc\n"
        "for name in asyncrpc.__all__:\n"
        "    assert getattr(asyncrpc, name) is not None, name\n"
        "from asyncrpc import init_rpc, RRef, autograd\n"
        "assert init_rpc is asyncrpc.api.init_rpc and RRef is asyncrpc.rref.RRef\n"
        "assert autograd is asyncrpc.autograd\n"
    )


def test_star_import_gives_every_public_name() -> None:
    namespace: dict[str, object] = {}
    exec("from asyncrpc import *", namespace)
    assert set(asyncrpc.__all__) <= namespace.keys()


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = asyncrpc.no_such_name
    assert not hasattr(asyncrpc, "no_such_name")
