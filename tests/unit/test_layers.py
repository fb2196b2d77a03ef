"""Arrows point down only: each layer imports only the layers docs/architecture.md lists
under it (read from the source, so a new import of an upper layer fails here)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "asyncrpc"

# layer -> the asyncrpc layers it may import (docs/architecture.md, "Layers")
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "wire": {"errors"},
    "serde": {"errors", "wire"},
    "transport": {"errors", "wire"},
    "rendezvous": {"errors"},
    "agent": {"errors", "wire", "serde", "transport"},
    "rref": {"errors", "agent", "serde"},
    "serving": {"errors", "agent"},
    "observability": {"errors", "agent"},
    "autograd": {"errors", "agent", "serde", "rref"},
    "optim": {"errors", "agent", "rref", "autograd"},
    "nn": {"errors", "rref"},
    "functions": {"agent", "serving"},
}


def _layer_of(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return parts[0]


def _imported_layers(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        found |= {name.split(".")[1] for name in names if name.startswith("asyncrpc.")}
    return found


def _modules_of(layer: str) -> list[Path]:
    return sorted((PACKAGE / layer).rglob("*.py")) or [PACKAGE / f"{layer}.py"]


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_a_layer_imports_only_the_layers_below_it(layer: str) -> None:
    for module in _modules_of(layer):
        upward = _imported_layers(module) - ALLOWED[layer] - {_layer_of(module)}
        assert not upward, f"{module.relative_to(PACKAGE)} imports {sorted(upward)}"


def test_every_layer_is_listed() -> None:
    layers = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert layers - {"compat"} <= set(ALLOWED)  # compat sits on top, beside api.py
